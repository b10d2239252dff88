"""`autocast`: the dtype of every op, forward and backward, through control flow and rules."""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._src.utils import compat
from tests.autocast_helpers import equations, inputs_of, matmul_inputs, mismatched

F16_POLICY = "p=f32,c=f16,o=f32"
HALVES = {"float16": "p=f32,c=f16,o=f32", "bfloat16": "p=f32,c=bf16,o=f32"}


def mlp(params, x):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"]) ** 2)


def mlp_params(seed=0, d=8, h=16):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
    "w1": jax.random.normal(k1, (d, h)) / d**0.5,
    "b1": jnp.zeros(h),
    "w2": jax.random.normal(k2, (h, 1)) / h**0.5,
  }


X = jax.random.normal(jax.random.key(9), (4, 8))


@pytest.mark.parametrize("half", HALVES)
def test_every_matmul_runs_in_the_compute_dtype_forward_and_backward(half):
  mixed = ols.autocast(mlp, HALVES[half])
  forward = jax.make_jaxpr(mixed)(mlp_params(), X)
  assert matmul_inputs(forward) == [(half, half)] * 2
  # Forward products accumulate in float32, and are rounded to the compute dtype.
  for eqn in equations(forward):
    if eqn.primitive.name == "dot_general":
      assert eqn.params["preferred_element_type"] == jnp.float32
  backward = jax.make_jaxpr(jax.grad(mixed))(mlp_params(), X)
  # 2 forward, 3 backward (w2, h for w1's path, w1; x is not differentiated).
  assert matmul_inputs(backward) == [(half, half)] * 5
  assert mismatched(backward) == []
  grads = jax.grad(mixed)(mlp_params(), X)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # float32 params


def test_without_autocast_jax_transposes_a_float32_accumulating_product_into_float32():
  # Why the products carry a custom rule: JAX's transpose of a float16
  # product whose preferred type is float32 takes the float32 cotangent.
  def naive(w, x):
    y = lax.dot(x.astype(jnp.float16), w.astype(jnp.float16), preferred_element_type=jnp.float32)
    return jnp.sum(y.astype(jnp.float16).astype(jnp.float32) ** 2)

  w = jnp.ones((8, 3))
  backward = matmul_inputs(jax.make_jaxpr(jax.grad(naive))(w, X))
  assert ("float32", "float16") in backward or ("float16", "float32") in backward
  mixed = ols.autocast(lambda w, x: jnp.sum((x @ w) ** 2), F16_POLICY)
  assert set(matmul_inputs(jax.make_jaxpr(jax.grad(mixed))(w, X))) == {("float16", "float16")}


def test_overflow_prone_ops_compute_in_float32():
  def model(w, x):
    logits = x @ w  # float16
    probs = jax.nn.softmax(logits)  # exp, sum in float32
    var = jnp.mean(jnp.square(logits - logits.mean()))  # square, reduce_sum in float32
    return jnp.sum(probs) + var + jnp.sum(jax.nn.sigmoid(logits)) + jnp.log1p(jnp.exp(var))

  jaxpr = jax.make_jaxpr(ols.autocast(model, F16_POLICY))(jnp.ones((8, 4)), X)
  for prim in ("exp", "reduce_sum", "square", "logistic", "log1p"):
    dtypes = inputs_of(jaxpr, prim)
    assert dtypes and all(d == ("float32",) for d in dtypes), (prim, dtypes)
  assert mismatched(jaxpr) == []


def test_arithmetic_runs_in_float32_and_exact_ops_keep_16_bit_values():
  def model(w, x, b16):
    y = x @ w  # a product: float16 operands, float32 result
    z = y * 0.5 + 1.0  # arithmetic: float32
    moved = jnp.maximum(b16.reshape(2, 2).T, b16[0])  # exact ops on float16 inputs: float16
    return jnp.tanh(z), z + b16, moved, jnp.sin(b16)

  out = ols.autocast(model, "c=f16")(jnp.ones((8, 4)), X, jnp.ones(4, jnp.float16))
  assert [o.dtype for o in out] == [jnp.float16] * 4  # output dtype: c=f16 -> o=f16
  jaxpr = jax.make_jaxpr(ols.autocast(model, "c=f16,o=f16"))(
    jnp.ones((8, 4)), X, jnp.ones(4, jnp.float16)
  )
  assert inputs_of(jaxpr, "tanh") == [("float32",)]
  assert inputs_of(jaxpr, "sin") == [("float32",)]  # a float16 argument, upcast to compute
  assert inputs_of(jaxpr, "max") == [("float16", "float16")]
  assert inputs_of(jaxpr, "transpose") == [("float16",)]
  assert mismatched(jaxpr) == []


