"""`loss_scale_optimizer`: an optax transformation that unscales, checks and skips.

The wrapper owns the loss scale. Each update divides the incoming gradients
(of the *scaled* loss) by the current scale, checks them for NaN/Inf, updates
the loss scale, and runs the inner transformation only on finite steps. On a
skipped step the updates are zeros and the inner state is returned untouched,
so schedules, Adam moments and step counts do not advance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._src import (
  dynamic_loss_scale,
  overflow_guard,
  serialization,
  skip_branch,
  tree_utils,
  validation,
)
from optax_lossscale._src import loss_scale as loss_scale_lib

SkipMode = Literal["auto", "cond", "select"]
_SETTINGS_ATTR = "loss_scale_optimizer_settings"
_SKIP_MODES = ("auto", "cond", "select")
# What skip_mode='auto' becomes, by the platform `jax.default_backend()` names
# (BENCHMARKS.md, "skip_mode='auto'"). On a GPU, XLA turns the update path's
# `cond` into selects anyway, and a conditional that survives (the fused
# `apply_gradients`) sends its predicate to the host on every step, which
# stalls asynchronous dispatch; on the H100 `select` was never slower beyond
# noise. On CPU `cond` is measured cheaper (no work or copies on a skip). TPUs
# run conditionals on the device; unmeasured, they keep the design default.
_AUTO_SELECT_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def resolve_skip_mode(skip_mode: SkipMode, platform: str | None = None) -> str:
  """`skip_mode` with 'auto' replaced by the choice for `platform`.

  Args:
    skip_mode: 'auto', 'cond' or 'select'.
    platform: a JAX platform name; by default `jax.default_backend()`, read
      only for 'auto' (so building an optimizer never initialises a backend:
      the wrapper resolves 'auto' when its update is traced).

  Returns:
    'cond' or 'select'.

  Example:
    >>> from optax_lossscale._src.optimizer import resolve_skip_mode
    >>> [resolve_skip_mode('auto', p) for p in ('cpu', 'gpu', 'tpu')]
    ['cond', 'select', 'cond']
  """
  if skip_mode != "auto":
    return skip_mode
  platform = jax.default_backend() if platform is None else platform
  return "select" if platform in _AUTO_SELECT_PLATFORMS else "cond"


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

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> isinstance(state, ols.LossScaleOptimizerState)
    True
    >>> _, state = tx.update({'w': jnp.full(2, jnp.nan)}, state)
    >>> bool(state.last_step_applied), int(state.total_skips), float(state.loss_scale())
    (False, 1, 16384.0)
  """

  inner_state: optax.OptState
  loss_scale: loss_scale_lib.LossScale
  last_step_applied: jax.Array
  consecutive_skips: jax.Array
  total_skips: jax.Array
  nonfinite_leaves: Any = None


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
    settings = getattr(self.update, _SETTINGS_ATTR, None)
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
    """Whether the loss scale is dynamic (can change and skip steps)."""
    return self.initial_loss_scale.dynamic

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
    return resolve_skip_mode(self._settings["skip_mode"])

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
    }

  @classmethod
  def from_config(
    cls, config: dict[str, Any], inner: optax.GradientTransformation
  ) -> LossScaleOptimizer:
    """Rebuilds the wrapper that `get_config()` describes, around `inner`.

    The inner transformation is not part of the config (optax transformations
    are closures, not serializable), so it is passed again.

    Args:
      config: a dict returned by `get_config()` (or its JSON round trip).
      inner: the transformation to wrap, e.g. `optax.adam(1e-3)`.

    Returns:
      A `LossScaleOptimizer` whose `get_config()` equals `config`.

    Example:
      >>> import optax
      >>> import optax_lossscale as ols
      >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), max_consecutive_skips=3)
      >>> again = ols.LossScaleOptimizer.from_config(tx.get_config(), optax.adam(1e-3))
      >>> again.get_config() == tx.get_config()
      True
    """
    if not isinstance(config, dict) or "loss_scale" not in config:
      raise ValueError(
        "config must be a dict returned by LossScaleOptimizer.get_config(); got"
        f" {type(config).__name__}{'' if not isinstance(config, dict) else ' without loss_scale'}."
      )
    # The keyword form only restates the serialized loss scale.
    derived = ("dynamic", "initial_scale", "dynamic_growth_steps")
    return loss_scale_optimizer(inner, **{k: v for k, v in config.items() if k not in derived})


