"""Matrix products and convolutions under `autocast`: 16-bit operands, float32 accumulation.

Forward, a product takes its floating operands in the compute dtype,
accumulates in float32 and returns the type the function declared
(`preferred_element_type`: float32 for a float32 function), so nothing
downstream sees a rounded logit, and an attention's float32 logits stay
float32. Bound plainly, JAX would transpose such a product into backward
products that take the float32 cotangent, running two thirds of a training
step's matrix FLOPs in float32. Here each product is a `custom_jvp` whose
tangent is the same product on compute-dtype operands (bilinear: one product
per nonzero tangent): its transposes, the backward pass, take compute-dtype
cotangents, and every matrix product of a training step runs on 16-bit
operands. They accumulate as the backend accumulates 16-bit products
(float32 on CPU, GPU and TPU matrix units; `tests/test_autocast.py` checks
the CPU).

A product whose output only products read (directly or through exact moves
such as a transpose: an attention's output read by its output projection)
writes it in the compute dtype instead (`plan.plan` finds them): its
readers round it to the compute dtype anyway, so they read the same bits,
and half the bytes are written and read.

Left as written: products of complex operands (a real compute dtype would
drop the imaginary part) and of fp8 operands (an fp8 layer's own choice).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import operator
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.autocast import fp8 as fp8_lib
from optax_lossscale._src.autocast import fp8_choice, report
from optax_lossscale._src.autocast import interpreter as interp


def out_dtype(eqn: Any) -> np.dtype:
  """The product's result type: the one the function declared."""
  return np.dtype(eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype)


def operand_dtype(eqn: Any, invals: list[Any], compute_dtype: np.dtype) -> np.dtype:
  """The compute dtype; or the function's own, for a product it declares on 16-bit operands.

  A product written on bfloat16 operands (a `.astype(jnp.bfloat16)`, a Flax
  `Dense(dtype=jnp.bfloat16)`) runs in bfloat16 whatever the policy says: an
  explicit cast is kept (under `c=f16` it would overflow above 65504).
  """
  declared = {
    np.dtype(var.aval.dtype)
    for var, v in zip(eqn.invars, invals, strict=True)
    if interp.is_float(v)
  }
  if len(declared) == 1 and next(iter(declared)).itemsize == 2:
    return next(iter(declared))
  return compute_dtype