def test_integer_and_boolean_work_is_untouched():
  def model(w, x, labels):
    logits = x @ w
    hits = jnp.sum((jnp.argmax(logits, -1) == labels).astype(jnp.int32))
    onehot = jax.nn.one_hot(labels, 4)
    return hits * 2, jnp.mean(onehot * logits), labels + 1

  labels = jnp.array([0, 1, 2, 3])
  hits, loss, shifted = ols.autocast(model, F16_POLICY)(jnp.ones((8, 4)), X, labels)
  want = model(jnp.ones((8, 4)), X, labels)
  assert hits.dtype == jnp.int32 and int(hits) == int(want[0])
  assert shifted.dtype == labels.dtype and bool(jnp.all(shifted == labels + 1))
  assert loss.dtype == jnp.float32


def test_outputs_take_the_output_dtype():
  fn = lambda x: {"y": x * 2, "n": jnp.arange(2), "pair": (x, x @ x.T)}
  out = ols.autocast(fn, "p=f32,c=bf16,o=f16")(X)
  assert out["y"].dtype == out["pair"][0].dtype == out["pair"][1].dtype == jnp.float16
  assert out["n"].dtype == jnp.int32


def test_functions_whose_naive_float16_cast_overflows():
  big = jnp.full((4, 4), 300.0)

  def stats(x):  # 300**2 = 90000 > 65504, float16's largest
    return jnp.mean(jnp.square(x)), jax.nn.logsumexp(x * 0.04 + 10), jnp.sum(x)

  naive = stats(big.astype(jnp.float16))
  assert not all(bool(jnp.isfinite(v)) for v in naive)
  got = ols.autocast(stats, F16_POLICY)(big)
  want = stats(big)
  for g, w in zip(got, want, strict=True):
    assert g.dtype == jnp.float32 and bool(jnp.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-3)


def test_control_flow_keeps_every_matmul_in_the_compute_dtype():
  def model(w, x):
    h = jax.jit(lambda a: a @ w)(x)
    h = jax.checkpoint(lambda a: jnp.tanh(a @ w), policy=jax.checkpoint_policies.dots_saveable)(h)
    h = lax.cond(jnp.sum(h) > 0, lambda a: a @ w, lambda a: jnp.exp(a), h)  # f16 | f32 branch
    h, _ = lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=3)
    h = lax.fori_loop(0, 2, lambda i, c: c @ w, h)
    return jnp.mean(h**2)

  w = jnp.eye(8) * 0.5
  mixed = ols.autocast(model, F16_POLICY)
  np.testing.assert_allclose(mixed(w, X), model(w, X), rtol=2e-2)
  # One product in each of jit, checkpoint, a cond branch, scan and fori_loop;
  # and their transposes, twice each (for w and for the carried activations),
  # but once for the first (x is not differentiated). dots_saveable saves the
  # checkpoint's product: the backward pass does not recompute it.
  for fn, count in ((mixed, 5), (jax.grad(mixed), 5 + 9)):
    jaxpr = jax.make_jaxpr(fn)(w, X)
    dtypes = matmul_inputs(jaxpr)
    assert len(dtypes) >= count and set(dtypes) == {("float16", "float16")}, dtypes
    assert mismatched(jaxpr) == []
  np.testing.assert_allclose(jax.grad(mixed)(w, X), jax.grad(model)(w, X), rtol=5e-2, atol=1e-3)


