"""`autocast` on the ops issue 30 found silently wrong or broken, one test each.

Extreme magnitudes (float16 overflows above 65504; bfloat16 keeps 8 bits),
complex values, a function's own accumulation types, constants in a
primitive's parameters, loop counters, compute dtypes that cannot be honoured,
in-place updates, and the primitives everyday code emits (stack, name,
platform_index, typed keys in loops). Each compares with the float32 function
or with a value computed by hand. `tests/test_autocast_corpus.py` runs the
broad corpus; these are the named cases, with their magnitudes.
"""

import jax
from jax import lax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests.autocast_helpers import matmul_inputs

F16 = "p=f32,c=f16,o=f32"
BF16 = "p=f32,c=bf16,o=f32"


def _close(got, want, rtol):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype, (got.dtype, want.dtype)
  assert np.all(np.isfinite(got)), got
  np.testing.assert_allclose(got, want, rtol=rtol)


# -- part 1: extreme magnitudes.


def test_softmax_cross_entropy_of_logits_4e4_apart_in_float16():
  # Logits of +-4e4 each fit float16; their difference (8e4, in log_softmax) does not.
  x = jnp.array([[1.0, -1.0, 0.0], [-1.0, 0.5, 1.0]])
  w = jnp.eye(3) * 4e4
  labels = jnp.array([[1.0, 0.0, 0.0], [0.0, 0.25, 0.75]])
  loss = lambda w, x: optax.softmax_cross_entropy(x @ w, labels)
  _close(ols.autocast(loss, F16)(w, x), loss(w, x), 1e-3)


def test_squared_error_of_values_near_4e4_in_float16():
  # Predictions and targets both activations of +-4e4: their difference overflows float16.
  x, w = jnp.array([[4.0, -4.0], [3.0, -4.5]]), jnp.eye(2) * 1e4
  loss = lambda w, x: jnp.mean(optax.squared_error((x @ w)[:, 0], (x @ w)[:, 1]))
  _close(ols.autocast(loss, F16)(w, x), loss(w, x), 1e-3)


_NORM = "jnp.linalg.norm squares with x * conj(x), a 16-bit mul: inf norms, zero outputs and grads"


def _activations_300():
  x = jnp.full((2, 8), 1.0) + jnp.arange(8.0) / 16
  return x, jnp.eye(8) * 300.0  # x @ w: activations of 300 to 440, their squares overflow float16


@pytest.mark.parametrize(
  "normalise",
  [
    pytest.param(lambda h: jnp.linalg.norm(h, axis=-1), id="norm"),
    pytest.param(  # L2 normalisation
      lambda h: h / jnp.linalg.norm(h, axis=-1, keepdims=True),
      id="l2_normalise",
    ),
  ],
)
def test_norm_and_l2_normalisation_of_activations_of_300_in_float16(normalise):
  x, w = _activations_300()
  f = lambda w, x: normalise(x @ w)
  loss = lambda w, x: jnp.sum(f(w, x) * jnp.arange(1.0, 9.0)[: f(w, x).shape[-1]])
  mixed = ols.autocast(f, F16)
  _close(mixed(w, x), f(w, x), 2e-3)
  grad = jax.grad(lambda w, x: jnp.sum(mixed(w, x) * jnp.arange(1.0, 9.0)[: f(w, x).shape[-1]]))
  g, want = grad(w, x), jax.grad(loss)(w, x)
  assert bool(jnp.any(g != 0)), "all-zero gradients"
  np.testing.assert_allclose(g, want, rtol=2e-2, atol=2e-3 * float(jnp.max(jnp.abs(want))))


def test_hand_written_rms_norm_of_activations_near_300_in_float16():
  # A square written `h * h` (not jnp.square): 300**2 overflows float16.
  x, w = _activations_300()

  def rms_norm(w, x):
    h = x @ w
    return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)

  _close(ols.autocast(rms_norm, F16)(w, x), rms_norm(w, x), 2e-3)


