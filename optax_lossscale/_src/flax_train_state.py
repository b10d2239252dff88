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
from typing import Any

from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from optax_lossscale._src import conditional_step, state_access
from optax_lossscale._src import loss_scale as loss_scale_lib

# Flax's fp8 marker (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT): those
# "gradients" overwrite fp8 metadata and would be written even on skipped steps.
_OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _holds_overwrite_collection(tree: Any) -> bool:
  return isinstance(tree, Mapping) and _OVERWRITE_WITH_GRADIENT in tree


def _check_writes_overwrite_leaves(tx: optax.GradientTransformation) -> None:
  if conditional_step.fused_apply_gradients(tx) is None:
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
      **kwargs: other fields to `.replace()`, as in Flax's `TrainState`.

    Returns:
      The next state. On an applied step `params` and `opt_state` are updated
      and `step` advances by one; on a skipped step only the loss scale and
      the skip counters in `opt_state` change.
    """
    fused = conditional_step.fused_apply_gradients(self.tx)
    if _holds_overwrite_collection(grads):
      _check_writes_overwrite_leaves(self.tx)
    if fused is not None:
      # The wrapper is the whole tx: update and apply inside its one branch.
      params, opt_state = fused(grads, self.opt_state, self.params)
      applied = state_access.step_applied(opt_state)
    else:
      updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
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
      ValueError: if `tx` contains no `loss_scale_optimizer` and no
        `skip_bad_steps` (or more than one of either).
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
      raise ValueError(
        "tx must contain exactly one optax_lossscale.loss_scale_optimizer(...)"
        " or skip_bad_steps(...), e.g. loss_scale_optimizer(optax.adam(1e-3)):"
        f" {e}"
      ) from e
    # An array from the start: the same dtype before and after a checkpoint,
    # and no retrace when the first jitted step turns a Python 0 into an array.
    return state.replace(step=jnp.zeros((), jnp.int32))
