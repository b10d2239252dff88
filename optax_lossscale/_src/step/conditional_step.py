"""The step both wrappers take once they know whether to apply it.

`loss_scale_optimizer` and `skip_bad_steps` differ only in how they decide
whether a step is applied (a loss scale's overflow check; a spike statistic).
Everything after the decision lives here, once:

  if should_apply:  out, inner_state = inner.update(prepare(grads), inner_state, params)
                    out = apply_updates(params, out)       # the fused step
  else:             out = zero updates (the params as they were, fused)
                    inner_state as it was, bit for bit

with `skip_mode='cond'` (a `lax.cond`: a skipped step does no inner work and
copies no state) or `'select'` (the inner update always runs and is selected
away), and the skip outputs typed like the applied ones (`skip_branch`).

It also holds what both wrappers attach to their update function: the
settings through which `apply_gradients`, the Flax `TrainState` and the
Keras-style attributes find them, and the fused `apply_gradients` step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal
import warnings

import jax
import optax

from optax_lossscale._src.step import overwrite, skip_branch
from optax_lossscale._src.utils import tree_utils

SkipMode = Literal["auto", "cond", "select"]
SKIP_MODES = ("auto", "cond", "select")
SETTINGS_ATTR = "loss_scale_optimizer_settings"
# What skip_mode='auto' becomes, by the platform `jax.default_backend()` names
# (docs/benchmark_findings.md, finding 2 and "GPU"). On a GPU, XLA turns the update path's
# `cond` into selects anyway, and a conditional that survives (the fused
# `apply_gradients`) sends its predicate to the host on every step, which
# stalls asynchronous dispatch; on the H100 `select` was never slower beyond
# noise. On CPU `cond` is measured cheaper (no work or copies on a skip). TPUs
# run conditionals on the device; unmeasured, they keep the design default.
_AUTO_SELECT_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})

# `(grads, state, params, extra_args, apply_to_params) -> (out, new_state)`.
Step = Callable[[Any, Any, Any, dict[str, Any], bool], tuple[Any, Any]]


def check_skip_mode(skip_mode: Any) -> SkipMode:
  """Validates `skip_mode` at construction."""
  if skip_mode not in SKIP_MODES:
    raise ValueError(f"skip_mode must be one of {SKIP_MODES}; got {skip_mode!r}.")
  return skip_mode


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
    >>> from optax_lossscale._src.step.conditional_step import resolve_skip_mode
    >>> [resolve_skip_mode('auto', p) for p in ('cpu', 'gpu', 'tpu')]
    ['cond', 'select', 'cond']
  """
  if skip_mode != "auto":
    return skip_mode
  platform = jax.default_backend() if platform is None else platform
  return "select" if platform in _AUTO_SELECT_PLATFORMS else "cond"


