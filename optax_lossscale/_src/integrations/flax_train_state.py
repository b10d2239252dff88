"""A Flax `TrainState` whose optimizer is a `loss_scale_optimizer` or `skip_bad_steps`.

Flax's own `TrainState` already works with the wrapper: on a skipped step the
updates are zeros and the inner optimizer state is untouched. This subclass
makes the skipped step exact and visible:

  state = state.apply_gradients(grads=scaled_grads)
    updates, opt_state = tx.update(scaled_grads, opt_state, params)
    if the step was applied: params += updates; step += 1
    else:                     params, step unchanged   # not even -0.0 -> +0.0

so a skipped step is as if it had not happened, except for the loss scale and
the skip counters, and `state.step` counts applied updates: it stays equal to
the inner optimizer's own `count`, which its schedules read. (Keras's
`optimizer.iterations` and `nnx.Optimizer.step` count calls instead.) To number
checkpoints or log lines by call, use `state.step + metrics(state)['total_skips']`:
`state.step` repeats across a skipped step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any

from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.step import composition, conditional_step
from optax_lossscale._src.storage.master_weights import MasterWeightsState
from optax_lossscale._src.storage.stochastic_rounding import StochasticRoundingState
from optax_lossscale._src.wrappers import state_access, state_conversion

# Flax's fp8 marker (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT): those
# "gradients" overwrite fp8 metadata and would be written even on skipped steps.
_OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _holds_overwrite_collection(tree: Any) -> bool:
  return isinstance(tree, Mapping) and _OVERWRITE_WITH_GRADIENT in tree


def _check_writes_overwrite_leaves(tx: optax.GradientTransformation) -> None:
  kind = (conditional_step.settings_of(tx) or {}).get("kind")
  if kind not in (composition.LOSS_SCALE, composition.SKIP):
    raise ValueError(
      "The params hold Flax's fp8 'overwrite with gradient' collection, which only the"
      " wrapper itself can write exactly (on applied steps only): make tx the"
      " loss_scale_optimizer or skip_bad_steps, with the other transformations inside"
      " it, e.g. loss_scale_optimizer(optax.chain(..., optax.adam(1e-3)))."
    )


class TrainState(train_state.TrainState):
  """`flax.training.train_state.TrainState` for a `loss_scale_optimizer`.

  Create it as usual, with a `tx` that contains a `loss_scale_optimizer`
  (possibly inside `optax.chain`; for accumulation, wrap `MultiSteps` in it),
  and feed `apply_gradients` the gradients of the **scaled** loss, e.g. from
  `optax_lossscale.value_and_grad`. A `tx` that is (or contains)
  `skip_bad_steps`, alone or inside the loss-scale wrapper, works the same
  way: a step either skips leaves `params` and `step` as they were.

  On a skipped (non-finite) step `params`, the inner optimizer state and
  `step` are unchanged, bit for bit; the loss scale backs off and the skip
  counters advance. So `step` counts applied updates; read the skips with
  `optax_lossscale.metrics(state)`.

  Attributes:
    step: int32 scalar array, the number of applied (not skipped) updates.
    loss_scale: the current `LossScale` (a read-only property).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import TrainState
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=2.0**8)
    >>> state = TrainState.create(apply_fn=None, params={'w': jnp.ones(2)}, tx=tx)
    >>> loss_fn = lambda p, x: jnp.sum(p['w'] * x)
    >>> step = jax.jit(lambda s, x: s.apply_gradients(
    ...     grads=ols.value_and_grad(loss_fn)(s, s.params, x)[1]))
    >>> state = step(state, jnp.array([1.0, jnp.inf]))  # overflow: skipped
    >>> state.params['w'], int(state.step), float(state.loss_scale())
    (Array([1., 1.], dtype=float32), 0, 128.0)
    >>> state = step(state, jnp.array([1.0, 2.0]))
    >>> state.params['w'], int(state.step)
    (Array([0.5, 0. ], dtype=float32), 1)
  """

  @property
  def loss_scale(self) -> loss_scale_lib.LossScale:
    """The current `LossScale`."""
    return state_access.get_loss_scale(self.opt_state)

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Applies the gradients of the scaled loss unless they overflowed.

    Args:
      grads: gradients of the **scaled** loss, with the structure of `params`.
      **kwargs: the names of fields of this state (`batch_stats`, ...) are
        replaced, as in Flax's `TrainState`; any other name is passed on to
        the transformation as an extra argument, e.g. `loss=loss` for
        `skip_bad_steps(..., monitor=("grad_norm", "loss"))`.

    Returns:
      The next state. On an applied step `params` and `opt_state` are updated
      and `step` advances by one; on a skipped step only the loss scale and
      the skip counters in `opt_state` change.
    """
    fields = {f.name for f in dataclasses.fields(self)}
    extra_args = {k: kwargs.pop(k) for k in list(kwargs) if k not in fields}
    fused = conditional_step.fused_apply_gradients(self.tx)
    if _holds_overwrite_collection(grads):
      _check_writes_overwrite_leaves(self.tx)
    if fused is not None:
      # The wrapper is the whole tx: update and apply inside its one branch.
      params, opt_state = fused(grads, self.opt_state, self.params, **extra_args)
      applied = _applied(opt_state)
    elif not _has_wrapper(self.opt_state):
      # A parameter writer in a chain, without a wrapper: every step applies.
      updates, opt_state = self.tx.update(grads, self.opt_state, self.params, **extra_args)
      params, applied = optax.apply_updates(self.params, updates), jnp.asarray(True)
    else:
      updates, opt_state = self.tx.update(grads, self.opt_state, self.params, **extra_args)
      applied = state_access.step_applied(opt_state)
      params = jax.lax.cond(
        applied,
        lambda p, u: optax.apply_updates(p, u),
        # The untouched branch second: XLA can then alias the params buffers.
        lambda p, u: p,
        self.params,
        updates,
      )
    step = jnp.asarray(self.step, jnp.int32) + applied.astype(jnp.int32)
    return self.replace(step=step, params=params, opt_state=opt_state, **kwargs)

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any] | None,
    params: Any,
    tx: optax.GradientTransformation,
    **kwargs: Any,
  ) -> TrainState:
    """Creates the state with `step=0` (int32) and `opt_state=tx.init(params)`.

    Raises:
      ValueError: if `tx` contains no `loss_scale_optimizer`, no
        `skip_bad_steps`, no `master_weights` and no `stochastic_rounding`
        (or more than one of either wrapper).
    """
    if _holds_overwrite_collection(params):
      _check_writes_overwrite_leaves(tx)
    # Not Flax's create: it leaves the fp8 collection out of `tx.init`, where
    # the wrapper marks it (overwrite_with_gradient='auto') and keeps it out of
    # the inner optimizer itself.
    state = cls(
      step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params), **kwargs
    )
    try:
      state_access.step_applied(state.opt_state)  # finds each wrapper, at most once
    except ValueError as e:
      if "No LossScaleOptimizerState" not in str(e) or not _writes_params(state.opt_state):
        raise ValueError(
          "tx must contain exactly one optax_lossscale.loss_scale_optimizer(...)"
          " or skip_bad_steps(...), e.g. loss_scale_optimizer(optax.adam(1e-3)),"
          " or a master_weights(...) or stochastic_rounding(...) for 16-bit"
          f" parameters: {e}"
        ) from e
    # An array from the start: the same dtype before and after a checkpoint,
    # and no retrace when the first jitted step turns a Python 0 into an array.
    return state.replace(step=jnp.zeros((), jnp.int32))