def _resolve_loss_scale(
  loss_scale: Any,
  dynamic: bool | None,
  initial_scale: float | None,
  dynamic_growth_steps: int | None,
) -> loss_scale_lib.LossScale:
  """Turns either of Keras's argument forms into a `LossScale`."""
  keyword_form = (dynamic, initial_scale, dynamic_growth_steps) != (None, None, None)
  if not keyword_form:
    return serialization.get(loss_scale)
  if not (isinstance(loss_scale, str) and loss_scale == "dynamic"):
    # `loss_scale_optimizer(inner, **tx.get_config())` passes both forms; accept
    # them when they describe the same scale.
    resolved = serialization.get(loss_scale)
    if _keywords_agree(resolved, dynamic, initial_scale, dynamic_growth_steps):
      return resolved
    raise ValueError(
      "Pass either loss_scale= or the keyword form (dynamic=, initial_scale=,"
      f" dynamic_growth_steps=), not both; got loss_scale={loss_scale!r} with"
      f" dynamic={dynamic!r}, initial_scale={initial_scale!r},"
      f" dynamic_growth_steps={dynamic_growth_steps!r}, which describe another scale."
      " To rebuild a wrapper from get_config(), use"
      " LossScaleOptimizer.from_config(config, inner)."
    )
  if dynamic is None:
    dynamic = True
  validation.check_bool("dynamic", dynamic)
  # Keras's keyword names in the errors, not the loss scales' own.
  renames = {
    "initial_loss_scale": "initial_scale",
    "loss_scale_value": "initial_scale",
    "increment_period": "dynamic_growth_steps",
  }
  try:
    if dynamic:
      given = {"initial_loss_scale": initial_scale, "increment_period": dynamic_growth_steps}
      return dynamic_loss_scale.DynamicLossScale(
        **{k: v for k, v in given.items() if v is not None}
      )
    if initial_scale is None:
      raise ValueError('"initial_scale" must be specified if "dynamic" is False.')
    if dynamic_growth_steps is not None:
      raise ValueError(
        f'"dynamic_growth_steps" must be None if "dynamic" is False; got {dynamic_growth_steps!r}.'
      )
    return loss_scale_lib.FixedLossScale(initial_scale)
  except ValueError as e:
    message = str(e)
    for internal, keyword in renames.items():
      if message.startswith(internal):
        raise ValueError(keyword + message[len(internal) :]) from None
    raise


def _keywords_agree(
  ls: loss_scale_lib.LossScale,
  dynamic: bool | None,
  initial_scale: float | None,
  dynamic_growth_steps: int | None,
) -> bool:
  """Whether Keras's keyword form, where given, describes the `LossScale` `ls`."""
  growth = ls.increment_period if isinstance(ls, dynamic_loss_scale.DynamicLossScale) else None
  return (
    (dynamic is None or dynamic == ls.dynamic)
    and (initial_scale is None or float(initial_scale) == float(ls()))
    and (dynamic_growth_steps is None or dynamic_growth_steps == growth)
  )


def _scaling_keeps_finiteness(ls: loss_scale_lib.LossScale) -> bool:
  """Whether the scaled gradients are finite exactly where the unscaled are.

  Unscaling multiplies by 1/S. With S >= 1 that neither overflows a finite
  gradient nor makes a NaN or Inf finite, so checking the scaled gradients
  gives TensorFlow's answer. `DynamicLossScale` keeps S within
  [min_loss_scale, max_loss_scale], so `min_loss_scale >= 1` (the default)
  guarantees it, as long as nobody sets the scale below `min_loss_scale` by
  hand (`replace` cannot check a traced value). A subclass that changes how
  the scale is updated or applied gets the unscaled gradients.
  """
  base = dynamic_loss_scale.DynamicLossScale
  same_rules = all(
    getattr(type(ls), method) is getattr(base, method) for method in ("update", "adjust", "unscale")
  )
  return same_rules and ls.min_loss_scale >= 1


