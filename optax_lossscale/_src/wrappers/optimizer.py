"""`loss_scale_optimizer`: an optax transformation that unscales, checks and skips.

The wrapper owns the loss scale. Each update divides the incoming gradients
(of the *scaled* loss) by the current scale, checks them for NaN/Inf, updates
the loss scale, and runs the inner transformation only on finite steps. On a
skipped step the updates are zeros and the inner state is returned untouched,
so schedules, Adam moments and step counts do not advance.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._src.diagnostics import overflow_guard
from optax_lossscale._src.loss_scales import (
  dynamic_loss_scale,
  keras_compat,
  serialization,
  skipping_fixed_loss_scale,
)
from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.step import composition, conditional_step, overwrite
from optax_lossscale._src.step.conditional_step import SkipMode
from optax_lossscale._src.utils import params_check, tree_utils
from optax_lossscale._src.wrappers import scaled_check


class LossScaleOptimizerState(NamedTuple):
  """State of `loss_scale_optimizer`.

  Attributes:
    inner_state: the wrapped transformation's state; bit-identical across a
      skipped step.
    loss_scale: the current `LossScale` (a pytree; its leaves are the scale
      and its counters).
    last_step_applied: bool scalar, whether the last update was applied
      (True before the first update).
    consecutive_skips: int32 scalar, skipped updates since the last applied one.
    total_skips: int32 scalar, skipped updates since `init`.
    nonfinite_leaves: None, or with `record_nonfinite_leaves=True` a tree
      shaped like the parameters holding one bool scalar per leaf: whether
      that leaf's gradient held NaN/Inf on the last skipped step.
    retries: int32 scalar, backward passes redone at a lower scale by
      `retry_on_overflow` for the last step it served (0 in a run without it).
    total_retries: int32 scalar, the same since `init`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> isinstance(state, ols.LossScaleOptimizerState)
    True
    >>> overflowed = ols.mark_scaled({'w': jnp.full(2, jnp.nan)})  # grads of a scaled loss
    >>> _, state = tx.update(overflowed, state)
    >>> bool(state.last_step_applied), int(state.total_skips), float(state.loss_scale())
    (False, 1, 16384.0)
  """

  inner_state: optax.OptState
  loss_scale: loss_scale_lib.LossScale
  last_step_applied: jax.Array
  consecutive_skips: jax.Array
  total_skips: jax.Array
  nonfinite_leaves: Any = None
  retries: jax.Array | None = None
  total_retries: jax.Array | None = None


class LossScaleOptimizer(optax.GradientTransformationExtraArgs):
  """The `GradientTransformationExtraArgs` returned by `loss_scale_optimizer`.

  It is still the `(init, update)` pair that optax, Flax and `optax.chain`
  expect; the extra read-only attributes mirror Keras's `LossScaleOptimizer`.

  Example:
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), dynamic_growth_steps=100)
    >>> isinstance(tx, optax.GradientTransformation), tx.dynamic
    (True, True)
    >>> tx.initial_scale, tx.dynamic_growth_steps, tx.skip_mode in ('cond', 'select')
    (32768.0, 100, True)
  """

  __slots__ = ()  # immutable, like the tuple it is

  # The tuple stays the two functions optax unpacks. The Keras-style settings
  # below ride on the update function, so they survive `_replace(init=...)`
  # and `jax.tree.map`, which rebuild the tuple from its two fields.

  @property
  def _settings(self) -> dict[str, Any]:
    settings = getattr(self.update, conditional_step.SETTINGS_ATTR, None)
    if settings is None:
      raise AttributeError(
        "This LossScaleOptimizer's update function was replaced; its settings are gone."
      )
    return settings

  @property
  def inner_optimizer(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped transformation."""
    return self._settings["inner"]

  @property
  def initial_loss_scale(self) -> loss_scale_lib.LossScale:
    """The `LossScale` that `init` puts in the state."""
    return self._settings["loss_scale"]

  @property
  def dynamic(self) -> bool:
    """Whether the loss scale is dynamic (can change; Keras's `dynamic`)."""
    return self.initial_loss_scale.dynamic

  @property
  def skips(self) -> bool:
    """Whether a non-finite step is skipped: True but for a `FixedLossScale` or `NoOpLossScale`."""
    return self.initial_loss_scale.skips

  @property
  def initial_scale(self) -> float:
    """The initial loss scale (the only one when `dynamic` is False)."""
    return float(self.initial_loss_scale())

  @property
  def dynamic_growth_steps(self) -> int | None:
    """Finite steps between growths, or None when the scale is not dynamic."""
    ls = self.initial_loss_scale
    return ls.increment_period if isinstance(ls, dynamic_loss_scale.DynamicLossScale) else None

  @property
  def skip_mode(self) -> SkipMode:
    """How skipped steps are implemented on the default backend: 'cond' or 'select'.

    'auto' is resolved here (see `loss_scale_optimizer`); `get_config` keeps
    the mode as requested, so a config saved on one backend stays 'auto'.
    """
    return conditional_step.resolve_skip_mode(self._settings["skip_mode"])

  @property
  def axis_name(self) -> Any:
    """The mapped axis name(s) the finiteness check agrees across, or None."""
    return self._settings["axis_name"]

  def get_config(self) -> dict[str, Any]:
    """A JSON-serializable dict of the wrapper's settings (not the inner's).

    Equivalent ways of building the wrapper give equal configs.
    """
    axis_name = self.axis_name
    return {
      "loss_scale": serialization.serialize(self.initial_loss_scale),
      "dynamic": self.dynamic,
      "initial_scale": self.initial_scale,
      "dynamic_growth_steps": self.dynamic_growth_steps,
      "skip_mode": self._settings["skip_mode"],
      "axis_name": list(axis_name) if isinstance(axis_name, tuple) else axis_name,
      **self._settings["diagnostics"],
      "overwrite_with_gradient": overwrite.config_value(self._settings["overwrite_with_gradient"]),
    }

  @classmethod
  def from_config(
    cls, config: dict[str, Any], inner: optax.GradientTransformation
  ) -> LossScaleOptimizer:
    """Rebuilds the wrapper that a config describes, around `inner`.

    Accepts the dict of our `get_config()` (or its JSON round trip) and those
    of Keras 2's and Keras 3's `LossScaleOptimizer.get_config()`. The inner
    transformation is not part of the config (optax transformations are
    closures, not serializable), so it is passed again; Keras's serialized
    `inner_optimizer` (and Keras 3's `name`) are ignored.

    Args:
      config: a dict returned by `get_config()`, or by Keras's.
      inner: the transformation to wrap, e.g. `optax.adam(1e-3)`.

    Returns:
      A `LossScaleOptimizer` whose `get_config()` equals `config` (ours),
      starting from the config's initial scale.

    Example:
      >>> import optax
      >>> import optax_lossscale as ols
      >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), max_consecutive_skips=3)
      >>> again = ols.LossScaleOptimizer.from_config(tx.get_config(), optax.adam(1e-3))
      >>> again.get_config() == tx.get_config()
      True
      >>> keras3 = {'name': 'loss_scale_optimizer', 'inner_optimizer': {},
      ...           'initial_scale': 1024.0, 'dynamic_growth_steps': 100}
      >>> ols.LossScaleOptimizer.from_config(keras3, optax.adam(1e-3)).initial_scale
      1024.0
    """
    return loss_scale_optimizer(inner, **keras_compat.config_to_kwargs(config))


