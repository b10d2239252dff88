"""`autocast(..., fp8=recipe)`: fp8 products with current scaling, forward and backward (issue 32).

Expectations are independent of the implementation: dtypes read on the
jaxpr of `jax.grad` of a GPT written in plain JAX (no fp8 anywhere in it);
the lowered HLO read instruction by instruction for the shape XLA's GPU GEMM
rewriter turns into a cuBLASLt fp8 GEMM; quantization against ml_dtypes'
own rounding; backward products against JAX's transpose of `dot_general`;
numerics against float32. XLA:CPU executes fp8 products by upcasting, so all
of it runs on CPU.
"""

import collections
import functools
import re

import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import optax_lossscale as ols
from optax_lossscale._src.autocast import fp8 as fp8_product
from optax_lossscale._src.autocast import fp8_choice
from tests.autocast_helpers import equations

# jax 0.7.1's XLA (the lowest supported) rounds some scaled values differently
# from ml_dtypes and from its own straight-line code (1 value in 1024 lands on
# the other side of an fp8 tie; a scan's fp8 products then differ from the
# unrolled ones): bit-level fp8 facts are checked from jax 0.8 on.
OLD_XLA = pytest.mark.skipif(
  tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 8),
  reason="XLA before jax 0.8 rounds some scaled values to the other side of an fp8 tie",
)

BF16 = "p=f32,c=bf16,o=f32"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
MATMUL = (((1,), (0,)), ((), ()))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def product(a, b, recipe, dims=MATMUL, out_dtype=jnp.float32):
  return fp8_product.fp8_dot_general(
    a, b, dimension_numbers=dims, recipe=recipe, compute_dtype=jnp.bfloat16, out_dtype=out_dtype
  )


def relative_error(x, ref):
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


# -- a GPT in plain JAX, no fp8 awareness.


def gpt_params(key, vocab, d, layers, seq):
  keys = iter(jax.random.split(key, 2 + 4 * layers))
  normal = lambda *shape: jax.random.normal(next(keys), shape) * 0.02
  blocks = [
    {"qkv": normal(d, 3 * d), "out": normal(d, d), "up": normal(d, 4 * d),
     "down": normal(4 * d, d), "ln1": jnp.ones(d), "ln2": jnp.ones(d)}
    for _ in range(layers)
  ]  # fmt: skip
  return {"embed": normal(vocab, d), "pos": normal(seq, d), "blocks": blocks}


def layer_norm(x, gain):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * gain


def gpt_loss(params, tokens, heads):
  x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
  b, t, d = x.shape
  causal = jnp.tril(jnp.ones((t, t), bool))
  for p in params["blocks"]:
    q, k, v = jnp.split(layer_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    att = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d) @ p["out"]
    x = x + jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["up"]) @ p["down"]
  logits = x @ params["embed"].T
  picked = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def dot_signatures(jaxpr):
  """Counts of (input dtypes, preferred_element_type, output dtype) over every dot_general."""
  counts = collections.Counter()
  for eqn in equations(jaxpr):
    if eqn.primitive.name == "dot_general":
      ins = tuple(sorted(str(v.aval.dtype) for v in eqn.invars))
      preferred = eqn.params["preferred_element_type"]
      counts[ins, str(np.dtype(preferred)), str(eqn.outvars[0].aval.dtype)] += 1
  return counts


