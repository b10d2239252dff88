"""`autocast`'s regions: float32 inside, 16 bits in what the backward pass keeps.

Each fact is checked against an independent computation: residuals read with
JAX's own `saved_residuals`, forward values and gradients against a
hand-written float32 program whose products take rounded operands.
"""

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from optax_lossscale._src.autocast import plan as autocast_plan
from optax_lossscale._src.autocast import regions as autocast_regions
from optax_lossscale._src.utils import compat
from tests.autocast_helpers import matmul_inputs

HALVES = {"bfloat16": "p=f32,c=bf16,o=f32", "float16": "p=f32,c=f16,o=f32"}
N, D = 256, 16  # 4096 elements per activation: above MIN_SAVED_SIZE


def residuals(fun, *args):
  """`(dtype, shape)` of every saved residual that is not an argument."""
  return [
    (str(aval.dtype), tuple(aval.shape))
    for aval, where in compat.saved_residuals(fun, *args)
    if "from the argument" not in where
  ]


def block(p, x):
  """A pre-LN residual MLP block and a squared loss, written in float32."""
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
  h = (x - mu) * lax.rsqrt(var + 1e-5) * p["g"]
  h = jax.nn.gelu(h @ p["w1"] + p["b1"])
  y = x + h @ p["w2"]
  return jnp.mean(y**2)


def block_params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
    "g": jnp.ones(D),
    "w1": jax.random.normal(k1, (D, 4 * D)) / D**0.5,
    "b1": jnp.zeros(4 * D),
    "w2": jax.random.normal(k2, (4 * D, D)) / (4 * D) ** 0.5,
  }


X = jax.random.normal(jax.random.key(7), (N, D)) * 3 + 1


@pytest.mark.parametrize("half", HALVES)
def test_every_activation_the_backward_pass_keeps_is_16_bit(half):
  f32 = residuals(block, block_params(), X)
  assert any(d == "float32" and int(np.prod(s)) >= N * D for d, s in f32)  # float32 keeps some
  got = residuals(ols.autocast(block, HALVES[half]), block_params(), X)
  big = [(d, s) for d, s in got if int(np.prod(s)) >= autocast_regions.MIN_SAVED_SIZE]
  assert big and {d for d, _ in big} == {half}, got
  f32_bytes = sum(4 * int(np.prod(s)) for d, s in f32 if d == "float32")
  got_bytes = sum(np.dtype(jnp.dtype(d)).itemsize * int(np.prod(s)) for d, s in got)
  assert got_bytes < 0.5 * f32_bytes


@pytest.mark.parametrize("half", HALVES)
def test_forward_is_the_float32_program_with_16_bit_product_operands(half):
  dtype = jnp.dtype(half)

  def reference(p, x):  # every op in float32; a product's operands rounded, its sum float32
    dot = lambda a, b: jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    h = (x - mu) * lax.rsqrt(var + 1e-5) * p["g"]
    h = jax.nn.gelu(dot(h, p["w1"]) + p["b1"])
    return jnp.mean((x + dot(h, p["w2"])) ** 2)

  got = jax.jit(ols.autocast(block, HALVES[half]))(block_params(), X)
  np.testing.assert_allclose(got, jax.jit(reference)(block_params(), X), rtol=1e-6)


@pytest.mark.parametrize("half", HALVES)
def test_gradients_are_the_region_derivative_at_the_saved_16_bit_inputs(half):
  dtype = jnp.dtype(half)
  x = jax.random.normal(jax.random.key(3), (N, D))
  w = jax.random.normal(jax.random.key(4), (D, D)) / 4
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
  got = jax.grad(ols.autocast(loss, HALVES[half]))(w, x)
  # By hand: the product's result h (float32), kept as h16; the region's derivative
  # at h16 in float32; the backward product on 16-bit operands.
  h16 = jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
  dh = jax.grad(lambda h: jnp.sum(jnp.tanh(h) ** 2))(h16.astype(jnp.float32))
  want = jnp.dot(x.astype(dtype).T, dh.astype(dtype), preferred_element_type=jnp.float32)
  np.testing.assert_allclose(got, want.astype(dtype).astype(jnp.float32), rtol=1e-2, atol=1e-6)
  # and the exact float32 gradient is within the compute dtype's rounding
  np.testing.assert_allclose(got, jax.grad(loss)(w, x), rtol=0.05, atol=0.05 * float(jnp.max(want)))


