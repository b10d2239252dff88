"""fp8 the user controls, can see and can trust (issue 38).

`autocast(..., fp8_products=...)` chooses the products; `ols.autocast_report`
says what each product does and why; a warning says when fp8 changed
nothing; and no operand magnitude float32 can hold makes an fp8 product or
its gradient NaN. Expectations are independent of the implementation: the
products counted on the jaxpr of `jax.grad` of the unmodified function, Flax's
own module names, float32's results.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import optax_lossscale as ols
from optax_lossscale._src.autocast import fp8 as fp8_product
from optax_lossscale._src.autocast import fp8_choice
from tests.autocast_helpers import equations

BF16, F16 = "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"
E4M3 = "float8_e4m3fn"


def fp8_dots(fun, *args):
  """How many products of `jax.grad(fun)`'s jaxpr take an fp8 operand."""
  jaxpr = jax.make_jaxpr(jax.grad(fun, argnums=tuple(range(len(args)))))(*args)
  return sum(
    1
    for e in equations(jaxpr)
    if e.primitive.name == "dot_general"
    and any(str(v.aval.dtype).startswith("float8") for v in e.invars)
  )


def mlp(params, x):
  with jax.named_scope("up"):
    h = jax.nn.relu(x @ params["up"])
  with jax.named_scope("down"):
    return jnp.mean((h @ params["down"]) ** 2)


MLP = {"up": jnp.ones((32, 64)) / 32, "down": jnp.ones((64, 16)) / 64}
X = jnp.ones((24, 32))


# -- fp8_products.


def test_auto_leaves_small_products_alone_and_all_takes_every_one_it_can():
  with pytest.warns(UserWarning, match="no matrix product"):
    assert fp8_dots(ols.autocast(mlp, BF16, fp8="tensorwise"), MLP, X) == 0
  every = ols.autocast(mlp, BF16, fp8="tensorwise", fp8_products="all")
  assert fp8_dots(every, MLP, X) == 6  # two products, each forward and twice backward
  # a dimension under 16 is never fp8, whatever is asked
  small = {"up": MLP["up"], "down": jnp.ones((64, 8))}
  assert fp8_dots(ols.autocast(mlp, BF16, fp8="tensorwise", fp8_products="all"), small, X) == 3


def test_a_callable_chooses_by_module_path_and_dimensions():
  seen = []

  def only_up(product):
    seen.append(product)
    return product.name == "up"

  f = ols.autocast(mlp, BF16, fp8="rowwise", fp8_products=only_up)
  assert fp8_dots(f, MLP, X) == 3
  assert [(p.name, p.dims, p.dtypes) for p in seen] == [
    ("up", (1, 24, 64, 32), ("float32", "float32")),
    ("down", (1, 24, 16, 64), ("float32", "float32")),
  ]
  assert seen[0].speedup == pytest.approx(fp8_choice.predicted_speedup(24, 64, 32, "rowwise"))


def test_flax_module_paths_reach_the_callable():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(64, name="up")(x)
      return nn.Dense(32, name="down")(jax.nn.gelu(x))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Block(name=f"block_{i}")(x)
      return jnp.mean(x**2)

  model = Model()
  params = model.init(jax.random.key(0), X)
  names = []
  keep = lambda p: names.append(p.name) or p.name.endswith("down")
  f = ols.autocast(model.apply, BF16, fp8="tensorwise", fp8_products=keep)
  assert fp8_dots(lambda p, x: f(p, x), params, X) == 6
  assert names == ["Model/block_0/up", "Model/block_0/down", "Model/block_1/up",
                   "Model/block_1/down"]  # fmt: skip