def test_a_while_loop_carry_widens_to_what_its_body_returns():
  def model(w, x):  # the carry enters float16 (a product) and the body returns exp: float32
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.exp(c[1] @ w)), (0, x @ w))

  w = jnp.eye(8) * 0.1
  n, h = ols.autocast(model, "c=f16,o=f32")(w, X)
  assert int(n) == 3 and h.dtype == jnp.float32
  np.testing.assert_allclose(h, model(w, X)[1], rtol=1e-2)


def test_custom_jvp_rules_are_kept():
  # jax.nn.relu's rule gives 0 at 0; differentiating its body, max(x, 0), gives 0.5.
  grad = jax.grad(ols.autocast(lambda x: jnp.sum(jax.nn.relu(x)), F16_POLICY))(jnp.zeros(3))
  assert grad.tolist() == [0.0, 0.0, 0.0]

  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))  # a deliberately "wrong" rule: 3 everywhere
  mixed = ols.autocast(lambda w, x: jnp.sum(f(x @ w)), F16_POLICY)
  w = jnp.eye(8)
  grad = jax.grad(mixed)(w, X)
  np.testing.assert_allclose(grad, 3.0 * X.T @ jnp.ones((4, 8)), rtol=1e-2)
  # The body was interpreted: its product takes float16 operands, sin runs in float32.
  jaxpr = jax.make_jaxpr(mixed)(w, X)
  assert inputs_of(jaxpr, "sin") == [("float32",)]
  assert set(matmul_inputs(jaxpr)) == {("float16", "float16")}


@pytest.mark.parametrize("jitted", [False, True], ids=["inline", "jit"])
def test_products_in_a_custom_jvp_rule_take_16_bit_cotangents(jitted):
  # A rule holding products on its tangents (here jax.jvp of a block, the
  # block maybe jitted): JAX transposes them in the backward pass. Bound as
  # autocast's differentiable products, their transposes would go through
  # the float32 forward product and take the float32 cotangent.
  def block(w, h):
    return jax.nn.gelu(h @ w) + h

  inner = jax.jit(block) if jitted else block

  @jax.custom_jvp
  def f(w, h):
    return block(w, h)

  f.defjvp(lambda primals, tangents: jax.jvp(inner, primals, tangents))
  loss = lambda w, x: jnp.mean(f(w, x) ** 2)
  w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
  mixed = ols.autocast(loss, F16_POLICY)
  backward = jax.make_jaxpr(jax.grad(mixed))(w, X)
  assert matmul_inputs(backward) and set(matmul_inputs(backward)) == {("float16", "float16")}
  assert mismatched(backward) == []
  np.testing.assert_allclose(jax.grad(mixed)(w, X), jax.grad(loss)(w, X), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize(("half", "tol"), [("float16", 2e-3), ("bfloat16", 4e-2)])
def test_grad_of_det_whose_rule_mixes_primal_and_tangent_work(half, tol):
  # jnp.linalg.det is a custom_jvp whose rule has elementwise runs mixing primal and tangent
  # values; jax >= 0.11 refuses a rule whose primal outputs depend on its tangents, so such
  # a run's primal and tangent work are two regions.
  f = lambda w, x: jnp.sum(jnp.linalg.det(x @ w))
  w = jnp.eye(40) + 0.01 * jax.random.normal(jax.random.key(0), (40, 40))
  x = jnp.broadcast_to(jnp.eye(40), (4, 40, 40))
  got = jax.jit(jax.grad(ols.autocast(f, HALVES[half])))(w, x)
  want = jax.grad(f)(w, x)
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < tol


def test_custom_vjp_rules_are_kept():
  @jax.custom_vjp
  def kernel(x):
    return x * 2.0

  kernel.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 5.0,))  # a deliberately "wrong" rule
  mixed = ols.autocast(lambda w, x: jnp.sum(kernel(x @ w)), F16_POLICY)
  w = jnp.eye(8)
  jaxpr = jax.make_jaxpr(mixed)(w, X)
  (call,) = [e for e in equations(jaxpr) if e.primitive.name == "custom_vjp_call"]
  assert str(call.invars[0].aval.dtype) == "float32"  # the product's declared float32 result
  np.testing.assert_allclose(jax.grad(mixed)(w, X), 5.0 * X.T @ jnp.ones((4, 8)), rtol=1e-2)