def test_a_1024_wide_mean_by_reduce_window_in_bfloat16():
  x = jnp.linspace(0.5, 1.5, 2048).reshape(1, 2048)
  w = jnp.ones((1, 1))

  def mean(w, x):  # 1024-wide windows, 512 apart
    return lax.reduce_window((x.T @ w).T, 0.0, lax.add, (1, 1024), (1, 512), "VALID") / 1024

  got, want = ols.autocast(mean, BF16)(w, x), mean(w, x)
  assert got.shape == (1, 3)
  np.testing.assert_allclose(got, want, atol=1e-2)


def test_average_pool_of_four_values_of_3e4_in_float16():
  x, w = jnp.full((1, 4), 3.0), jnp.eye(4) * 1e4  # four 3e4: their sum overflows float16
  pool = lambda w, x: lax.reduce_window((x @ w).reshape(1, 2, 2, 1), 0.0, lax.add, (1, 2, 2, 1),
                                        (1, 1, 1, 1), "VALID") / 4  # fmt: skip
  got = ols.autocast(pool, F16)(w, x)
  _close(got, pool(w, x), 1e-3)
  assert float(got.ravel()[0]) == 3e4


def test_take_fills_with_the_functions_constant_not_minus_inf_in_float16():
  take = lambda w, x: jnp.take(x @ w, jnp.array([0, 5, 1]), axis=1, mode="fill", fill_value=-1e9)
  x, w = jnp.ones((2, 3)), jnp.eye(3)
  got = ols.autocast(take, F16)(w, x)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, take(w, x))  # -1e9, not -inf
  assert float(got[0, 1]) == -1e9


def test_a_float_loop_counter_started_from_an_activation_counts_past_2048():
  # while_loop(lambda c: c < 3000., lambda c: c + 1., (x @ w)[0] * 0.) never ends if the counter
  # stays float16 (2048 + 1 rounds to 2048). Bounded here by an int guard, so that a failure is
  # a wrong count rather than a hung test.
  def count(w, x):
    c0 = (x @ w)[0, 0] * 0.0
    cond = lambda c: (c[0] < 3000.0) & (c[1] < 4000)
    return lax.while_loop(cond, lambda c: (c[0] + 1.0, c[1] + 1), (c0, 0))

  x, w = jnp.ones((1, 2)), jnp.ones((2, 2))
  counter, steps = ols.autocast(count, F16)(w, x)
  assert counter.dtype == jnp.float32
  assert (float(counter), int(steps)) == (3000.0, 3000)


def test_dot_product_attention_in_float16_is_finite_and_close_to_float32():
  # jax.nn.dot_product_attention asks for float32 logits (preferred_element_type): here they
  # reach 1e5, above float16's 65504. Kept in float32, the error is the inputs' rounding (3e-4).
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (2, 6, 8)) * 100
  ws = [jax.random.normal(k, (8, 8)) / 8**0.5 for k in keys[1:]]

  def attend(ws, x):
    q, k, v = (jnp.reshape(x @ w, (2, 6, 2, 4)) for w in ws)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)

  got, want = ols.autocast(attend, F16)(ws, x), attend(ws, x)
  assert bool(jnp.all(jnp.isfinite(got)))
  np.testing.assert_allclose(got, want, atol=2e-3 * float(jnp.max(jnp.abs(want))))


def test_an_explicit_float32_accumulation_in_the_function_is_kept():
  # The function computes in float16 itself and asks for a float32 result: 2049 is not a float16.
  def f(w, x):
    return lax.dot(x.astype(jnp.float16), w.astype(jnp.float16), preferred_element_type=jnp.float32)

  x, w = jnp.ones((1, 2049)), jnp.ones((2049, 1))
  assert float(f(w, x)[0, 0]) == 2049.0
  assert float(ols.autocast(f, F16)(w, x)[0, 0]) == 2049.0


# -- part 1: complex values are never cast to a real dtype.


