"""The interpreter behind `autocast`: the first-order rules and what the loop shares.

Each equation is re-bound on the values the interpreter holds, which may have
other floating dtypes than the jaxpr declares (a float32 program whose
products now take 16-bit operands). A rule decides the dtypes of the
equation's floating inputs, then binds the primitive with its parameters as
written:

  compute      matrix products and convolutions: operands in the compute
               dtype, float32 accumulation and result (`products`)
  float32      arithmetic: inputs promoted to at least float32
  widest       exact ops (moves, comparisons, max, select): inputs promoted to
               their widest floating dtype, so 16-bit values stay 16-bit
  as_written   ops whose parameters fix their dtypes (bitcasts, callbacks,
               typed kernels): inputs cast back to the declared dtypes
  independent  ops whose operands do not meet (collectives, sort): as they are

The loop (`loop`) groups consecutive float32 and widest equations
into regions (`regions`): the backward pass keeps only their 16-bit
inputs, as a fused kernel does. Primitives that hold jaxprs (jit, scan, cond, ...) have
rules of their own in `control`; the table that names every known
primitive is in `rules`. Integer, boolean and key values are never
cast, and complex values never become real.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import contextlib
import contextvars
import dataclasses
import enum
import functools
import threading
from typing import Any
import warnings

import jax
from jax import lax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.utils import compat

# `(ctx, eqn, invals) -> outvals` (a list, also for single-result primitives).
Rule = Callable[["Context", Any, list[Any]], list[Any]]


class UnknownPrimitiveError(NotImplementedError):
  """`autocast` met a primitive it has no rule for; the message names it.

  Raised when the function is traced, under `autocast(...,
  unknown_primitives='error')`; by default such a primitive runs as written
  and `autocast` warns once. `autocast(fun, policy, rules={name: kind})`
  gives the primitive a rule.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> halve_p = jax.extend.core.Primitive('halve')
    >>> _ = halve_p.def_impl(lambda x: x / 2)
    >>> _ = halve_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    >>> f = lambda x: halve_p.bind((x @ x).astype(jnp.float16))
    >>> try:
    ...   ols.autocast(f, 'c=f16', unknown_primitives='error')(jnp.ones((2, 2)))
    ... except ols.UnknownPrimitiveError as e:
    ...   print(str(e).split(',')[0])
    autocast has no rule for the primitive 'halve'
    >>> ols.autocast(f, 'c=f16', rules={'halve': 'widest'})(jnp.ones((2, 2))).dtype
    dtype('float16')
  """


# What a primitive without a rule does: run as written and warn once, or raise.
UNKNOWN_PRIMITIVES = ("warn", "error")

_RULE_ADVICE = (
  " Give it one with autocast(fun, policy, rules={{{name!r}: kind}}):"
  " 'widest' runs it on its inputs' widest floating dtype, so 16-bit work stays in 16"
  " bits (right for an elementwise or data-movement kernel that accepts any float);"
  " 'float32' promotes its inputs to float32 (right for an overflow-prone op);"
  " 'as_written' casts its inputs back to the dtypes the function declares, float32"
  " for a float32 function (right for a typed kernel, but it runs 16-bit work in"
  " float32); 'independent' and 'compute' are the other kinds ({kinds})."
)


def unknown_primitive(name: str) -> UnknownPrimitiveError:
  return UnknownPrimitiveError(
    f"autocast has no rule for the primitive {name!r}, so it cannot tell which dtype it"
    " must run in (unknown_primitives='error')."
    + _RULE_ADVICE.format(name=name, kinds=list(KIND_NAMES))
  )


# The primitives already warned about: one warning per primitive per process.
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def rule_of(ctx: Context, name: str) -> Rule:
  """The rule of the primitive `name`; without one, `as_written` (with a warning) or an error.

  Running an unknown primitive as written (its inputs cast back to the
  dtypes the function declares, its outputs as it returns them) is never
  wrong, only slower: its inputs are what the function as written gives it,
  whatever the primitive does (a bitcast reads bits of a declared width, a
  typed kernel wants its dtypes). Any other guess (float32 inputs, the
  widest dtype) can be silently wrong.
  """
  rule = ctx.rules.get(name)
  if rule is not None:
    return rule
  if ctx.unknown_primitives == "error":
    raise unknown_primitive(name)
  with _WARNED_LOCK:
    first = name not in _WARNED
    _WARNED.add(name)
  if first:
    warnings.warn(
      f"autocast has no rule for the primitive {name!r}: it runs as written, on the dtypes"
      " the function declares (float32 for a float32 function), so its work is not in 16"
      f" bits. If it accepts any floating dtype, rules={{{name!r}: 'widest'}} keeps 16-bit"
      f" work in 16 bits; rules={{{name!r}: 'as_written'}} keeps it as it runs now, without"
      " this warning; unknown_primitives='error' raises instead. (Warned once per primitive.)",
      UserWarning,
      stacklevel=2,
    )
  return as_written


class Kind(enum.Enum):
  """What a value is, for deciding what the backward pass may keep in 16 bits.

  GIVEN: an argument of the function or a constant (kept alive by the caller
  anyway: a 16-bit copy would only add memory). STAT: a reduction (a sum, a
  mean, a maximum) and what is computed from reductions alone: kept exact.
  ACT: every other computed value, an activation.
  """

  GIVEN = 0
  STAT = 1
  ACT = 2


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
  """What the rules need: the compute dtype, the table of rules, the fp8 recipe and products.

  Compares and hashes by value, so that two `autocast` wrappers of one policy
  share the interpreter's caches.
  """

  compute_dtype: np.dtype
  rules: Mapping[str, Rule]
  fusible: frozenset[str] = frozenset()
  fp8: str | None = None
  fp8_products: Any = "auto"  # 'auto', 'all' or a callable (compared by identity)
  unknown_primitives: str = "warn"

  @functools.cached_property
  def _key(self) -> tuple[Any, ...]:
    rules = tuple(sorted(self.rules.items()))
    return (
      self.compute_dtype,
      rules,
      self.fusible,
      self.fp8,
      self.fp8_products,
      self.unknown_primitives,
    )

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Context) and self._key == other._key


# The kinds of the values an interpreter loop holds, by the value's identity:
# set by the loop, read by the rules of the primitives holding jaxprs, which
# pass them on to their bodies.
_KINDS: contextvars.ContextVar[dict[int, tuple[Any, Kind]] | None] = contextvars.ContextVar(
  "autocast_kinds", default=None
)
# Each value's copy in the compute dtype, made once (products and regions share it).
_COPIES: contextvars.ContextVar[dict[tuple[int, Any], tuple[Any, Any]] | None] = (
  contextvars.ContextVar("autocast_copies", default=None)
)


# How many times the values of the running loop are kept (a scan's length: its
# backward pass keeps every step's residuals, stacked).
_REPEATS: contextvars.ContextVar[int] = contextvars.ContextVar("autocast_repeats", default=1)


def repeats() -> int:
  return _REPEATS.get()


@contextlib.contextmanager
def repeated(times: int) -> Any:
  """Evaluates bodies whose residuals the backward pass keeps `times` over (a scan's)."""
  token = _REPEATS.set(_REPEATS.get() * max(int(times), 1))
  try:
    yield
  finally:
    _REPEATS.reset(token)


# Set while a region's body is evaluated: no region inside a region.
_IN_REGION: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "autocast_in_region", default=False
)


