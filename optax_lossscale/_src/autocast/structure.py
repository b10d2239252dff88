"""Structural keys of jaxpr fragments: equal when two fragments compute the same thing.

`autocast` interprets, differentiates and compiles a region once per
structure (`regions`): a 24-block model holds 24 copies of each of
its regions, and a re-trace of the same function new copies of all of them,
equal but not identical. The key of a run of equations names, per equation,
its primitive, its parameters, which earlier values (or literals) it reads
and its context (`threefry_partitionable`, ...), and which values leave the
run. Jaxprs among the parameters are keyed by their own structure, so a
`custom_jvp` function (whose JAX thunks are fresh on every call) is keyed by
its body and its rule's jaxpr. A fragment whose parameters cannot be hashed
(a large constant array) has no key: it is built anew each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend as jex
import numpy as np

from optax_lossscale._src.utils import compat

# Constants up to this many elements are keyed by value; larger ones make the
# fragment uncacheable (hashing them would cost what caching saves).
_MAX_CONSTANT_SIZE = 4096


# Rules within rules followed this deep at most (then the fragment is not cached).
_MAX_RULE_DEPTH = 3


class Unkeyable(Exception):
  """The fragment holds something that has no structural key."""


def run_key(eqns: Sequence[Any], invars: Sequence[Any], outvars: Sequence[Any]) -> Any:
  """The key of the equations `eqns`, read from `invars`, returning `outvars`; or None."""
  try:
    index = {v: i for i, v in enumerate(invars)}
    parts = tuple(_eqn_key(eqn, index, ()) for eqn in eqns)
    return parts, tuple(_ref(v, index) for v in outvars)
  except (Unkeyable, TypeError, ValueError):
    return None


def _eqn_key(eqn: Any, index: dict[Any, int], enclosing: tuple[Any, ...]) -> Any:
  """`enclosing`: the bodies of the `custom_jvp` functions whose rules hold `eqn`."""
  refs = tuple(_ref(v, index) for v in eqn.invars)
  for v in eqn.outvars:
    index[v] = len(index)
  if eqn.primitive.name == "custom_jvp_call":
    params: Any = _custom_jvp_key(eqn, enclosing)
  else:
    params = tuple(sorted((k, _param_key(v, enclosing)) for k, v in eqn.params.items()))
  key = (eqn.primitive, params, refs, len(eqn.outvars), eqn.ctx)
  hash(key)
  return key


def _ref(v: Any, index: dict[Any, int]) -> Any:
  if isinstance(v, jex.core.Literal):
    return ("literal", str(v.aval.dtype), np.asarray(v.val).tobytes())
  return index[v]


def _param_key(value: Any, enclosing: tuple[Any, ...]) -> Any:
  if isinstance(value, jex.core.ClosedJaxpr):
    return jaxpr_key(value.jaxpr, value.consts, enclosing)
  if isinstance(value, jex.core.Jaxpr):
    return jaxpr_key(value, (), enclosing)
  if isinstance(value, (tuple, list)):
    return tuple(_param_key(v, enclosing) for v in value)
  return value


def jaxpr_key(jaxpr: Any, consts: Sequence[Any], enclosing: tuple[Any, ...] = ()) -> Any:
  """The structure of a whole jaxpr with its constants (raises `Unkeyable`)."""
  index = {v: i for i, v in enumerate([*jaxpr.constvars, *jaxpr.invars])}
  types = tuple(str(v.aval) for v in [*jaxpr.constvars, *jaxpr.invars])
  parts = tuple(_eqn_key(eqn, index, enclosing) for eqn in jaxpr.eqns)
  outs = tuple(_ref(v, index) for v in jaxpr.outvars)
  return types, parts, outs, tuple(_constant_key(c) for c in consts)


def _constant_key(value: Any) -> Any:
  shape = np.shape(value)
  if int(np.prod(shape)) > _MAX_CONSTANT_SIZE:
    raise Unkeyable("a large constant")
  try:
    array = np.asarray(value)
  except Exception as e:  # a tracer closed over: no value to key by
    raise Unkeyable("a traced constant") from e
  return shape, str(array.dtype), array.tobytes()


def _custom_jvp_key(eqn: Any, enclosing: tuple[Any, ...]) -> Any:
  """A `custom_jvp` call by its body and its rule's jaxpr (the thunks are new per call).

  A rule commonly calls its own function for the primal output (`relu`'s
  does): within the rule, a call whose body is an enclosing function's body
  is keyed as that function, not followed again (it would never end).
  """
  p = eqn.params
  if len(enclosing) >= _MAX_RULE_DEPTH:  # rules calling functions whose rules call ...
    raise Unkeyable("custom_jvp rules nested too deep")
  body = jaxpr_key(p["call_jaxpr"].jaxpr, p["call_jaxpr"].consts, enclosing)
  if body in enclosing:
    return ("custom_jvp, the enclosing one", enclosing.index(body))
  num_args = len(eqn.invars) - p["num_consts"]
  try:
    rule, rule_consts, out_zeros = compat.custom_jvp_rule_jaxpr(p, num_args)
  except Exception as e:  # a rule that refuses to be traced (Equinox's `nondifferentiable`
    raise Unkeyable("a custom_jvp rule that does not trace") from e  # raises by design)
  return (
    "custom_jvp",
    body,
    jaxpr_key(rule, rule_consts, (*enclosing, body)),
    tuple(out_zeros),
    p["num_consts"],
    p["symbolic_zeros"],
  )