def apply_inner_if(
  should_apply: jax.Array | None,
  inner: optax.GradientTransformationExtraArgs,
  grads: Any,
  inner_state: Any,
  params: Any,
  extra_args: dict[str, Any],
  *,
  skip_mode: SkipMode,
  apply_to_params: bool,
  prepare: Callable[[Any], Any] | None = None,
  marked: overwrite.Marked | None = None,
  marked_factor: jax.Array | None = None,
) -> tuple[Any, Any]:
  """Runs `inner` on the step's gradients if `should_apply`, else passes through.

  Args:
    should_apply: a scalar bool array, or None to apply unconditionally.
    inner: the wrapped transformation (with extra-args support).
    grads: the step's gradients, as the wrapper received them.
    inner_state: the inner transformation's state.
    params: the parameters, or None (not with `apply_to_params`).
    extra_args: passed on to `inner.update`.
    skip_mode: 'auto', 'cond' or 'select'.
    apply_to_params: return the new params (`apply_updates` inside the
      branch, so the updates are never written to memory) instead of the
      updates.
    prepare: applied to `grads` inside the applied branch (the loss scale's
      unscaling), so that XLA fuses it into the inner update.
    marked: the overwrite-with-gradient leaves (`overwrite`), or None. They
      bypass `prepare` and `inner` (whose state has no entries for them) and
      are written with their new value on an applied step.
    marked_factor: multiplies the marked leaves in loss-scale units (the new
      loss scale over the old), on applied and skipped steps alike.

  Returns:
    `(out, new_inner_state)`: `out` is the updates, or the new params with
    `apply_to_params`; on a skipped step zero updates (the params as given)
    and `inner_state` unchanged, typed exactly like the applied outputs.
  """
  if marked is not None:
    if params is None:
      raise ValueError(
        "Overwrite-with-gradient leaves (fp8 metadata) need the params: call"
        " tx.update(grads, state, params), or better ols.apply_gradients(tx, grads,"
        " state, params), which writes them exactly."
      )
    rest_grads, new_values = marked.split(grads)
    rest_params, old_values = marked.split(params)
    out, inner_state = apply_inner_if(
      should_apply,
      inner,
      rest_grads,
      inner_state,
      rest_params,
      extra_args,
      skip_mode=skip_mode,
      apply_to_params=apply_to_params,
      prepare=prepare,
    )
    values = overwrite.written(marked, should_apply, new_values, old_values, marked_factor)
    if not apply_to_params:
      warnings.warn(
        "Overwrite-with-gradient leaves (fp8 metadata) through tx.update: their update is"
        " new - old, which optax.apply_updates adds back to within one rounding of the new"
        " value. ols.apply_gradients(tx, grads, state, params) and"
        " optax_lossscale.flax.TrainState write them exactly.",
        UserWarning,
        stacklevel=5,
      )
      values = [v - o for v, o in zip(values, old_values, strict=True)]
    return marked.merge(out, values), inner_state

  def apply_inner(grads: Any, inner_state: Any, params: Any) -> tuple[Any, Any]:
    if prepare is not None:
      grads = prepare(grads)
    fused = fused_apply_gradients(inner) if apply_to_params else None
    if fused is not None:  # a wrapper inside: its own skips leave the params untouched too
      return fused(grads, inner_state, params, **extra_args)
    updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    if apply_to_params:
      # Inside the branch the updates fuse into the parameter update.
      return optax.apply_updates(params, updates), inner_state
    return updates, inner_state

  operands = (grads, inner_state, params)
  if should_apply is None:
    return apply_inner(*operands)
  old_params = params if apply_to_params else None

  if resolve_skip_mode(skip_mode) == "cond":

    def skip_inner(grads: Any, inner_state: Any, params: Any) -> tuple[Any, Any]:
      shapes = jax.eval_shape(apply_inner, grads, inner_state, params)
      return skip_branch.skip_outputs(shapes, inner_state, params if apply_to_params else None)

    # The pass-through is the false branch: XLA then aliases the state
    # buffers instead of copying them.
    return jax.lax.cond(should_apply, apply_inner, skip_inner, *operands)

  new_out, new_inner_state = apply_inner(*operands)
  # The applied outputs' types, read off them rather than by tracing the inner
  # update a second time.
  shapes = jax.eval_shape(lambda tree: tree, (new_out, new_inner_state))
  old_out, old_inner_state = skip_branch.skip_outputs(shapes, inner_state, old_params)
  return (
    tree_utils.select_tree(should_apply, new_out, old_out),
    tree_utils.select_tree(should_apply, new_inner_state, old_inner_state),
  )


def attach(step: Step, settings: dict[str, Any]) -> Callable[..., tuple[optax.Updates, Any]]:
  """The optax update function of a wrapper whose step is `step`.

  Its fused twin, `(grads, state, params, **extra) -> (new_params, state)`, and
  `settings` ride on it as an attribute, so that they survive `_replace` and
  `jax.tree.map` over the transformation (which rebuild the tuple from its two
  functions) and `apply_gradients` finds the fused step.
  """

  def update_fn(
    grads: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
  ) -> tuple[optax.Updates, Any]:
    return step(grads, state, params, extra_args, False)

  def apply_gradients_fn(
    grads: optax.Updates, state: Any, params: optax.Params, **extra_args: Any
  ) -> tuple[optax.Params, Any]:
    return step(grads, state, params, extra_args, True)

  setattr(
    update_fn,
    SETTINGS_ATTR,
    {**settings, "update": update_fn, "apply_gradients": apply_gradients_fn},
  )
  return update_fn


def settings_of(optimizer: optax.GradientTransformation) -> dict[str, Any] | None:
  """The settings `attach` put on a wrapper's update function, else None.

  None also when `update` was wrapped (`functools.wraps` copies the settings
  attribute): the fused step would then bypass the wrapping.
  """
  settings = getattr(optimizer.update, SETTINGS_ATTR, None)
  if settings is None or settings["update"] is not optimizer.update:
    return None
  return settings


def fused_apply_gradients(optimizer: optax.GradientTransformation) -> Callable[..., Any] | None:
  """`(grads, state, params, **extra) -> (params, state)` of a wrapper, else None."""
  settings = settings_of(optimizer)
  return None if settings is None else settings["apply_gradients"]
