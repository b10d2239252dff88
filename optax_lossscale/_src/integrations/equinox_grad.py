"""Loss scaling with Equinox: `value_and_grad` through `eqx.filter_value_and_grad`.

An Equinox module is a pytree whose leaves include non-arrays (activation
functions, static settings), which `jax.value_and_grad` refuses. Equinox
differentiates with respect to the module's floating-point arrays only and
returns gradients shaped like the module, with `None` where it holds
anything else; the optimizer is given the same filter of the module,
`eqx.filter(model, eqx.is_inexact_array)`, as params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx

from optax_lossscale._src.wrappers import grad


def filter_value_and_grad(
  fun: Callable[..., Any], has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
  """`optax_lossscale.value_and_grad` for Equinox modules, via `eqx.filter_value_and_grad`.

  The returned function takes the loss scale first, then `fun`'s arguments,
  and differentiates with respect to the floating-point arrays of the first of
  them (the model), as `eqx.filter_value_and_grad` does.

  Args:
    fun: the loss function of a module (and data): `fun(model, *args,
      **kwargs)` returns a real scalar, or `(loss, aux)` when `has_aux` is True.
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    A function `(loss_scale, model, *args, **kwargs) -> (value, scaled_grads)`.
    `loss_scale` is a `LossScale` or anything `optax_lossscale.get_loss_scale`
    accepts (an optimizer state holding a `loss_scale_optimizer` state);
    `value` is the unscaled loss exactly as `fun` computed it (or
    `(loss, aux)`); `scaled_grads` are the gradients of the scaled loss,
    shaped like `model` with `None` at its non-array leaves, for
    `tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))`.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.equinox import filter_value_and_grad
    >>> model = eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0))
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
    >>> params = eqx.filter(model, eqx.is_inexact_array)
    >>> opt_state = tx.init(params)
    >>> loss_fn = lambda m, x: jnp.sum(m(x) ** 2)
    >>> x = jnp.ones(2)
    >>> loss, grads = filter_value_and_grad(loss_fn)(opt_state, model, x)
    >>> bool(loss == loss_fn(model, x))
    True
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> model = eqx.apply_updates(model, updates)
    >>> int(ols.metrics(opt_state)['total_skips'])
    0
  """
  return grad.scaled_value_and_grad(
    fun, has_aux, lambda f: eqx.filter_value_and_grad(f, has_aux=True)
  )