def test_fp8_products_is_traced_in_not_global():
  # Two settings in one program, a jitted layer shared between them: each
  # function keeps its own (the interpreter's cache of the jit is per setting).
  layer = jax.jit(lambda w, x: jnp.tanh(x @ w))
  loss = lambda w, x: jnp.sum(layer(w, x) ** 2)
  w, x = jnp.ones((32, 32)) / 32, jnp.ones((16, 32))
  every = ols.autocast(loss, BF16, fp8="tensorwise", fp8_products="all")
  none = ols.autocast(loss, BF16, fp8="tensorwise", fp8_products=lambda p: False)
  both = lambda w, x: every(w, x) + none(w, x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (`none` warns that it chose nothing)
    assert fp8_dots(both, w, x) == 3
    assert fp8_dots(none, w, x) == 0
  assert fp8_dots(every, w, x) == 3


@pytest.mark.parametrize("bad", ["ALL", "cost", None, 3, True])
def test_fp8_products_is_checked_when_autocast_is_built(bad):
  with pytest.raises(ValueError, match=r"fp8_products must be 'auto'.*'all'.*callable.*got"):
    ols.autocast(mlp, BF16, fp8="tensorwise", fp8_products=bad)


# -- the warning.


def test_a_warning_once_per_function_when_no_product_qualifies():
  f = ols.autocast(mlp, BF16, fp8="rowwise")
  with pytest.warns(UserWarning) as caught:
    jax.make_jaxpr(f)(MLP, X)
    jax.make_jaxpr(f)(MLP, jnp.ones((8, 32)))  # traced again: no second warning
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1
  assert "of its 2 products: 2 cost model below x1" in messages[0]
  assert "fp8_products='all'" in messages[0]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # fp8 off, or a product in fp8: nothing to say
    jax.make_jaxpr(ols.autocast(mlp, BF16))(MLP, X)
    jax.make_jaxpr(ols.autocast(mlp, BF16, fp8="rowwise", fp8_products="all"))(MLP, X)
  with pytest.warns(UserWarning, match="1 'below 16'"):
    jax.make_jaxpr(ols.autocast(lambda x: x @ x.T, BF16, fp8="tensorwise"))(jnp.ones((8, 8)))


# -- the report.


def test_the_report_has_a_row_per_product_with_its_dtypes_and_reason():
  def loss(params, x):
    x = mlp(params, x)  # up (fp8) and down (filtered out)
    with jax.named_scope("tiny"):
      return x + jnp.sum(jnp.ones((4, 8)) @ jnp.ones((8, 4)))  # below 16

  f = ols.autocast(loss, F16, fp8="tensorwise", fp8_products=lambda p: p.name == "up")
  rows = ols.autocast_report(f, MLP, X)
  expected_dots = sum(1 for e in equations(jax.make_jaxpr(loss)(MLP, X)) if "dot" in str(e))
  assert len(rows) == expected_dots == 3
  up, down, tiny = rows
  assert (up.name, up.dims, up.fp8, up.reason) == ("up", (1, 24, 64, 32), True, "chosen")
  assert up.forward == (E4M3, E4M3) and up.backward == ("float8_e5m2", E4M3)
  assert (down.name, down.fp8, down.reason) == ("down", False, "filtered out")
  assert down.forward == down.backward == ("float16", "float16")
  assert (tiny.name, tiny.reason) == ("tiny", "below 16")
  table = str(rows).splitlines()
  assert table[0].split()[:2] == ["name", "dims"] and len(table) == 4
  assert re.match(r"up\s+1, 24, 64, 32\s+e4m3 x e4m3\s+e5m2 x e4m3\s+yes\s+chosen$", table[1])
  # what the report says is what the gradient's jaxpr runs
  assert fp8_dots(f, MLP, X) == 3 * sum(r.fp8 for r in rows)


def test_the_report_gives_the_cost_models_verdict_and_counts_a_loop_body_once():
  def loss(ws, x):
    def body(x, w):
      with jax.named_scope("layer"):
        return jnp.tanh(x @ w), None

    return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, ws)[0])

  ws = jax.ShapeDtypeStruct((3, 4096, 4096), jnp.float32)
  x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)  # abstract: nothing allocated
  (row,) = ols.autocast_report(ols.autocast(loss, BF16, fp8="rowwise"), ws, x)
  speedup = fp8_choice.predicted_speedup(4096, 4096, 4096, "rowwise")
  assert row.name == "layer" and row.reason == f"cost model x{speedup:.2f}"
  assert row.fp8 == (speedup > 1)
  (off,) = ols.autocast_report(ols.autocast(loss, BF16), ws, x)
  assert (off.fp8, off.reason, off.forward) == (False, "fp8 off", ("bfloat16", "bfloat16"))