@pytest.mark.skipif(
  not compat.CUSTOM_VJP_BWD_LOGS, reason="jax.custom_vjp.defvjp_with_logs is jax >= 0.11's"
)
def test_custom_vjp_backward_logs_are_kept_in_their_declared_dtypes():
  @jax.custom_vjp
  def layer(w, h):
    return jnp.tanh(h @ w)

  def fwd(w, h):
    y = jnp.tanh(h @ w)
    return y, (w, h, y)

  def bwd(res, g):
    w, h, y = res
    d = g * (1 - y**2)
    return (h.T @ d, d @ w.T), {"d_norm": jnp.sum(d * d), "steps": jnp.int32(3)}

  layer.defvjp_with_logs(fwd, bwd)
  w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
  _, want_vjp = jax.vjp(layer, w, X)
  y, f_vjp = jax.vjp(ols.autocast(layer, "c=bf16,o=f32"), w, X)
  (dw, dx), logs = f_vjp.with_logs(jnp.ones_like(y))
  (want_dw, want_dx), want = want_vjp.with_logs(jnp.ones_like(y))
  assert (dw.dtype, dx.dtype, logs["d_norm"].dtype) == (jnp.float32,) * 3
  assert int(logs["steps"]) == 3
  np.testing.assert_allclose(logs["d_norm"], want["d_norm"], rtol=2e-2)
  np.testing.assert_allclose(dw, want_dw, rtol=5e-2, atol=5e-2)
  np.testing.assert_allclose(dx, want_dx, rtol=5e-2, atol=5e-2)


def test_custom_vjp_under_vmap_with_an_unused_output_shared_across_the_batch():
  # The second output does not vary over the batch and nothing reads it: JAX hands its zero
  # cotangent to the rule as a symbolic zero, which jax 0.12's vmap reads (a nonzero one
  # with a batched cotangent for `w` raises, as diffrax's default adjoint did under vmap).
  @jax.custom_vjp
  def layer(w, h):
    return jnp.tanh(h @ w), jnp.sum(w)

  def fwd(w, h):
    return layer(w, h), (w, h, jnp.tanh(h @ w))

  def bwd(res, g):
    w, h, y = res
    d = g[0] * (1 - y**2)
    return h.T @ d + g[1], d @ w.T

  layer.defvjp(fwd, bwd)
  loss = lambda w, xs: jnp.sum(jax.vmap(lambda x: layer(w, x)[0])(xs))
  w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
  xs = X[:, None]
  mixed = ols.autocast(loss, "c=bf16,o=f32")
  got, want = jax.grad(mixed)(w, xs), jax.grad(loss)(w, xs)
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2
  products = matmul_inputs(jax.make_jaxpr(jax.grad(mixed))(w, xs))
  assert products and set(products) == {("bfloat16", "bfloat16")}, products


def test_jit_grad_vmap_jvp_and_hessian():
  mixed = ols.autocast(mlp, "p=f32,c=bf16,o=f32")
  params = mlp_params()
  want = mlp(params, X)
  np.testing.assert_allclose(jax.jit(mixed)(params, X), want, rtol=3e-2)
  # One program and eager ops: the same bits on the CPU; elsewhere a bfloat16
  # intermediate may stay float32 in the fused program (excess precision).
  same = 1e-6 if jax.default_backend() == "cpu" else 2**-7
  np.testing.assert_allclose(mixed(params, X), jax.jit(mixed)(params, X), rtol=same)
  batched = jax.vmap(mixed, in_axes=(None, 0))(params, jnp.stack([X, 2 * X]))
  np.testing.assert_allclose(batched, [want, mlp(params, 2 * X)], rtol=3e-2)
  tangent = jax.tree.map(jnp.ones_like, params)
  _, jvp = jax.jvp(lambda p: mixed(p, X), (params,), (tangent,))
  _, want_jvp = jax.jvp(lambda p: mlp(p, X), (params,), (tangent,))
  np.testing.assert_allclose(jvp, want_jvp, rtol=5e-2)
  hess = jax.hessian(lambda w: mixed({**params, "w2": w}, X))(params["w2"])
  assert hess.shape == (16, 1, 16, 1) and bool(jnp.all(jnp.isfinite(hess)))


