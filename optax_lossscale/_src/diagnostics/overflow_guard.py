"""Which leaves overflowed, and a guard that stops a run the loss scale cannot save.

Two opt-in features of `loss_scale_optimizer`, kept here so the wrapper only
wires them in:

* recording, per gradient leaf, one bool "non-finite on the last skipped
  step" in the optimizer state (`record_nonfinite_leaves=True`);
* a guard that raises `OverflowGuardError` from the training step when
  `max_consecutive_skips` is exceeded, or when a step overflows although the
  scale is already at `min_loss_scale` (`raise_at_min_loss_scale=True`).

The guard is a `lax.cond` whose true branch builds a `gradient_report` and
hands it to a host callback that raises; the false branch is empty, so a run
that never trips it pays a scalar predicate and a branch, never a host round
trip. When both options are off nothing of this module is traced at all.

The callback is a `jax.pure_callback` whose (zero) result is folded into
every scalar of the new wrapper state (`keep_alive`), not a
`jax.debug.callback`: a computation with effects, such as
a debug callback, loses jit's C++ dispatch fast path, which cost 0.1 to 1 ms
per call on CPU even when the callback never ran. Any host callback still
makes the CPU runtime execute the step synchronously (the call returns once
the step has run), the guard's remaining cost. An exception raised in the
callback reaches the caller (jax 0.10.2) as a `jax.errors.JaxRuntimeError`
or a `ValueError`, depending on which dispatch path the call took (which the
history of calls decides); either message ends with the original
`OverflowGuardError: ...` text.

When it surfaces depends on the backend. On CPU a step holding a host
callback runs synchronously, so the error is raised by the step call itself.
On a GPU or TPU dispatch is asynchronous: the call returns at once and the
error is raised when a result of that step (or of a later one) is read, e.g.
by `jax.block_until_ready`, `float(...)`, `jax.device_get` or a logged
metric. A training loop that never reads anything would run on past the
failure; one that logs `ols.metrics(state)` every N steps stops within N
steps. Block on the step's results where the error must stop the loop at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.diagnostics import gradient_report as report_lib
from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.utils import tree_utils, validation

GuardFn = Callable[[loss_scale_lib.LossScale, jax.Array, jax.Array, Any], jax.Array]


class OverflowGuardError(FloatingPointError):
  """Raised (through the training step) when loss scaling cannot recover.

  Under `jit` jax re-raises it from the host callback, as a
  `jax.errors.JaxRuntimeError` or `ValueError` whose message holds this
  error's text: catch those and look for `OverflowGuardError` in the message.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), max_consecutive_skips=1)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> nan = ols.mark_scaled({'w': jnp.array([jnp.nan, 1.0])})  # an overflow, by hand
    >>> _, state = tx.update(nan, state)  # one skip is tolerated
    >>> try:  # blocking: on a GPU/TPU the error arrives when a result is read
    ...   jax.block_until_ready(tx.update(nan, state))
    ... except Exception as e:
    ...   print('OverflowGuardError' in str(e))
    True
  """


def _is_none(x: Any) -> bool:
  return x is None


def init_nonfinite_leaves(params: Any) -> Any:
  """One False per leaf of `params` (`None` leaves included), as bool scalars."""
  return jax.tree.map(lambda _: jnp.asarray(False), params, is_leaf=_is_none)


def _leaf_nonfinite(g: Any) -> jax.Array:
  if g is None or not tree_utils.is_inexact(g) or not jnp.size(g):
    return jnp.asarray(False)
  return jnp.logical_not(tree_utils.leaf_all_finite(g))


def update_nonfinite_leaves(
  previous: Any,
  checked_grads: Any,
  should_apply: jax.Array,
  axis_name: tree_utils.AxisName = None,
) -> Any:
  """This step's per-leaf non-finite flags if it was skipped, else `previous`.

  Args:
    previous: the flags in the state, a tree shaped like the parameters.
    checked_grads: the gradients the wrapper checked (scaled or unscaled,
      finite in the same places); same leaves as `previous` (a `None`
      gradient counts as one finite leaf).
    should_apply: whether this step is applied.
    axis_name: mapped axes whose shards are OR-ed, so every replica records
      the same flags.

  Returns:
    A tree with the structure of `previous`.
  """
  treedef = jax.tree.structure(previous)
  grads_leaves = jax.tree.leaves(checked_grads, is_leaf=_is_none)
  if len(grads_leaves) != treedef.num_leaves:
    raise ValueError(
      "record_nonfinite_leaves needs gradients with the same leaves as the"
      f" parameters given to init; got {len(grads_leaves)} gradient leaves for"
      f" {treedef.num_leaves} parameter leaves."
    )
  flags = [_leaf_nonfinite(g) for g in grads_leaves]
  if axis_name is not None and flags:
    # One all-reduce of a small int vector: a leaf is flagged if any shard saw NaN/Inf.
    stacked = jax.lax.pmax(jnp.stack(flags).astype(jnp.int32), axis_name) > 0
    flags = list(stacked)
  current = jax.tree.unflatten(treedef, flags)
  return jax.tree.map(lambda old, new: jnp.where(should_apply, old, new), previous, current)


def too_many_skips_reason(consecutive_skips: Any, max_consecutive_skips: int | None) -> str:
  """The guard message's reason when a streak of skips passed the limit."""
  return (
    f"{int(consecutive_skips)} consecutive steps were skipped, more than"
    f" max_consecutive_skips={max_consecutive_skips}"
  )