def _scaling_keeps_finiteness(ls: loss_scale_lib.LossScale) -> bool:
  """Whether the scaled gradients are finite exactly where the unscaled are.

  Unscaling multiplies by 1/S. With S >= 1 that neither overflows a finite
  gradient nor makes a NaN or Inf finite, so checking the scaled gradients
  gives TensorFlow's answer. `DynamicLossScale` keeps S within
  [min_loss_scale, max_loss_scale], so `min_loss_scale >= 1` (the default)
  guarantees it, as long as nobody sets the scale below `min_loss_scale` by
  hand (`replace` cannot check a traced value); a `SkippingFixedLossScale`
  of at least 1 too. A subclass that changes how the scale is updated or
  applied gets the unscaled gradients.
  """
  same_rules = lambda base, methods: all(
    getattr(type(ls), method) is getattr(base, method) for method in methods
  )
  if isinstance(ls, skipping_fixed_loss_scale.SkippingFixedLossScale):
    base = skipping_fixed_loss_scale.SkippingFixedLossScale
    return same_rules(base, ("update", "unscale", "_reciprocal")) and ls.loss_scale_value >= 1
  base = dynamic_loss_scale.DynamicLossScale
  return same_rules(base, ("update", "adjust", "unscale")) and ls.min_loss_scale >= 1


