"""`skip_bad_steps`: skip NaN/Inf steps and loss or gradient-norm spikes, without loss scaling.

For bfloat16 and float32 runs, which need no loss scale but still die of one
non-finite step or of one bad batch. Per update:

  sq     = psum_over_axis_name(sum(g**2))              # only when spikes are watched
  finite = sq is finite, or if sq is +Inf all_finite(grads, axis_name)  (else all_finite)
  norm   = sqrt(sq)     # +Inf also when finite gradients' squares overflow float32
  spike  = finite and, for a watched quantity x (log norm, loss) past its warm-up,
           (x - running_mean) / running_std > spike_threshold
  if spike and the spike streak already reached max_consecutive_spike_skips:
    on_spike_streak='accept': apply the step and re-base the statistic on x
    on_spike_streak='raise':  skip the step and raise OverflowGuardError
  elif spike: on_spike='skip': skip the step
              on_spike='clip': a norm spike is applied with grads * T / norm,
                               T = exp(mean + spike_threshold * std) (a loss
                               spike is still skipped); it feeds no statistic
  apply = finite and not (a skipped spike)
  inner runs only if apply (lax.cond); the statistic is fed only applied steps

Skipped steps do not feed the statistic: a spike would otherwise widen the
variance and hide the next one, and a NaN would poison it. Neither do a zero
norm nor one that overflows float32 (log 0 and log Inf carry no scale); the
latter is a spike once warmed up, and applied before, as without spike
detection: the finiteness answer is the same with or without it. A real change of
regime therefore looks like a streak of spikes, which the streak bound ends.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._src.diagnostics import overflow_guard, skip_guard
from optax_lossscale._src.step import composition, conditional_step, overwrite
from optax_lossscale._src.utils import params_check, tree_utils, validation
from optax_lossscale._src.wrappers import spike_statistic as stat_lib

MONITORS = ("grad_norm", "loss")
_ON_SPIKE = ("skip", "clip")
_ON_SPIKE_STREAK = ("accept", "raise")
# What a clipped step feeds the gradient-norm statistic: its norm after clipping
# ("clipped", the threshold, as ZClip does), its norm before ("raw"), or nothing
# ("none"). Measured in benchmarks/spike_clipping.py (docs/benchmark_findings.md,
# "Clipping spikes"): with recurring bad batches, feeding the threshold or the raw norm
# raised the threshold until later spikes went through; nothing kept it.
_CLIPPED_FEEDS = "none"


class SkipBadStepsState(NamedTuple):
  """State of `skip_bad_steps`.

  Attributes:
    inner_state: the wrapped transformation's state; bit-identical across a
      skipped step.
    last_step_applied: bool scalar, whether the last update was applied.
    consecutive_skips: int32 scalar, skipped updates (any reason) since the
      last applied one.
    total_skips: int32 scalar, skipped updates since `init`.
    nonfinite_skips: int32 scalar, updates skipped for NaN/Inf.
    spike_skips: int32 scalar, updates skipped as spikes.
    consecutive_spike_skips: int32 scalar, the current streak of spikes,
      skipped or (with `on_spike='clip'`) clipped; non-finite steps inside it
      neither extend nor end it.
    spike_rebases: int32 scalar, spike streaks ended by accepting the step
      and re-basing the statistic (`on_spike_streak='accept'`).
    spike_clips: int32 scalar, gradient-norm spikes applied with their
      gradients scaled down to the threshold norm (`on_spike='clip'`).
    grad_norm: the `RunningStatistic` of the log global gradient norm, or None
      when the norm is not watched.
    loss: the `RunningStatistic` of the loss, or None when it is not watched.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.skip_bad_steps(optax.adam(1e-3))
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> _, state = tx.update({'w': jnp.array([jnp.inf, 0.0])}, state)
    >>> bool(state.last_step_applied), int(state.nonfinite_skips), int(state.inner_state[0].count)
    (False, 1, 0)
  """

  inner_state: optax.OptState
  last_step_applied: jax.Array
  consecutive_skips: jax.Array
  total_skips: jax.Array
  nonfinite_skips: jax.Array
  spike_skips: jax.Array
  consecutive_spike_skips: jax.Array
  spike_rebases: jax.Array
  spike_clips: jax.Array
  grad_norm: stat_lib.RunningStatistic | None = None
  loss: stat_lib.RunningStatistic | None = None


class SkipBadSteps(optax.GradientTransformationExtraArgs):
  """The `GradientTransformationExtraArgs` returned by `skip_bad_steps`.

  The `(init, update)` pair optax expects, plus `inner_optimizer` and
  `get_config()`.

  Example:
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=6.0)
    >>> isinstance(tx, optax.GradientTransformationExtraArgs), tx.get_config()['monitor']
    (True, ['grad_norm'])
  """

  __slots__ = ()

  @property
  def inner_optimizer(self) -> optax.GradientTransformation:
    """The wrapped transformation."""
    return getattr(self.update, conditional_step.SETTINGS_ATTR)["inner"]

  def get_config(self) -> dict[str, Any]:
    """A JSON-serializable dict of the settings (not the inner's)."""
    return dict(getattr(self.update, conditional_step.SETTINGS_ATTR)["config"])


def _sum_of_squares(tree: Any, nonfinite_as_nan: bool = False) -> jax.Array:
  """The squared global L2 norm of the inexact leaves, accumulated in float32 or wider.

  With `nonfinite_as_nan` a NaN/Inf value contributes NaN, so that the sum is
  NaN exactly when a gradient is not finite and +Inf only when finite ones
  overflow float32's squares: one reduction answers both questions.
  """
  total = jnp.zeros((), jnp.float32)
  for g in jax.tree.leaves(tree):
    if not tree_utils.is_inexact(g) or not jnp.size(g):
      continue
    g = jnp.asarray(g)
    if jnp.iscomplexobj(g):
      g = jnp.abs(g)
    g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
    squares = jnp.where(jnp.isfinite(g), g * g, jnp.nan) if nonfinite_as_nan else g * g
    total = total + jnp.sum(squares).astype(jnp.float32)
  return total


def _check_monitor(monitor: Any) -> tuple[str, ...]:
  names = (monitor,) if isinstance(monitor, str) else monitor
  accepted = f"one of {MONITORS} or a tuple of them"
  if not isinstance(names, (tuple, list)) or not names:
    raise ValueError(f"monitor must be {accepted}; got {monitor!r}.")
  if any(n not in MONITORS for n in names) or len(set(names)) != len(names):
    raise ValueError(f"monitor must be {accepted}, without repeats; got {monitor!r}.")
  return tuple(n for n in MONITORS if n in names)


def skip_bad_steps(
  inner: optax.GradientTransformation,
  *,
  spike_threshold: float | None = None,
  monitor: str | Sequence[str] = "grad_norm",
  warmup_steps: int = 100,
  ema_decay: float = 0.99,
  min_std: float = 0.05,
  max_consecutive_spike_skips: int = 10,
  on_spike: Literal["skip", "clip"] = "skip",
  on_spike_streak: Literal["accept", "raise"] = "accept",
  max_consecutive_skips: int | None = None,
  skip_mode: conditional_step.SkipMode = "auto",
  axis_name: tree_utils.AxisName = None,
  overwrite_with_gradient: overwrite.Spec = "auto",
) -> SkipBadSteps:
  """Wraps an optax transformation to skip non-finite steps and, optionally, spikes.

  For runs without loss scaling (bfloat16, float32). A step is skipped when
  its gradients (or their norm, or the watched loss) hold NaN/Inf, and, with
  `spike_threshold` set, when the log of the global gradient norm or the loss
  (`monitor`) lies more than `spike_threshold` running standard deviations
  above its running mean, after `warmup_steps` accepted steps. The running
  mean and variance are exponential moving averages (`ema_decay`) over the
  **applied** steps only (an all-zero gradient, whose log-norm is -inf, is
  applied without feeding it); the standard deviation is floored at
  `min_std` (for the log-norm, a relative change; for the loss, times |mean|).

  A skipped step returns zero updates (of the dtypes `inner` returns) and
  leaves `inner`'s state bit-identical. An applied step returns exactly what
  `inner.update(grads, inner_state, params, **extra_args)` returns. After
  `max_consecutive_spike_skips` spike skips in a row the next spike is taken
  as a change of regime: `on_spike_streak='accept'` applies it and re-centres
  the statistic on it, `'raise'` raises `OverflowGuardError` with a gradient
  report. `ols.metrics(state)` reports the skips by reason and the statistic.

  With `loss` in `monitor`, pass the (unscaled, scalar) loss to every update:
  `tx.update(grads, state, params, loss=loss)`. It is also passed on to
  `inner`, as optax passes extra arguments.

  Inside `shard_map`/`pmap`, pass `axis_name`: the squared norm is summed
  (`psum`) and the loss averaged (`pmean`) across it, so every shard makes
  the same decision. Gradients already equal across a named axis give a norm
  sqrt(n) times too large; the decision is unchanged (a constant factor
  shifts the log-norm and its mean alike).

  To combine with loss scaling (float16), put this inside the loss-scale
  wrapper, `loss_scale_optimizer(skip_bad_steps(inner, ...))`: an overflow is
  then handled (and the scale backs off) before this sees the step, and it
  sees unscaled gradients, whose norm does not jump when the scale changes.
  The other order is rejected at `init`.

  For gradient accumulation put `optax.MultiSteps` inside:
  `skip_bad_steps(optax.MultiSteps(inner, k).gradient_transformation())`
  skips a bad micro-batch before it is accumulated. The other order is
  refused at `init`: MultiSteps clears its accumulator by multiplying it by
  zero, so one NaN micro-batch would stay in it and every later step would
  be skipped. Watching the gradient norm after a norm clipping in a chain
  (`optax.chain(optax.clip_by_global_norm(c), skip_bad_steps(...))`) is
  refused at the first update: the clipped norm never spikes. Put the
  clipping inside, `skip_bad_steps(optax.chain(clip, inner), ...)`.

  Args:
    inner: the transformation to wrap, e.g. `optax.adam(1e-3)` or a chain.
    spike_threshold: the z-score above which a watched value is a spike, a
      positive number; None (default) skips non-finite steps only and
      computes no norm.
    monitor: what to watch for spikes: `'grad_norm'` (default), `'loss'`, or
      both as a tuple (a spike in either skips).
    warmup_steps: applied steps that feed the statistic before spikes are
      detected (an integer >= 1).
    ema_decay: the moving averages' decay, in [0, 1); about `1/(1-decay)`
      steps of memory. The first steps average exactly.
    min_std: the floor on the standard deviation (>= 0).
    max_consecutive_spike_skips: spikes (skipped or clipped) tolerated in a
      row (>= 1).
    on_spike: `'skip'` (default) skips a spiking step; `'clip'` applies a
      gradient-norm spike with its gradients scaled down to the threshold
      norm `exp(mean + spike_threshold * std)` of the running statistic of
      the log-norm, as ZClip does. Unlike ZClip, a clipped step feeds the
      statistic nothing, as a skipped one: feeding it the clipped norm let
      recurring bad batches raise the threshold until they went through
      (docs/benchmark_findings.md, "Clipping spikes"); a real change of regime ends as a
      streak of spikes does. A loss spike is still skipped. Needs
      `'grad_norm'` in `monitor`. `metrics` counts these steps as
      `spike_clips`.
    on_spike_streak: `'accept'` or `'raise'`: what the next spike does.
    max_consecutive_skips: if set (>= 1), a skipped step that makes the streak
      of skips (any reason) longer than this raises `OverflowGuardError`.
    skip_mode: `'cond'` runs `inner` inside `lax.cond`; `'select'` runs it
      always and selects the result; `'auto'` (the default) picks per backend
      when the update is traced, as `loss_scale_optimizer` does.
    axis_name: inside `shard_map`/`pmap`, the axis name(s) to agree across.
    overwrite_with_gradient: which leaves are fp8 metadata whose "gradient"
      is their new value (see `loss_scale_optimizer`): `'auto'` (Flax's
      `_overwrite_with_gradient` collection), None, a pytree of bools or a
      predicate `(path, leaf) -> bool`. They are checked for NaN/Inf, left
      out of the norm and of the inner optimizer, and written on applied
      steps only.

  Returns:
    A `SkipBadSteps`, an `optax.GradientTransformationExtraArgs`;
    `ols.apply_gradients(tx, ...)` fuses its parameter update into the skip
    branch.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=6.0, warmup_steps=2)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, 1.1, 1.0, jnp.nan, 1000.0, 1.05):
    ...   params, state = ols.apply_gradients(tx, {'w': jnp.full(2, g)}, state, params)
    >>> m = ols.metrics(state)
    >>> int(m['nonfinite_skips']), int(m['spike_skips']), int(m['total_skips'])
    (1, 1, 2)

  References:
    `optax.apply_if_finite`; Levanter's loss-spike skipping; Paxml's
    `is_valid_step`.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3));"
      f" got {type(inner).__name__}."
    )
  inner_kind = (conditional_step.settings_of(inner) or {}).get("kind")
  writes_params = inner_kind if inner_kind in composition.PARAM_WRITERS else None
  if inner_kind == composition.LOSS_SCALE:
    raise ValueError(
      "skip_bad_steps must go inside the loss-scale wrapper, not around it:"
      " loss_scale_optimizer(skip_bad_steps(inner, ...)), so that an overflow"
      " backs the scale off and the spike check sees unscaled gradients."
    )
  if inner_kind == composition.SKIP:
    raise ValueError(
      "skip_bad_steps cannot wrap another skip_bad_steps; use one, with the options"
      " of both: skip_bad_steps(inner, spike_threshold=..., ...)."
    )
  if spike_threshold is not None:
    spike_threshold = validation.check_float(
      "spike_threshold",
      spike_threshold,
      low=0.0,
      low_inclusive=False,
      accepted="None (no spike detection) or a positive number",
    )
  monitors = _check_monitor(monitor) if spike_threshold is not None else ()
  if spike_threshold is None:
    _check_monitor(monitor)
  warmup_steps = validation.check_int(
    "warmup_steps", warmup_steps, low=1, accepted="an integer >= 1"
  )
  ema_decay = validation.check_float(
    "ema_decay",
    ema_decay,
    low=0.0,
    low_inclusive=True,
    high=1.0,
    high_inclusive=False,
    accepted="a number in [0, 1)",
  )
  min_std = validation.check_float(
    "min_std", min_std, low=0.0, low_inclusive=True, accepted="a number >= 0"
  )
  max_consecutive_spike_skips = validation.check_int(
    "max_consecutive_spike_skips",
    max_consecutive_spike_skips,
    low=1,
    accepted="an integer >= 1",
  )
  if on_spike not in _ON_SPIKE:
    raise ValueError(f"on_spike must be one of {_ON_SPIKE}; got {on_spike!r}.")
  if on_spike == "clip" and "grad_norm" not in monitors:
    raise ValueError(
      "on_spike='clip' scales the gradients down to the threshold norm, so it needs"
      " spike_threshold set and 'grad_norm' in monitor; got"
      f" spike_threshold={spike_threshold!r}, monitor={monitor!r}."
    )
  if on_spike_streak not in _ON_SPIKE_STREAK:
    raise ValueError(f"on_spike_streak must be one of {_ON_SPIKE_STREAK}; got {on_spike_streak!r}.")
  max_consecutive_skips = overflow_guard.check_max_consecutive_skips(max_consecutive_skips)
  skip_mode = conditional_step.check_skip_mode(skip_mode)
  overwrite_with_gradient = overwrite.check_spec(overwrite_with_gradient)
  axis_name = tree_utils.normalize_axis_name(axis_name)
  config = {
    "spike_threshold": spike_threshold,
    "monitor": list(monitors),
    "warmup_steps": warmup_steps,
    "ema_decay": ema_decay,
    "min_std": min_std,
    "max_consecutive_spike_skips": max_consecutive_spike_skips,
    "on_spike": on_spike,
    "on_spike_streak": on_spike_streak,
    "max_consecutive_skips": max_consecutive_skips,
    "skip_mode": skip_mode,
    "axis_name": list(axis_name) if isinstance(axis_name, tuple) else axis_name,
    "overwrite_with_gradient": overwrite.config_value(overwrite_with_gradient),
  }
  guard = skip_guard.make_guard(config)
  user_inner, inner = inner, optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> SkipBadStepsState:
    composition.check_init(composition.SKIP, init_fn)
    params_check.check_params_are_arrays(params, "skip_bad_steps.init")
    marked = overwrite.resolve(overwrite_with_gradient, params)
    inner_state = inner.init(overwrite.exclude(marked, params))
    zero = jnp.zeros((), jnp.int32)
    return SkipBadStepsState(
      inner_state=inner_state,
      last_step_applied=jnp.ones((), jnp.bool_),
      consecutive_skips=zero,
      total_skips=zero,
      nonfinite_skips=zero,
      spike_skips=zero,
      consecutive_spike_skips=zero,
      spike_rebases=zero,
      spike_clips=zero,
      grad_norm=stat_lib.init() if "grad_norm" in monitors else None,
      loss=stat_lib.init() if "loss" in monitors else None,
    )

  composition.register_init(init_fn, composition.SKIP)

  def watched_values(
    grads: Any, loss: Any, marked: overwrite.Marked | None
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Whether the step is finite, and the watched values (raw) by name.

    Overwrite-with-gradient leaves are new values, not gradients: checked for
    NaN/Inf, left out of the norm.
    """
    values = {}
    written = []
    if marked is not None:
      grads, written = marked.split(grads)
    if "grad_norm" in monitors:
      # The norm is the finiteness check, one pass over the gradients: a NaN/Inf
      # gradient makes the sum NaN or +Inf (on every shard, after the psum). +Inf
      # is also what finite gradients whose squares overflow float32 give. To
      # tell the two apart, 'cond' mode (CPU, TPU) reads the gradients again
      # under a cond taken only when the sum is +Inf; 'select' mode (GPUs, where
      # a conditional sends its predicate to the host) turns non-finite values
      # into NaN inside the one reduction, arithmetic a memory-bound GPU pass
      # absorbs (on CPU it costs x1.7 to x8 of the plain sum: docs/benchmark_findings.md).
      by_cond = conditional_step.resolve_skip_mode(skip_mode) == "cond"
      squares = _sum_of_squares(grads, nonfinite_as_nan=not by_cond)
      if axis_name is not None:
        squares = jax.lax.psum(squares, axis_name)
      values["grad_norm"] = jnp.sqrt(squares)
      if by_cond:
        exact = lambda: tree_utils.all_finite(grads, axis_name)
        finite = jax.lax.cond(jnp.isinf(squares), exact, lambda: jnp.isfinite(squares))
      else:
        finite = jnp.logical_not(jnp.isnan(squares))
    else:
      finite = tree_utils.all_finite(grads, axis_name)
    if "loss" in monitors:
      if loss is None:
        raise ValueError(
          "skip_bad_steps(monitor=...'loss'...) needs the loss of every step: pass it as"
          " loss=loss to tx.update(grads, state, params, loss=loss),"
          " ols.apply_gradients(tx, grads, state, params, loss=loss),"
          " TrainState.apply_gradients(grads=grads, loss=loss) or"
          " nnx.Optimizer.update(model, grads, loss=loss)."
        )
      loss = jnp.asarray(loss)
      if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
          f"loss must be a real floating scalar; got dtype {loss.dtype} and shape {loss.shape}."
        )
      loss = loss.astype(jnp.float32)
      if axis_name is not None:
        loss = jax.lax.pmean(loss, axis_name)
      values["loss"] = loss
      finite = finite & jnp.isfinite(loss)
    if written:
      finite = finite & tree_utils.all_finite(written, axis_name)
    return finite, values

  def step(
    grads: optax.Updates,
    state: SkipBadStepsState,
    params: optax.Params | None,
    extra_args: dict[str, Any],
    apply_to_params: bool,
  ) -> tuple[Any, SkipBadStepsState]:
    if not isinstance(state, SkipBadStepsState):
      raise TypeError(
        "skip_bad_steps's update expects the SkipBadStepsState that its init returned;"
        f" got {type(state).__name__}. Pass this wrapper's state, opt_state ="
        " tx.init(params) with tx the skip_bad_steps transformation."
      )
    if params is not None:
      params_check.check_params_are_arrays(params, "skip_bad_steps.update")
    marked = overwrite.resolve(overwrite_with_gradient, grads)
    composition.check_update(
      composition.SKIP,
      update_fn,
      "grad_norm" in monitors,
      writes_values=marked is not None,
      traced=composition.is_traced(grads),
      writes_params=writes_params,
    )
    finite, values = watched_values(grads, extra_args.get("loss"), marked)
    stats = {name: getattr(state, name) for name in monitors}
    # The statistic's units: the log of the norm (scale-free), the loss itself.
    xs = {n: jnp.log(v) if n == "grad_norm" else v for n, v in values.items()}
    spiked = {
      n: (stats[n].count >= warmup_steps)
      & (stat_lib.zscore(stats[n], xs[n], min_std, relative=n == "loss") > spike_threshold)
      for n in monitors
    }
    spike = functools.reduce(jnp.logical_or, spiked.values(), jnp.asarray(False)) & finite
    streak_over = spike & (state.consecutive_spike_skips >= max_consecutive_spike_skips)
    rebase = streak_over if on_spike_streak == "accept" else jnp.asarray(False)
    handled = spike & ~rebase
    clipped, prepare, threshold = jnp.asarray(False), None, None
    if on_spike == "clip":
      # A norm spike (not a loss spike, nor a norm that overflowed float32,
      # which has no finite size to clip from) is applied with the gradients
      # scaled down to the threshold norm.
      threshold = stat_lib.threshold(stats["grad_norm"], spike_threshold, min_std, relative=False)
      norm_spike = spiked["grad_norm"] & jnp.isfinite(xs["grad_norm"])
      clipped = handled & norm_spike & ~spiked.get("loss", jnp.asarray(False))
      factor = jnp.where(clipped, jnp.exp(threshold - xs["grad_norm"]), 1.0)
      prepare = lambda g: tree_utils.map_inexact(lambda x: x * factor.astype(x.dtype), g)
    spike_skip = handled & ~clipped
    should_apply = finite & ~spike_skip

    out, inner_state = conditional_step.apply_inner_if(
      should_apply,
      inner,
      grads,
      state.inner_state,
      params,
      extra_args,
      skip_mode=skip_mode,
      apply_to_params=apply_to_params,
      prepare=prepare,
      marked=marked,
    )

    new_stats = {}
    for n in monitors:
      x = xs[n]
      feeds = should_apply
      if n == "grad_norm" and on_spike == "clip":
        if _CLIPPED_FEEDS == "clipped":
          x = jnp.where(clipped, threshold, x)
        elif _CLIPPED_FEEDS == "none":
          feeds = feeds & ~clipped
      fed = jax.tree.map(
        functools.partial(jnp.where, spiked[n] & rebase),
        stat_lib.rebase(stats[n], x),
        stat_lib.accumulate(stats[n], x, ema_decay),
      )
      # A zero norm (log -inf) says nothing about the scale of the next one and
      # would poison the mean: it is applied but does not feed the statistic.
      feeds = feeds & jnp.isfinite(x)
      kept = jax.tree.map(functools.partial(jnp.where, feeds), fed, stats[n])
      new_stats[n] = kept._replace(last=values[n])

    skipped = ~should_apply
    as_int = lambda b: b.astype(jnp.int32)
    consecutive_skips = jnp.where(skipped, state.consecutive_skips + 1, 0).astype(jnp.int32)
    spike_streak = state.consecutive_spike_skips
    new_state = SkipBadStepsState(
      inner_state=inner_state,
      last_step_applied=should_apply,
      consecutive_skips=consecutive_skips,
      total_skips=state.total_skips + as_int(skipped),
      nonfinite_skips=state.nonfinite_skips + as_int(~finite),
      spike_skips=state.spike_skips + as_int(spike_skip),
      consecutive_spike_skips=jnp.where(
        handled, spike_streak + 1, jnp.where(should_apply, 0, spike_streak)
      ).astype(jnp.int32),
      spike_rebases=state.spike_rebases + as_int(rebase),
      spike_clips=state.spike_clips + as_int(clipped),
      grad_norm=new_stats.get("grad_norm"),
      loss=new_stats.get("loss"),
    )
    if guard is not None:
      too_many = jnp.asarray(False)
      if max_consecutive_skips is not None:
        too_many = skipped & (consecutive_skips > max_consecutive_skips)
      raising = streak_over if on_spike_streak == "raise" else jnp.asarray(False)
      zero = guard(grads, consecutive_skips, spike_streak, too_many, raising, finite, values)
      # Every scalar of the new state and the smallest leaf of the output depend
      # on the guard, so it fires whatever the caller keeps (the inner state is
      # left alone: it can be large).
      new_state = new_state._replace(
        **{
          f: overflow_guard.fold_into_scalars(zero, getattr(new_state, f))
          for f in new_state._fields
          if f != "inner_state"
        }
      )
      out = overflow_guard.fold_into_smallest_leaf(zero, out)
    return out, new_state

  update_fn = conditional_step.attach(
    step, {"kind": composition.SKIP, "inner": user_inner, "config": config}
  )
  return SkipBadSteps(init_fn, update_fn)
