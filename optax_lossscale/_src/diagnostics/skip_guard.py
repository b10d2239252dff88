"""The guard of `skip_bad_steps`: raise `OverflowGuardError` when skipping cannot go on.

It fires when `max_consecutive_skips` is exceeded, or when a spike streak runs
past `max_consecutive_spike_skips` with `on_spike_streak='raise'`. Built like
the loss-scale wrapper's guard (`overflow_guard.make_guard`): a `lax.cond`
whose true branch builds a `gradient_report` of the step's gradients and hands
it to a raising `jax.pure_callback`, so a run that never fires pays a scalar
predicate and an empty branch. The loss-scale guard's message and checks are
about the scale, so only the error type and the report are shared.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.diagnostics import gradient_report as report_lib
from optax_lossscale._src.diagnostics import overflow_guard

_NONFINITE_ADVICE = (
  "The last step's gradients (or watched loss) held NaN/Inf: look at the leaves above, the"
  " loss and the forward pass feeding them (log/exp/division by zero, values beyond the"
  " dtype's range), and at the input batch; compute the loss and normalisation statistics"
  " in float32; lower the learning rate if the parameters grew until activations overflow."
)
_SPIKE_ADVICE = (
  "A long streak of spikes is a change of regime or a real divergence: lower the learning"
  " rate, clip the gradients, check the data, or let the guard accept it"
  " (on_spike_streak='accept')."
)


def _guard_message(
  report: report_lib.GradientReport,
  skips: np.ndarray,
  spike_streak: np.ndarray,
  too_many: np.ndarray,
  streak_over: np.ndarray,
  finite: np.ndarray,
  values: dict[str, np.ndarray],
  config: dict[str, Any],
) -> str:
  reasons = []
  if bool(too_many):
    reasons.append(overflow_guard.too_many_skips_reason(skips, config["max_consecutive_skips"]))
  if bool(streak_over):
    reasons.append(
      f"{int(spike_streak) + 1} consecutive steps were spikes, more than"
      f" max_consecutive_spike_skips={config['max_consecutive_spike_skips']}"
      " (on_spike_streak='raise')"
    )
  seen = ", ".join(f"{k} {float(v):.6g}" for k, v in values.items())
  return (
    f"skip_bad_steps stopped the run: {'; and '.join(reasons)}.\n"
    f"This step: {seen or 'no watched values'}.\n\n"
    f"{report_lib.format_gradient_report(report)}\n\n"
    f"{_SPIKE_ADVICE if bool(finite) else _NONFINITE_ADVICE}"
  )


def make_guard(config: dict[str, Any]) -> Any:
  """The in-step guard (a cond around a raising host callback), or None when off.

  The same construction as `loss_scale_optimizer`'s guard: the guard returns
  the callback's int32 zero, which the caller folds into every scalar of the
  new state (`overflow_guard.fold_into_scalars`) so that the callback is never
  pruned, and a run that never fires pays a scalar predicate and an empty
  branch.
  """
  if config["max_consecutive_skips"] is None and config["on_spike_streak"] != "raise":
    return None

  def raise_error(
    report: Any,
    skips: Any,
    spike_streak: Any,
    too_many: Any,
    streak_over: Any,
    finite: Any,
    values: Any,
  ) -> np.ndarray:
    # Re-checked here: under vmap a batched cond runs this for every element.
    if bool(np.any(too_many)) or bool(np.any(streak_over)):
      raise overflow_guard.OverflowGuardError(
        _guard_message(report, skips, spike_streak, too_many, streak_over, finite, values, config)
      )
    return np.zeros((), np.int32)

  def guard(
    grads: Any,
    skips: jax.Array,
    spike_streak: jax.Array,
    too_many: jax.Array,
    streak_over: jax.Array,
    finite: jax.Array,
    values: dict[str, jax.Array],
  ) -> jax.Array:
    def fire(grads: Any, *operands: Any) -> jax.Array:
      # No loss scaling here: the gradients' own (narrowest) dtype is the one
      # whose range matters, e.g. bfloat16 in a bfloat16 run.
      report = report_lib.gradient_report(grads, report_lib.narrowest_float_dtype(grads))
      result = jax.ShapeDtypeStruct((), jnp.int32)
      return jax.pure_callback(raise_error, result, report, *operands, vmap_method="sequential")

    operands = (skips, spike_streak, too_many, streak_over, finite, values)
    zero = jax.lax.cond(
      too_many | streak_over, fire, lambda *_: jnp.zeros((), jnp.int32), grads, *operands
    )
    return zero

  return guard