def _restarted(ls: loss_scale_lib.LossScale) -> loss_scale_lib.LossScale:
  """`ls` in its initial state, as its config describes it (TensorFlow's choice).

  The wrapper is rebuilt from `get_config()`, which holds the initial scale,
  so it must start there: a loss scale that has already stepped would
  otherwise start the wrapper elsewhere than its config's copy. Its current
  state is not silently dropped: a warning says what was discarded.
  """
  fresh = ls.from_config(ls.get_config())
  try:
    same = fresh == ls
  except (TypeError, jax.errors.ConcretizationTypeError):  # traced state: nothing to compare
    return fresh
  if not same:
    warnings.warn(
      f"loss_scale_optimizer starts from the initial state of the given {type(ls).__name__}"
      f" (scale {float(fresh()):g}), not from its current state (scale {float(ls()):g}),"
      " as TensorFlow's LossScaleOptimizer does and as get_config() describes. To start"
      " from the current scale, build a new loss scale with that initial value; to resume a"
      " run, restore its optimizer state from a checkpoint.",
      UserWarning,
      stacklevel=4,
    )
  return fresh


def _check_float_grads(grads: optax.Updates) -> None:
  """Raises at trace time if a gradient leaf is an integer or bool array.

  An integer leaf cannot be a gradient of the scaled loss that unscaling
  turns into the true one: `g / S` is not an integer, and passing it through
  would hand the inner optimizer a value `S` times too large (a silent
  `[-4, -8]` for `[-1, -2]` at scale 4).
  """
  params_check.check_float_grads(
    grads,
    "loss_scale_optimizer",
    "It cannot be unscaled and would reach the inner optimizer multiplied by the loss scale.",
  )


def _check_state(state: Any) -> None:
  if not isinstance(state, LossScaleOptimizerState):
    hint = ""
    if isinstance(state, (tuple, list)) or hasattr(state, "_fields"):
      hint = (
        " It looks like the inner optimizer's state: pass the state of this wrapper,"
        " opt_state = tx.init(params) with tx the loss_scale_optimizer."
      )
    raise TypeError(
      "loss_scale_optimizer's update expects the LossScaleOptimizerState that its init"
      f" returned; got {type(state).__name__}.{hint}"
    )