def test_statistics_and_small_values_stay_float32():
  def f(w, x):
    h = x @ w
    ss = jnp.sum(h * h, -1, keepdims=True)  # a statistic crossing a product
    y = h @ w
    return jnp.sum(y / jnp.sqrt(ss) * jnp.sum(x[:3] @ w))  # a small product output

  rows = 2 * autocast_regions.MIN_SAVED_SIZE  # the statistic alone is above the size threshold
  x = jax.random.normal(jax.random.key(0), (rows, 8)) * 300  # squares overflow float16
  w = jnp.eye(8)
  got = residuals(ols.autocast(f, HALVES["float16"]), w, x)
  assert ("float32", (rows, 1)) in got  # the sum of squares, exact
  assert ("float16", (rows, 8)) in got
  grads = jax.grad(ols.autocast(f, HALVES["bfloat16"]))(w, x)
  np.testing.assert_allclose(grads, jax.grad(f)(w, x), rtol=2e-2, atol=1e-2 * jnp.max(grads))


def test_identical_blocks_share_one_interpreted_region():
  def stack(p, x, depth):
    for _ in range(depth):
      x = x + jnp.tanh(x @ p["w"] + p["b"]) * 0.5
    return jnp.sum(x)

  p = {"w": jnp.eye(D) / 2, "b": jnp.zeros(D)}
  policy = "p=f32,c=bf16,o=f32"
  counts = []
  for depth in (4, 12):
    autocast_regions._fused_cache.clear()
    jax.make_jaxpr(jax.grad(ols.autocast(lambda p, x, d=depth: stack(p, x, d), policy)))(p, X)
    counts.append(len(autocast_regions._fused_cache))
  assert 0 < counts[0] == counts[1] < 4, counts  # the first, the middle and the last blocks


def _region_calls(jaxpr):
  """The regions of a jaxpr (its scan bodies' included): the names of the `jit`s and
  `custom_jvp` calls that hold a region's work, in order."""
  out = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("jit", "pjit") and eqn.params["name"] == "autocast_region":
      out.append("jit")
    elif name == "custom_jvp_call" and eqn.params["call_jaxpr"].jaxpr.eqns:
      out.append("inline")
    elif name == "scan":
      out.extend(_region_calls(eqn.params["jaxpr"].jaxpr))
  return out


def test_a_region_runs_inline_where_it_is_first_met_and_under_its_jit_when_repeated(
  monkeypatch,
):
  # Unrolled identical blocks: the first block's regions inline, the later ones call the
  # jit the first built (traced and differentiated once). A scanned block meets each of
  # its regions once: all inline, with no jit to trace, linearize and transpose.
  def stack(p, x):
    for _ in range(6):  # the first and the last blocks differ (what they read, return)
      x = x + jnp.tanh(x @ p["w"] + p["b"]) * 0.5
    return jnp.sum(x)

  def scanned(ws, x):
    step = lambda h, w: (h + jnp.tanh(h @ w) * 0.5, None)
    return jnp.sum(lax.scan(step, x, ws)[0])

  policy = HALVES["bfloat16"]
  p = {"w": jnp.eye(D) / 2, "b": jnp.zeros(D)}
  unrolled = _region_calls(jax.make_jaxpr(ols.autocast(stack, policy))(p, X).jaxpr)
  assert unrolled[:2] == ["inline"] * 2 and unrolled.count("jit") == 3, unrolled
  ws = jnp.stack([jnp.eye(D) / 2] * 4)
  looped = _region_calls(jax.make_jaxpr(ols.autocast(scanned, policy))(ws, X).jaxpr)
  assert looped and set(looped) == {"inline"}, looped
  # A region computes the same inline or under its jit: in one compiled program the
  # gradients are those with every region under its jit (XLA inlines the calls before
  # it fuses), and within bfloat16's rounding of float32's. Bit for bit as checked on
  # XLA:CPU; elsewhere within one bfloat16 rounding (2**-8) of the largest gradient,
  # in case another backend's fusion rounds one side's 16-bit work apart.
  grad = lambda: jax.jit(jax.grad(ols.autocast(stack, policy)))(p, X)
  mixed = grad()
  monkeypatch.setattr(autocast_regions.interp, "met_before", lambda key: True)
  all_jit = grad()
  forced = _region_calls(jax.make_jaxpr(ols.autocast(stack, policy))(p, X).jaxpr)
  assert set(forced) == {"jit"} and len(forced) >= len(unrolled), forced
  if jax.default_backend() == "cpu":
    chex.assert_trees_all_equal(mixed, all_jit)
  for got, want in zip(jax.tree.leaves(mixed), jax.tree.leaves(all_jit), strict=True):
    np.testing.assert_allclose(got, want, rtol=0, atol=2**-8 * float(jnp.max(jnp.abs(want))))
  expected = jax.grad(stack)(p, X)["w"]
  np.testing.assert_allclose(
    mixed["w"], expected, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(expected)))
  )