def test_float16_backward_products_accumulate_in_float32_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("how compute-dtype products accumulate is the backend's; measured on CPU")
  # d/dw sum(x @ w) sums 8192 ones: float16 accumulation would stop at 2048.
  x = jnp.ones((8192, 1))
  grad = jax.grad(ols.autocast(lambda w: jnp.sum(x @ w), F16_POLICY))(jnp.ones((1, 1)))
  assert float(grad[0, 0]) == 8192.0


def test_an_unknown_primitive_is_named_and_can_be_given_a_rule():
  double_p = jax.extend.core.Primitive("ols_test_double")
  double_p.def_impl(lambda x: x * 2)
  double_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  fn = lambda w, x: jnp.sum(double_p.bind(x @ w))
  with pytest.raises(ols.UnknownPrimitiveError, match="'ols_test_double'"):
    ols.autocast(fn, F16_POLICY, unknown_primitives="error")(jnp.eye(8), X)
  out = ols.autocast(fn, F16_POLICY, rules={"ols_test_double": "as_written"})(jnp.eye(8), X)
  np.testing.assert_allclose(out, 2 * jnp.sum(X), rtol=1e-2)


@pytest.mark.parametrize(
  ("kwargs", "error", "message"),
  [
    ({"fun": 3, "policy": F16_POLICY}, TypeError, "fun must be callable"),
    ({"fun": mlp, "policy": jnp.float16}, TypeError, "policy must be an ols.Policy"),
    ({"fun": mlp, "policy": "c=f17"}, ValueError, "Unknown dtype 'f17'"),
    ({"fun": mlp, "policy": "c=f16", "rules": {"exp": "fast"}}, ValueError, "rules maps"),
    ({"fun": mlp, "policy": "c=f16", "rules": ["exp"]}, TypeError, "rules must be a mapping"),
  ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, message):
  with pytest.raises(error, match=message):
    ols.autocast(**kwargs)


def test_static_arguments_and_in_place_updates_of_mutable_arguments():
  def step(state, x, scale, name):
    assert isinstance(scale, float) and name == "run"  # static: Python values stay Python
    state["count"] = state["count"] + 1
    state["mean"] = 0.9 * state["mean"] + 0.1 * jnp.mean(x @ x.T)
    return jnp.sum(x) * scale

  state = {"count": jnp.zeros((), jnp.int32), "mean": jnp.zeros(())}
  mixed = ols.autocast(step, F16_POLICY)
  for _ in range(2):
    mixed(state, X, 2.0, "run")
  assert int(state["count"]) == 2 and state["mean"].dtype == jnp.float32
  want = {"count": jnp.zeros((), jnp.int32), "mean": jnp.zeros(())}
  for _ in range(2):
    step(want, X, 2.0, "run")
  np.testing.assert_allclose(state["mean"], want["mean"], rtol=1e-2)


def test_it_trains_in_float16_with_loss_scaling_as_float32_does():
  x = jax.random.normal(jax.random.key(1), (256, 8))
  y = jnp.sin(x @ jnp.linspace(-1, 1, 8))[:, None]
  loss_fn = lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

  def train(loss, tx):
    params = mlp_params(3)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      value, grads = ols.value_and_grad(loss)(state, params, x, y)
      params, state = ols.apply_gradients(tx, grads, state, params)
      return params, state, value

    for _ in range(300):
      params, state, _ = step(params, state)
    return float(loss_fn(params, x, y)), state

  full, _ = train(loss_fn, ols.loss_scale_optimizer(optax.adam(1e-2)))
  half, state = train(ols.autocast(loss_fn, F16_POLICY), ols.loss_scale_optimizer(optax.adam(1e-2)))
  assert full < 0.05
  assert abs(half - full) < 0.1 * full + 2e-3, (half, full)
  assert int(ols.metrics(state)["total_skips"]) < 10


def test_it_composes_with_retry_on_overflow():
  params = mlp_params()
  loss = ols.autocast(mlp, F16_POLICY)
  # 2**20 overflows the float16 backward pass; 2**15 is the first scale that does not.
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**20))
  state = tx.init(params)
  step = ols.retry_on_overflow(ols.value_and_grad(loss))
  _, grads, state = jax.jit(step)(state, params, X)
  params, state = ols.apply_gradients(tx, grads, state, params)
  metrics = ols.metrics(state)
  assert bool(metrics["last_step_applied"]) and int(metrics["retries"]) == 5
  assert float(metrics["loss_scale"]) == 2.0**15
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