def loss_scale_optimizer(
  inner: optax.GradientTransformation,
  loss_scale: Any = "dynamic",
  *,
  dynamic: bool | None = None,
  initial_scale: float | None = None,
  dynamic_growth_steps: int | None = None,
  skip_mode: SkipMode = "auto",
  axis_name: tree_utils.AxisName = None,
  record_nonfinite_leaves: bool = False,
  max_consecutive_skips: int | None = None,
  raise_at_min_loss_scale: bool = False,
  overwrite_with_gradient: overwrite.Spec = "auto",
  **keras_options: Any,
) -> LossScaleOptimizer:
  """Wraps an optax transformation with loss scaling and overflow skipping.

  Feed it the gradients of the **scaled** loss (`value_and_grad`, or
  `jax.grad` of `get_scaled_loss`). Each update divides them by the current
  scale, checks them for NaN/Inf, updates the loss scale and, on a finite
  step, returns exactly what
  `inner.update(ls.unscale(grads), inner_state, params)` returns. On a
  non-finite step the updates are zeros of the dtypes `inner` would return
  and `inner`'s state is left bit-identical: its step count, schedules and
  moments do not advance. Which scales skip: `DynamicLossScale` (the default)
  and `SkippingFixedLossScale` (a constant scale, jmp's recipe) skip every
  non-finite step; `FixedLossScale` (a number, or `dynamic=False`:
  TensorFlow's rule) and `NoOpLossScale` skip none, and apply NaN/Inf
  updates as they come.

  The unscaling is compiled into the inner update, so the unscaled gradients
  never reach memory. With power-of-two scales (the dynamic default) they are
  the true gradients bit for bit; the inner arithmetic is then the unwrapped
  optimizer's, fused as XLA fuses it, which (as between any two XLA
  programs) may round a multiply-add differently in the last bit. With
  `min_loss_scale >= 1` (the default) the finiteness check reads the scaled
  gradients as they are, which gives the same answer: dividing by a scale of
  at least 1 cannot change which values are finite.

  Every gradient leaf must be floating or `None`: an integer or bool leaf
  raises a `TypeError` naming its path when the step is traced. It cannot be
  unscaled (`g / S` is no integer), and passing it through would feed the
  inner optimizer a value `S` times too large without a word. Keep integer
  arrays out of the tree you optimize. A NaN/Inf in *any* floating leaf skips
  the step, also in a leaf the inner optimizer ignores (a frozen leaf under
  `optax.set_to_zero` in a `multi_transform`): leave such leaves out of the
  gradients rather than relying on the inner optimizer to drop them.

  Gradients of the plain loss would be divided by the scale all the same.
  When the update runs (or is traced) and no loss has been scaled since the
  wrapper was built, it warns, `UnscaledGradientsWarning`: every
  `LossScale.scale` counts (`value_and_grad`, `get_scaled_loss`, their Flax,
  NNX and Equinox forms, `retry_on_overflow`), and `mark_scaled` declares a
  loss scaled another way. The check is Python run at trace time: nothing of
  it is in the compiled step.

  To step, `apply_gradients(tx, grads, state, params)` is cheaper than
  `update` followed by `optax.apply_updates`: it applies the updates inside
  the skip branch, so they are never written to memory.

  The wrapper goes outermost. Compositions that would run and be wrong are
  refused with a `ValueError` naming the fix: a wrapper inside another (also
  through a chain), two in one optimizer, one after another transformation
  in a chain (only `optax.identity()` may come first: the others would see
  the scaled gradients), and a skipping one inside `optax.apply_if_finite`,
  `optax.MultiSteps`, `optax.masked` or `optax.multi_transform`; the
  construction, `init` or the first `update` raises, whichever first can
  see it. Two compositions around a skipping wrapper run but count skipped
  steps as taken, and warn (once per trace): a stateful transformation after
  it in a chain, and `optax.inject_hyperparams` with a schedule around it
  (put `inject_hyperparams` inside: `loss_scale_optimizer(
  optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))`).

  For gradient accumulation wrap `optax.MultiSteps` (pass
  `optax.MultiSteps(inner, k).gradient_transformation()` as `inner`): each
  micro-batch is then checked, an overflowing one is skipped and not
  accumulated, and the scale backs off at once. The other order is refused:
  MultiSteps clears its accumulator by multiplying it by zero, and
  `inf * 0` is NaN, so every later update would be skipped.

  Args:
    inner: the transformation to wrap, e.g. `optax.adam(1e-3)` or a chain.
    loss_scale: `'dynamic'`, a number (a `FixedLossScale`, which never
      skips) or a `LossScale`.
    dynamic: Keras's keyword form; True for a dynamic scale (default), False
      for a fixed one (then `initial_scale` is required).
    initial_scale: the initial (or fixed) scale in the keyword form; 2**15
      by default when dynamic.
    dynamic_growth_steps: finite steps between growths in the keyword form;
      2000 by default, must be None when `dynamic=False`.
    skip_mode: `'cond'` runs `inner` inside `lax.cond` so a skipped step does
      no optimizer work and copies no state; `'select'` always runs `inner`
      and selects the result; `'auto'` picks per backend from measurements
      when the update is traced: `'select'` on GPUs, `'cond'` on CPU and TPU
      (BENCHMARKS.md). The skip decision, the loss scale and a skipped step's
      outputs are the same bits in every mode. An applied step computes the
      same arithmetic; compiled as a step of its own, the modes give the
      same bits, but inside a larger program (steps in a `lax.scan`) XLA may
      fuse that arithmetic differently per mode and round the last bit
      differently, as it does for the unwrapped optimizer between programs.
    axis_name: inside `shard_map`/`pmap`, the axis name or tuple of names
      across which shards must agree to skip; not needed under plain `jit`.
    record_nonfinite_leaves: keep in the state one bool per parameter leaf
      saying whether its gradient held NaN/Inf on the last skipped step;
      `metrics` then lists them by path under `'nonfinite_leaves'`.
    max_consecutive_skips: if set (an integer >= 1), a skipped step that makes
      the streak of consecutive skips longer than this raises
      `OverflowGuardError` from the step, with a report naming the leaves
      that overflowed. Off by default; when off nothing is added to the step.
      The guard fires whatever the caller keeps of the step: its zero is
      folded into every scalar of the new state and into the smallest leaf
      of the updates (or, through `apply_gradients`, of the new params).
    raise_at_min_loss_scale: raise `OverflowGuardError` when a step overflows
      although the scale is already at the loss scale's `min_loss_scale`.
      The error is raised from a host callback, so jax delivers it as a
      `jax.errors.JaxRuntimeError` or `ValueError` whose message holds the
      `OverflowGuardError` text. With a guard on, the step contains a host
      callback (never run unless it fires), which makes CPU execution of the
      step synchronous; see the diagnostics guide. With a `FixedLossScale` no
      step is skipped, so the guards never fire and the flags stay False.
    overwrite_with_gradient: which gradient leaves are fp8 metadata whose
      "gradient" is their new value (Flax's `Fp8DirectDotGeneralOp` and
      `Fp8Einsum` scales and amax histories): `'auto'` (default) marks every
      leaf under a `_overwrite_with_gradient` key (Flax's collection), None
      marks none, a pytree of bools shaped like the params (or a prefix) or
      a predicate `(path, leaf) -> bool` marks others. Marked leaves are never
      unscaled and never reach `inner` (its state has no entries for them),
      are checked for NaN/Inf with the rest, and are written with their new
      value on an applied step and left as they were on a skipped one
      (exactly through `apply_gradients` and the Flax `TrainState`; through
      `update`, as `new - old`, with a warning). Flax's output-gradient
      metadata (`output_grad_amax_history`, `output_grad_scale`) is measured
      in units of the loss scale; it is multiplied by the factor by which
      the scale changes, so that the next step quantizes its scaled
      cotangents with the right scale (docs/benchmark_findings.md, "fp8 metadata").
    **keras_options: Keras 3's base-optimizer options (`weight_decay`,
      `clipnorm`, `global_clipnorm`, `clipvalue`, `use_ema`, `ema_momentum`,
      `ema_overwrite_frequency`, `loss_scale_factor`,
      `gradient_accumulation_steps`) are accepted at their defaults only, as
      Keras 3 does; another value raises a `ValueError` naming the optax
      transformation to put inside the wrapper instead.

  A `LossScale` instance that has already stepped is used from its initial
  state (with a warning), as TensorFlow does and as `get_config()` records
  it, so that `LossScaleOptimizer.from_config(tx.get_config(), inner)` starts
  where `tx` starts.

  Returns:
    A `LossScaleOptimizer`, an `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p['w'] ** 2)
    >>> grads = jax.grad(lambda p: ols.get_scaled_loss(loss(p), state))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> updates['w']
    Array([-0.2, -0.2], dtype=float32)

  References:
    Keras `tf.keras.mixed_precision.LossScaleOptimizer`;
    Micikevicius et al., 2018, https://arxiv.org/abs/1710.03740
  """
  if not isinstance(inner, optax.GradientTransformation):
    hint = ""
    if hasattr(inner, "gradient_transformation"):
      hint = " Pass optax.MultiSteps(...).gradient_transformation()."
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3));"
      f" got {type(inner).__name__}.{hint}"
    )
  keras_compat.check_keras_options(keras_options)
  inner_settings = conditional_step.settings_of(inner)
  inner_kind = None if inner_settings is None else inner_settings["kind"]
  writes_params = inner_kind if inner_kind in composition.PARAM_WRITERS else None
  if inner_kind == composition.LOSS_SCALE:
    raise ValueError(
      "loss_scale_optimizer cannot wrap another loss_scale_optimizer: the gradients"
      " would be unscaled twice. Wrap the inner optimizer once:"
      " loss_scale_optimizer(inner_optimizer)."
    )
  skip_mode = conditional_step.check_skip_mode(skip_mode)
  axis_name = tree_utils.normalize_axis_name(axis_name)
  overwrite_with_gradient = overwrite.check_spec(overwrite_with_gradient)
  initial_ls = _restarted(
    keras_compat.resolve_loss_scale(loss_scale, dynamic, initial_scale, dynamic_growth_steps)
  )
  diagnostics = overflow_guard.check_options(
    initial_ls, max_consecutive_skips, raise_at_min_loss_scale, record_nonfinite_leaves
  )
  guard = overflow_guard.make_guard(initial_ls, max_consecutive_skips, raise_at_min_loss_scale)
  user_inner, inner = inner, optax.with_extra_args_support(inner)
  site, scaled_since = scaled_check.construction_site()

  def init_fn(params: optax.Params) -> LossScaleOptimizerState:
    composition.check_init(composition.LOSS_SCALE, init_fn, initial_ls.skips)
    params_check.check_params_are_arrays(params, "loss_scale_optimizer.init")
    marked = overwrite.resolve(overwrite_with_gradient, params)
    return LossScaleOptimizerState(
      inner_state=inner.init(overwrite.exclude(marked, params)),
      # Fresh buffers: a donated state must not delete the prototype's arrays.
      loss_scale=jax.tree.map(lambda x: jnp.array(x, copy=True), initial_ls),
      last_step_applied=jnp.ones((), jnp.bool_),
      consecutive_skips=jnp.zeros((), jnp.int32),
      total_skips=jnp.zeros((), jnp.int32),
      nonfinite_leaves=(
        overflow_guard.init_nonfinite_leaves(params) if record_nonfinite_leaves else None
      ),
      retries=jnp.zeros((), jnp.int32),
      total_retries=jnp.zeros((), jnp.int32),
    )

  composition.register_init(init_fn, composition.LOSS_SCALE)

  def step(
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None,
    extra_args: dict[str, Any],
    apply_to_params: bool,
  ) -> tuple[Any, LossScaleOptimizerState]:
    """One update; returns the updates, or with `apply_to_params` the new params."""
    _check_state(state)
    marked = overwrite.resolve(overwrite_with_gradient, grads)
    traced = composition.is_traced(grads)
    composition.check_update(
      composition.LOSS_SCALE,
      update_fn,
      writes_values=marked is not None,
      can_skip=state.loss_scale.skips,
      traced=traced,
      writes_params=writes_params,
    )
    scaled_check.check(initial_ls, state.loss_scale, site, scaled_since, traced)
    _check_float_grads(grads)
    if params is not None:
      params_check.check_params_are_arrays(params, "loss_scale_optimizer.update")
    ls = state.loss_scale
    conditional = functools.partial(
      conditional_step.apply_inner_if,
      inner=inner,
      grads=grads,
      inner_state=state.inner_state,
      params=params,
      extra_args=extra_args,
      skip_mode=skip_mode,
      apply_to_params=apply_to_params,
      # Unscaling beside its consumers lets XLA fuse it into the inner update:
      # the unscaled gradients are never written to memory.
      prepare=ls.unscale,
      marked=marked,
    )
    if not ls.skips:
      # FixedLossScale never skips (TensorFlow semantics): no check, no branch.
      out, inner_state = conditional(None)
      return out, state._replace(inner_state=inner_state)

    # Read only by reductions (the check, the recorded flags). Where the scale
    # cannot change which gradients are finite, they read the gradient buffers
    # as they are: one pass that writes nothing (docs/benchmark_findings.md, finding 3).
    # Overwrite-with-gradient leaves are new values, not scaled gradients:
    # checked as they are.
    checked = grads
    if not _scaling_keeps_finiteness(ls):
      checked = overwrite.unscaled_rest(marked, grads, ls.unscale)
    new_ls, should_apply = ls.update(checked, axis_name=axis_name)
    # fp8 metadata of the output gradients is in units of the loss scale: it
    # follows the scale when the scale changes (docs/benchmark_findings.md, "fp8 metadata").
    factor = None if marked is None else new_ls() / ls()
    out, inner_state = conditional(should_apply, marked_factor=factor)

    skipped = jnp.logical_not(should_apply)
    consecutive_skips = jnp.where(skipped, state.consecutive_skips + 1, 0).astype(jnp.int32)
    nonfinite_leaves = state.nonfinite_leaves
    if record_nonfinite_leaves:
      nonfinite_leaves = overflow_guard.update_nonfinite_leaves(
        nonfinite_leaves, checked, should_apply, axis_name
      )
    new_state = state._replace(
      inner_state=inner_state,
      loss_scale=new_ls,
      last_step_applied=should_apply,
      consecutive_skips=consecutive_skips,
      total_skips=state.total_skips + skipped.astype(jnp.int32),
      nonfinite_leaves=nonfinite_leaves,
    )
    if guard is not None:
      zero = guard(ls, should_apply, consecutive_skips, grads)
      out, new_state = overflow_guard.keep_alive(zero, out, new_state)
    return out, new_state

  update_fn = conditional_step.attach(
    step,
    {
      "kind": composition.LOSS_SCALE,
      "inner": user_inner,
      "loss_scale": initial_ls,
      "skip_mode": skip_mode,
      "axis_name": axis_name,
      "diagnostics": diagnostics,
      "overwrite_with_gradient": overwrite_with_gradient,
    },
  )
  return LossScaleOptimizer(init_fn, update_fn)