def test_a_re_trace_reuses_each_inline_region_s_traced_derivative(monkeypatch):
  # A region's tangent is one function object per structure: JAX's caches of its
  # checkpoint's trace, partial evaluation and transposition serve a re-trace, which
  # evaluates a region's body for its forward values only, not for its derivative (a
  # tangent rebuilt per call would be traced again: as many evaluations as the first).
  def scanned(ws, x):
    step = lambda h, w: (h + jnp.tanh(h @ w) * 0.5, None)
    return jnp.sum(lax.scan(step, x, ws)[0] ** 2)

  from optax_lossscale._src.autocast import interpreter

  evaluated = []
  real = interpreter.eval_flat
  monkeypatch.setattr(interpreter, "eval_flat", lambda *a: evaluated.append(1) or real(*a))
  ws = jnp.stack([jnp.eye(D) / 2] * 4)
  autocast_regions._fused_cache.clear()
  counts = []
  for _ in range(3):  # each a new function: no jit cache of the step itself
    evaluated.clear()
    jax.jit(jax.grad(ols.autocast(lambda w, x: scanned(w, x), HALVES["bfloat16"]))).trace(ws, X)
    counts.append(len(evaluated))
  assert counts[0] > counts[1] == counts[2], counts


def test_a_scanned_stack_keeps_16_bit_residuals_per_step():
  def scanned(ws, x):
    step = lambda h, w: (h + jnp.tanh(h @ w), None)
    return jnp.sum(lax.scan(step, x, ws)[0] ** 2)

  ws = jnp.stack([jnp.eye(D) / 2] * 4)
  got = residuals(ols.autocast(scanned, HALVES["bfloat16"]), ws, X)
  stacked = [(d, s) for d, s in got if s[:1] == (4,) and int(np.prod(s)) >= 4 * N * D]
  assert stacked and {d for d, _ in stacked} == {"bfloat16"}, got


def test_forward_mode_vmap_and_second_order_go_through_regions():
  f = lambda w, x: jnp.sum(jax.nn.gelu(x @ w) ** 2)
  mixed = ols.autocast(f, HALVES["float16"])
  w, x = jnp.eye(D) / 2, X[:8]
  t = jnp.ones_like(w)
  np.testing.assert_allclose(
    jax.jvp(mixed, (w, x), (t, jnp.zeros_like(x)))[1],
    jax.jvp(f, (w, x), (t, jnp.zeros_like(x)))[1],
    rtol=2e-2,
  )
  np.testing.assert_allclose(
    jax.vmap(mixed, (None, 0))(w, x[:, None]), jax.vmap(f, (None, 0))(w, x[:, None]), rtol=2e-2
  )
  h = jax.hessian(lambda v: mixed(jnp.eye(D) * v, x))(0.5)
  np.testing.assert_allclose(h, jax.hessian(lambda v: f(jnp.eye(D) * v, x))(0.5), rtol=5e-2)


def test_every_product_of_a_training_step_keeps_16_bit_operands_through_regions():
  mixed = ols.autocast(block, HALVES["float16"])
  backward = jax.make_jaxpr(jax.grad(mixed))(block_params(), X)
  assert set(matmul_inputs(backward)) == {("float16", "float16")}


def test_small_steps_of_a_long_scan_are_counted_stacked():
  # 4 x 64 = 256 elements a step (under MIN_SAVED_SIZE), kept for each of 16 steps.
  def rnn(w, xs):
    step = lambda h, x: (jnp.tanh(h @ w + x), h)
    return jnp.sum(lax.scan(step, jnp.zeros((4, 64)), xs)[1] ** 2)

  w, xs = jnp.eye(64) / 2, jax.random.normal(jax.random.key(0), (16, 4, 64))
  got = residuals(ols.autocast(rnn, HALVES["bfloat16"]), w, xs)
  stacked = [(d, s) for d, s in got if s[:1] == (16,) and int(np.prod(s)) >= 16 * 256]
  assert stacked and {d for d, _ in stacked} == {"bfloat16"}, got


def test_regions_holding_custom_jvp_functions_are_cached_across_traces():
  def mlp(ws, x):
    for w in ws:
      x = jax.nn.relu(x @ w)  # relu is a custom_jvp function: its rule calls relu again
    return jnp.sum(x)

  ws, x = [jnp.eye(D)] * 3, X
  mixed = ols.autocast(mlp, HALVES["float16"])
  jax.make_jaxpr(jax.grad(mixed))(ws, x)
  before = len(autocast_regions._fused_cache)
  jax.make_jaxpr(jax.grad(mixed))(ws, x)  # a re-trace: a new jaxpr, equal regions
  assert len(autocast_regions._fused_cache) == before
  np.testing.assert_allclose(jax.grad(mixed)(ws, x)[0], jax.grad(mlp)(ws, x)[0], rtol=1e-2)


def _product_out_dtypes(closed):
  """The output dtypes of the autocast products in a jaxpr, in order."""
  return [
    str(e.outvars[0].aval.dtype)
    for e in closed.jaxpr.eqns
    if e.primitive.name in ("jit", "pjit") and e.params["name"] == "autocast_product"
  ]


