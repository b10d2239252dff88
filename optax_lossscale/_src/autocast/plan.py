"""The plan of a jaxpr: what `autocast` will do with each equation, decided before it runs.

Planning reads only the jaxpr (its equations, avals and name stacks) and the
interpreter's context, never a traced value, and its result is cached by the
jaxpr's identity, so a body met again (24 identical blocks, a re-trace) is
planned once. The run (`loop`, `regions`, the rules) reads a plan and never
writes one back:

  steps     each maximal run of consecutive float32/widest equations as one
            `Region`, every other equation as a `Step` run by its rule
  kinds     each variable's kind: GIVEN (the caller's arrays), ACT
            (activations), STAT (reductions and what follows from them alone)
  narrow    the products whose output only products read, written in the
            compute dtype (`products.compute` reads it)

Inside a `custom_jvp` rule, `split_at_tangents` cuts a region into its
primal and tangent parts (jax >= 0.11 refuses a rule whose primal outputs
depend on its tangents).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import threading
from typing import Any
import weakref

import jax.extend as jex
import numpy as np

from optax_lossscale._src.autocast import interpreter as interp
from optax_lossscale._src.autocast import products, structure
from optax_lossscale._src.utils import compat

Kind = interp.Kind

# The reductions: their outputs are statistics.
REDUCTIONS = frozenset({
  "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
  "reduce_xor", "argmax", "argmin",
})  # fmt: skip

# Equations whose JVP needs no primal value but integer indices (with products
# and quotients by constants, `_keeps_values`): a run of only these keeps
# nothing floating for the backward pass, so it needs no region.
LINEAR = frozenset({
  "add", "add_any", "sub", "neg", "reshape", "transpose", "broadcast_in_dim", "squeeze",
  "expand_dims", "convert_element_type", "slice", "concatenate", "pad", "rev", "copy",
  "copy_p", "reduce_sum", "dynamic_slice", "gather", "real", "imag", "conj", "complex",
  "split", "stop_gradient", "iota", "select_n", "eq", "ne", "lt", "gt", "le", "ge",
  "and", "or", "not", "xor",
})  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """One equation run by its rule."""

  eqn: Any

  @property
  def invars(self) -> Sequence[Any]:
    return self.eqn.invars

  @property
  def outvars(self) -> Sequence[Any]:
    return self.eqn.outvars


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
  """Consecutive float32/widest equations run as one fused, remat-style call."""

  eqns: tuple[Any, ...]
  invars: tuple[Any, ...]
  outvars: tuple[Any, ...]
  key: Any  # the structure, hashable, or None when it cannot be cached
  name_stack: Any
  wrap: bool  # False: nothing floating is kept for the backward pass, run inline


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  steps: tuple[Step | Region, ...]
  kinds: dict[Any, Kind]
  narrow: frozenset[int] = frozenset()  # the products written in the compute dtype (ids)


_plans: weakref.WeakKeyDictionary[Any, dict[Any, Plan]] = weakref.WeakKeyDictionary()
_fusible_jaxprs: weakref.WeakKeyDictionary[Any, dict[Any, bool]] = weakref.WeakKeyDictionary()
_lock = threading.RLock()


def plan(ctx: interp.Context, jaxpr: Any, in_kinds: tuple[Kind, ...], flat: bool = False) -> Plan:
  """The steps and value kinds of `jaxpr`, cached by its identity; `flat`: no regions."""
  with _lock:
    per_jaxpr = _plans.setdefault(jaxpr, {})
    found = per_jaxpr.get((ctx, in_kinds, flat))
    if found is None:
      found = per_jaxpr[(ctx, in_kinds, flat)] = _plan(ctx, jaxpr, in_kinds, flat)
    return found


def fusible(ctx: interp.Context, eqn: Any) -> bool:
  """Whether `eqn` may join a region: elementwise, movement or reduction work only."""
  name = eqn.primitive.name
  if name in ctx.fusible:
    return not eqn.effects
  if name in _CALLS or name == "custom_jvp_call":
    return not eqn.effects and _fusible_body(ctx, _body(eqn))
  return False


# The calls whose body is the computation (a `custom_jvp_call`'s also has a rule).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _body(eqn: Any) -> Any:
  """The `Jaxpr` a call equation runs."""
  closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return getattr(closed, "jaxpr", closed)


def _fusible_body(ctx: interp.Context, jaxpr: Any) -> bool:
  with _lock:
    per_jaxpr = _fusible_jaxprs.setdefault(jaxpr, {})
    if ctx not in per_jaxpr:
      per_jaxpr[ctx] = all(fusible(ctx, e) for e in jaxpr.eqns)
    return per_jaxpr[ctx]


def _plan(ctx: interp.Context, jaxpr: Any, in_kinds: tuple[Kind, ...], flat: bool) -> Plan:
  kinds = _kinds(ctx, jaxpr, in_kinds)
  if flat or ctx.compute_dtype.itemsize >= 4:  # nothing kept in 16 bits: each eqn by its rule
    return Plan(tuple(Step(e) for e in jaxpr.eqns), kinds)
  last_read: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jex.core.Literal):
        last_read[v] = i
  end = len(jaxpr.eqns)
  for v in jaxpr.outvars:
    if not isinstance(v, jex.core.Literal):
      last_read[v] = end
  steps: list[Step | Region] = []
  run: list[Any] = []

  def close(stop: int) -> None:
    if run:
      steps.append(_region(run, last_read, stop))
      run.clear()

  for i, eqn in enumerate(jaxpr.eqns):
    if fusible(ctx, eqn):
      run.append(eqn)
    else:
      close(i)
      steps.append(Step(eqn))
  close(end)
  return Plan(tuple(steps), kinds, _narrow_products(ctx, jaxpr))


# Exact moves: on a 16-bit value they give the 16-bit rounding of what they give
# on its float32 value.
_MOVES = frozenset({
  "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "copy", "copy_p",
  "slice", "rev",
})  # fmt: skip


def _narrow_products(ctx: interp.Context, jaxpr: Any) -> frozenset[int]:
  """The products whose output only products read, directly or through exact moves.

  A product returns its declared float32 and the product reading it rounds it
  to the compute dtype: writing it in the compute dtype in the first place
  gives the reader the same bits and halves what is written and read (a
  Flax attention's output, read by its output projection). Any other reader
  (arithmetic, a jaxpr output, control flow, an fp8 product) keeps float32.
  """
  if ctx.fp8 is not None:
    return frozenset()
  readers: dict[Any, list[Any]] = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not isinstance(v, jex.core.Literal):
        readers.setdefault(v, []).append(eqn)
  for v in jaxpr.outvars:
    if not isinstance(v, jex.core.Literal):
      readers.setdefault(v, []).append(None)

  def is_product(eqn: Any) -> bool:
    floats = [v.aval.dtype for v in eqn.invars if interp.is_float(v.aval)]
    return (
      ctx.rules.get(eqn.primitive.name) is products.compute
      and len(eqn.outvars) == 1
      and bool(floats)
      and all(interp.is_real_float(d) and np.dtype(d).itemsize >= 4 for d in floats)
    )

  def read_in_16_bits(v: Any) -> bool:
    found = readers.get(v)
    return bool(found) and all(
      e is not None
      and (
        is_product(e)
        or (
          e.primitive.name in _MOVES
          and ctx.rules.get(e.primitive.name) is interp.widest
          and read_in_16_bits(e.outvars[0])
        )
      )
      for e in found
    )

  return frozenset(
    id(e) for e in jaxpr.eqns
    if is_product(e) and np.dtype(e.outvars[0].aval.dtype).itemsize > ctx.compute_dtype.itemsize
    and read_in_16_bits(e.outvars[0])
  )  # fmt: skip


def _region(eqns: Sequence[Any], last_read: dict[Any, int], stop: int) -> Region:
  defined: set[Any] = set()
  invars: list[Any] = []
  seen: set[Any] = set()
  for eqn in eqns:
    for v in eqn.invars:
      if not isinstance(v, jex.core.Literal) and v not in defined and v not in seen:
        seen.add(v)
        invars.append(v)
    defined.update(eqn.outvars)
  outvars = tuple(
    v for e in eqns for v in e.outvars if not compat.is_drop_var(v)
    and last_read.get(v, -1) >= stop
  )  # fmt: skip
  floating = any(interp.is_float(v.aval) for v in outvars if hasattr(v.aval, "dtype"))
  wrap = floating and _keeps_values(eqns, invars)
  stacks = [e.source_info.name_stack for e in eqns]
  return Region(
    tuple(eqns),
    tuple(invars),
    outvars,
    structure.run_key(eqns, invars, outvars) if wrap else None,  # only wrapped runs are cached
    _common(stacks),
    wrap,
  )


def _keeps_values(eqns: Sequence[Any], invars: Sequence[Any]) -> bool:
  """Whether JAX's reverse mode of `eqns` would keep a value computed from `invars`.

  Only then is a region worth its call: a run that is linear in what it reads
  (additions, moves, products and quotients by scalar constants: an
  attention's `(q + b) / sqrt(d)`, an embedding's gather, also in a `jit`)
  keeps nothing of its inputs but integer indices, its backward pass reads
  the cotangents, and run inline it keeps what it would keep wrapped, without
  a custom rule and a checkpoint to trace. A factor computed from an input (a
  mask from token ids) is a value kept: a region keeps the ids instead. So is
  a full-size constant factor (a causal mask from `iota`): JAX would keep it
  in float32, a region recomputes it. A custom rule (`custom_jvp_call`) may
  keep anything.
  """
  return _keeps(eqns, set(invars))


def _keeps(eqns: Sequence[Any], derived: set[Any]) -> bool:
  """`_keeps_values`, `derived` the variables computed from the inputs (any dtype)."""
  for eqn in eqns:
    reads = [not isinstance(v, jex.core.Literal) and v in derived for v in eqn.invars]
    if not any(reads):
      continue  # a constant
    name = eqn.primitive.name
    if name in _CALLS:
      body = _body(eqn)
      if _keeps(body.eqns, {v for v, r in zip(body.invars, reads, strict=True) if r}):
        return True
    elif (name == "mul" and sum(reads) == 1 and _scalar(eqn.invars[reads.index(False)])) or (
      name == "div" and not reads[1] and _scalar(eqn.invars[1])
    ):
      pass  # by a scalar constant: linear
    elif name not in LINEAR:
      return True
    derived.update(eqn.outvars)
  return False


def _scalar(v: Any) -> bool:
  return not np.shape(v.aval)


def split_at_tangents(region: Region, tangent: Sequence[bool]) -> tuple[Region, ...]:
  """`region` as its primal part then its tangent part, in a `custom_jvp` rule.

  `tangent` says which of the region's inputs are linear in the rule's
  tangents. JAX linearizes a rule by evaluating what does not depend on the
  tangents ahead (jax >= 0.11 requires every primal output of the rule to come
  from that part); a region is one call, so a region mixing primal and tangent
  work would make its primal outputs depend on the tangents. The primal part
  never reads the tangent part, so running it first keeps the order.
  """
  linear_vars = {v for v, t in zip(region.invars, tangent, strict=True) if t}
  primal: list[Any] = []
  linear: list[Any] = []
  for eqn in region.eqns:
    if any(v in linear_vars for v in eqn.invars if not isinstance(v, jex.core.Literal)):
      linear.append(eqn)
      linear_vars.update(eqn.outvars)
    else:
      primal.append(eqn)
  if not primal or not linear:
    return (region,)
  read_later = {v for e in linear for v in e.invars if not isinstance(v, jex.core.Literal)}
  read_later.update(region.outvars)
  keep = dict.fromkeys(read_later, 0)  # "read at or after step 0": kept as an output
  return (_region(primal, keep, 0), _region(linear, dict.fromkeys(region.outvars, 0), 0))


def _common(stacks: Sequence[Any]) -> Any:
  """The longest common prefix of the equations' name stacks (the region's scope in HLO)."""
  first = stacks[0]
  n = len(first.stack)
  for s in stacks[1:]:
    n = min(n, len(s.stack))
    while n and s.stack[:n] != first.stack[:n]:
      n -= 1
  return dataclasses.replace(first, stack=first.stack[:n])


def _kinds(ctx: interp.Context, jaxpr: Any, in_kinds: tuple[Kind, ...]) -> dict[Any, Kind]:
  """Every variable's kind: arguments GIVEN, reductions STAT, the rest ACT."""
  kinds: dict[Any, Kind] = dict.fromkeys(jaxpr.constvars, Kind.GIVEN)
  kinds.update(zip(jaxpr.invars, in_kinds, strict=True))
  for eqn in jaxpr.eqns:
    ins = {kinds.get(v, Kind.GIVEN) for v in eqn.invars if not isinstance(v, jex.core.Literal)}
    if eqn.primitive.name in REDUCTIONS:
      out = Kind.STAT
    elif Kind.ACT in ins or not fusible(ctx, eqn):
      out = Kind.ACT
    elif Kind.STAT in ins:
      out = Kind.STAT
    else:
      out = Kind.ACT
    for v in eqn.outvars:
      kinds[v] = out
  return kinds