def test_fft_under_a_float32_policy_returns_complex():
  x = jnp.arange(8.0)
  got = ols.autocast(jnp.fft.fft, "f32")(x)
  assert jnp.issubdtype(got.dtype, jnp.complexfloating), got.dtype
  np.testing.assert_allclose(got, jnp.fft.fft(x), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("policy", [F16, BF16])
def test_a_complex_matrix_product_stays_complex(policy):
  a = jnp.arange(6.0).reshape(2, 3) + 1j * jnp.ones((2, 3))
  b = jnp.ones((3, 2)) - 2j * jnp.eye(3, 2)
  matmul = lambda a, b: a @ b
  got = ols.autocast(matmul, policy)(a, b)
  assert jnp.issubdtype(got.dtype, jnp.complexfloating), got.dtype
  np.testing.assert_allclose(got, matmul(a, b), rtol=1e-5)  # small integers: exact in 16 bits
  jaxpr = jax.make_jaxpr(ols.autocast(matmul, policy))(a, b)
  assert all("complex" in d for dts in matmul_inputs(jaxpr) for d in dts), matmul_inputs(jaxpr)


@pytest.mark.parametrize("policy", [F16, BF16])
def test_lax_complex_of_16_bit_operands(policy):
  f = lambda w, x: jnp.abs(lax.complex(x @ w, (x @ w) * 2.0)) + jnp.angle(lax.complex(x @ w, 1.0))
  x, w = jnp.array([[1.0, -2.0]]), jnp.eye(2)
  _close(ols.autocast(f, policy)(w, x), f(w, x), 1e-2)


# -- part 1: compute dtypes autocast cannot honour are refused.


def test_a_float64_compute_dtype_without_x64_is_refused():
  if jax.config.jax_enable_x64:
    pytest.skip("with x64 enabled, float64 is a real dtype")
  x, w = jnp.ones((2, 3)), jnp.ones((3, 2))
  with pytest.raises(ValueError, match=r"float64|f64"):
    ols.autocast(lambda w, x: x @ w, "p=f32,c=f64,o=f32")(w, x)


def test_an_fp8_compute_dtype_is_refused():
  x, w = jnp.ones((2, 3)), jnp.full((3, 2), 200.0)  # products of 600: NaN in float8_e4m3fn
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    policy = ols.Policy(jnp.float32, jnp.float8_e4m3fn, jnp.float32)
    ols.autocast(lambda w, x: x @ w, policy)(w, x)


# -- part 1: in-place updates of integer leaves.


@pytest.mark.parametrize(
  "increment",
  [
    pytest.param(1, id="int"),
    pytest.param(0.5, id="float"),
  ],
)  # fmt: skip
def test_an_in_place_update_of_an_int_leaf_is_written_as_the_function_writes_it(increment):
  def step(state, w, x):
    state["count"] = state["count"] + increment
    state["ema"] = 0.5 * state["ema"] + jnp.mean(x @ w)
    return jnp.sum(x @ w)

  x, w = jnp.ones((2, 3)), jnp.ones((3, 2))
  mixed = {"count": jnp.array(2**24 + 1, jnp.int32), "ema": jnp.zeros(())}
  plain = dict(mixed)
  ols.autocast(step, F16)(mixed, w, x)
  step(plain, w, x)
  assert mixed["count"].dtype == plain["count"].dtype
  assert mixed["count"].item() == plain["count"].item()
  assert mixed["ema"].dtype == jnp.float32


# -- part 2: everyday primitives and structures.


@pytest.mark.parametrize("policy", [F16, BF16])
@pytest.mark.parametrize(
  "op",
  [
    pytest.param(lambda h: jnp.stack([h, h * 2]), id="stack"),
    pytest.param(lambda h: jnp.unstack(h)[1], id="unstack"),
    pytest.param(lambda h: jnp.select([h > 0, h < -1], [h, h * h], 0.5), id="select"),
    pytest.param(lambda h: jnp.linalg.det(h[:, :4] + 4 * jnp.eye(4)), id="det"),  # n >= 4
    pytest.param(lambda h: jnp.linalg.slogdet(h[:, :4] + 4 * jnp.eye(4))[1], id="slogdet"),
    pytest.param(lambda h: jnp.corrcoef(h), id="corrcoef"),
    pytest.param(lambda h: jax.ad_checkpoint.checkpoint_name(h, "act") * 2, id="checkpoint_name"),
    pytest.param(lambda h: lax.linalg.lu_pivots_to_permutation(lax.linalg.lu(h[:, :4])[1], 4)
                 * h[:, 0], id="lu_pivots_to_permutation"),
  ],
)  # fmt: skip
def test_everyday_primitives_have_rules(op, policy):
  x = jnp.array([[1.0, -2.0, 0.5, 3.0], [0.25, 1.5, -1.0, 2.0], [2.0, 0.5, 1.0, -0.5],
                 [-1.5, 1.0, 0.75, 0.5]])  # fmt: skip
  f = lambda w, x: op(x @ w)
  got, want = ols.autocast(f, policy)(jnp.eye(4), x), f(jnp.eye(4), x)
  np.testing.assert_allclose(got, want, rtol=3e-2, atol=1e-2)


def test_a_remat_policy_that_saves_named_activations():
  def block(w, x):
    a = jax.ad_checkpoint.checkpoint_name(jnp.tanh(x @ w), "act")
    return jnp.sum(jnp.sin(a @ w))

  remat = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names("act"))
  x, w = jnp.ones((2, 3)) * 0.5, jnp.eye(3)
  mixed = ols.autocast(remat, F16)
  np.testing.assert_allclose(jax.grad(mixed)(w, x), jax.grad(remat)(w, x), rtol=1e-2)