def check_max_consecutive_skips(value: Any) -> int | None:
  """Validates `max_consecutive_skips`: None, or an int32 >= 1 (the streak is an int32)."""
  if value is None:
    return None
  return validation.check_int(
    "max_consecutive_skips",
    value,
    low=1,
    accepted=f"None (no limit) or an integer in [1, {validation.INT32_MAX}]",
  )


def check_options(
  loss_scale: loss_scale_lib.LossScale,
  max_consecutive_skips: Any,
  raise_at_min_loss_scale: Any,
  record_nonfinite_leaves: Any,
) -> dict[str, Any]:
  """Validates the wrapper's diagnostic arguments and returns them for `get_config`."""
  max_consecutive_skips = check_max_consecutive_skips(max_consecutive_skips)
  raise_at_min_loss_scale = validation.check_bool(
    "raise_at_min_loss_scale", raise_at_min_loss_scale
  )
  record_nonfinite_leaves = validation.check_bool(
    "record_nonfinite_leaves", record_nonfinite_leaves
  )
  if not loss_scale.skips and (max_consecutive_skips is not None or raise_at_min_loss_scale):
    # Accepted (a config may switch the scale kind), but never silently.
    warnings.warn(
      f"max_consecutive_skips={max_consecutive_skips} / raise_at_min_loss_scale="
      f"{raise_at_min_loss_scale} have no effect with a {type(loss_scale).__name__}:"
      " it never skips a step, so the overflow guard can never fire. Use a loss"
      " scale that skips: a dynamic one (loss_scale='dynamic') or, for a constant"
      " scale, SkippingFixedLossScale (max_consecutive_skips only).",
      UserWarning,
      stacklevel=3,
    )
  if raise_at_min_loss_scale and loss_scale.skips and not hasattr(loss_scale, "min_loss_scale"):
    raise ValueError(
      "raise_at_min_loss_scale=True needs a loss scale with a min_loss_scale"
      f" (e.g. DynamicLossScale); got {type(loss_scale).__name__}."
    )
  return {
    "record_nonfinite_leaves": bool(record_nonfinite_leaves),
    "max_consecutive_skips": None if max_consecutive_skips is None else int(max_consecutive_skips),
    "raise_at_min_loss_scale": bool(raise_at_min_loss_scale),
  }


_ADVICE = """\
What to try:
  - If the scale is at or near 1, the NaN/Inf do not come from loss scaling:
    look at the loss and the forward pass feeding the leaves above (a loss
    summed instead of averaged over a large batch, log/exp/division by zero,
    float16 activations beyond 65504), and at the input batch (NaN/Inf,
    unnormalised features).
  - Compute the loss, softmax and normalisation statistics in float32.
  - If the parameters grew until activations overflow, lower the learning
    rate or clip the gradients (optax.clip_by_global_norm).
  - If the scale only fell from a high start, start lower with the scale
    optax_lossscale.suggest_loss_scale(unscaled_grads) suggests, or allow a
    longer streak with a larger max_consecutive_skips."""


def _guard_message(
  report: report_lib.GradientReport,
  scale: np.ndarray,
  consecutive_skips: np.ndarray,
  too_many: np.ndarray,
  at_min: np.ndarray,
  max_consecutive_skips: int | None,
  min_loss_scale: float | None,
) -> str:
  reasons = []
  if bool(too_many):
    reasons.append(too_many_skips_reason(consecutive_skips, max_consecutive_skips))
  if bool(at_min):
    reasons.append(
      f"the step overflowed at min_loss_scale={min_loss_scale:g}, so backing off cannot help"
    )
  bad = report.nonfinite_paths()
  named = ", ".join(bad) if bad else "none on this shard"
  return (
    f"Loss scaling cannot recover: {'; and '.join(reasons)}.\n"
    f"Loss scale of this step: {float(scale):g}. Leaves with NaN/Inf in the"
    f" unscaled gradients: {named}.\n\n"
    f"{report_lib.format_gradient_report(report)}\n\n{_ADVICE}"
  )


