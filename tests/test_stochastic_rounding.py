"""stochastic_round and stochastic_rounding: unbiased to the bit, reproducible, learning.

Unbiasedness is checked exhaustively: for a value whose rounding uses `s`
random bits, every one of the 2**s bit patterns is fed in and the mean of the
results must equal the value exactly (in rational arithmetic); each result
must be one of the value's two neighbours in the target dtype, found with
NumPy/ml_dtypes' `nextafter`, independently of the implementation.
"""

from __future__ import annotations

from fractions import Fraction
import platform

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._src.storage import rounding
from tests import assert_trees_equal_across_programs
from tests import autocast_helpers as helpers
from tests.autocast_helpers import equations

BF16 = jnp.bfloat16
F16 = jnp.float16


def all_patterns(s):
  """Every value of `s` random bits, placed where the rounding reads them (the top)."""
  return jnp.asarray((np.arange(2**s, dtype=np.uint64) << (32 - s)).astype(np.uint32))


_round_all = jax.jit(
  lambda x, bits, dtype: rounding.round_with_bits(jnp.broadcast_to(x, bits.shape), bits, dtype),
  static_argnums=2,
)


def exact_mean(values, virtual_inf):
  """The mean in rational arithmetic, infinities counted as `virtual_inf`."""
  values = np.asarray(values, np.float64)
  distinct, counts = np.unique(values, return_counts=True)
  total = Fraction(0)
  for value, count in zip(distinct.tolist(), counts.tolist(), strict=True):
    value = np.copysign(virtual_inf, value) if np.isinf(value) else value
    total += Fraction(value) * count
  return total / len(values)


def neighbours(x, dtype):
  """The two values of `dtype` around the float32 `x`, by ml_dtypes' nextafter."""
  np_dtype = np.dtype(dtype)
  near = np.float32(x).astype(np_dtype)
  other = np.nextafter(near, np_dtype.type(np.inf if float(near) < float(x) else -np.inf))
  return sorted({float(near), float(other)})


# (value, dtype, random bits the rounding uses): the normal range of both dtypes,
# bfloat16 and float32 subnormals, float16 subnormals (more bits below a fixed ulp),
# the edges of the finite range.
CASES = [
  (1.0 + 2**-10, BF16, 16),
  (1.0 + 3 * 2**-12 + 2**-20, BF16, 16),
  (-2.5 + 2**-20, BF16, 16),
  (3e-39, BF16, 16),  # a float32 subnormal, between two bfloat16 subnormals
  (-1e-40, BF16, 16),
  (3.38e38, BF16, 16),  # between the two largest finite bfloat16 values
  (1.0 + 2**-12 + 2**-22, F16, 13),
  (-1000.3, F16, 13),
  (2.0**-14 * 1.3, F16, 13),  # float16's smallest normal binade
  (2.0**-20 * 1.37, F16, 19),  # a float16 subnormal: 13 + (-14 - -20) bits
  (-(2.0**-17) * 1.999, F16, 16),
  (2.0**-25 * 1.25, F16, 21),  # below the smallest float16 subnormal
]


