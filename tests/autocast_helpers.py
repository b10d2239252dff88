"""Reading the dtypes of a jaxpr's equations, sub-jaxprs (control flow, custom rules) included."""

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