@functools.cache
def _linen_block():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
      x = x + y
      return x + nn.Dense(8)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x))))

  return Block()


def test_a_flax_linen_transformer_block():
  block = _linen_block()
  x = jax.random.normal(jax.random.key(2), (2, 5, 8))
  variables = block.init(jax.random.key(0), x)
  loss = lambda v, x: jnp.mean(block.apply(v, x) ** 2)
  mixed = ols.autocast(loss, F16_POLICY)
  np.testing.assert_allclose(mixed(variables, x), loss(variables, x), rtol=2e-2)
  jaxpr = jax.make_jaxpr(jax.grad(mixed))(variables, x)
  dtypes = matmul_inputs(jaxpr)
  assert len(dtypes) >= 20 and set(dtypes) == {("float16", "float16")}
  assert mismatched(jaxpr) == []
  assert set(inputs_of(jaxpr, "exp")) == {("float32",)}  # the softmax
  assert set(inputs_of(jaxpr, "rsqrt")) == {("float32",)}  # the LayerNorms


def test_flax_train_state_step():
  pytest.importorskip("flax")
  from optax_lossscale.flax import TrainState

  block = _linen_block()
  x = jax.random.normal(jax.random.key(2), (2, 5, 8))
  variables = block.init(jax.random.key(0), x)
  state = TrainState.create(
    apply_fn=block.apply, params=variables, tx=ols.loss_scale_optimizer(optax.adam(1e-3))
  )
  loss = ols.autocast(lambda v, x: jnp.mean(block.apply(v, x) ** 2), F16_POLICY)

  @jax.jit
  def step(state):
    value, grads = ols.value_and_grad(loss)(state, state.params, x)
    return state.apply_gradients(grads=grads), value

  first = None
  for _ in range(5):
    state, value = step(state)
    first = value if first is None else first
  assert float(value) < float(first) and int(state.step) == 5


