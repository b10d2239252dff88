"""fp8 matrix products with current scaling, forward and backward: `autocast(..., fp8=recipe)`.

Each product `dot_general(lhs, rhs)` that `fp8_choice.decide` accepts runs as three
fp8 products with float32 accumulation, torchao's recipes in JAX::

  forward   out      = (q(lhs, e4m3) . q(rhs, e4m3))          * 1/s_lhs * 1/s_rhs
  backward  grad_lhs = (q(g, fg)     . q(rhs, e4m3))^T        * 1/s_g   * 1/s_rhs
            grad_rhs = (q(lhs, e4m3)^T . q(g, fg))            * 1/s_lhs * 1/s_g

  q(x, f) = convert(clamp(x * s, -max_f, max_f), f),  s = max_f / amax(x)   (float32)

with the gradient's format `fg` e5m2 (tensorwise) or e4m3 (rowwise, whose
per-row scales need range less than precision), as torchao's recipes.

The scales are *current*: computed from the operand's own amax in the same
step, so the product has no state. 'tensorwise' takes one scale per tensor;
'rowwise' one power-of-two scale per row or column along the dimensions
each product does not contract. Either way each operand is quantized once:
the backward reads the forward's fp8 operands (residuals of 1 byte per
element). A rowwise operand's scales lie along the dimensions its backward
product contracts, so they are moved onto the gradient before it is
quantized (`g * 1/s_rhs`, per column of `g`: exact, powers of two), and the
gradient gets row scales of its own. The two inverse scales are applied one
after the other, never multiplied together (near 1e22 each, their product
leaves float32). A zero amax gives the scale 1; a non-finite amax (an inf or
NaN operand) makes the product NaN, never a clipped finite value.

The lowered program is the one XLA's GPU GEMM rewriter turns into a cuBLASLt
fp8 GEMM: a dot whose operands are fp8 (converts of clamped, scaled float32
tensors) with float32 output, multiplied by the two inverse scales in turn
(tensorwise: scalars, which the rewriter may fold into the GEMM, unmeasured;
rowwise: vectors, an elementwise pass after it). On CPU XLA executes
the same program by upcasting, so the numerics are those of a GPU run up to
the order of the float32 sums.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

RECIPES = ("tensorwise", "rowwise")
FORWARD = jnp.float8_e4m3fn  # activations and weights: precision (3 mantissa bits)
# The incoming gradient: range (5 exponent bits) under one scale per tensor;
# precision under a scale per row, as torchao's rowwise recipe (each row's
# amax maps to 448). On the benchmarks' LM (300 steps, seeds 0-1) rowwise with
# an e4m3 gradient ended 0.0023 and 0.0028 from float32, with e5m2 0.0037 and
# 0.0038; one product of N(0, 1) matrices: gradient errors 0.038 and 0.059.
GRADIENTS = {"tensorwise": jnp.float8_e5m2, "rowwise": jnp.float8_e4m3fn}

# The largest scale, about 2**120 (an amax below max_f / 2**120 counts as that
# small): the scale and its inverse stay finite and normal in float32, and so
# tiny a tensor quantizes to zeros anyway.
_SCALE_LIMIT = 2.0**120


def product_dims(
  lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers: Any
) -> tuple[int, int, int, int]:
  """`(batch, m, n, k)`: the batch size and the sizes of one matrix product of `dot_general`."""
  (lc, rc), (lb, rb) = dimension_numbers
  m = math.prod(lhs_shape[i] for i in _free(len(lhs_shape), lc, lb))
  n = math.prod(rhs_shape[i] for i in _free(len(rhs_shape), rc, rb))
  return math.prod(lhs_shape[i] for i in lb), m, n, math.prod(lhs_shape[i] for i in lc)


# -- quantization.


def _scale(amax: jax.Array, fp8_max: float, power_of_two: bool) -> jax.Array:
  """`fp8_max / amax` in float32; 1 where amax is 0, NaN where it is not finite."""
  scale = fp8_max / jnp.maximum(amax, fp8_max / _SCALE_LIMIT)
  if power_of_two:  # down to 2**e (the mantissa bits cleared): x * scale and 1 / scale are exact
    bits = lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0x7F800000)
    scale = lax.bitcast_convert_type(bits, jnp.float32)
  scale = lax.select(amax == 0, jnp.ones_like(scale), scale)
  return lax.select(jnp.isfinite(amax), scale, jnp.full_like(scale, jnp.nan))


def quantize(
  x: jax.Array, fmt: Any, recipe: str, contracting: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
  """`(q, inverse_scale)`: `x` in fp8 format `fmt`, scaled by its current amax.

  'tensorwise': one scale (shape `()`); 'rowwise': one power-of-two scale per
  index of the dimensions not in `contracting` (the amax is taken over the
  contracting dimensions; shape of `x` with those set to 1).
  """
  fp8_max = float(jnp.finfo(fmt).max)
  x32 = x.astype(jnp.float32)
  if recipe == "tensorwise":
    amax = jnp.max(jnp.abs(x32))
  else:
    amax = jnp.max(jnp.abs(x32), axis=tuple(contracting), keepdims=True)
  scale = _scale(amax, fp8_max, power_of_two=recipe == "rowwise")
  q = lax.convert_element_type(lax.clamp(-fp8_max, x32 * scale, fp8_max), fmt)
  return q, 1.0 / scale


# -- the products.


def _free(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
  return [d for d in range(ndim) if d not in contracting and d not in batch]


def _as_output(
  inverse: jax.Array, contracting: Sequence[int], batch: Sequence[int], first: bool, n_other: int
) -> jax.Array:
  """A rowwise inverse scale (keepdims) laid out as the output: batch, lhs free, rhs free."""
  free = _free(inverse.ndim, contracting, batch)
  moved = jnp.transpose(inverse, (*batch, *free, *contracting))
  moved = moved.reshape(moved.shape[: len(batch) + len(free)])
  if first:  # lhs: (batch, lhs free) -> (batch, lhs free, 1 per rhs free)
    return moved.reshape(moved.shape + (1,) * n_other)
  # rhs: (batch, rhs free) -> (batch, 1 per lhs free, rhs free)
  return moved.reshape(moved.shape[: len(batch)] + (1,) * n_other + moved.shape[len(batch) :])


def _rescale(out: jax.Array, scale_a: jax.Array, scale_b: jax.Array) -> jax.Array:
  """`out * scale_a * scale_b`, never forming `scale_a * scale_b` where it leaves float32.

  Two inverse scales near 2e19 (operands' maxima near 1e22) multiply to
  infinity, though the product they rescale is finite. The exponents are
  added as integers and split in halves, so each factor stays in range and
  `out` is multiplied by each in turn (one elementwise pass after the GEMM).
  """
  ma, ea = jnp.frexp(scale_a)
  mb, eb = jnp.frexp(scale_b)
  e = ea + eb
  half = e // 2
  return out * jnp.ldexp(ma * mb, half) * jnp.ldexp(jnp.ones_like(ma), e - half)


def scaled_dot(
  qa: jax.Array, inv_a: jax.Array, qb: jax.Array, inv_b: jax.Array, dimension_numbers: Any
) -> jax.Array:
  """`dot_general` of two quantized operands, float32 accumulation, rescaled: float32 output."""
  out = lax.dot_general(qa, qb, dimension_numbers, preferred_element_type=jnp.float32)
  (ac, bc), (ab, bb) = dimension_numbers
  a_free = len(_free(qa.ndim, ac, ab))
  b_free = len(_free(qb.ndim, bc, bb))
  scale_a = _as_output(inv_a, ac, ab, True, b_free) if inv_a.ndim else inv_a
  scale_b = _as_output(inv_b, bc, bb, False, a_free) if inv_b.ndim else inv_b
  return _rescale(out, scale_a, scale_b)


def _transposed(
  dimension_numbers: Any, x_ndim: int, y_ndim: int, swap: bool
) -> tuple[Any, tuple[int, ...]]:
  """The backward product of `x` in `dot_general(x, y)`, `dot_general(g, y)`, and its transpose.

  JAX's own transpose rule of `dot_general` (`_dot_general_transpose_lhs`);
  with `swap`, `x` is the rhs of the forward product (the roles exchanged).
  """
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  x_kept = _free(x_ndim, x_contract, x_batch)
  y_kept = _free(y_ndim, y_contract, y_batch)
  nb = len(x_batch)
  ans_batch = list(range(nb))
  if swap:
    ans_y = list(range(nb, nb + len(y_kept)))
  else:
    ans_y = list(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
  dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
  x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
  unsorted = [*x_batch, *x_kept, *x_contract_sorted_by_y]
  return dims, tuple(int(i) for i in np.argsort(unsorted))


def _relative(inverse: jax.Array) -> jax.Array:
  """Power-of-two inverse scales over their largest (exact; at most 1)."""
  return inverse / jnp.max(inverse)


def _canonical(dimension_numbers: Any) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))


@functools.lru_cache(maxsize=512)
def _product(
  dims: Any,
  ndims: tuple[int, int],
  recipe: str,
  dtypes: tuple[np.dtype, np.dtype],
  compute_dtype: np.dtype,
  out_dtype: np.dtype,
) -> Any:
  """The differentiable fp8 product of one configuration, as a `custom_vjp`.

  A `custom_vjp` rather than the `custom_jvp` of autocast's 16-bit products:
  the backward quantizes the incoming gradient with a scale computed from it,
  which is not linear in it, so JAX could not derive the backward by
  transposing a tangent rule. The cost: `jax.jvp` through an fp8 product
  raises, as through any `custom_vjp`.
  """
  (lc, rc), (lb, rb) = dims
  # The backward products, JAX's transposes of this one.
  lhs_dims, lhs_axes = _transposed(dims, ndims[0], ndims[1], swap=False)
  rhs_dims, rhs_axes = _transposed(((rc, lc), (rb, lb)), ndims[1], ndims[0], swap=True)
  n_lhs_free = len(_free(ndims[0], lc, lb))
  n_rhs_free = len(_free(ndims[1], rc, rb))
  # grad_rhs as `lhs . g` rather than JAX's `g . lhs`: for `x @ w` it comes out
  # laid out as `w` (no transpose pass after the GEMM).
  (g_contract, l_contract), (g_batch, l_batch) = rhs_dims
  rhs_dims = ((l_contract, g_contract), (l_batch, g_batch))
  nb = len(lb)
  moved = lambda a: a if a < nb else a + len(lc) if a < nb + n_rhs_free else a - n_rhs_free
  rhs_axes = tuple(moved(a) for a in rhs_axes)

  def forward(lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, Any]:
    ql, il = quantize(lhs, FORWARD, recipe, lc)
    qr, ir = quantize(rhs, FORWARD, recipe, rc)
    out = scaled_dot(ql, il, qr, ir, dims).astype(out_dtype)
    # The backward reads the same fp8 operands: 1 byte per element, quantized once.
    return out, (ql, il, qr, ir)

  def backward(residuals: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    ql, il, qr, ir = residuals
    if recipe == "tensorwise":
      qg, ig = quantize(g, GRADIENTS[recipe], recipe, ())
      grad_lhs = scaled_dot(qg, ig, qr, ir, lhs_dims)
      grad_rhs = scaled_dot(ql, il, qg, ig, rhs_dims)
    else:
      # A saved operand's row scales lie along dimensions the backward product
      # contracts; they move onto the gradient, exactly (powers of two, taken
      # relative to their largest so the gradient keeps its range), and the
      # gradient is scaled per row of its own: the forward's fp8 operands serve.
      g32 = g.astype(jnp.float32)
      fg = GRADIENTS[recipe]
      qg, ig = quantize(g32 * _relative(_as_output(ir, rc, rb, False, n_lhs_free)), fg, recipe,
                        lhs_dims[0][0])  # fmt: skip
      grad_lhs = scaled_dot(qg, ig, qr, jnp.max(ir), lhs_dims)
      qg, ig = quantize(g32 * _relative(_as_output(il, lc, lb, True, n_rhs_free)), fg, recipe,
                        rhs_dims[0][1])  # fmt: skip
      grad_rhs = scaled_dot(ql, jnp.max(il), qg, ig, rhs_dims)
    grad_lhs = jnp.transpose(grad_lhs, lhs_axes).astype(dtypes[0])
    grad_rhs = jnp.transpose(grad_rhs, rhs_axes).astype(dtypes[1])
    return grad_lhs, grad_rhs

  @jax.custom_vjp
  def product(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    return forward(lhs, rhs)[0]

  product.defvjp(forward, backward)
  return product


def fp8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  dimension_numbers: Any,
  recipe: str,
  compute_dtype: Any,
  out_dtype: Any,
) -> jax.Array:
  """`lax.dot_general(lhs, rhs, dimension_numbers)` on fp8 operands, forward and backward.

  Forward: both operands in `float8_e4m3fn`; backward (under `jax.grad`): the
  incoming gradient in `float8_e5m2` (tensorwise) or `float8_e4m3fn`
  (rowwise) against the saved operands in `float8_e4m3fn`; each operand with
  its own current scale ('tensorwise' or 'rowwise', see the module), every
  product accumulated in float32 and
  rescaled in float32. The output is `out_dtype`; each gradient has its
  operand's dtype. The backward keeps the forward's fp8 operands and their
  scales, whatever the compute dtype.

  Args:
    lhs: a 16- or 32-bit floating array.
    rhs: a 16- or 32-bit floating array.
    dimension_numbers: as `lax.dot_general`'s.
    recipe: 'tensorwise' or 'rowwise'.
    compute_dtype: the policy's compute dtype (part of the cached configuration).
    out_dtype: the dtype of the result.

  Returns:
    The product, `out_dtype`.
  """
  if recipe not in RECIPES:
    raise ValueError(f"recipe must be one of {RECIPES}; got {recipe!r}.")
  dims = _canonical(dimension_numbers)
  fn = _product(
    dims,
    (lhs.ndim, rhs.ndim),
    recipe,
    (np.dtype(lhs.dtype), np.dtype(rhs.dtype)),
    np.dtype(compute_dtype),
    np.dtype(out_dtype),
  )
  return fn(lhs, rhs)