def test_typed_prng_keys_in_a_loop_carry_and_a_cond_output():
  def f(w, x, key):
    h = x @ w

    def body(c):
      k, acc, i = c
      k, sub = jax.random.split(k)
      return k, acc + jax.random.normal(sub, acc.shape), i + 1

    key, h, _ = lax.while_loop(lambda c: c[2] < 3, body, (key, h, 0))
    key = lax.cond(jnp.sum(h) > 0, lambda k: jax.random.split(k)[0], lambda k: k, key)
    return h, jax.random.key_data(key)

  x, w, key = jnp.ones((2, 3)), jnp.eye(3), jax.random.key(0)
  (h, data), (want_h, want_data) = ols.autocast(f, F16)(w, x, key), f(w, x, key)
  np.testing.assert_array_equal(data, want_data)
  np.testing.assert_allclose(h, want_h, rtol=1e-2)


@pytest.mark.parametrize(
  "sample",
  [
    lambda k, h: jax.random.poisson(k, h),
    lambda k, h: jax.random.binomial(k, 8.0, jax.nn.sigmoid(h)),
    lambda k, h: jax.random.multinomial(k, 8.0, jax.nn.softmax(h)),
  ],
  ids=["poisson", "binomial", "multinomial"],
)
def test_samplers_whose_loops_carry_keys(sample):
  x, w, key = jnp.array([[0.5, 1.0, 2.0, 4.0]]), jnp.eye(4), jax.random.key(3)
  f = lambda w, x, key: sample(key, x @ w)
  np.testing.assert_array_equal(ols.autocast(f, F16)(w, x, key), f(w, x, key))


@pytest.mark.parametrize(
  "special",
  [
    jax.scipy.special.expi,
    jax.scipy.special.exp1,
    lambda h: jax.scipy.special.expn(2, h),
    lambda h: jax.scipy.special.hyp1f1(0.5, 1.5, h),
    lambda h: jax.scipy.special.hyp2f1(0.5, 1.0, 1.5, h * 0.25),
  ],
  ids=["expi", "exp1", "expn", "hyp1f1", "hyp2f1"],
)
def test_special_functions_with_loops(special):
  x, w = jnp.array([[0.5, 1.0, 2.0, 3.0]]), jnp.eye(4)
  f = lambda w, x: special(x @ w)
  _close(ols.autocast(f, F16)(w, x), f(w, x), 1e-2)


def test_autocast_of_vmap_of_a_data_dependent_while_loop():
  def halve_until_small(h):
    return lax.while_loop(lambda c: jnp.max(jnp.abs(c)) > 1.0, lambda c: c * 0.5, h)

  f = lambda w, x: jax.vmap(halve_until_small)(x @ w)
  x, w = jnp.array([[3.0, 0.5], [0.25, 0.5], [9.0, -20.0]]), jnp.eye(2)
  got = ols.autocast(f, F16)(w, x)
  np.testing.assert_array_equal(got, f(w, x))  # halvings are exact
