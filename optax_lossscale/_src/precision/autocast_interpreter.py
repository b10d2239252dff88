"""The interpreter behind `autocast`: one loop over a jaxpr, a rule per primitive.

Each equation is re-bound on the values the interpreter holds, which may have
other floating dtypes than the jaxpr declares (a float32 program now fed
float16 activations). A rule decides the dtypes of the equation's floating
inputs, then binds the primitive with its parameters as written:

  compute      matrix products and convolutions: inputs in the compute dtype,
               accumulated in float32 (forward and backward, see `_matmul`)
  float32      overflow- and precision-prone ops: inputs promoted to >= float32
  widest       everything else: inputs promoted to their widest floating dtype
  as_written   ops whose parameters fix their dtypes (bitcasts, callbacks,
               custom_vjp kernels): inputs cast back to the declared dtypes
  independent  ops whose operands do not meet (collectives, sort): as they are

Primitives that hold jaxprs (jit, scan, cond, ...) have rules of their own in
`autocast_control`; the table that names every known primitive is in
`autocast_rules`. Integer, boolean and key values are never cast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import functools
import operator
from typing import Any

import jax
from jax import lax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.precision import fp8_product  # fp8 hook
from optax_lossscale._src.utils import compat

# `(ctx, eqn, invals) -> outvals` (a list, also for single-result primitives).
Rule = Callable[["Context", Any, list[Any]], list[Any]]


class UnknownPrimitiveError(NotImplementedError):
  """`autocast` met a primitive it has no rule for; the message names it.

  Raised when the function is traced, never as a silent float32 fallback.
  `autocast(fun, policy, rules={name: kind})` gives the primitive a rule.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> halve_p = jax.extend.core.Primitive('halve')
    >>> _ = halve_p.def_impl(lambda x: x / 2)
    >>> _ = halve_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    >>> f = lambda x: halve_p.bind(x @ x)
    >>> try:
    ...   ols.autocast(f, 'c=f16')(jnp.ones((2, 2)))
    ... except ols.UnknownPrimitiveError as e:
    ...   print(str(e).split(',')[0])
    autocast has no rule for the primitive 'halve'
    >>> ols.autocast(f, 'c=f16', rules={'halve': 'widest'})(jnp.ones((2, 2))).dtype
    dtype('float16')
  """


@dataclasses.dataclass(frozen=True)
class Context:
  """What the rules need: the compute dtype, the table of rules and the fp8 recipe (or None)."""

  compute_dtype: np.dtype
  rules: Mapping[str, Rule]
  fp8: str | None = None  # fp8 hook: 'tensorwise', 'rowwise' or None

  def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates an open `jaxpr` with the rules."""
    return eval_jaxpr(self, jaxpr, consts, args)

  def eval_closed(self, closed: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates a `ClosedJaxpr` with the rules."""
    return eval_jaxpr(self, closed.jaxpr, closed.consts, args)


def eval_jaxpr(ctx: Context, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """The interpreter loop: `jax.core.eval_jaxpr` with a rule per equation."""
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    if isinstance(v, jex.core.Literal):  # a NumPy constant of the declared dtype
      return np.asarray(v.val, v.aval.dtype) if _is_plain(v.aval.dtype) else v.val
    return env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    rule = ctx.rules.get(eqn.primitive.name)
    if rule is None:
      raise UnknownPrimitiveError(
        f"autocast has no rule for the primitive {eqn.primitive.name!r}, so it cannot tell"
        " which dtype it must run in. Tell it with autocast(fun, policy, rules="
        f"{{{eqn.primitive.name!r}: kind}}), kind one of {sorted(KINDS)}: 'as_written'"
        " runs it on the dtypes the function declares (right for typed kernels)."
      )
    with compat.eqn_context(eqn):
      outs = rule(ctx, eqn, [read(v) for v in eqn.invars])
    env.update(zip(eqn.outvars, outs, strict=True))  # dropped outputs too, as JAX does
  return [read(v) for v in jaxpr.outvars]


# -- dtypes of the values the interpreter holds.


def _is_plain(dtype: Any) -> bool:
  """A NumPy dtype, not an extended one (PRNG keys)."""
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def dtype_of(value: Any) -> Any:
  dtype = getattr(value, "dtype", None)
  return np.result_type(value) if dtype is None else dtype


def is_float(value: Any) -> bool:
  """Floating or complex (never an extended dtype such as a PRNG key's)."""
  dtype = dtype_of(value)
  return _is_plain(dtype) and jnp.issubdtype(dtype, jnp.inexact)


def cast(value: Any, dtype: Any) -> Any:
  """`value` as `dtype`; the same object when it already is."""
  if not is_float(value) or dtype_of(value) == np.dtype(dtype):
    return value
  return lax.convert_element_type(value, dtype)


def cast_all(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
  return [cast(v, d) for v, d in zip(values, dtypes, strict=True)]


def _is_scalar_constant(var: Any) -> bool:
  """A literal of the jaxpr: a Python or NumPy number of the function, e.g. `0.5` in `x * 0.5`."""
  return isinstance(var, jex.core.Literal) and not np.shape(var.val)


def _fits(value: Any, dtype: np.dtype) -> bool:
  """Whether a real constant keeps its magnitude in `dtype` (inf and NaN fit anywhere)."""
  value = np.asarray(value)
  if np.iscomplexobj(value) or not np.isfinite(value):
    return not np.iscomplexobj(value) or jnp.issubdtype(dtype, jnp.complexfloating)
  return bool(abs(value) <= jnp.finfo(dtype).max)


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
  """Binds `eqn`'s primitive with its parameters as written, on `invals`."""
  subfuns, params = compat.bind_params(eqn)
  out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def widest_float(eqn: Any, invals: Sequence[Any], floor: Any = None) -> np.dtype | None:
  """The dtype the floating inputs meet in; scalar constants yield where they fit.

  JAX has already promoted a Python number to its partner's dtype when it
  traced the function (`x * 0.5` holds a float32 `0.5` for a float32 `x`).
  Such a constant yields to the other inputs' dtype when its value fits
  there, as a Python number would, so `x * 0.5` stays in `x`'s float16; one
  that would overflow (`-1e9` in float16) keeps its dtype. `floor` is a
  minimum (float32 for the float32 rule).
  """
  inputs = [(var, dtype_of(v)) for v, var in zip(invals, eqn.invars, strict=True) if is_float(v)]
  if not inputs:
    return None
  others = [d for var, d in inputs if not _is_scalar_constant(var)]
  if floor is not None:
    others.append(np.dtype(floor))
  target = functools.reduce(jnp.promote_types, others) if others else None
  for var, dtype in inputs:
    if _is_scalar_constant(var) and (target is None or not _fits(var.val, target)):
      target = dtype if target is None else jnp.promote_types(target, dtype)
  return np.dtype(target)


# -- the first-order rules.


def widest(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  target = widest_float(eqn, invals)
  return bind(eqn, [cast(v, target) if is_float(v) else v for v in invals])


def float32(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  target = widest_float(eqn, invals, floor=np.float32)
  return bind(eqn, [cast(v, target) if is_float(v) else v for v in invals])


def as_written(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  return bind(eqn, [cast(v, var.aval.dtype) for v, var in zip(invals, eqn.invars, strict=True)])


def independent(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  return bind(eqn, invals)


def reciprocal_in_float32(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`div`: `1 / x` (a constant numerator) in float32, as torch's `__rdiv__`."""
  if _is_scalar_constant(eqn.invars[0]):
    return float32(ctx, eqn, invals)
  return widest(ctx, eqn, invals)


def compute(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """Matrix products and convolutions: floating inputs in the compute dtype.

  fp8 inputs are the function's own choice (an fp8 layer quantizes its
  operands and says how to accumulate): such a product is left as written.
  """
  if ctx.fp8 is not None and eqn.primitive.name == "dot_general":  # fp8 hook
    dims, c = eqn.params["dimension_numbers"], ctx.compute_dtype  # fp8 hook
    if fp8_product.eligible(*invals, dims, recipe=ctx.fp8):  # fp8 hook
      out = fp8_product.fp8_dot_general(  # fp8 hook
        *invals, dimension_numbers=dims, recipe=ctx.fp8, compute_dtype=c, out_dtype=c
      )  # fp8 hook
      return [out]  # fp8 hook
  floats = [v for v in invals if is_float(v)]
  if not floats:
    return bind(eqn, invals)
  if any(dtype_of(v).itemsize == 1 for v in floats):
    return as_written(ctx, eqn, invals)
  c = ctx.compute_dtype
  params = dict(eqn.params)
  if isinstance(params.get("precision"), (lax.DotAlgorithm, lax.DotAlgorithmPreset)):
    # An algorithm fixes the input types (XLA would cast ours back): drop it.
    params["precision"] = None
  ops = [cast(v, c) for v in invals]
  if c.itemsize >= 4:
    return [eqn.primitive.bind(*ops, **{**params, "preferred_element_type": c})]
  try:
    key = tuple(sorted(params.items()))
    hash(key)
  except TypeError:  # an unhashable parameter: build the product uncached
    return [_matmul.__wrapped__(eqn.primitive, tuple(params.items()), c)(*ops)]
  return [_matmul(eqn.primitive, key, c)(*ops)]


@functools.lru_cache(maxsize=512)
def _matmul(primitive: Any, items: tuple[tuple[str, Any], ...], c: np.dtype) -> Callable[..., Any]:
  """`primitive` on compute-dtype inputs, accumulated in float32, as a `custom_jvp`.

  Forward: the product with `preferred_element_type=float32`, rounded to the
  compute dtype. Bound plainly, JAX would transpose that float32 product into
  backward products that take the float32 cotangent (and so run in float32).
  Here the tangent rule is the product itself on compute-dtype operands
  (bilinear: one product per nonzero tangent), whose transposes, the backward
  pass, take the compute-dtype cotangent: every matrix product of a training
  step runs on compute-dtype inputs. The backward products accumulate as the
  backend accumulates compute-dtype products (float32 on CPU, GPU and TPU
  matrix units; checked on CPU in `tests/test_autocast.py`).
  """

  params = dict(items)

  def product(*ops: Any, preferred: Any) -> Any:
    return primitive.bind(*ops, **{**params, "preferred_element_type": preferred})

  @jax.custom_jvp
  def f(*ops: Any) -> Any:
    return lax.convert_element_type(product(*ops, preferred=np.float32), c)

  def f_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    out = f(*primals)
    terms = [
      product(*primals[:i], t, *primals[i + 1 :], preferred=c)
      for i, t in enumerate(tangents)
      if is_float(primals[i]) and not isinstance(t, jax.custom_derivatives.SymbolicZero)
    ]
    return out, functools.reduce(operator.add, terms) if terms else jnp.zeros_like(out)

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f


KINDS: dict[str, Rule] = {
  "compute": compute,
  "float32": float32,
  "widest": widest,
  "as_written": as_written,
  "independent": independent,
}