def test_a_gpt_of_width_4096_runs_its_projections_in_fp8_forward_and_backward():
  # A GPT of width 4096 (8x1024 tokens, vocabulary 32768; a Llama-8B's widths),
  # traced abstractly. By the cost model (float32 operands: autocast's), every
  # projection pays in tensorwise fp8: QKV (8192x12288x4096) x1.25, the output
  # projection (8192x4096x4096) x1.15, the MLP (8192x16384x4096 both ways)
  # x1.26, the head x1.28; not the attention products (1024x1024x128 per
  # head, x0.47).
  layers = 2
  params = jax.eval_shape(lambda: gpt_params(jax.random.key(0), 32768, 4096, layers, 1025))
  tokens = jax.ShapeDtypeStruct((8, 1025), jnp.int32)
  step = ols.autocast(lambda p, t: gpt_loss(p, t, heads=32), BF16, fp8="tensorwise")
  counts = dot_signatures(jax.make_jaxpr(jax.grad(step))(params, tokens))
  fp8 = 4 * layers + 1
  assert counts == {
    ((E4M3, E4M3), "float32", "float32"): fp8,  # forward
    ((E4M3, E5M2), "float32", "float32"): 2 * fp8,  # backward: the gradient in e5m2
    (("bfloat16", "bfloat16"), "float32", "float32"): 2 * layers,  # attention, forward
    (("bfloat16", "bfloat16"), "bfloat16", "bfloat16"): 4 * layers,  # and backward
  }
  # The 186M LM of the benchmarks (width 1024): its biggest product, the head
  # (8192x32768x1024), is charged more scaling traffic than its GEMMs save.
  assert fp8_choice.predicted_speedup(8192, 32768, 1024) < 1


@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
def test_every_product_of_a_small_gpt_in_fp8_trains_close_to_float32(recipe):
  # fp8_products='all' lifts the cost model: every product with dimensions >= 16
  # (here all of them, attention included) is fp8.
  params = gpt_params(jax.random.key(0), vocab=64, d=64, layers=1, seq=33)
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 64)
  loss = lambda p, t: gpt_loss(p, t, heads=4)
  fp8_loss = ols.autocast(loss, BF16, fp8=recipe, fp8_products="all")
  counts = dot_signatures(jax.make_jaxpr(jax.grad(fp8_loss))(params, tokens))
  value, grads = jax.jit(jax.value_and_grad(fp8_loss))(params, tokens)
  # QKV, two attention products, output, MLP up and down, head: forward, and
  # twice backward (the gradient in e5m2 tensorwise, e4m3 rowwise)
  if recipe == "tensorwise":
    assert counts == {
      ((E4M3, E4M3), "float32", "float32"): 7,
      ((E4M3, E5M2), "float32", "float32"): 14,
    }
  else:
    assert counts == {((E4M3, E4M3), "float32", "float32"): 21}
  ref_value, ref_grads = jax.value_and_grad(loss)(params, tokens)
  assert abs(float(value - ref_value)) < 1e-3
  flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])
  # e5m2 gradients (2 mantissa bits): ~9% from float32 here, bfloat16 ~0.5%
  assert relative_error(flat(grads), flat(ref_grads)) < 0.2
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # the params' dtype


def test_fp8_is_checked_when_autocast_is_built():
  for bad in ("e4m3", True, "TENSORWISE"):
    with pytest.raises(ValueError, match=r"fp8 must be None or one of \('tensorwise', 'rowwise'\)"):
      ols.autocast(lambda x: x, BF16, fp8=bad)


# -- eligibility.


def test_eligible_products():
  big = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  assert fp8_choice.eligible(big, big, MATMUL)
  assert fp8_choice.eligible(big, jax.ShapeDtypeStruct((4096, 4096), jnp.float32), MATMUL)
  assert not fp8_choice.eligible(big, big, MATMUL, recipe="rowwise")  # x1.18 and x0.86
  square = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)  # x0.92: no
  assert not fp8_choice.eligible(square, square, MATMUL)
  # batch dimensions are allowed; a dimension under 16 never is
  batched = jax.ShapeDtypeStruct((2, 8192, 8192), jnp.bfloat16)
  assert fp8_choice.eligible(batched, batched, (((2,), (1,)), ((0,), (0,))))
  thin = jax.ShapeDtypeStruct((4096, 8), jnp.bfloat16)
  every = functools.partial(fp8_choice.eligible, dimension_numbers=MATMUL, products="all")
  assert not every(big, thin)
  assert every(*[jax.ShapeDtypeStruct((16, 16), jnp.float16)] * 2)
  # operands fp8 already (a layer's own quantization), complex, integer or float64: never
  for dtype in (jnp.float8_e4m3fn, jnp.complex64, jnp.int32):
    other = jax.ShapeDtypeStruct((64, 64), dtype)
    assert not every(other, other)
  assert not fp8_choice.eligible(*[jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)] * 2, MATMUL)