class StochasticRoundTest(parameterized.TestCase):
  @parameterized.parameters(*CASES)
  def test_exhaustively_unbiased_between_the_two_neighbours(self, x, dtype, s):
    x = float(np.float32(x))
    results = np.asarray(_round_all(jnp.float32(x), all_patterns(s), dtype), np.float64)
    self.assertEqual(results.dtype, np.float64)
    self.assertEqual(exact_mean(results, np.inf), Fraction(x))
    self.assertEqual(sorted(set(results.tolist())), neighbours(x, dtype))

  @parameterized.parameters(
    (65505.0, 1 / 32), (65519.0, 15 / 32), (-65530.0, 26 / 32), (65536.0, 1.0), (1e6, 1.0)
  )
  def test_float16_past_the_largest_finite_value_rounds_to_inf_as_often_as_it_would_round_up(
    self, x, p_inf
  ):
    # Unbiased with infinity standing for 65536, the value the exponent would reach.
    results = np.asarray(_round_all(jnp.float32(x), all_patterns(13), F16), np.float64)
    self.assertEqual(np.mean(np.isinf(results)), p_inf)
    self.assertTrue(np.all(np.sign(results) == np.sign(x)))
    if x < 65536:
      self.assertEqual(exact_mean(results, 65536.0), Fraction(float(np.float32(x))))
    # Round-to-nearest overflows from 65520 on.
    with np.errstate(over="ignore"):
      self.assertEqual(bool(np.isinf(np.float16(np.float32(x)))), abs(x) >= 65520)

  @parameterized.parameters(BF16, F16)
  def test_exact_values_infinities_nans_and_signed_zeros_stay(self, dtype):
    x = jnp.array([0.0, -0.0, 1.0, -0.5, 2.0**-24, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    for bits in (jnp.zeros(8, jnp.uint32), jnp.full(8, 0xFFFFFFFF, jnp.uint32)):
      y = np.asarray(rounding.round_with_bits(x, bits, dtype)).astype(np.float32)
      np.testing.assert_array_equal(y[:7], np.asarray(x[:7]))
      np.testing.assert_array_equal(np.signbit(y[:2]), [False, True])
      self.assertTrue(np.isnan(y[7]))
    # A NaN whose payload sits only in float32's low bits is still a NaN.
    payload = jax.lax.bitcast_convert_type(jnp.uint32(0x7F800001), jnp.float32)
    self.assertTrue(bool(jnp.isnan(rounding.round_with_bits(payload, jnp.uint32(0), dtype))))

  def test_the_bfloat16_bit_trick_equals_the_general_rule(self):
    # bfloat16 adds 16 random bits to the float32 bits and truncates; the general
    # rule (written for float16's narrower exponent) must agree on every value.
    key_x, key_bits = jax.random.split(jax.random.key(0))
    exponents = jax.random.randint(key_x, (50_000,), -149, 128).astype(jnp.float32)
    mantissas = jax.random.uniform(key_x, (50_000,), minval=-2.0, maxval=2.0)
    x = mantissas * jnp.exp2(exponents)
    bits = jax.random.bits(key_bits, x.shape, jnp.uint32)
    fast = rounding.round_with_bits(x, bits, BF16)
    raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
    general = rounding._round_narrower_exponent(raw, bits, np.dtype(BF16))
    general = general | ((raw >> 16) & np.uint32(0x8000))
    np.testing.assert_array_equal(
      np.asarray(fast).view(np.uint16), np.asarray(general.astype(jnp.uint16))
    )

  def test_same_key_same_bits_and_the_mean_is_the_value(self):
    x = jnp.full(100_000, 1.0 + 2**-10, jnp.float32)
    a = ols.stochastic_round(x, BF16, jax.random.key(0))
    b = jax.jit(ols.stochastic_round, static_argnums=1)(x, BF16, jax.random.key(0))
    c = ols.stochastic_round(x, BF16, jax.random.PRNGKey(1))
    chex.assert_trees_all_equal(a, b)
    self.assertEqual(a.dtype, BF16)
    self.assertFalse(bool(jnp.all(a == c)))
    # 1/8 of an ulp up on average: the standard error of the mean is ~0.1% of that.
    mean_ulps = (a.astype(jnp.float32).mean() - 1.0) / 2**-7
    self.assertAlmostEqual(float(mean_ulps), 1 / 8, delta=0.005)

  def test_dtypes_other_than_bfloat16_and_float16_are_refused(self):
    for dtype in (jnp.float32, jnp.float8_e4m3fn, jnp.int16):
      with self.assertRaisesRegex(ValueError, r"dtype must be one of the dtypes bfloat16, float16"):
        ols.stochastic_round(jnp.ones(2), dtype, jax.random.key(0))


class HashBitsTest(parameterized.TestCase):
  """The bits `stochastic_rounding` rounds with: a keyed hash of each element's index.

  Not a generator with proven properties, so checked as one would check a
  generator's output, at fixed seeds (deterministic): every bit balanced, the
  top byte uniform, no correlation between neighbours, between consecutive
  steps' seeds or between rows; and a bijection of the index for one seed.
  Each threshold is five standard deviations of the statistic for random bits.
  """

  N = 2**20

  def bits(self, seed, shape=None):
    return np.asarray(rounding.hash_bits(jnp.asarray(seed, jnp.uint32), shape or (self.N,)))

  def test_a_bijection_of_the_index(self):
    self.assertLen(np.unique(self.bits([7, 11])), self.N)

  def test_balanced_uniform_and_uncorrelated(self):
    seeds = jax.random.bits(jax.random.key(0), (3, 2), jnp.uint32)  # three steps' seeds
    a, b = self.bits(seeds[0]), self.bits(seeds[1])
    n, five_sigma = self.N, 5 / np.sqrt(self.N)
    ones = np.unpackbits(a.view(np.uint8)).reshape(n, 32).mean(axis=0)
    np.testing.assert_array_less(np.abs(ones - 0.5), five_sigma / 2)
    counts = np.bincount(a >> 24, minlength=256)
    chi2 = np.sum((counts - n / 256) ** 2 / (n / 256))
    self.assertLess(chi2, 255 + 5 * np.sqrt(2 * 255))
    # Pairs of neighbours' top nibbles: uniform over the 256 pairs.
    pairs = np.bincount((a[:-1] >> 28) * 16 + (a[1:] >> 28), minlength=256)
    chi2 = np.sum((pairs - (n - 1) / 256) ** 2 / ((n - 1) / 256))
    self.assertLess(chi2, 255 + 5 * np.sqrt(2 * 255))
    u, v = (a >> 16) / 2**16, (b >> 16) / 2**16
    for x, y in ((u[:-1], u[1:]), (u, v), (u[: n // 2], u[n // 2 :])):
      self.assertLess(abs(np.corrcoef(x, y)[0, 1]), five_sigma)
    # A 2-D leaf hashes its row-major index: the same bits as the flat one.
    np.testing.assert_array_equal(self.bits(seeds[2], (1024, 1024)).ravel(), self.bits(seeds[2]))

  def test_a_seed_word_changes_half_the_bits(self):
    a = self.bits([7, 11])
    for other in ([6, 11], [7, 10]):
      flipped = np.unpackbits((a ^ self.bits(other)).view(np.uint8)).mean()
      self.assertAlmostEqual(float(flipped), 0.5, delta=0.002)


def make_params(dtype=BF16):
  return {
    "w": (1.0 + jnp.linspace(-0.1, 0.1, 12, dtype=jnp.float32).reshape(3, 4)).astype(dtype),
    "b": jnp.array([0.5, -0.25, 0.125, 1.0], dtype),
    "c": jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32),
  }


def loss_fn(params, x):
  f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  return jnp.mean((jnp.tanh(x @ f32["w"] + f32["b"] + f32["c"]) - 0.3) ** 2)


def batch(step):
  return jnp.cos(jnp.arange(6.0).reshape(2, 3) + step)


grads_of = jax.jit(jax.grad(loss_fn))


class StochasticRoundingTest(parameterized.TestCase):
  def test_learns_where_round_to_nearest_stalls(self):
    start = {"w": (1.0 + jnp.linspace(-0.05, 0.05, 256)).astype(BF16)}
    grads = {"w": jnp.ones(256, BF16)}
    stalled, learned = start, start
    bare, tx = optax.adam(1e-3), ols.stochastic_rounding(optax.adam(1e-3), key=0)
    bare_state, state = bare.init(start), tx.init(start)
    for _ in range(50):
      stalled, bare_state = ols.apply_gradients(bare, grads, bare_state, stalled)
      learned, state = ols.apply_gradients(tx, grads, state, learned)
    chex.assert_trees_all_equal(stalled, start)
    # Adam moves every weight down by about 50 * 1e-3 (its first steps by exactly lr).
    moved = start["w"].astype(jnp.float32) - learned["w"].astype(jnp.float32)
    self.assertAlmostEqual(float(moved.mean()), 0.05, delta=0.003)

  def test_unbiased_over_keys_the_mean_is_the_float32_result(self):
    params = {"w": jnp.full(64, 1.0, BF16), "b": jnp.full(64, -3.0, BF16)}
    grads = {"w": jnp.full(64, 0.7, BF16), "b": jnp.full(64, -0.3, BF16)}

    def one_step(key):
      tx = ols.stochastic_rounding(optax.sgd(1e-3), key)  # a traced key: built inside vmap
      new, _ = ols.apply_gradients(tx, grads, tx.init(params), params)
      return jax.tree.map(lambda p: p.astype(jnp.float32), new)

    keys = jax.random.split(jax.random.key(42), 2000)
    new = jax.jit(jax.vmap(one_step))(keys)
    for name in params:
      exact = params[name].astype(jnp.float32) - 1e-3 * grads[name].astype(jnp.float32)
      ulp = 2.0**-7 if name == "w" else 2.0**-6
      # The rounding error of one draw is within an ulp; over 128000 draws the mean's
      # standard error is below 0.002 ulp.
      np.testing.assert_allclose(float(new[name].mean()), float(exact[0]), atol=0.01 * ulp, rtol=0)
      # The float32 result is below half an ulp away: round-to-nearest would not move.
      self.assertEqual(float(exact[0].astype(BF16)), float(params[name][0]))

  def test_same_key_same_run_bit_for_bit_eager_jit_and_scan(self):
    # Plain SGD: one multiply, rounded alike eagerly and compiled, so that every
    # difference would be the random bits'. (XLA may round a fused program's
    # multiply-adds differently from eager ops, as for any optimizer.)
    tx = ols.stochastic_rounding(optax.sgd(1e-2), key=jax.random.key(7))
    xs = jnp.stack([batch(i) for i in range(5)])

    def run(step_fn):
      params = make_params()
      state = tx.init(params)
      for x in xs:
        params, state = step_fn(jax.grad(loss_fn)(params, x), state, params)
      return params, state

    eager = run(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    jitted = run(jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p)))
    again = run(jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p)))

    def body(carry, x):
      params, state = carry
      return ols.apply_gradients(tx, jax.grad(loss_fn)(params, x), state, params), None

    params = make_params()
    scanned, _ = jax.jit(lambda c: jax.lax.scan(body, c, xs))((params, tx.init(params)))
    chex.assert_trees_all_equal(jitted, again)  # one program: bit for bit everywhere
    assert_trees_equal_across_programs(eager, jitted)  # two programs: bit for bit on CPU
    assert_trees_equal_across_programs(scanned, jitted)
    other = ols.stochastic_rounding(optax.sgd(1e-2), key=jax.random.key(8))
    params = make_params()
    state = other.init(params)
    for x in xs:
      params, state = ols.apply_gradients(other, grads_of(params, x), state, params)
    self.assertFalse(bool(jnp.all(params["w"] == jitted[0]["w"])))

  def test_update_and_apply_updates_land_on_the_fused_step_bits(self):
    tx = ols.stochastic_rounding(optax.adam(1e-3), key=3)
    fused = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    update = jax.jit(tx.update)
    p1 = p2 = make_params()
    s1 = s2 = tx.init(p1)
    for i in range(6):
      p1, s1 = fused(grads_of(p1, batch(i)), s1, p1)
      updates, s2 = update(grads_of(p2, batch(i)), s2, p2)
      self.assertEqual(updates["w"].dtype, jnp.float32)
      p2 = optax.apply_updates(p2, updates)
      chex.assert_trees_all_equal(p1, p2)
      chex.assert_trees_all_equal(s1, s2)

  def test_no_float32_copy_of_the_parameters_in_the_state(self):
    params = make_params()
    tx = ols.stochastic_rounding(optax.adam(1e-3), key=0)
    state = tx.init(params)
    _, state = ols.apply_gradients(tx, grads_of(params, batch(0)), state, params)
    # The inner state is Adam's on the parameters as they are, plus one key.
    self.assertEqual(state.inner_state[0].mu["w"].dtype, BF16)
    self.assertEqual(state.inner_state[0].nu["b"].dtype, BF16)
    self.assertEqual((state.key.dtype, state.key.shape), (jnp.uint32, (2,)))
    bytes_of = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    bare = optax.adam(1e-3).init(params)
    self.assertEqual(bytes_of(state), bytes_of(bare) + 8)
    for leaf in jax.tree.leaves(state.inner_state):
      self.assertFalse(leaf.dtype == jnp.float32 and leaf.shape == params["w"].shape)

  def test_in_the_jaxpr_the_step_is_float32_then_rounded(self):
    # The claim on the program: the inner optimizer computes in float32 (no
    # equation does 16-bit arithmetic: every 16-bit result is a state leaf stored
    # back, converted from float32, a view of bits (bitcast_convert_type), the
    # rounding's choice between two such views (select_n) or a one-element read
    # of a new parameter (slice, reshape: the CPU's write order, storage/schedule.py));
    # for each 16-bit parameter, one float32 `add` of the parameter, converted up,
    # and its update, then one rounding of its bits to the parameter's dtype.
    # (Where the default backend is a CPU, `rounding.cast` converts between float32
    # and bfloat16 on the bits: a bfloat16 moment is stored back as a view of
    # uint16 bits, and a bfloat16 parameter is converted up by a shift of its bits.)
    params = {"h": jnp.ones(5, jnp.float16), "w": jnp.ones((4, 3), BF16)}
    tx = ols.stochastic_rounding(optax.adam(1e-3), key=0)
    step = lambda g, s, p: ols.apply_gradients(tx, g, s, p)
    jaxpr = jax.make_jaxpr(step)(params, tx.init(params), params)
    eqns = list(equations(jaxpr))
    made_by = {id(v): e for e in eqns for v in e.outvars}
    half = [
      (e.primitive.name, str(e.invars[0].aval.dtype))
      for e in eqns
      for v in e.outvars
      if getattr(v.aval, "dtype", None) in (BF16, F16)
    ]
    # (jit, cond: calls, whose own equations are listed too)
    moves = {"bitcast_convert_type", "select_n", "slice", "reshape", "cond", "jit", "pjit"}
    self.assertEqual({name for name, _ in half} - moves, {"convert_element_type"})
    on_bits = jax.default_backend() == "cpu"  # the bfloat16 leaf's moments are views of bits
    self.assertCountEqual(  # Adam's mu and nu of each parameter
      [h for h in half if h[0] == "convert_element_type"],
      [("convert_element_type", "float32")] * (2 if on_bits else 4),
    )

    def converted_up_from(v, dtype):  # through the conversion's own equations
      for _ in range(5):
        e = made_by.get(id(v))
        if e is None:
          return False
        if any(u.aval.dtype == dtype for u in e.invars):
          return e.primitive.name in ("convert_element_type", "bitcast_convert_type")
        if e.primitive.name not in ("bitcast_convert_type", "shift_left", "convert_element_type"):
          return False
        v = e.invars[0]
      return False

    for name, p in params.items():
      sums = [
        e
        for e in eqns
        if e.primitive.name == "add"
        and e.outvars[0].aval.shape == p.shape
        and e.outvars[0].aval.dtype == jnp.float32
        and any(converted_up_from(v, p.dtype) for v in e.invars)
      ]
      self.assertLen(sums, 1, name)
      rounded = [
        e
        for e in eqns
        if e.primitive.name == "select_n"
        and e.outvars[0].aval.dtype == p.dtype
        and e.outvars[0].aval.shape == p.shape
      ]
      self.assertLen(rounded, 1, name)

  def test_the_key_advances_once_per_applied_step_and_differs_per_leaf(self):
    tx = ols.stochastic_rounding(optax.sgd(2.0**-10), key=jax.random.key(5))
    # Two leaves with the same values and updates: each gets its own bits.
    params = {"a": jnp.ones(4096, BF16), "b": jnp.ones(4096, BF16)}
    grads = {"a": jnp.ones(4096, BF16), "b": jnp.ones(4096, BF16)}
    state = tx.init(params)
    np.testing.assert_array_equal(state.key, jax.random.key_data(jax.random.key(5)))
    new, new_state = ols.apply_gradients(tx, grads, state, params)
    expected_key = jax.random.split(jax.random.key(5))[1]
    np.testing.assert_array_equal(new_state.key, jax.random.key_data(expected_key))
    self.assertFalse(bool(jnp.all(new["a"] == new["b"])))
    # 2**-10 is a quarter of the bfloat16 spacing below 1.0 (2**-8): a quarter go down.
    self.assertAlmostEqual(float(jnp.mean(new["a"] < 1)), 0.25, delta=0.03)
    self.assertAlmostEqual(float(jnp.mean(new["b"] < 1)), 0.25, delta=0.03)

  def test_one_draw_of_random_words_a_step_however_many_leaves(self):
    # A draw per leaf (a fold_in, then two words) was a small loop of its own on a CPU:
    # 1.3 ms a step for 256 leaves. The words of every leaf come from one draw.
    def draws(leaves):
      tx = ols.stochastic_rounding(optax.adam(1e-3), key=0)
      params = {f"w{i}": jnp.ones((8, 16), BF16) for i in range(leaves)}
      jaxpr = jax.make_jaxpr(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
        params, tx.init(params), params
      )
      names = [e.primitive.name for e in equations(jaxpr)]
      return {n: names.count(n) for n in ("random_split", "random_fold_in", "random_bits")}

    self.assertEqual(draws(2), {"random_split": 1, "random_fold_in": 0, "random_bits": 1})
    self.assertEqual(draws(40), draws(2))

  def test_each_moment_is_written_after_its_own_parameter_only(self):
    # The state is ordered after the new parameters that read it (no copy of a donated
    # moment on a CPU). Each leaf's moments wait for that leaf's parameter only, so
    # that XLA:CPU can step one leaf after another; the count waits for them all.
    tx = ols.stochastic_rounding(optax.adam(1e-3), key=0)
    params = {"a": jnp.ones((8, 16), BF16), "b": jnp.ones((4, 32), BF16)}
    jaxpr = jax.make_jaxpr(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
      params, tx.init(params), params
    ).jaxpr
    new_params, new_state = jax.tree.unflatten(
      jax.tree.structure((params, tx.init(params))), jaxpr.outvars
    )
    adam = new_state.inner_state[0]
    depends_on = lambda var, target: helpers.depends_on(jaxpr, var, target)

    for leaf, other in (("a", "b"), ("b", "a")):
      for moment in (adam.mu[leaf], adam.nu[leaf]):
        self.assertTrue(depends_on(moment, new_params[leaf]))
        self.assertFalse(depends_on(moment, new_params[other]))
    # (In the jaxpr on every backend: the order is a `platform_dependent` branch.)
    self.assertTrue(all(depends_on(adam.count, new_params[k]) for k in params))

  def test_leaves_of_one_shape_and_values_round_independently(self):
    # Forty identical leaves, each stepped a quarter of an ulp down: each leaf's words
    # are its own row of the step's draw, so no two leaves round alike.
    tx = ols.stochastic_rounding(optax.sgd(2.0**-10), key=1)
    params = {f"w{i:02d}": jnp.ones(1024, BF16) for i in range(40)}
    new, _ = ols.apply_gradients(tx, jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    down = np.stack([np.asarray(new[k] < 1) for k in sorted(new)])
    self.assertEqual(len({row.tobytes() for row in down}), 40)
    np.testing.assert_allclose(down.mean(axis=1), 0.25, atol=0.06)
    # Pairs of leaves agree where independent bits would (a quarter down each: 5/8).
    agree = [np.mean(down[i] == down[j]) for i in range(40) for j in range(i + 1, 40)]
    self.assertAlmostEqual(float(np.mean(agree)), 0.625, delta=0.01)

  @parameterized.product(skip_mode=["cond", "select"], fused=[True, False])
  def test_a_skipped_step_inside_loss_scale_optimizer_leaves_params_and_key(self, skip_mode, fused):
    tx = ols.loss_scale_optimizer(
      ols.stochastic_rounding(optax.adam(1e-3), key=1),
      ols.DynamicLossScale(2.0**10),
      skip_mode=skip_mode,
    )

    def step(grads, state, params):
      if fused:
        return ols.apply_gradients(tx, grads, state, params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(step)
    params = make_params(F16)
    state = tx.init(params)
    scaled = lambda p, i: jax.tree.map(lambda g: g * 2.0**10, grads_of(p, batch(i)))
    params, state = step(scaled(params, 0), state, params)
    poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.nan), scaled(params, 1))
    new_params, new_state = step(poisoned, state, params)
    self.assertFalse(bool(new_state.last_step_applied))
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    # The next applied step uses the key the skipped step did not consume.
    _, after = step(scaled(params, 1), new_state, params)
    expected = jax.random.split(jax.random.wrap_key_data(state.inner_state.key))[1]
    np.testing.assert_array_equal(after.inner_state.key, jax.random.key_data(expected))

  def test_a_skipped_step_inside_skip_bad_steps_leaves_the_key(self):
    tx = ols.skip_bad_steps(ols.stochastic_rounding(optax.adam(1e-3), key=1))
    params = make_params()
    state = tx.init(params)
    poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads_of(params, batch(0)))
    new_params, new_state = ols.apply_gradients(tx, poisoned, state, params)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)

  def test_float32_leaves_are_stepped_as_the_inner_optimizer_steps_them(self):
    tx = ols.stochastic_rounding(optax.sgd(0.1), key=0)
    params = make_params()
    grads = grads_of(params, batch(0))
    new, _ = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
      grads, tx.init(params), params
    )
    np.testing.assert_array_equal(new["c"], params["c"] - 0.1 * grads["c"])

  def test_a_typed_key_of_another_implementation(self):
    tx = ols.stochastic_rounding(optax.sgd(1e-3), key=jax.random.key(0, impl="rbg"))
    params = {"w": jnp.ones(8, BF16)}
    state = tx.init(params)
    self.assertEqual(state.key.shape, jax.random.key_data(jax.random.key(0, impl="rbg")).shape)
    _, state = ols.apply_gradients(tx, {"w": jnp.ones(8, BF16)}, state, params)
    expected = jax.random.split(jax.random.key(0, impl="rbg"))[1]
    np.testing.assert_array_equal(state.key, jax.random.key_data(expected))