def _check_float_grads(grads: optax.Updates) -> None:
  """Raises at trace time if a gradient leaf is an integer or bool array.

  An integer leaf cannot be a gradient of the scaled loss that unscaling
  turns into the true one: `g / S` is not an integer, and passing it through
  would hand the inner optimizer a value `S` times too large (a silent
  `[-4, -8]` for `[-1, -2]` at scale 4). `jax.grad(..., allow_int=True)` gives
  integer parameters `float0` gradients, which pass; so do `None` leaves.
  """
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    dtype = getattr(g, "dtype", None)
    if dtype is None or dtype == jax.dtypes.float0:
      continue
    if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
      raise TypeError(
        f"loss_scale_optimizer got an integer gradient leaf at"
        f" {jax.tree_util.keystr(path) or '<root>'} (dtype {dtype}); it cannot be"
        " unscaled and would reach the inner optimizer multiplied by the loss scale."
        " Give that leaf a float gradient, a float0 one (jax.grad(...,"
        " allow_int=True)) or None, or keep it out of the optimized params."
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
) -> LossScaleOptimizer:
  """Wraps an optax transformation with loss scaling and overflow skipping.

  Feed it the gradients of the **scaled** loss (`get_scaled_loss`). Each
  update divides them by the current scale, checks them for NaN/Inf, updates
  the loss scale and, on a finite step, returns exactly what
  `inner.update(ls.unscale(grads), inner_state, params)` returns. On a
  non-finite step (dynamic scales only) the updates are zeros of the dtypes
  `inner` would return and `inner`'s state is left bit-identical: its step
  count, schedules and moments do not advance.

  The unscaling is compiled into the inner update, so the unscaled gradients
  never reach memory. With power-of-two scales (the dynamic default) they are
  the true gradients bit for bit; the inner arithmetic is then the unwrapped
  optimizer's, fused as XLA fuses it, which (as between any two XLA
  programs) may round a multiply-add differently in the last bit. With
  `min_loss_scale >= 1` (the default) the finiteness check reads the scaled
  gradients as they are, which gives the same answer: dividing by a scale of
  at least 1 cannot change which values are finite.

  Every gradient leaf must be floating or `None` (`float0` leaves pass this
  check, if the inner optimizer takes them): an integer or bool leaf raises a
  `TypeError` naming its path when the step is traced. It cannot be unscaled
  (`g / S` is no integer), and passing it through would feed the inner
  optimizer a value `S` times too large without a word.

  To step, `apply_gradients(tx, grads, state, params)` is cheaper than
  `update` followed by `optax.apply_updates`: it applies the updates inside
  the skip branch, so they are never written to memory.

  For gradient accumulation wrap `optax.MultiSteps` (pass
  `optax.MultiSteps(inner, k).gradient_transformation()` as `inner`): each
  micro-batch is then checked, an overflowing one is skipped and not
  accumulated, and the scale backs off at once. The other order,
  `optax.MultiSteps(loss_scale_optimizer(...), k)`, cannot recover from an
  overflow: MultiSteps clears its accumulator by multiplying it by zero, and
  `inf * 0` is NaN, so every later update would be skipped.

  Args:
    inner: the transformation to wrap, e.g. `optax.adam(1e-3)` or a chain.
    loss_scale: `'dynamic'`, a number (a fixed scale) or a `LossScale`.
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
      (BENCHMARKS.md). Every mode gives the same results bit for bit.
    axis_name: inside `shard_map`/`pmap`, the axis name or tuple of names
      across which shards must agree to skip; not needed under plain `jit`.
    record_nonfinite_leaves: keep in the state one bool per parameter leaf
      saying whether its gradient held NaN/Inf on the last skipped step;
      `metrics` then lists them by path under `'nonfinite_leaves'`.
    max_consecutive_skips: if set (an integer >= 1), a skipped step that makes
      the streak of consecutive skips longer than this raises
      `OverflowGuardError` from the step, with a report naming the leaves
      that overflowed. Off by default; when off nothing is added to the step.
      The guard fires whatever the caller keeps of the new state (any of its
      scalars, or the next step through a `scan`); a caller keeping none of
      it keeps nothing the guard can reach.
    raise_at_min_loss_scale: raise `OverflowGuardError` when a step overflows
      although the scale is already at the loss scale's `min_loss_scale`.
      The error is raised from a host callback, so jax delivers it as a
      `jax.errors.JaxRuntimeError` or `ValueError` whose message holds the
      `OverflowGuardError` text. With a guard on, the step contains a host
      callback (never run unless it fires), which makes CPU execution of the
      step synchronous; see the README. With a fixed scale no step is
      skipped, so the guards never fire and the flags stay False.

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
  if skip_mode not in _SKIP_MODES:
    raise ValueError(f"skip_mode must be one of {_SKIP_MODES}; got {skip_mode!r}.")
  axis_name = tree_utils.normalize_axis_name(axis_name)
  initial_ls = _resolve_loss_scale(loss_scale, dynamic, initial_scale, dynamic_growth_steps)
  diagnostics = overflow_guard.check_options(
    initial_ls, max_consecutive_skips, raise_at_min_loss_scale, record_nonfinite_leaves
  )
  guard = overflow_guard.make_guard(initial_ls, max_consecutive_skips, raise_at_min_loss_scale)
  user_inner, inner = inner, optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> LossScaleOptimizerState:
    return LossScaleOptimizerState(
      inner_state=inner.init(params),
      # Fresh buffers: a donated state must not delete the prototype's arrays.
      loss_scale=jax.tree.map(lambda x: jnp.array(x, copy=True), initial_ls),
      last_step_applied=jnp.ones((), jnp.bool_),
      consecutive_skips=jnp.zeros((), jnp.int32),
      total_skips=jnp.zeros((), jnp.int32),
      nonfinite_leaves=(
        overflow_guard.init_nonfinite_leaves(params) if record_nonfinite_leaves else None
      ),
    )

  def step(
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None,
    extra_args: dict[str, Any],
    apply_to_params: bool,
  ) -> tuple[Any, LossScaleOptimizerState]:
    """One update; returns the updates, or with `apply_to_params` the new params."""
    _check_float_grads(grads)
    ls = state.loss_scale

    def apply_inner(
      scaled_grads: optax.Updates, inner_state: optax.OptState, params: optax.Params | None
    ) -> tuple[Any, optax.OptState]:
      # Unscaling beside its consumers lets XLA fuse it into the inner update:
      # the unscaled gradients are never written to memory.
      inner_fused = fused_apply_gradients(inner) if apply_to_params else None
      if inner_fused is not None:  # e.g. skip_bad_steps: its skips leave params untouched too
        return inner_fused(ls.unscale(scaled_grads), inner_state, params, **extra_args)
      updates, inner_state = inner.update(
        ls.unscale(scaled_grads), inner_state, params, **extra_args
      )
      if apply_to_params:
        # Inside the branch the updates fuse into the parameter update and are
        # never written to memory either.
        return optax.apply_updates(params, updates), inner_state
      return updates, inner_state

    operands = (grads, state.inner_state, params)
    if not ls.dynamic:
      # A fixed scale never skips (TensorFlow semantics): no check, no branch.
      out, inner_state = apply_inner(*operands)
      return out, state._replace(inner_state=inner_state)

    # Read only by reductions (the check, the recorded flags). Where the scale
    # cannot change which gradients are finite, they read the gradient buffers
    # as they are: one pass that writes nothing (BENCHMARKS.md, finding 3).
    checked = grads if _scaling_keeps_finiteness(ls) else ls.unscale(grads)
    new_ls, should_apply = ls.update(checked, axis_name=axis_name)

    if resolve_skip_mode(skip_mode) == "cond":

      def skip_inner(
        grads: optax.Updates, inner_state: optax.OptState, params: optax.Params | None
      ) -> tuple[Any, optax.OptState]:
        shapes = jax.eval_shape(apply_inner, grads, inner_state, params)
        return skip_branch.skip_outputs(shapes, inner_state, params if apply_to_params else None)

      # The pass-through is the false branch: XLA then aliases the state
      # buffers instead of copying them.
      out, inner_state = jax.lax.cond(should_apply, apply_inner, skip_inner, *operands)
    else:
      new_out, new_inner_state = apply_inner(*operands)
      # The applied outputs' types, read off them rather than by tracing the
      # inner update a second time.
      shapes = jax.eval_shape(lambda tree: tree, (new_out, new_inner_state))
      old_params = params if apply_to_params else None
      old_out, old_inner_state = skip_branch.skip_outputs(shapes, state.inner_state, old_params)
      out = tree_utils.select_tree(should_apply, new_out, old_out)
      inner_state = tree_utils.select_tree(should_apply, new_inner_state, old_inner_state)

    skipped = jnp.logical_not(should_apply)
    consecutive_skips = jnp.where(skipped, state.consecutive_skips + 1, 0).astype(jnp.int32)
    nonfinite_leaves = state.nonfinite_leaves
    if record_nonfinite_leaves:
      nonfinite_leaves = overflow_guard.update_nonfinite_leaves(
        nonfinite_leaves, checked, should_apply, axis_name
      )
    new_state = LossScaleOptimizerState(
      inner_state=inner_state,
      loss_scale=new_ls,
      last_step_applied=should_apply,
      consecutive_skips=consecutive_skips,
      total_skips=state.total_skips + skipped.astype(jnp.int32),
      nonfinite_leaves=nonfinite_leaves,
    )
    if guard is not None:
      new_state = overflow_guard.keep_alive(
        guard(ls, should_apply, consecutive_skips, grads), new_state
      )
    return out, new_state

  def update_fn(
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleOptimizerState]:
    return step(grads, state, params, extra_args, apply_to_params=False)

  def apply_gradients_fn(
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params,
    **extra_args: Any,
  ) -> tuple[optax.Params, LossScaleOptimizerState]:
    return step(grads, state, params, extra_args, apply_to_params=True)

  setattr(
    update_fn,
    _SETTINGS_ATTR,
    {
      "inner": user_inner,
      "loss_scale": initial_ls,
      "skip_mode": skip_mode,
      "axis_name": axis_name,
      "diagnostics": diagnostics,
      "update": update_fn,
      "apply_gradients": apply_gradients_fn,
    },
  )
  return LossScaleOptimizer(init_fn, update_fn)


def fused_apply_gradients(optimizer: optax.GradientTransformation) -> Callable[..., Any] | None:
  """`(grads, state, params, **extra) -> (params, state)` of a wrapper, else None.

  None also when `update` was wrapped (`functools.wraps` copies the settings
  attribute): the fused step would bypass the wrapping.
  """
  settings = getattr(optimizer.update, _SETTINGS_ATTR, None)
  if settings is None or settings["update"] is not optimizer.update:
    return None
  return settings["apply_gradients"]