def test_a_product_read_only_by_products_is_written_in_16_bits(monkeypatch):
  def attention_like(w, x):
    h = (x @ w).T  # read by the next product only (through an exact move): 16 bits
    g = h @ x  # read by arithmetic: its declared float32
    return jnp.sum(jnp.tanh(g))

  w, x = jnp.eye(D) / 2, X[:D]
  mixed = ols.autocast(attention_like, HALVES["bfloat16"])
  assert _product_out_dtypes(jax.make_jaxpr(mixed)(w, x)) == ["bfloat16", "float32"]
  value, grads = jax.value_and_grad(mixed, (0, 1))(w, x)
  # The reader gets the bits it read before: the same value and gradients as with the
  # product written in float32.
  monkeypatch.setattr(autocast_plan, "_narrow_products", lambda ctx, jaxpr: frozenset())
  mixed = ols.autocast(attention_like, HALVES["bfloat16"])
  assert _product_out_dtypes(jax.make_jaxpr(mixed)(w, x)) == ["float32", "float32"]
  want_value, want_grads = jax.value_and_grad(mixed, (0, 1))(w, x)
  np.testing.assert_array_equal(value, want_value)
  for g, want in zip(grads, want_grads, strict=True):
    np.testing.assert_array_equal(g, want)


def test_a_scan_body_is_interpreted_once_when_its_carry_is_settled(monkeypatch):
  from optax_lossscale._src.autocast import loop as autocast_loop

  def scanned(ws, x, dtype):  # written in `dtype`
    step = lambda h, w: (h + jnp.tanh(h @ w), None)
    return jnp.sum(lax.scan(step, x.astype(dtype), ws.astype(dtype))[0].astype(jnp.float32) ** 2)

  bodies = []
  original = autocast_loop.eval_closed
  monkeypatch.setattr(
    autocast_loop,
    "eval_closed",
    lambda ctx, closed, *a, **k: bodies.append(closed) or original(ctx, closed, *a, **k),
  )
  ws = jnp.stack([jnp.eye(D) / 2] * 4)
  mixed = ols.autocast(lambda ws, x: scanned(ws, x, jnp.float32), HALVES["bfloat16"])
  jax.make_jaxpr(jax.grad(mixed))(ws, X)
  assert len(bodies) == 1  # float32 carry: its dtype is settled, no search
  # A carry written in bfloat16 meets autocast's float32 arithmetic: the search widens it.
  bodies.clear()
  mixed16 = ols.autocast(lambda ws, x: scanned(ws, x, jnp.bfloat16), HALVES["bfloat16"])
  jaxpr = jax.make_jaxpr(mixed16)(ws, X)
  assert len(bodies) > 1
  (scan_eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert [str(v.aval.dtype) for v in scan_eqn.outvars] == ["float32"]


@pytest.mark.parametrize(
  "between, wrapped",
  [
    (lambda q, b: (q + b) / jnp.sqrt(64.0), False),  # an attention's scaling: linear
    (lambda q, b: jax.jit(lambda q: 0.5 * q - b)(q), False),  # linear, through a jit
    (lambda q, b: jnp.tanh(q + b), True),
    (lambda q, b: (q + b) * q, True),  # a product of two activations keeps both
    (lambda q, b: b / (q * q + 1.0), True),  # a quotient by an activation keeps it
    (lambda q, b: q * (q > 0), True),  # a factor computed from an input is kept
    (lambda q, b: q * jnp.tril(jnp.ones(q.shape)), True),  # so is a full-size constant
  ],
)
def test_a_run_linear_in_what_it_reads_is_run_inline(between, wrapped):
  # A run between two products whose derivative reads no input (additions, scalings by
  # constants) keeps nothing for the backward pass: no region is built for it, and it
  # computes what a region would.
  w = jax.random.normal(jax.random.key(1), (D, D)) / 4
  b = jnp.linspace(-1.0, 1.0, D)

  def f(w, b, x):
    return jnp.sum(between(x @ w, b) @ w)

  policy = HALVES["bfloat16"]
  autocast_regions._fused_cache.clear()
  grads = jax.grad(ols.autocast(f, policy), argnums=(0, 1))(w, b, X)
  assert bool(autocast_regions._fused_cache) == wrapped
  want = jax.grad(f, argnums=(0, 1))(w, b, X)
  # Both products round their operands to bfloat16 (2**-8 relative each way): within
  # about 8 such roundings of float32's gradients, on any backend.
  for g, h in zip(grads, want, strict=True):
    np.testing.assert_allclose(g, h, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(h))))
  big = [d for d, s in residuals(ols.autocast(f, policy), w, b, X) if int(np.prod(s)) >= N * D]
  assert "float32" not in big, big