def test_the_cost_model_reproduces_torchaos_h100_measurements():
  # torchao's float8 README (H100, forward and backward of a linear, M K N):
  # 1024 2048 1024 -> x0.80, 4096 8192 16384 -> x1.39. Arguments are m, n, k;
  # torchao's operands and outputs are bfloat16.
  torchao = functools.partial(fp8_choice.predicted_speedup, source_bytes=2, out_bytes=2)
  assert torchao(1024, 1024, 2048) == pytest.approx(0.80, abs=0.03)  # the model: x0.79
  assert torchao(4096, 16384, 8192) == pytest.approx(1.39, abs=0.05)  # x1.38
  # rowwise quantizes the gradient twice and rescales by vectors: it needs the
  # biggest products (a Llama-8B MLP's down projection, bfloat16 operands)
  assert fp8_choice.predicted_speedup(4096, 4096, 4096, "rowwise") < 1.0
  assert fp8_choice.predicted_speedup(8192, 4096, 16384, "rowwise", source_bytes=(2, 2, 4)) > 1


def test_convolutions_and_small_products_keep_the_compute_dtype():
  def f(w, k, x):
    h = jnp.tanh(x @ w)  # 8x32x32: too small to profit
    return jnp.sum(lax.conv(h[:, None, :, None], k, (1, 1), "SAME"))

  w, k, x = jnp.ones((32, 32)), jnp.ones((4, 1, 3, 1)), jnp.ones((8, 32))
  jaxpr = jax.make_jaxpr(jax.grad(ols.autocast(f, BF16, fp8="tensorwise"), (0, 1)))(w, k, x)
  for eqn in equations(jaxpr):
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      assert {str(v.aval.dtype) for v in eqn.invars} == {"bfloat16"}, eqn


# -- the lowered program: XLA's fp8 GEMM pattern.

_LINE = re.compile(r"^\s*(?:ROOT )?(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(([^)]*)\)")


def hlo_graph(text):
  """name -> (dtype, rank, opcode, operand names), and name -> users, of an HLO module."""
  nodes, users = {}, collections.defaultdict(list)
  for line in text.splitlines():
    match = _LINE.match(line)
    if match:
      name, dtype, shape, opcode, args = match.groups()
      # an operand is its name, or (older XLA) its type then its name: "f32[2,3]{1,0} %a"
      args = re.sub(r"\[[^\]]*\]|\{[^}]*\}", "", args)
      operands = [a.split()[-1] for a in args.split(",") if a.strip()]
      nodes[name] = (dtype, len(shape.split(",")) if shape else 0, opcode, operands)
      for a in operands:
        users[a].append(name)
  return nodes, users


@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
def test_the_lowered_products_have_the_shape_of_a_cublaslt_fp8_gemm(recipe):
  def loss(a, b):
    out = fp8_product.fp8_dot_general(
      a, b, dimension_numbers=MATMUL, recipe=recipe, compute_dtype=jnp.bfloat16,
      out_dtype=jnp.bfloat16,
    )  # fmt: skip
    return jnp.sum(out.astype(jnp.float32) ** 2)

  a, b = jnp.ones((64, 32)), jnp.ones((32, 48))
  text = jax.jit(jax.grad(loss, (0, 1))).lower(a, b).as_text(dialect="hlo")
  nodes, users = hlo_graph(text)
  dots = [n for n, node in nodes.items() if node[2] == "dot"]
  assert len(dots) == 3  # forward, and the two backward products
  kinds = []
  for dot in dots:
    out_dtype, _, _, operands = nodes[dot]
    assert out_dtype == "f32"  # float32 accumulation and output
    kinds.append(tuple(sorted(nodes[o][0] for o in operands)))
    for operand in operands:  # fp8 = convert(clamp(lo, x * scale, hi))
      _, _, opcode, (clamped,) = nodes[operand]
      assert opcode == "convert"
      _, scaled, _ = nodes[clamped][3]
      assert nodes[clamped][2] == "clamp" and nodes[scaled][2] == "multiply"
    (rescale,) = users[dot]  # the result multiplied by the inverse scales, in float32
    assert nodes[rescale][2] == "multiply" and nodes[rescale][0] == "f32"
    (factor,) = [o for o in nodes[rescale][3] if o != dot]
    if recipe == "tensorwise":  # a scalar, broadcast: the GEMM's output scale
      assert nodes[factor][2] == "broadcast" and nodes[nodes[factor][3][0]][1] == 0
  gradient = "f8e5m2" if recipe == "tensorwise" else "f8e4m3fn"
  assert sorted(kinds) == sorted(
    [("f8e4m3fn", "f8e4m3fn"), *[tuple(sorted(("f8e4m3fn", gradient)))] * 2]
  )