def in_region() -> bool:
  return _IN_REGION.get()


# The values of a `custom_jvp` rule being evaluated that are linear in its
# tangent inputs, by identity (the loop marks what it computes from them): a
# product on one is the tangent rule's own 16-bit product, not a product
# differentiable in its turn (which JAX would transpose through its float32
# primal, taking the float32 cotangent).
_TANGENTS: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
  "autocast_tangents", default=None
)


@contextlib.contextmanager
def tangents_scope(tangents: Sequence[Any]) -> Any:
  """Evaluates a `custom_jvp` rule whose tangent inputs are `tangents`."""
  token = _TANGENTS.set({id(t): t for t in tangents})
  try:
    yield
  finally:
    _TANGENTS.reset(token)


def any_tangent(values: Sequence[Any]) -> bool:
  """Whether any of `values` is linear in the tangents of the rule being evaluated."""
  memo = _TANGENTS.get()
  return memo is not None and any(memo.get(id(v)) is v for v in values)


def mark_tangents(invals: Sequence[Any], outs: Sequence[Any]) -> None:
  """Marks `outs` as tangents when computed from one (within a rule; else nothing)."""
  memo = _TANGENTS.get()
  if memo is not None and any(memo.get(id(v)) is v for v in invals):
    memo.update((id(o), o) for o in outs)


# The products of the running loop whose outputs only products read (by the
# equation's identity, `plan.plan`): written in the compute dtype.
_NARROW: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
  "autocast_narrow", default=frozenset()
)