def compute(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`dot_general`, `conv_general_dilated`, `ragged_dot_general` on compute-dtype operands.

  With `autocast(..., fp8=recipe)`, a `dot_general` that `fp8_choice.decide` chooses
  runs on fp8 operands instead. Each product records what it did
  (`report.record`).
  """
  c = ctx.compute_dtype
  tangent = interp.any_tangent(invals)
  name = eqn.primitive.name
  dims: tuple[int, ...] = ()
  reason = "fp8 off" if ctx.fp8 is None else "convolution"
  if name == "dot_general":
    dims = fp8_lib.product_dims(*(np.shape(v) for v in invals), eqn.params["dimension_numbers"])
  if ctx.fp8 is not None and name == "dot_general" and not tangent:
    dimension_numbers = eqn.params["dimension_numbers"]
    chosen, reason = fp8_choice.decide(
      *invals, dimension_numbers, ctx.fp8, ctx.fp8_products, report.current_name()
    )
    if chosen:
      backward = (fp8_lib.GRADIENTS[ctx.fp8], fp8_lib.FORWARD)
      report.record(name, dims, (fp8_lib.FORWARD,) * 2, backward, True, reason)
      out = fp8_lib.fp8_dot_general(
        *invals,
        dimension_numbers=dimension_numbers,
        recipe=ctx.fp8,
        compute_dtype=c,
        out_dtype=out_dtype(eqn),
      )
      return [out]
  floats = [v for v in invals if interp.is_float(v)]
  if (
    not floats
    or any(interp.is_complex(v) for v in floats)
    or any(interp.dtype_of(v).itemsize == 1 for v in floats)
  ):
    if not tangent:
      written = tuple(interp.dtype_of(v) for v in invals)
      report.record(name, dims, written, written, False, "as written")
    return interp.as_written(ctx, eqn, invals)
  c = operand_dtype(eqn, invals, c)
  if not tangent:
    report.record(name, dims, (c, c), (c, c), False, reason)
  params = dict(eqn.params)
  if isinstance(params.get("precision"), (lax.DotAlgorithm, lax.DotAlgorithmPreset)):
    # An algorithm fixes the input types (XLA would cast ours back): drop it.
    params["precision"] = None
  ops = [interp.compute_copy(v, c) if interp.is_float(v) else v for v in invals]
  # Read only by products (`plan.plan`): written in the dtype they read it in.
  result = c if interp.writes_narrow(eqn) else out_dtype(eqn)
  if c.itemsize >= 4:
    return [eqn.primitive.bind(*ops, **{**params, "preferred_element_type": result})]
  if tangent:  # a custom_jvp rule's tangent: linear, a 16-bit product as `_product`'s own
    out = eqn.primitive.bind(*ops, **{**params, "preferred_element_type": c})
    return [interp.cast(out, result)]
  try:
    key = tuple(sorted(params.items()))
    hash(key)
  except TypeError:  # an unhashable parameter: build the product uncached
    return [_product.__wrapped__(eqn.primitive, tuple(params.items()), c, result)(*ops)]
  return [_product(eqn.primitive, key, c, result)(*ops)]


@functools.lru_cache(maxsize=1024)
def _product(
  primitive: Any, items: tuple[tuple[str, Any], ...], c: np.dtype, result: np.dtype
) -> Callable[..., Any]:
  """`primitive` on compute-dtype operands: float32 accumulation forward, 16-bit backward."""
  params = dict(items)

  def product(*ops: Any, preferred: Any, fence: bool = True) -> Any:
    dims = params.get("dimension_numbers")
    if fence and primitive.name == "dot_general" and _refused_on_cpu(*ops, dims):
      return _fenced_dot(*ops, params, preferred)
    return primitive.bind(*ops, **{**params, "preferred_element_type": preferred})

  @jax.custom_jvp
  def f(*ops: Any) -> Any:
    return interp.cast(product(*ops, preferred=np.float32), result)

  def f_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    out = interp.cast(product(*primals, preferred=np.float32), result)
    terms = [
      product(*primals[:i], t, *primals[i + 1 :], preferred=c, fence=False)
      for i, t in enumerate(tangents)
      if interp.is_float(primals[i]) and not isinstance(t, jax.custom_derivatives.SymbolicZero)
    ]
    tangent = functools.reduce(operator.add, terms) if terms else jnp.zeros_like(out)
    return out, interp.cast(tangent, result)

  f.defjvp(f_jvp, symbolic_zeros=True)

  def autocast_product(*ops: Any) -> Any:
    return f(*ops)

  return jax.jit(autocast_product)


# -- a form the CPU backend compiles but cannot run.


def _refused_on_cpu(lhs: Any, rhs: Any, dims: Any) -> bool:
  """Whether XLA's CPU backend would compile this bfloat16 product into one it cannot run.

  XLA 0.10.2 on the CPU keeps a bfloat16 product for its YNNPACK kernels and
  upcasts the others; a product whose lhs is contracted on a leading
  dimension and whose rhs has several free dimensions (or is not in
  batch, contracting, free order) is kept, then rewritten into a form the
  library does not take, and fails at run time ("Unsupported element type
  for DotThunk::Execute: BF16 x BF16 = F32"; e3nn-jax's tensor products and
  linear layers are such products). Any other product, and any product in
  float16, runs as written.
  """
  if jax.default_backend() != "cpu":
    return False
  if not all(interp.dtype_of(v) == jnp.bfloat16 for v in (lhs, rhs)):
    return False
  (lc, rc), (lb, rb) = dims
  lf = [d for d in range(np.ndim(lhs)) if d not in lc and d not in lb]
  rf = [d for d in range(np.ndim(rhs)) if d not in rc and d not in rb]
  lhs_canonical = [*lb, *lf, *lc] == list(range(np.ndim(lhs)))
  rhs_canonical = [*rb, *rc, *rf] == list(range(np.ndim(rhs))) and len(rf) <= 1
  return not lhs_canonical and not rhs_canonical


def _fenced_dot(lhs: Any, rhs: Any, params: dict[str, Any], preferred: Any) -> Any:
  """The same product as `[batch, m, k] @ [batch, k, n]`, its operands behind a barrier.

  XLA folds a transpose or reshape into the product it feeds, which would
  give back the form `_refused_on_cpu` avoids; the optimization barrier
  keeps the canonical operands (a copy of each, on the CPU only).
  """
  (lc, rc), (lb, rb) = params["dimension_numbers"]
  lf = [d for d in range(np.ndim(lhs)) if d not in lc and d not in lb]
  rf = [d for d in range(np.ndim(rhs)) if d not in rc and d not in rb]
  size = lambda x, ds: int(np.prod([np.shape(x)[d] for d in ds], dtype=np.int64))
  b, m, k, n = size(lhs, lb), size(lhs, lf), size(lhs, lc), size(rhs, rf)
  a = lax.reshape(lhs, (b, m, k), dimensions=(*lb, *lf, *lc))
  c = lax.reshape(rhs, (b, k, n), dimensions=(*rb, *rc, *rf))
  a, c = lax.optimization_barrier((a, c))
  out = lax.dot_general(
    a, c, (((2,), (1,)), ((0,), (0,))), precision=params.get("precision"),
    preferred_element_type=preferred,
  )  # fmt: skip
  shape = [np.shape(lhs)[d] for d in (*lb, *lf)] + [np.shape(rhs)[d] for d in rf]
  return lax.reshape(out, tuple(shape))
