"""`apply_gradients`: the optimizer update and the parameter update as one step.

optax splits a step in two, `tx.update` (gradients to updates) and
`optax.apply_updates` (updates to params). A `loss_scale_optimizer` skips
inside the first, so on its own it must return the updates from its
`lax.cond` and let `apply_updates` read them back. Run together, both happen
inside the branch: XLA fuses the update into the parameter write, as for bare
optax, and a skipped step returns the params as they were.
"""

from __future__ import annotations

from typing import Any

import optax

from optax_lossscale._src.step import conditional_step


def apply_gradients(
  optimizer: optax.GradientTransformation,
  grads: optax.Updates,
  opt_state: optax.OptState,
  params: optax.Params,
  **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
  """`optimizer.update` then `optax.apply_updates`, as one step.

  For a `loss_scale_optimizer` the parameter update runs inside the skip
  branch: on an applied step the updates fuse into the new parameters and are
  never written to memory, and on a skipped step the parameters are returned
  untouched (bit for bit, no `p + 0`; with `skip_mode='cond'` without being
  read). This is the cheapest way to step (see BENCHMARKS.md); the result is
  the same as

    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

  which is what this function does for any other transformation, including
  a chain that merely contains a `loss_scale_optimizer`.

  Args:
    optimizer: an optax transformation, typically a `loss_scale_optimizer`.
    grads: the gradients (of the **scaled** loss for a `loss_scale_optimizer`).
    opt_state: the optimizer's state.
    params: the parameters; required.
    **extra_args: passed on to `optimizer.update`.

  Returns:
    `(new_params, new_opt_state)`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=2.0**8)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = ols.mark_scaled({'w': jnp.full(2, 256.0)})  # 1.0, scaled by hand
    >>> params, state = ols.apply_gradients(tx, grads, state, params)
    >>> params['w']
    Array([0.5, 0.5], dtype=float32)
    >>> overflowed = {'w': jnp.full(2, jnp.inf)}
    >>> params, state = ols.apply_gradients(tx, overflowed, state, params)
    >>> params['w'], int(state.total_skips)
    (Array([0.5, 0.5], dtype=float32), 1)
  """
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
      "optimizer must be an optax.GradientTransformation, e.g."
      f" loss_scale_optimizer(optax.adam(1e-3)); got {type(optimizer).__name__}."
    )
  if params is None:
    raise ValueError("params must be given: apply_gradients returns the updated params.")
  fused = conditional_step.fused_apply_gradients(optimizer)
  if fused is not None:
    return fused(grads, opt_state, params, **extra_args)
  updates, opt_state = optimizer.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state