def test_a_jitted_layer_called_twice_gives_two_rows_under_their_own_names():
  layer = jax.jit(lambda w, x: jnp.tanh(x @ w))

  def loss(w, x):
    with jax.named_scope("first"):
      x = layer(w, x)
    with jax.named_scope("second"):
      return jnp.sum(layer(w, x))

  f = ols.autocast(loss, BF16, fp8="tensorwise", fp8_products="all")
  w, x = jnp.ones((32, 32)), jnp.ones((16, 32))
  for _ in range(2):  # the second report reuses the interpreted jit: same rows
    assert [r.name for r in ols.autocast_report(f, w, x)] == ["first", "second"]


def test_the_report_refuses_a_function_without_autocast():
  with pytest.raises(ValueError, match=r"no ols\.autocast function ran"):
    ols.autocast_report(mlp, MLP, X)


# -- never NaN where float32 is finite (issue 38: both cases).

MAGNITUDES = (1e-30, 1e-20, 1e-10, 1e-4, 1.0, 1e5, 1e10, 1e20, 1e30)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _vjp(w, x, g, recipe, policy):
  f = ols.autocast(lambda w, x: x @ w, policy, fp8=recipe, fp8_products="all")
  out, backward = jax.vjp(f, w, x)
  return out, *backward(g)


def _relative_error(x, ref):
  unit = jnp.max(jnp.abs(ref))  # (a norm of values near 1e-30 would underflow)
  return float(jnp.linalg.norm((x - ref) / unit) / jnp.linalg.norm(ref / unit))


@pytest.mark.parametrize("policy", [BF16, F16])
@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
def test_no_operand_magnitude_makes_a_product_or_its_gradient_nan(recipe, policy):
  w0 = jax.random.normal(jax.random.key(0), (32, 48))
  x0 = jax.random.normal(jax.random.key(1), (64, 32))
  g = jax.random.normal(jax.random.key(2), (64, 48))
  cases = [(m, 1.0) for m in MAGNITUDES] + [(1.0, m) for m in MAGNITUDES]
  cases += [(m, m) for m in (1e-15, 1e15, 1e18)]  # inverse scales ~2e15 each: ~4e30 together
  for mw, mx in cases:
    w, x = w0 * mw, x0 * mx
    ours = _vjp(w, x, g, recipe, policy)
    reference = (x @ w, *jax.vjp(lambda w, x: x @ w, w, x)[1](g))
    for name, a, ref in zip(("out", "grad w", "grad x"), ours, reference, strict=True):
      assert bool(jnp.all(jnp.isfinite(ref)))
      # e5m2 gradients: ~0.06 from float32 (measured); e4m3 products ~0.04
      assert _relative_error(a, ref) < 0.12, (mw, mx, name, _relative_error(a, ref))


@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
def test_two_operands_with_maxima_near_1e22_give_a_finite_product(recipe):
  # Each operand's maximum is 1e22, placed where they never meet in one term:
  # the float32 product is finite (about 1e22), the two inverse scales
  # (1e22 / 448 each) multiply to past float32's largest value (before the
  # fix: every output NaN tensorwise, the outliers' row and column rowwise).
  x = jax.random.normal(jax.random.key(0), (16, 16)).at[0, 0].set(1e22)
  w = jax.random.normal(jax.random.key(1), (16, 16)).at[1, 0].set(1e22)
  g = jax.random.normal(jax.random.key(2), (16, 16))
  for policy in (BF16, F16):
    out, grad_w, grad_x = _vjp(w, x, g, recipe, policy)
    ref = x @ w
    assert bool(jnp.all(jnp.isfinite(ref)))
    for a in (out, grad_w, grad_x):
      assert bool(jnp.all(jnp.isfinite(a)))
    if recipe == "rowwise":  # rows and columns scaled apart from the outliers': as float32
      assert _relative_error(out[1:, 1:], ref[1:, 1:]) < 0.1