def make_guard(
  loss_scale: loss_scale_lib.LossScale,
  max_consecutive_skips: int | None,
  raise_at_min_loss_scale: bool,
) -> GuardFn | None:
  """Returns the in-step guard, or None when both options are off.

  The guard takes the step's loss scale (before its update), whether the step
  is applied, the new consecutive-skip count and the scaled gradients, and
  returns an int32 zero; `keep_alive` folds it into the new state so the
  compiler cannot prune it (a `pure_callback` whose result is unused is dead
  code).
  """
  if not loss_scale.skips or (max_consecutive_skips is None and not raise_at_min_loss_scale):
    return None
  min_loss_scale = getattr(loss_scale, "min_loss_scale", None) if raise_at_min_loss_scale else None

  def raise_error(report: Any, scale: Any, skips: Any, too_many: Any, at_min: Any) -> np.ndarray:
    # Re-checked here: under vmap a batched `cond` becomes a select that runs
    # this branch for every element, triggered or not.
    if bool(np.any(too_many)) or bool(np.any(at_min)):
      message = _guard_message(
        report, scale, skips, too_many, at_min, max_consecutive_skips, min_loss_scale
      )
      raise OverflowGuardError(message)
    return np.zeros((), np.int32)

  def guard(
    ls: loss_scale_lib.LossScale, should_apply: jax.Array, consecutive_skips: jax.Array, grads: Any
  ) -> jax.Array:
    skipped = jnp.logical_not(should_apply)
    too_many = jnp.asarray(False)
    if max_consecutive_skips is not None:
      too_many = skipped & (consecutive_skips > max_consecutive_skips)
    at_min = jnp.asarray(False)
    if min_loss_scale is not None:
      at_min = skipped & (ls() <= jnp.float32(min_loss_scale))

    def fire(
      grads: Any, scale: jax.Array, skips: jax.Array, too_many: jax.Array, at_min: Any
    ) -> jax.Array:
      # Unscaling and the report happen only here, so a run that never fires
      # never pays for them (the operands are the step's input gradients).
      report = report_lib.gradient_report(ls.unscale(grads))
      result = jax.ShapeDtypeStruct((), jnp.int32)
      return jax.pure_callback(
        raise_error, result, report, scale, skips, too_many, at_min, vmap_method="sequential"
      )

    zero = jax.lax.cond(
      too_many | at_min,
      fire,
      lambda *_: jnp.zeros((), jnp.int32),
      grads,
      ls(),
      consecutive_skips,
      too_many,
      at_min,
    )
    return zero

  return guard


def _fold(zero: jax.Array, x: Any) -> Any:
  """`x` with the guard's zero folded in: the same value, now depending on the guard."""
  if not isinstance(x, jax.Array) or x.dtype == jax.dtypes.float0:
    return x
  if x.dtype == jnp.bool_:
    return x & (zero == 0)
  # Subtracting keeps -0.0 (-0.0 + 0.0 would be +0.0): the value stays bit for bit.
  return x - zero.astype(x.dtype)


def keep_alive(zero: jax.Array, out: Any, state: Any) -> tuple[Any, Any]:
  """Folds the guard's zero into the step's outputs, so that it is never pruned.

  A pure callback is dead code unless an output the caller keeps depends on
  it. The zero is folded into every scalar of the new wrapper state (the loss
  scale, which the next step reads, so it stays live through a `scan`; the
  counters; `last_step_applied`) and into the smallest leaf of `out` (the
  updates, or the new params of the fused step), so a step that returns
  only the params keeps it too. Scalar work and one pass over one small leaf;
  the inner state and `nonfinite_leaves` are left as they are (they can be
  large).
  """
  state = state._replace(**{f: fold_into_scalars(zero, getattr(state, f)) for f in _SCALAR_FIELDS})
  return fold_into_smallest_leaf(zero, out), state


_SCALAR_FIELDS = ("loss_scale", "last_step_applied", "consecutive_skips", "total_skips")


def fold_into_scalars(zero: jax.Array, tree: Any) -> Any:
  """`tree` with the guard's zero folded into each scalar leaf (see `keep_alive`)."""
  return jax.tree.map(lambda x: _fold(zero, x) if jnp.ndim(x) == 0 else x, tree)


def fold_into_smallest_leaf(zero: jax.Array, tree: Any) -> Any:
  """`tree` with the guard's zero folded into its smallest array leaf (see `keep_alive`)."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [
    i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.dtype != jax.dtypes.float0
  ]
  if arrays:
    smallest = min(arrays, key=lambda i: leaves[i].size)
    leaves[smallest] = _fold(zero, leaves[smallest])
  return jax.tree.unflatten(treedef, leaves)