@contextlib.contextmanager
def narrow_scope(eqn_ids: frozenset[int]) -> Any:
  """Evaluates a loop whose products `eqn_ids` write their outputs in the compute dtype."""
  token = _NARROW.set(eqn_ids)
  try:
    yield
  finally:
    _NARROW.reset(token)


def writes_narrow(eqn: Any) -> bool:
  """Whether the product `eqn` writes its output in the compute dtype (only products read it)."""
  return id(eqn) in _NARROW.get()


@contextlib.contextmanager
def scope() -> Any:
  """One top-level evaluation: the memo of value kinds and of the cached calls met."""
  kinds = _KINDS.set({})
  met = _MET.set(set())
  try:
    yield
  finally:
    _KINDS.reset(kinds)
    _MET.reset(met)


# The cache keys of the calls (regions) the running top-level evaluation has met.
_MET: contextvars.ContextVar[set[Any] | None] = contextvars.ContextVar("autocast_met", default=None)


def met_before(key: Any) -> bool:
  """Whether this top-level evaluation has met `key` before (and notes it met now)."""
  met = _MET.get()
  if met is None:
    return False
  if key in met:
    return True
  met.add(key)
  return False


@contextlib.contextmanager
def copies_scope() -> Any:
  """A fresh memo of compute-dtype copies (one per loop: a body is another trace)."""
  token = _COPIES.set({})
  try:
    yield
  finally:
    _COPIES.reset(token)


def kind_of(value: Any) -> Kind:
  """The kind the running loop gave `value` (ACT when unknown)."""
  memo = _KINDS.get()
  entry = None if memo is None else memo.get(id(value))
  return entry[1] if entry is not None and entry[0] is value else Kind.ACT


def remember_kind(value: Any, kind: Kind) -> None:
  memo = _KINDS.get()
  if memo is not None and kind is not Kind.ACT:
    memo[id(value)] = (value, kind)


