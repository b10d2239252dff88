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
writes it in the compute dtype instead (`regions.plan` finds them): its
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

  With `autocast(..., fp8=recipe)`, an eligible `dot_general` runs on fp8
  operands instead (`fp8`).
  """
  c = ctx.compute_dtype
  tangent = interp.any_tangent(invals)
  if ctx.fp8 is not None and eqn.primitive.name == "dot_general" and not tangent:
    dims = eqn.params["dimension_numbers"]
    if fp8_lib.eligible(*invals, dims, recipe=ctx.fp8):
      out = fp8_lib.fp8_dot_general(
        *invals, dimension_numbers=dims, recipe=ctx.fp8, compute_dtype=c, out_dtype=out_dtype(eqn)
      )
      return [out]
  floats = [v for v in invals if interp.is_float(v)]
  if not floats or any(interp.is_complex(v) for v in floats):
    return interp.as_written(ctx, eqn, invals)
  if any(interp.dtype_of(v).itemsize == 1 for v in floats):
    return interp.as_written(ctx, eqn, invals)
  params = dict(eqn.params)
  if isinstance(params.get("precision"), (lax.DotAlgorithm, lax.DotAlgorithmPreset)):
    # An algorithm fixes the input types (XLA would cast ours back): drop it.
    params["precision"] = None
  c = operand_dtype(eqn, invals, c)
  ops = [interp.compute_copy(v, c) if interp.is_float(v) else v for v in invals]
  # Read only by products (`regions.plan`): written in the dtype they read it in.
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

  def product(*ops: Any, preferred: Any) -> Any:
    return primitive.bind(*ops, **{**params, "preferred_element_type": preferred})

  @jax.custom_jvp
  def f(*ops: Any) -> Any:
    return interp.cast(product(*ops, preferred=np.float32), result)

  def f_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    out = interp.cast(product(*primals, preferred=np.float32), result)
    terms = [
      product(*primals[:i], t, *primals[i + 1 :], preferred=c)
      for i, t in enumerate(tangents)
      if interp.is_float(primals[i]) and not isinstance(t, jax.custom_derivatives.SymbolicZero)
    ]
    tangent = functools.reduce(operator.add, terms) if terms else jnp.zeros_like(out)
    return out, interp.cast(tangent, result)

  f.defjvp(f_jvp, symbolic_zeros=True)

  def autocast_product(*ops: Any) -> Any:
    return f(*ops)

  return jax.jit(autocast_product)