# -- quantization.


@OLD_XLA
def test_tensorwise_quantization_is_ml_dtypes_rounding_of_the_scaled_tensor():
  x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32) * 30
  q, inverse = fp8_product.quantize(jnp.asarray(x), jnp.float8_e4m3fn, "tensorwise", (1,))
  scale = np.float32(448) / np.abs(x).max()
  expected = (x * scale).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(q), expected)
  assert float(inverse) == pytest.approx(1 / scale, rel=2.5e-7)  # an ulp: 1 / scale is rounded
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448  # the amax lands on the maximum


@OLD_XLA
def test_rowwise_scales_are_powers_of_two_per_row():
  rows = 10.0 ** np.linspace(-6, 3, 16, dtype=np.float32)
  x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32) * rows[:, None]
  q, inverse = fp8_product.quantize(jnp.asarray(x), jnp.float8_e5m2, "rowwise", (1,))
  assert inverse.shape == (16, 1)
  scale = 1 / np.asarray(inverse)[:, 0]
  np.testing.assert_array_equal(scale, 2.0 ** np.round(np.log2(scale)))  # powers of two
  amax = np.abs(x).max(axis=1)
  assert np.all(amax * scale <= 57344) and np.all(amax * scale > 57344 / 2)
  expected = (x * scale[:, None]).astype(ml_dtypes.float8_e5m2)  # exact: scale is 2**e
  np.testing.assert_array_equal(np.asarray(q), expected)


def test_zero_and_non_finite_operands():
  a = jax.random.normal(jax.random.key(0), (32, 32))
  for recipe in fp8_product.RECIPES:
    zeros = product(jnp.zeros((32, 32)), a, recipe)
    assert bool(jnp.all(zeros == 0))  # amax 0: the scale is 1, no NaN
    for bad in (jnp.inf, jnp.nan):
      poisoned = a.at[3, 5].set(bad)
      out = product(poisoned, a, recipe)
      grad = jax.grad(lambda b, x=poisoned, r=recipe: jnp.sum(product(x, b, r)))(a)
      # never a clipped finite value: the rows the bad value reaches (all, tensorwise) are NaN
      assert bool(jnp.all(jnp.isnan(out[3]))) and not bool(jnp.any(jnp.isinf(out)))
      assert bool(jnp.all(jnp.isnan(out))) == (recipe == "tensorwise")
      assert not bool(jnp.all(jnp.isfinite(grad)))


# -- numerics against float32.


def test_a_product_of_normal_matrices_is_within_a_tenth_of_float32():
  a = jax.random.normal(jax.random.key(0), (256, 256))
  b = jax.random.normal(jax.random.key(1), (256, 256))
  for recipe in fp8_product.RECIPES:
    error = relative_error(product(a, b, recipe), a @ b)
    assert 0.01 < error < 0.1, (recipe, error)  # measured 0.037; bfloat16: 0.003