def test_nnx_model_with_batchnorm_and_dropout_updates_its_state():
  nnx = pytest.importorskip("flax.nnx")
  from optax_lossscale.flax import nnx_value_and_grad

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(8, 16, rngs=rngs)
      self.bn = nnx.BatchNorm(16, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))

  def loss(model, x):
    return jnp.mean(model(x) ** 2)

  model = Model(nnx.Rngs(0))
  mixed = ols.autocast(loss, F16_POLICY)
  optimizer = nnx.Optimizer(model, ols.loss_scale_optimizer(optax.sgd(1e-2)), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    value, grads = nnx_value_and_grad(mixed)(optimizer, model, x)
    optimizer.update(model, grads)
    return value

  # Each step's BatchNorm statistics against float32's from the same parameters and
  # statistics, in units every backend guarantees. The Linear's product rounds its two
  # operands to float16 (relative error <= u = 2**-11 each) and accumulates its K = 8 terms
  # in float32 (<= K u32 each side, u32 = 2**-24), so |h' - h| <= e = (2u + 2K u32) |x| @ |W|
  # (+ the bias add's 2 u32 |h|); the batch mean moves by at most mean(e), the batch
  # variance, mean(h**2) - mean(h)**2 in float32, by at most mean(2 |h - mean(h)| (e +
  # mean(e))) + e's square + its cancellation's 4 u32 mean(h**2); the running statistics
  # take (1 - momentum) of it.
  u, u32, k = 2.0**-11, 2.0**-24, 8
  x = X * 2
  for count in (1, 2):
    want = nnx.clone(model)
    loss(want, x)  # float32's step: the statistics move, the parameters do not
    kernel, bias = want.lin.kernel[...], want.lin.bias[...]
    step(model, optimizer, x)
    h = x @ kernel + bias
    e = (2 * u + 2 * k * u32) * (abs(x) @ abs(kernel)) + 2 * u32 * abs(h)
    fraction = 1 - model.bn.momentum
    centered = abs(h - h.mean(0))
    bound = {
      "mean": fraction * e.mean(0),
      "var": fraction * ((2 * centered * (e + e.mean(0)) + (e + e.mean(0)) ** 2).mean(0)
                         + 4 * u32 * (h**2).mean(0)),
    }  # fmt: skip
    for name in ("mean", "var"):
      got, expected = getattr(model.bn, name)[...], getattr(want.bn, name)[...]
      assert got.dtype == jnp.float32
      diff = abs(got - expected)
      # + float32's rounding of the running update itself (a few u32 of its value)
      assert bool(jnp.all(diff <= bound[name] + 4 * u32 * abs(expected))), (
        name, count, float(jnp.max(diff / bound[name]))
      )  # fmt: skip
    # The dropout RNG count moved as in float32.
    assert int(model.drop.rngs.count[...]) == int(want.drop.rngs.count[...]) == count


def test_equinox_filter_value_and_grad():
  eqx = pytest.importorskip("equinox")
  from optax_lossscale.equinox import filter_value_and_grad

  key = jax.random.key(0)
  model = eqx.nn.Sequential(
    [eqx.nn.Conv2d(1, 4, 3, key=key), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Lambda(jnp.ravel),
     eqx.nn.Linear(4 * 6 * 6, 3, key=key)]
  )  # fmt: skip
  x = jax.random.normal(key, (2, 1, 8, 8))
  loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
  params = eqx.filter(model, eqx.is_inexact_array)
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  state = tx.init(params)
  value, grads = filter_value_and_grad(ols.autocast(loss, F16_POLICY))(state, model, x)
  np.testing.assert_allclose(value, loss(model, x), rtol=2e-2)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  grad_fn = eqx.filter_grad(ols.autocast(loss, F16_POLICY))
  jaxpr, *_ = eqx.filter_make_jaxpr(lambda m: grad_fn(m, x))(model)
  names = {e.primitive.name for e in equations(jaxpr)}
  assert "conv_general_dilated" in names
  assert set(matmul_inputs(jaxpr)) == {("float16", "float16")}


def test_nnx_attention_runs_in_float16_on_cpu_where_a_hand_cast_model_fails():
  nnx = pytest.importorskip("flax.nnx")
  if jax.default_backend() != "cpu":
    pytest.skip("the missing dot algorithm (F16_F16_F32) is XLA:CPU's")
  kw = {"num_heads": 2, "in_features": 8, "qkv_features": 8, "decode": False}
  x = jax.random.normal(jax.random.key(0), (2, 4, 8))
  hand_cast = nnx.MultiHeadAttention(**kw, dtype=jnp.float16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="F16_F16_F32"):
    jax.jit(lambda x: hand_cast(x))(x.astype(jnp.float16))
  model = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  mixed = ols.autocast(lambda m, x: m(x), "p=f32,c=f16,o=f32")
  got = nnx.jit(mixed)(model, x)
  np.testing.assert_allclose(got, model(x), rtol=2e-2, atol=2e-3)
  jaxpr = jax.make_jaxpr(lambda x: mixed(model, x))(x)
  assert set(matmul_inputs(jaxpr)) == {("float16", "float16")}


def test_the_guide_lists_the_rules_of_the_table():
  # docs/guides/mixed_precision.md's table names the same primitives as the code.
  import pathlib
  import re

  from optax_lossscale._src.autocast import rules as autocast_rules

  page = pathlib.Path(__file__).resolve().parents[1] / "docs/guides/mixed_precision.md"
  rows: dict[str, set[str]] = {}
  for line in page.read_text().splitlines():
    kind = line.split("|")[1].strip() if line.startswith("|") else ""
    if kind in ("compute", "float32", "kernels") and kind not in rows:  # the rule table first
      rows[kind] = set(re.findall(r"`(\w+)`", line.split("|")[2]))
  assert rows["compute"] == set(autocast_rules.COMPUTE)
  assert rows["float32"] == set(autocast_rules.FLOAT32)
  assert rows["kernels"] == set(autocast_rules.KERNELS)


def test_16_bit_weights_with_a_float32_input_run_as_torch_autocast_runs_them():
  eqx = pytest.importorskip("equinox")
  conv = eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))
  conv16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, conv)
  x = jax.random.normal(jax.random.key(1), (3, 8, 8))
  with pytest.raises(TypeError, match="same dtypes"):
    conv16(x)  # as written, JAX refuses the mixed convolution
  loss = lambda m, x: jnp.sum(m(x) ** 2)
  mixed = ols.autocast(loss, "p=bf16,c=bf16,o=f32")
  want = loss(jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a,
                           conv16), x)  # fmt: skip
  np.testing.assert_allclose(mixed(conv16, x), want, rtol=1e-2)
  grads = eqx.filter_grad(mixed)(conv16, x)
  assert grads.weight.dtype == jnp.bfloat16
  assert set(matmul_inputs(jax.make_jaxpr(mixed)(conv16, x))) == {("bfloat16", "bfloat16")}


