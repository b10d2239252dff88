"""Loss scaling with Flax NNX: `nnx.Optimizer` plus one differentiation helper.

`nnx.Optimizer(model, loss_scale_optimizer(tx), wrt=nnx.Param)` needs nothing
from this module: its `update(model, grads)` feeds the wrapper the gradients,
and on a skipped step the wrapper returns zero updates and the untouched inner
state, so the parameters stay as they were (`p + 0`; only a parameter equal to
-0.0 would become +0.0). `nnx.Optimizer.step` still advances on a skipped
step; `optax_lossscale.metrics(optimizer)` counts the skips.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from optax_lossscale._src import grad


def nnx_value_and_grad(
  fun: Callable[..., Any],
  argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """`optax_lossscale.value_and_grad` for NNX modules, via `nnx.value_and_grad`.

  Args:
    fun: the loss function of a module (and data); returns a real scalar, or
      `(loss, aux)` when `has_aux` is True.
    argnums: which argument(s) to differentiate; an `nnx.DiffState` selects the
      variables (e.g. `nnx.DiffState(0, nnx.Param)`), as in `nnx.value_and_grad`.
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    A function `(loss_scale, *args, **kwargs) -> (value, scaled_grads)`, where
    `loss_scale` is a `LossScale`, an optimizer state or an `nnx.Optimizer`,
    `value` is the unscaled loss (or `(loss, aux)`) and `scaled_grads` is the
    `nnx.State` of gradients of the scaled loss, for `optimizer.update`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import nnx_value_and_grad
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> loss_fn = lambda m, x: jnp.sum(m(x) ** 2)
    >>> loss, grads = nnx_value_and_grad(loss_fn)(optimizer, model, jnp.ones((1, 2)))
    >>> bool(loss == loss_fn(model, jnp.ones((1, 2))))
    True
    >>> _ = optimizer.update(model, grads)
    >>> int(ols.metrics(optimizer)['total_skips'])
    0
  """
  return grad.scaled_value_and_grad(
    fun, has_aux, lambda f: nnx.value_and_grad(f, argnums=argnums, has_aux=True)
  )
