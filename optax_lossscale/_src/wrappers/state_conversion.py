"""Switch the guards on or off in the middle of a run, keeping the optimizer's state.

A run that started with bare `optax.adam` can continue under
`loss_scale_optimizer` or `skip_bad_steps`, and the other way round: the
wrappers only add their own counters and loss scale around the inner
optimizer's state, so converting keeps that state (Adam's moments, its step
count, a schedule's position) bit for bit and starts the wrapper's own state
fresh.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_lossscale._src.wrappers.optimizer import LossScaleOptimizerState
from optax_lossscale._src.wrappers.skip_bad_steps import SkipBadStepsState

_WRAPPER_STATES = (LossScaleOptimizerState, SkipBadStepsState)


def innermost_state(opt_state: Any) -> Any:
  """`opt_state` without the wrappers' layers: the innermost optimizer's state."""
  while isinstance(opt_state, _WRAPPER_STATES):
    opt_state = opt_state.inner_state
  return opt_state


def convert_state(tx: optax.GradientTransformation, opt_state: Any, params: Any) -> Any:
  """The state `tx` takes, carrying over the innermost optimizer state of `opt_state`.

  Either state may have wrappers (`loss_scale_optimizer`, `skip_bad_steps`)
  around the same inner optimizer, or none: the inner state moves over bit
  for bit, and the wrappers of `tx` start from their `init` (the initial
  loss scale, zero counters).

  Args:
    tx: the transformation to continue with, e.g.
      `ols.loss_scale_optimizer(optax.adam(1e-3))`, or the bare `optax.adam(1e-3)`.
    opt_state: the state so far, e.g. a bare Adam state restored from a
      checkpoint, or a wrapper's state.
    params: the current params (for `tx.init`, which builds the wrappers'
      fresh state).

  Returns:
    A state for `tx.update`.

  Raises:
    ValueError: if the inner states differ in structure, shapes or dtypes
      (another inner optimizer, or other params), naming the difference.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> params = {'w': jnp.ones(2)}
    >>> bare = optax.adam(0.1)
    >>> state = bare.init(params)
    >>> _, state = bare.update({'w': jnp.ones(2)}, state, params)
    >>> tx = ols.loss_scale_optimizer(bare)
    >>> wrapped = ols.convert_state(tx, state, params)
    >>> int(wrapped.inner_state[0].count), float(ols.get_loss_scale(wrapped)())
    (1, 32768.0)
    >>> back = ols.convert_state(bare, wrapped, params)
    >>> int(back[0].count)
    1
  """
  return _place(tx.init(params), innermost_state(opt_state))


def _place(target: Any, inner: Any) -> Any:
  if isinstance(target, _WRAPPER_STATES):
    return target._replace(inner_state=_place(target.inner_state, inner))
  _check_same_layout(target, inner)
  return inner


def _check_same_layout(expected: Any, given: Any) -> None:
  expected_def, given_def = jax.tree.structure(expected), jax.tree.structure(given)
  if expected_def != given_def:
    raise ValueError(
      "The optimizer state to carry over does not have the structure the new"
      " transformation's inner optimizer builds for these params (another inner"
      " optimizer, or other params?):"
      f"\n  new: {expected_def}\n  old: {given_def}"
    )
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(given), strict=True
  ):
    a_type = (jax.numpy.shape(a), jax.numpy.result_type(a))
    b_type = (jax.numpy.shape(b), jax.numpy.result_type(b))
    if a_type != b_type:
      raise ValueError(
        f"The optimizer state to carry over differs at {jax.tree_util.keystr(path)}:"
        f" the new transformation builds shape {a_type[0]} {a_type[1]}, the old state"
        f" holds shape {b_type[0]} {b_type[1]}."
      )