def eval_flat(ctx: Context, eqns: Sequence[Any], invars: Sequence[Any], outvars: Sequence[Any],
              args: Sequence[Any]) -> list[Any]:  # fmt: skip
  """Evaluates `eqns` one by one with their rules (a region's body: no regions inside)."""
  env: dict[Any, Any] = dict(zip(invars, args, strict=True))
  read = lambda v: literal(v) if isinstance(v, jex.core.Literal) else env[v]
  token = _IN_REGION.set(True)
  try:
    for eqn in eqns:
      rule = rule_of(ctx, eqn.primitive.name)
      with compat.eqn_context(eqn, names=False):
        outs = rule(ctx, eqn, [read(v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs, strict=True))
  finally:
    _IN_REGION.reset(token)
  return [read(v) for v in outvars]


def literal(v: Any) -> Any:
  """A jaxpr literal as a NumPy constant of its declared dtype (a key literal as it is).

  In a region's forward pass (`constants_apart`), a floating scalar comes
  through an optimization barrier, so that XLA does not merge it with the
  same constant of the backward pass (see `regions`).
  """
  if not is_plain(v.aval.dtype):
    return v.val
  value = np.asarray(v.val, v.aval.dtype)
  if _APART.get() and not value.ndim and jnp.issubdtype(value.dtype, jnp.floating):
    return lax.optimization_barrier(value)
  return value


# Set while a region's forward pass is traced: its scalar constants are its own.
_APART: contextvars.ContextVar[bool] = contextvars.ContextVar("autocast_apart", default=False)


@contextlib.contextmanager
def constants_apart() -> Any:
  """Traces a region's forward pass, its floating scalar constants kept from XLA's CSE."""
  token = _APART.set(True)
  try:
    yield
  finally:
    _APART.reset(token)


# -- dtypes of the values the interpreter holds.


def is_plain(dtype: Any) -> bool:
  """A NumPy dtype, not an extended one (PRNG keys)."""
  return _classes(dtype)[0]


@functools.lru_cache(maxsize=256)
def _classes(dtype: Any) -> tuple[bool, bool, bool]:
  """Whether `dtype` is plain (not extended), and then floating, complex; asked for
  every value the interpreter reads, answered once per dtype."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return False, False, False
  return (
    True,
    bool(jnp.issubdtype(dtype, jnp.floating)),
    bool(jnp.issubdtype(dtype, jnp.complexfloating)),
  )


def dtype_of(value: Any) -> Any:
  # A tracer's aval is an attribute (or one property call), where its `dtype` is a
  # property reading the aval: asked of every value the interpreter reads.
  dtype = getattr(getattr(value, "aval", None), "dtype", None)
  if dtype is None:
    dtype = getattr(value, "dtype", None)
  return np.result_type(value) if dtype is None else dtype


def is_inexact_dtype(dtype: Any) -> bool:
  """`dtype` floating or complex (never an extended dtype such as a PRNG key's)."""
  _, floating, complex_ = _classes(dtype)
  return floating or complex_


def is_float(value: Any) -> bool:
  """Floating or complex (never an extended dtype such as a PRNG key's)."""
  return is_inexact_dtype(dtype_of(value))


def is_real_float(value: Any) -> bool:
  return _classes(dtype_of(value))[1]


def is_complex(value: Any) -> bool:
  return _classes(dtype_of(value))[2]


def cast(value: Any, dtype: Any) -> Any:
  """`value` as `dtype`; the same object when it already is.

  Complex values never become real: a complex value asked to become a real
  dtype becomes the complex dtype at least as wide (complex64 for float16).
  """
  current = dtype_of(value)
  _, floating, complex_ = _classes(current)
  if not (floating or complex_):
    return value
  dtype = np.dtype(dtype)
  if complex_ and not jnp.issubdtype(dtype, jnp.complexfloating):
    dtype = np.dtype(jnp.promote_types(dtype, np.complex64))
  if current == dtype:
    return value
  return lax.convert_element_type(value, dtype)


def cast_all(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
  return [cast(v, d) for v, d in zip(values, dtypes, strict=True)]


def compute_copy(value: Any, dtype: Any) -> Any:
  """`value` in the compute dtype, converted once per value (products and regions share it)."""
  memo = _COPIES.get()
  if memo is None or not is_real_float(value) or dtype_of(value) == np.dtype(dtype):
    return cast(value, dtype)
  key = (id(value), np.dtype(dtype))
  entry = memo.get(key)
  if entry is not None and entry[0] is value:
    return entry[1]
  copy = cast(value, dtype)
  memo[key] = (value, copy)
  return copy


def is_scalar_constant(var: Any) -> bool:
  """A literal of the jaxpr: a Python or NumPy number of the function, e.g. `0.5` in `x * 0.5`."""
  return isinstance(var, jex.core.Literal) and not np.shape(var.val)


def fits(value: Any, dtype: np.dtype) -> bool:
  """Whether a real constant keeps its magnitude in `dtype` (inf and NaN fit anywhere)."""
  value = np.asarray(value)
  if np.iscomplexobj(value) or not np.all(np.isfinite(value)):
    return not np.iscomplexobj(value) or jnp.issubdtype(dtype, jnp.complexfloating)
  return bool(np.all(abs(value) <= jnp.finfo(dtype).max))


def bind(eqn: Any, invals: Sequence[Any], **overrides: Any) -> list[Any]:
  """Binds `eqn`'s primitive with its parameters as written (and `overrides`), on `invals`."""
  subfuns, params = compat.bind_params(eqn)
  out = eqn.primitive.bind(*subfuns, *invals, **{**params, **overrides})
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
  others = [d for var, d in inputs if not is_scalar_constant(var)]
  if floor is not None:
    others.append(np.dtype(floor))
  target = functools.reduce(jnp.promote_types, others) if others else None
  for var, dtype in inputs:
    if is_scalar_constant(var) and (target is None or not fits(var.val, target)):
      target = dtype if target is None else jnp.promote_types(target, dtype)
  # A constant held in the parameters (gather's fill value) must fit too.
  fill = eqn.params.get("fill_value")
  if fill is not None and target is not None and not fits(fill, np.dtype(target)):
    target = jnp.promote_types(target, np.float32)
  return np.dtype(target)


def _cast_floats(invals: Sequence[Any], target: np.dtype | None) -> list[Any]:
  return [cast(v, target) if is_float(v) and target is not None else v for v in invals]


# -- the first-order rules.


def widest(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  return bind(eqn, _cast_floats(invals, widest_float(eqn, invals)))


def float32(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  return bind(eqn, _cast_floats(invals, widest_float(eqn, invals, floor=np.float32)))


def as_written(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  return bind(eqn, [cast(v, var.aval.dtype) for v, var in zip(invals, eqn.invars, strict=True)])


def independent(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
  del ctx
  return bind(eqn, invals)


# The kinds a user may name in `autocast(..., rules=)` ('compute' is `products`').
KIND_NAMES = ("as_written", "compute", "float32", "independent", "widest")
