"""Reading a jaxpr: its equations' dtypes, sub-jaxprs (control flow, custom rules) included,
and which values are computed from which."""

from collections.abc import Iterator

import jax
import numpy as np

MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")


def _subjaxprs(value):
  for item in value if isinstance(value, (tuple, list)) else (value,):
    if isinstance(item, jax.extend.core.ClosedJaxpr):
      yield item.jaxpr
    elif isinstance(item, jax.extend.core.Jaxpr):
      yield item


def equations(jaxpr) -> Iterator:
  """Every equation of `jaxpr` (a Jaxpr or ClosedJaxpr) and of its sub-jaxprs, depth first."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in _subjaxprs(value):
        yield from equations(sub)


def depends_on(jaxpr, var, target) -> bool:
  """Whether `var` of `jaxpr`'s top level is computed from `target` (a variable of it):
  an equation's outputs depend on all its inputs (a `cond`'s on every branch's)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  produced = {v: e for e in jaxpr.eqns for v in e.outvars}
  seen, todo = set(), [var]
  while todo:
    v = todo.pop()
    if v is target:
      return True
    if v in seen or v not in produced:
      continue
    seen.add(v)
    todo.extend(x for x in produced[v].invars if not isinstance(x, jax.extend.core.Literal))
  return False


def in_dtypes(eqn) -> tuple[str, ...]:
  return tuple(str(v.aval.dtype) for v in eqn.invars)


def matmul_inputs(jaxpr) -> list[tuple[str, ...]]:
  """The input dtypes of every matrix product and convolution."""
  return [in_dtypes(e) for e in equations(jaxpr) if e.primitive.name in MATMULS]


def inputs_of(jaxpr, primitive: str) -> list[tuple[str, ...]]:
  return [in_dtypes(e) for e in equations(jaxpr) if e.primitive.name == primitive]


def mismatched(jaxpr) -> list[str]:
  """Equations whose floating inputs do not share one dtype (converts have one input)."""
  out = []
  for eqn in equations(jaxpr):
    if eqn.primitive.name in ("cond", "while", "scan", "custom_jvp_call", "custom_vjp_call",
                              "jit", "pjit", "remat2", "checkpoint", "shard_map"):  # fmt: skip
      continue
    floats = {
      str(v.aval.dtype)
      for v in eqn.invars
      if not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)
      and np.issubdtype(v.aval.dtype, np.inexact)
    }
    if len(floats) > 1:
      out.append(f"{eqn.primitive.name}{sorted(floats)}")
  return out