def test_current_scaling_keeps_large_and_small_tensors_finite_and_scaled():
  key = jax.random.key(2)
  a, b = jax.random.normal(key, (128, 128)), jax.random.normal(jax.random.key(3), (128, 128))
  for magnitude in (1e4, 1e-4):
    x = a * magnitude
    unscaled = x.astype(jnp.float8_e4m3fn).astype(jnp.float32) @ b  # a plain cast: NaN or zeros
    assert not bool(jnp.all(jnp.isfinite(unscaled))) or bool(jnp.all(unscaled == 0))
    for recipe in fp8_product.RECIPES:
      assert relative_error(product(x, b, recipe), x @ b) < 0.1, (magnitude, recipe)
  # one tensor whose magnitudes run from 1e-4 to 1e4: finite, and right where it matters
  magnitudes = 10.0 ** jax.random.uniform(key, (128, 128), minval=-4, maxval=4)
  x = magnitudes * jnp.sign(a)
  for recipe in fp8_product.RECIPES:
    out = product(x, b, recipe)
    assert bool(jnp.all(jnp.isfinite(out))) and relative_error(out, x @ b) < 0.1


def test_rowwise_is_better_when_rows_differ_in_magnitude_by_1e6():
  a = jax.random.normal(jax.random.key(0), (256, 256)) * 10.0 ** -jnp.linspace(0, 6, 256)[:, None]
  b = jax.random.normal(jax.random.key(1), (256, 256))
  ref = a @ b

  def per_row_error(out):  # the mean over rows of each row's relative error
    return float(jnp.mean(jnp.linalg.norm(out - ref, axis=1) / jnp.linalg.norm(ref, axis=1)))

  tensorwise = per_row_error(product(a, b, "tensorwise"))
  rowwise = per_row_error(product(a, b, "rowwise"))
  assert rowwise < 0.06 and tensorwise > 0.15  # measured 0.0375 and 0.184


@pytest.mark.parametrize(
  "lhs_shape, rhs_shape, dims",
  [
    ((16, 24), (40, 16), (((0,), (1,)), ((), ()))),  # both transposed
    ((3, 16, 32), (3, 32, 24), (((2,), (1,)), ((0,), (0,)))),  # batched
    ((16, 4, 3, 2), (3, 2, 24, 4), (((2, 3), (0, 1)), ((1,), (3,)))),  # two contracting, batch
  ],
)
def test_the_backward_products_are_jaxs_transposes_of_the_dequantized_product(
  lhs_shape, rhs_shape, dims
):
  def dequantized(x, fmt):
    # The fp8 values from a program of their own, widened in NumPy: inside one
    # program XLA:GPU may drop a float32 -> fp8 -> float32 round trip (excess
    # precision), and eager ops round some ties otherwise on jax < 0.8.
    q, inverse = jax.jit(fp8_product.quantize, static_argnums=(1, 2, 3))(x, fmt, "tensorwise", ())
    return jnp.asarray(np.asarray(q).astype(np.float32) * np.asarray(inverse))

  @jax.jit
  def compare(lhs, rhs, g, lhs_q, rhs_q, g_q):
    out, backward = jax.vjp(lambda a, b: product(a, b, "tensorwise", dims), lhs, rhs)
    # JAX's own transpose rule, on the operands the fp8 products see
    plain = lambda a, b: lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST)
    ref_out, ref_backward = jax.vjp(plain, lhs_q, rhs_q)
    exact = jax.vjp(plain, lhs, rhs)[1](g)
    return (out, *backward(g)), (ref_out, *ref_backward(g_q)), exact

  lhs = jax.random.normal(jax.random.key(0), lhs_shape)
  rhs = jax.random.normal(jax.random.key(1), rhs_shape)
  g = jax.random.normal(
    jax.random.key(2), jax.eval_shape(lambda: lax.dot_general(lhs, rhs, dims)).shape
  )
  quantized = dequantized(lhs, E4M3), dequantized(rhs, E4M3), dequantized(g, E5M2)
  ours, reference, exact = compare(lhs, rhs, g, *quantized)
  # The same products up to the order of float32 sums on the CPU. On an H200
  # (jax 0.11.2) the both-transposed case came within 0.4% (a 16-bit rounding
  # somewhere in XLA:GPU's fp8 product; not isolated): a wrong transpose is
  # off by far more.
  close = 1e-5 if jax.default_backend() == "cpu" else 1e-2
  for x, ref in zip(ours, reference, strict=True):
    np.testing.assert_allclose(x, ref, rtol=close, atol=close)
  for x, ref in zip(ours[1:], exact, strict=True):  # and near the float32 gradients
    assert x.shape == ref.shape and relative_error(x, ref) < 0.15