class ErrorTest(parameterized.TestCase):
  @parameterized.parameters(
    (True,),
    (-1,),
    (2**64,),
    (1.5,),
    ("0",),
    (jnp.ones(3, jnp.uint32),),
    (jax.random.split(jax.random.key(0), 2),),
  )
  def test_a_key_that_is_not_one_key_or_seed_is_refused_when_built(self, key):
    with self.assertRaisesRegex(ValueError, r"key must be a PRNG key"):
      ols.stochastic_rounding(optax.sgd(0.1), key)

  def test_a_parameter_it_cannot_round_to_is_refused_at_init(self):
    tx = ols.stochastic_rounding(optax.sgd(0.1), key=0)
    with self.assertRaisesRegex(ValueError, r"at \['q'\] is float8_e4m3fn"):
      tx.init({"w": jnp.ones(2, BF16), "q": jnp.ones(2, jnp.float8_e4m3fn)})

  def test_an_integer_gradient_leaf_is_refused(self):
    tx = ols.stochastic_rounding(optax.sgd(0.1), key=0)
    params = {"w": jnp.ones(2, BF16), "n": jnp.arange(2)}
    with self.assertRaisesRegex(TypeError, r"integer gradient leaf at \['n'\]"):
      tx.update({"w": jnp.ones(2, BF16), "n": jnp.arange(2)}, tx.init(params), params)

  def test_compositions_that_cannot_work_are_refused(self):
    with self.assertRaisesRegex(ValueError, r"goes inside the loss_scale_optimizer wrapper"):
      ols.stochastic_rounding(ols.loss_scale_optimizer(optax.sgd(0.1)), key=0)
    tx = optax.chain(
      ols.stochastic_rounding(optax.sgd(0.1), key=0), optax.add_decayed_weights(1e-4)
    )
    params = make_params()
    with self.assertRaisesRegex(ValueError, r"add_decayed_weights comes after it"):
      tx.update(grads_of(params, batch(0)), tx.init(params), params)
    with self.assertRaisesRegex(ValueError, r"its update needs them"):
      inner = ols.stochastic_rounding(optax.sgd(0.1), key=0)
      inner.update(grads_of(params, batch(0)), inner.init(params))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_neighbours_helper_agrees_with_ml_dtypes(dtype):
  # The test's own oracle: 1 + 2**-10 lies between 1 and the next value up.
  finfo = ml_dtypes.finfo(np.dtype(dtype))
  assert neighbours(1.0 + 2**-12, dtype) == [1.0, 1.0 + float(finfo.eps)]