def test_rowwise_under_float16_keeps_no_float16_copy_of_an_operand_around_1e5():
  # The case the issue met: a float16 residual of an operand at 1e5 is inf,
  # and every weight gradient NaN. The residuals are the fp8 copies.
  w = jax.random.normal(jax.random.key(0), (32, 32)) * 1e5
  x = jax.random.normal(jax.random.key(1), (16, 32))
  f = ols.autocast(lambda w, x: x @ w, F16, fp8="rowwise", fp8_products="all")
  _, backward = jax.vjp(f, w, x)
  assert not [r for r in jax.tree.leaves(backward) if r.dtype == jnp.float16]
  grad_w, _ = backward(jnp.ones((16, 32)))
  assert bool(jnp.all(jnp.isfinite(grad_w)))


@pytest.mark.parametrize(
  "lhs_shape, rhs_shape, dims",
  [
    ((16, 24), (40, 16), (((0,), (1,)), ((), ()))),  # both transposed
    ((3, 16, 32), (3, 32, 24), (((2,), (1,)), ((0,), (0,)))),  # batched
    ((16, 4, 3, 2), (3, 2, 24, 4), (((2, 3), (0, 1)), ((1,), (3,)))),  # two contracting, batch
  ],
)
def test_rowwise_gradients_follow_float32_for_any_dimension_numbers(lhs_shape, rhs_shape, dims):
  lhs = jax.random.normal(jax.random.key(0), lhs_shape)
  rhs = jax.random.normal(jax.random.key(1), rhs_shape)
  plain = lambda a, b: jax.lax.dot_general(a, b, dims)
  g = jax.random.normal(jax.random.key(2), jax.eval_shape(plain, lhs, rhs).shape)
  fp8 = lambda a, b: fp8_product.fp8_dot_general(
    a, b, dimension_numbers=dims, recipe="rowwise", compute_dtype=jnp.bfloat16,
    out_dtype=jnp.float32,
  )  # fmt: skip
  ours = jax.jit(lambda a, b: jax.vjp(fp8, a, b)[1](g))(lhs, rhs)
  reference = jax.vjp(plain, lhs, rhs)[1](g)
  for x, ref in zip(ours, reference, strict=True):
    assert x.shape == ref.shape and _relative_error(x, ref) < 0.15


# -- what the scaling moves.


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's compiled program")
@pytest.mark.skipif(
  tuple(int(p) for p in jax.__version_info__[:2]) < (0, 10),
  reason="the CPU terms were read off jax 0.10's XLA:CPU; jax 0.7.1's fuses tensorwise's"
  " step otherwise (20% fewer bytes accessed: another compiler's count)",
)
@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
@pytest.mark.parametrize("m, k, n", [(256, 512, 1024), (1024, 256, 512), (512, 1024, 256)])
def test_the_cost_models_bytes_are_what_the_compiled_step_moves(recipe, m, k, n):
  # A product and its two backward products, compiled by XLA:CPU: the bytes
  # its `cost_analysis` counts against `traffic`'s, with the CPU's terms (it
  # upcasts fp8 to float32, folds no scalar into a dot, does not fuse a
  # reduction's producer and takes any layout). A GPU's count (1-byte fp8,
  # scalars folded, fused reductions, K-major fp8 copies) is unchecked here.
  def step(x, w, g):
    out, backward = jax.vjp(
      lambda x, w: fp8_product.fp8_dot_general(
        x, w, dimension_numbers=(((1,), (0,)), ((), ())), recipe=recipe,
        compute_dtype=jnp.bfloat16, out_dtype=jnp.float32,
      ), x, w,
    )  # fmt: skip
    return out, *backward(g)

  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((m, k), (k, n), (m, n))]
  analysis = jax.jit(step).lower(*shapes).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  model = fp8_choice.traffic(
    m, n, k, recipe, stored_bytes=4, folds_scalar=False, fuses_producers=False,
    k_major_fp8=False,
  )  # fmt: skip
  assert model.total == pytest.approx(analysis["bytes accessed"], rel=0.2)