@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
def test_a_loss_scale_changes_no_bit_of_the_unscaled_gradients(recipe):
  # The gradient's fp8 scale comes from its own amax: a power-of-two loss
  # scale S cancels exactly, so fp8 needs no loss scale for its range.
  w = jax.random.normal(jax.random.key(0), (64, 32))
  x = jax.random.normal(jax.random.key(1), (16, 64))
  loss = lambda w: jnp.mean(jnp.tanh(product(x, w, recipe, out_dtype=jnp.bfloat16)) ** 2)
  grads = jax.grad(loss)(w)
  scaled = jax.grad(lambda w: loss(w) * 2.0**12)(w) / 2.0**12
  np.testing.assert_array_equal(grads, scaled)


@OLD_XLA
def test_composes_with_jit_vmap_scan_and_checkpoint():
  ws = jax.random.normal(jax.random.key(0), (3, 32, 32)) / 6
  xs = jax.random.normal(jax.random.key(1), (4, 16, 32))

  def unrolled(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x**2)

  def scanned(ws, x):
    body = jax.checkpoint(lambda x, w: (jnp.tanh(x @ w), None))
    return jnp.sum(lax.scan(body, x, ws)[0] ** 2)

  # Compute in float32 around the fp8 products: in bfloat16, XLA's excess
  # precision (a bfloat16 rounding kept in float32 inside a fusion) differs
  # between a loop body and straight-line code, and fp8 magnifies one
  # rounding's difference into a different fp8 value.
  every = functools.partial(ols.autocast, fp8="tensorwise", fp8_products="all")
  grad = lambda f: jax.grad(every(f, "p=f32,c=f32,o=f32"))
  reference = grad(unrolled)(ws, xs[0])
  np.testing.assert_allclose(jax.jit(grad(scanned))(ws, xs[0]), reference, rtol=1e-6)
  per_example = jax.jit(jax.vmap(grad(unrolled), in_axes=(None, 0)))(ws, xs)
  np.testing.assert_allclose(per_example[0], reference, rtol=1e-6)
  # forward mode cannot pass a custom_vjp function, as in JAX
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(every(unrolled, BF16), (ws, xs[0]), (ws, xs[0]))


@pytest.mark.parametrize("recipe", fp8_product.RECIPES)
@pytest.mark.parametrize("policy", [BF16, "p=f32,c=f16,o=f32"])
def test_both_recipes_keep_their_residuals_in_fp8(recipe, policy):
  # Each operand is quantized once: the backward reads the forward's fp8 copies
  # (rowwise too: the saved operand's row scales move onto the gradient).
  w = jax.random.normal(jax.random.key(0), (32, 32))
  x = jax.random.normal(jax.random.key(1), (16, 32))
  f = ols.autocast(lambda w, x: x @ w, policy, fp8=recipe, fp8_products="all")
  _, backward = jax.vjp(f, w, x)
  residuals = [r for r in jax.tree.leaves(backward) if r.ndim == 2 and r.size > 32]
  assert {str(r.dtype) for r in residuals} == {E4M3}
  text = jax.jit(jax.grad(lambda w, x: jnp.sum(f(w, x) ** 2), (0, 1))).lower(w, x).as_text()
  # two operand quantizations (e4m3), and one of the gradient (e5m2, tensorwise)
  # or two (e4m3, rowwise)
  e4m3 = len(re.findall(r"stablehlo.convert .* -> tensor<[\dx]*f8E4M3FN>", text))
  e5m2 = len(re.findall(r"stablehlo.convert .* -> tensor<[\dx]*f8E5M2>", text))
  assert (e4m3, e5m2) == ((2, 1) if recipe == "tensorwise" else (4, 0))