def convert_train_state(
  state: train_state.TrainState, tx: optax.GradientTransformation
) -> train_state.TrainState:
  """`state` continued under `tx`, with the guards switched on or off.

  Carries over `step`, `params`, `apply_fn`, the other fields and the inner
  optimizer's state bit for bit (`ols.convert_state`). If `tx` contains a
  `loss_scale_optimizer` or `skip_bad_steps`, the result is this module's
  `TrainState` (a Flax `TrainState` of a bare run can be switched over);
  otherwise Flax's own `TrainState`.

  Args:
    state: a Flax `TrainState` or this module's.
    tx: the transformation to continue with.

  Returns:
    The `TrainState` for `tx`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax.training import train_state
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import convert_train_state
    >>> bare = optax.adam(1e-3)
    >>> state = train_state.TrainState.create(apply_fn=None, params={'w': jnp.ones(2)}, tx=bare)
    >>> guarded = convert_train_state(state, ols.skip_bad_steps(bare))
    >>> type(guarded).__name__, int(guarded.opt_state.inner_state[0].count)
    ('TrainState', 0)
    >>> type(convert_train_state(guarded, bare)) is train_state.TrainState
    True
  """
  fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
  fields.update(tx=tx, opt_state=state_conversion.convert_state(tx, state.opt_state, state.params))
  if not _has_wrapper(fields["opt_state"]) and not _writes_params(fields["opt_state"]):
    base = {f.name for f in dataclasses.fields(train_state.TrainState)}
    extra = sorted(set(fields) - base)
    if extra:
      raise ValueError(
        f"Flax's TrainState has no fields {extra}; subclass it to carry them and"
        " build it from the converted opt_state: ols.convert_state(tx, state.opt_state,"
        " state.params)."
      )
    return train_state.TrainState(**fields)
  fields["step"] = jnp.asarray(fields["step"], jnp.int32)
  cls = type(state) if isinstance(state, TrainState) else TrainState
  return cls(**fields)


def _has_wrapper(opt_state: Any) -> bool:
  try:
    state_access.step_applied(opt_state)
  except ValueError:
    return False
  return True


def _writes_params(opt_state: Any) -> bool:
  """Whether `opt_state` holds the state of `master_weights` or `stochastic_rounding`."""
  is_writer = lambda x: isinstance(x, (MasterWeightsState, StochasticRoundingState))
  return any(is_writer(x) for x in jax.tree.leaves(opt_state, is_leaf=is_writer))


def _applied(opt_state: Any) -> jax.Array:
  """Whether the step was applied: by every wrapper in `opt_state`, True without one."""
  return state_access.step_applied(opt_state) if _has_wrapper(opt_state) else jnp.asarray(True)
