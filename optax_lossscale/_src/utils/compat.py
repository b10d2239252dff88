"""Shims for the older releases inside the declared dependency ranges.

Each shim names the releases it serves, so that it can go when the lower
bounds in `pyproject.toml` pass them. CI runs the core tests on exactly those
lower bounds (`make test-lowest`, pinned by `constraints-lowest.txt`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax._src import source_info_util
import numpy as np


def varying_axes(aval: Any) -> frozenset[Any]:
  """The `shard_map` mesh axes an abstract value (or ShapeDtypeStruct) varies over.

  jax 0.10 moved the set from `aval.vma` to `aval.manual_axis_type.varying`.
  """
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()) or ())  # jax < 0.10


def pvary(x: jax.Array, axis_names: tuple[Any, ...]) -> jax.Array:
  """`x` marked as varying over the `shard_map` mesh axes `axis_names`.

  A change of type only, never of value. jax 0.9 replaced `jax.lax.pvary`
  with `jax.lax.pcast(..., to="varying")`.
  """
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axis_names, to="varying")
  return jax.lax.pvary(x, axis_names)  # jax < 0.9


def custom_jvp_rule_jaxpr(
  params: dict[str, Any], num_args: int, zeros: Any = None
) -> tuple[Any, Any, list[bool]]:
  """The JVP rule of a `custom_jvp_call` equation as `(jaxpr, consts, out_zeros)`.

  The jaxpr takes the primal arguments (without the call's consts) and then
  one tangent per argument whose entry of `zeros` is False (default: all
  nonzero); `out_zeros` says which output tangents the rule returns as
  symbolic zeros (those are not among the jaxpr's outputs). JAX keeps the
  rule as a thunk, `jvp_jaxpr_fun`, the same in jax 0.7.1 and 0.10.2
  (private: `jax._src.custom_derivatives.lift_jvp` calls it this way).
  """
  zeros = [False] * num_args if zeros is None else [bool(z) for z in zeros]
  jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
  return jaxpr, consts, list(out_zeros)


# jax 0.11 added `jax.custom_vjp.defvjp_with_logs`: since then a `custom_vjp_call`'s
# backward rule returns `(cotangents, logs)` rather than the cotangents alone.
CUSTOM_VJP_BWD_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")

# jax 0.12 hands every backward rule its symbolic-zero cotangents (the rule's wrapper,
# `_flatten_bwd`, instantiates them for a rule without `symbolic_zeros`; under `vmap` a
# symbolic zero is what tells an output shared across the batch from one with a
# cotangent); before, only a rule with `symbolic_zeros` got them, the others zeros.
_CUSTOM_VJP_BWD_TAKES_ZEROS = tuple(int(x) for x in jax.__version_info__[:2]) >= (0, 12)


def custom_vjp_bwd(params: dict[str, Any], res: list[Any], cts: list[Any]) -> tuple[list[Any], Any]:
  """A `custom_vjp_call` equation's backward rule applied: `(cotangents, logs)`.

  `cts` holds one cotangent per output, a `jax.custom_derivatives.SymbolicZero` where it
  is zero, handed to the rule as JAX's own transpose does in this release. The result
  holds one cotangent per argument of the function (JAX's `Zero` where the rule gives
  none: no `dtype`); `logs` is what a rule defined with `defvjp_with_logs` (jax >= 0.11)
  logs, None before. The rule, `params["bwd"]`, takes the residuals and then one
  cotangent per output; checked on jax 0.7.1, 0.10.2, 0.11.2 and 0.12.0.1 (private:
  `jax._src.interpreters.ad._custom_lin_transpose` calls it this way).
  """
  if not (params.get("symbolic_zeros", False) or _CUSTOM_VJP_BWD_TAKES_ZEROS):
    cts = [_instantiate(ct) for ct in cts]  # jax < 0.12
  out = params["bwd"].call_wrapped(*res, *cts)
  if CUSTOM_VJP_BWD_LOGS:
    cts_in, logs = out
    return list(cts_in), logs
  return list(out), None  # jax < 0.11


def _instantiate(ct: Any) -> Any:
  """A symbolic-zero cotangent as an array of zeros (any other value as it is)."""
  if not isinstance(ct, jax.custom_derivatives.SymbolicZero):
    return ct
  if ct.dtype == jax.dtypes.float0:
    return np.zeros(ct.shape, jax.dtypes.float0)
  return jax.numpy.zeros(ct.shape, ct.dtype)


def scan_operands(params: dict[str, Any], args: list[Any]) -> tuple[list[Any], ...]:
  """A `scan` equation's operands split as `(consts, carry, xs)`.

  jax 0.11 replaced the counts `num_consts` and `num_carry` with `ft_in`, a
  flat tree of the three groups (private: `jax._src.lax.control_flow.loops`
  splits them this way; checked on jax 0.11.2 and 0.12.0.1).
  """
  if "ft_in" in params:
    return tuple(list(part) for part in params["ft_in"].update(args).unpack())
  n_consts, n_carry = params["num_consts"], params["num_carry"]  # jax < 0.11
  return (
    list(args[:n_consts]),
    list(args[n_consts : n_consts + n_carry]),
    list(args[n_consts + n_carry :]),
  )


def shard_map_manual_axes(params: dict[str, Any]) -> frozenset[Any]:
  """The mesh axes a `shard_map` equation is manual over (`jax.shard_map`'s `axis_names`).

  jax 0.10 renamed the parameter from `manual_axes` to `newly_manual_axes`.
  """
  if "newly_manual_axes" in params:
    return frozenset(params["newly_manual_axes"])
  return frozenset(params["manual_axes"])  # jax < 0.10


def shard_map_check_vma(params: dict[str, Any]) -> bool:
  """A `shard_map` equation's `check_vma` (called `check_rep` before jax 0.7)."""
  return bool(params.get("check_vma", params.get("check_rep", True)))


def bind_params(eqn: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
  """`(subfuns, params)` to re-bind a jaxpr equation's primitive, as `eval_jaxpr` does.

  `Primitive.get_bind_params` returned that pair up to jax 0.7; since jax 0.8
  it returns the params alone, holding the subfunctions under 'subfuns'.
  """
  out = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(out, tuple):
    return tuple(out[0]), out[1]  # jax < 0.8
  return (), out


def eqn_context(eqn: Any, names: bool = True) -> contextlib.AbstractContextManager[Any]:
  """The context `jax.core.eval_jaxpr` binds an equation in: its name stack and its ctx.

  Keeps the HLO metadata (Flax module paths, `jax.named_scope`) of re-bound
  equations (`names=False`: the ctx alone, e.g. `threefry_partitionable`).
  Private in every supported release (`jax._src.source_info_util`).
  """
  stack = contextlib.ExitStack()
  if names:
    stack.enter_context(name_stack(eqn.source_info.name_stack))
  manager = getattr(getattr(eqn, "ctx", None), "manager", None)
  if manager is not None:
    stack.enter_context(manager)
  return stack


def name_stack(stack: Any) -> contextlib.AbstractContextManager[Any]:
  """Binds under the current name stack extended by `stack` (a jaxpr equation's)."""
  full = source_info_util.current_name_stack() + stack
  return source_info_util.user_context(None, name_stack=full)


def typeof(value: Any) -> Any:
  """The abstract value of an array or tracer (`jax.typeof`, jax >= 0.6.1)."""
  if hasattr(jax, "typeof"):
    return jax.typeof(value)
  return jax.core.get_aval(value)  # pragma: no cover


def saved_residuals(fun: Any, *args: Any) -> list[tuple[Any, str]]:
  """What reverse mode keeps of `fun(*args)` for the backward pass: `(aval, description)` pairs.

  The list `jax.ad_checkpoint.print_saved_residuals` prints; private
  (`jax._src.ad_checkpoint.saved_residuals`) in every supported release.
  """
  from jax._src import ad_checkpoint

  return ad_checkpoint.saved_residuals(fun, *args)


def is_drop_var(var: Any) -> bool:
  """Whether a jaxpr equation's output variable is dropped (`_` in a printed jaxpr).

  `jax.extend.core.DropVar` from jax 0.8; private (`jax._src.core`) before.
  """
  import jax.extend as jex

  drop = getattr(jex.core, "DropVar", None)
  if drop is None:  # jax < 0.8
    from jax._src import core

    drop = core.DropVar
  return isinstance(var, drop)