def test_an_in_place_update_keeps_the_dtype_the_function_gave_it():
  def step(state, w):
    state["count"] = state["count"] + 1  # an int stays an int
    state["half"] = state["half"] / 2  # an int leaf the function makes a float: not truncated
    state["ema"] = 0.9 * state["ema"] + 0.1 * jnp.mean(state["x"] @ w)
    return jnp.sum(state["x"] @ w)

  state = {"count": jnp.int32(41), "half": jnp.int32(3), "ema": jnp.float32(0.0), "x": X}
  ols.autocast(step, F16_POLICY)(state, jnp.eye(8))
  assert state["count"].dtype == jnp.int32 and int(state["count"]) == 42
  assert state["half"].dtype == jnp.float32 and float(state["half"]) == 1.5
  assert state["ema"].dtype == jnp.float32
  np.testing.assert_allclose(state["ema"], 0.1 * jnp.mean(X), rtol=1e-3)


def test_compute_dtypes_autocast_cannot_run_are_refused():
  with pytest.raises(ValueError, match=r"float64.*jax_enable_x64"):
    ols.autocast(lambda x: x @ x.T, ols.Policy(jnp.float32, jnp.float64, jnp.float32))
  with pytest.raises(ValueError, match=r"8-bit float.*fp8="):
    ols.autocast(lambda x: x @ x.T, ols.Policy(jnp.float32, jnp.float8_e4m3fn, jnp.float32))


@pytest.mark.parametrize(
  "dtype",
  [
    np.float16, jnp.bfloat16, np.float32, np.float64, jnp.float8_e4m3fn, jnp.float8_e5m2,
    np.int8, np.uint32, np.bool_, np.complex64,
  ],
)  # fmt: skip
def test_dtype_tests_answered_once_per_dtype_agree_with_jax(dtype):
  from optax_lossscale._src.autocast import interpreter

  x = np.zeros(3, dtype)
  for _ in range(2):  # the second answer is the remembered one
    assert interpreter.is_plain(x.dtype)
    assert interpreter.is_float(x) == bool(jnp.issubdtype(dtype, jnp.inexact))
    assert interpreter.is_inexact_dtype(x.dtype) == bool(jnp.issubdtype(dtype, jnp.inexact))
    assert interpreter.is_real_float(x) == bool(jnp.issubdtype(dtype, jnp.floating))
    assert interpreter.is_complex(x) == bool(jnp.issubdtype(dtype, jnp.complexfloating))


def test_dtype_tests_call_a_prng_key_neither_plain_nor_float():
  from optax_lossscale._src.autocast import interpreter

  key = jax.random.key(0)
  for _ in range(2):
    assert not interpreter.is_plain(key.dtype)
    assert not (interpreter.is_float(key) or interpreter.is_real_float(key))
    assert not interpreter.is_inexact_dtype(key.dtype)
    assert not interpreter.is_complex(key)
