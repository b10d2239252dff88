"""A count of the losses scaled in this process: what `loss_scale_optimizer`'s check reads.

The wrapper divides whatever gradients it is given by the loss scale. Given
the gradients of the plain loss (`jax.grad(loss_fn)`), it divides them by
2**15 and trains with steps that much too small, and nothing in the arrays
can say so: gradients are numbers, with no record of the loss they came from
(a mark riding on them would not survive `jit` boundaries, `pmean` or a sum
over micro-batches). What can be known, in Python, is whether a loss was
scaled at all:

  every scaling goes through LossScale.scale (get_scaled_loss, value_and_grad
    and its Flax and Equinox forms, retry_on_overflow) or mark_scaled
    -> count += 1, when it runs or is traced (never in a compiled step)
  the wrapper's update, when it runs or is traced:
    if no loss was scaled since the wrapper was built: warn

`wrappers/scaled_check.py` makes that decision; this module only counts.
"""

from __future__ import annotations

from typing import Any

# Losses scaled (or marked as scaled) in this process so far.
_count = 0


class UnscaledGradientsWarning(UserWarning):
  """Gradients reached a `loss_scale_optimizer`, but no loss was scaled.

  Given when a loss-scaling optimizer's update runs (or is traced, under
  `jit`) and no loss has been scaled since the optimizer was built: its
  gradients are then most likely those of the plain loss, which the wrapper
  would divide by the loss scale. Silence it for gradients you know are
  scaled with `mark_scaled`, or with a warnings filter:
  `warnings.filterwarnings('ignore', category=ols.UnscaledGradientsWarning)`.

  Example:
    >>> import optax_lossscale as ols
    >>> issubclass(ols.UnscaledGradientsWarning, UserWarning)
    True
  """


def note_scaled() -> None:
  """Counts one scaled loss (called by `LossScale.scale` and `mark_scaled`)."""
  global _count
  _count += 1


def scaled_count() -> int:
  """The number of losses scaled (or marked) in this process so far."""
  return _count


def mark_scaled(tree: Any) -> Any:
  """Says that `tree` is a loss you scaled yourself, or the gradients of one.

  `loss_scale_optimizer` warns (`UnscaledGradientsWarning`) when it is given
  gradients and no loss has been scaled since it was built: the likely
  mistake of differentiating the plain loss. The package's own ways of
  scaling count by themselves (`get_scaled_loss`, `value_and_grad`, its
  Flax and Equinox forms, `retry_on_overflow`, `LossScale.scale`); a loss
  multiplied by the scale some other way (`loss * ols.get_loss_scale(state)()`,
  a constant, a cotangent seeded with the scale) does not. Pass that loss,
  or the gradients it gives, through `mark_scaled` where it is computed
  (in the traced function under `jit`). The value is returned unchanged;
  nothing is added to a compiled program.

  Args:
    tree: anything: a loss, gradients, any pytree.

  Returns:
    `tree`, unchanged (the same object).

  Example:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p['w'] ** 2)
    >>> scaled_by_hand = lambda p: loss(p) * 2.0**10  # the scale, written out
    >>> grads = ols.mark_scaled(jax.grad(scaled_by_hand)(params))
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter('error')  # no UnscaledGradientsWarning
    ...   updates, state = tx.update(grads, state, params)
    >>> updates['w']
    Array([-0.2, -0.2], dtype=float32)
  """
  note_scaled()
  return tree
