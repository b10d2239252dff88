"""The interpreter loop of `autocast`: `jax.core.eval_jaxpr` with a rule per equation.

It reads the jaxpr's plan (`plan`, built once per jaxpr and context) and
runs its steps: a region by `regions.run`, every other equation by its
rule (`rules`). The primitives that hold jaxprs (`control`) run their
bodies through this loop, each body by its own plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend as jex

from optax_lossscale._src.autocast import interpreter as interp
from optax_lossscale._src.autocast import plan as plan_lib
from optax_lossscale._src.autocast import regions, report
from optax_lossscale._src.utils import compat

Kind = interp.Kind


def eval_jaxpr(
  ctx: interp.Context,
  jaxpr: Any,
  consts: Sequence[Any],
  args: Sequence[Any],
  kinds: Sequence[Kind] | None = None,
) -> list[Any]:
  """The interpreter loop: `jax.core.eval_jaxpr` with a rule per equation.

  Consecutive float32 and widest equations run as one region (see
  `regions`); every other equation by its rule. `kinds` says which
  arguments are activations (default: none, they are the caller's arrays).
  """
  if kinds is None:
    kinds = [Kind.GIVEN] * len(args)
  plan = plan_lib.plan(ctx, jaxpr, tuple(kinds), flat=interp.in_region())
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    if isinstance(v, jex.core.Literal):  # a NumPy constant of the declared dtype
      return interp.literal(v)
    return env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for v, value in zip(jaxpr.invars, args, strict=True):
    interp.remember_kind(value, plan.kinds[v])
  for value in consts:
    interp.remember_kind(value, Kind.GIVEN)
  # copies are shared within one loop, never across (a body is another trace)
  with interp.copies_scope(), interp.narrow_scope(plan.narrow):
    for step in plan.steps:
      invals = [read(v) for v in step.invars]
      if isinstance(step, plan_lib.Region):
        # In a custom_jvp rule, a region's primal work and its tangent work run apart.
        tangent = [interp.any_tangent([x]) for x in invals]
        parts = plan_lib.split_at_tangents(step, tangent) if any(tangent) else (step,)
        for part in parts:
          ins = [read(v) for v in part.invars]
          kinds_in = [plan.kinds.get(v, Kind.GIVEN) for v in part.invars]
          _write(env, plan, part, ins, regions.run(ctx, part, ins, kinds_in))
      else:
        eqn = step.eqn
        rule = interp.rule_of(ctx, eqn.primitive.name)
        with compat.eqn_context(eqn), report.entering(eqn):
          _write(env, plan, step, invals, rule(ctx, eqn, invals))
  return [read(v) for v in jaxpr.outvars]


def _write(env: dict[Any, Any], plan: plan_lib.Plan, step: Any, invals: list[Any],
           outs: list[Any]) -> None:  # fmt: skip
  """Stores a step's outputs with their kinds (tangents when computed from one)."""
  interp.mark_tangents(invals, outs)
  for v, out in zip(step.outvars, outs, strict=True):
    env[v] = out  # dropped outputs too, as JAX does
    interp.remember_kind(out, plan.kinds.get(v, Kind.ACT))


def eval_closed(
  ctx: interp.Context, closed: Any, args: Sequence[Any], kinds: Sequence[Kind] | None = None
) -> list[Any]:
  """Evaluates a `ClosedJaxpr` with the rules."""
  return eval_jaxpr(ctx, closed.jaxpr, closed.consts, args, kinds)