class CastTest(parameterized.TestCase):
  """`rounding.cast`: `astype`, bit for bit, on the bits between float32 and bfloat16 in a
  program traced where the default backend is a CPU (`astype` eagerly and elsewhere, so
  the facts hold on every backend)."""

  def test_float32_to_bfloat16_is_astype_bit_for_bit(self):
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 4096, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    special = np.array(
      [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 1, 0x807FFFFF,
       0x00808000, 0x00018000, 0x3F808000, 0x3F818000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF],
      np.uint32,
    )  # fmt: skip
    # Everywhere, and below the normal range (subnormals) in particular.
    bits = np.concatenate([random, random & 0x807FFFFF, ties, special])
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
    view = lambda y: np.asarray(jax.lax.bitcast_convert_type(y, jnp.uint16))
    expected = view(jax.jit(lambda x: x.astype(BF16))(x))
    traced = view(jax.jit(lambda x: rounding.cast(x, BF16))(x))
    np.testing.assert_array_equal(view(rounding.cast(x, BF16)), expected)  # eagerly: astype
    # Off NaNs, the backend's conversion, and where it is computed on the bits (a CPU),
    # the rounding of ml_dtypes too (to nearest, ties to even; subnormals kept).
    nan = np.isnan(bits.view(np.float32))
    np.testing.assert_array_equal(traced[~nan], expected[~nan])
    if jax.default_backend() == "cpu":
      with np.errstate(invalid="ignore"):
        oracle = bits.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
      np.testing.assert_array_equal(traced[~nan], oracle[~nan])
      # A NaN: the quiet NaN of its sign, as XLA:CPU makes it on x86.
      np.testing.assert_array_equal(traced[nan], ((bits[nan] >> 16) & 0x8000) | 0x7FC0)
      if platform.machine().lower() in ("x86_64", "amd64"):
        np.testing.assert_array_equal(traced[nan], expected[nan])
    else:
      np.testing.assert_array_equal(traced[nan], expected[nan])

  def test_bfloat16_to_float32_is_astype_for_every_pattern(self):
    patterns = jnp.arange(2**16, dtype=jnp.uint32).astype(jnp.uint16)
    every = jax.lax.bitcast_convert_type(patterns, BF16)
    view = lambda y: np.asarray(jax.lax.bitcast_convert_type(y, jnp.uint32))
    got = view(jax.jit(lambda x: rounding.cast(x, jnp.float32))(every))
    np.testing.assert_array_equal(got, view(jax.jit(lambda x: x.astype(jnp.float32))(every)))
    np.testing.assert_array_equal(got, np.arange(2**16, dtype=np.uint32) << 16)

  @parameterized.parameters((jnp.float32, F16), (F16, jnp.float32), (BF16, F16), (jnp.int32, BF16))
  def test_other_pairs_are_astype(self, source, target):
    x = jnp.arange(-3, 4).astype(source)
    got = rounding.cast(x, target)
    self.assertEqual(got.dtype, np.dtype(target))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x.astype(target)))

  @pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA:CPU's program: elsewhere cast is the conversion"
  )
  def test_on_a_cpu_the_program_converts_no_float_to_bfloat16(self):
    # XLA:CPU's own float32 -> bfloat16 conversion is the slow loop `cast` avoids.
    x = jnp.linspace(-1.0, 1.0, 1024)
    text = jax.jit(lambda x: rounding.cast(x, BF16)).lower(x).compile().as_text()
    self.assertNotRegex(text, r"= bf16\[[\d,]*\]\S* convert\(")
    text = jax.jit(lambda x: x.astype(BF16)).lower(x).compile().as_text()
    self.assertRegex(text, r"= bf16\[[\d,]*\]\S* convert\(")  # the pattern finds one
