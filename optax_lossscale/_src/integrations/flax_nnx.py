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
import jax
import optax

from optax_lossscale._src.utils import validation
from optax_lossscale._src.wrappers import grad, retry, state_access, state_conversion
from optax_lossscale._src.wrappers.optimizer import LossScaleOptimizerState


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


def nnx_retry_on_overflow(
  fun: Callable[..., Any],
  max_retries: int = 8,
  *,
  argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
  has_aux: bool = False,
  axis_name: Any = None,
) -> Callable[..., tuple[Any, Any]]:
  """`nnx_value_and_grad` that retries an overflow on the same batch (`ols.retry_on_overflow`).

  The backward pass is redone at a backed-off scale, inside the compiled
  step, until the gradients are finite; the optimizer's loss scale and its
  `retries` counters are updated in place (an `nnx.Optimizer` is mutable).
  Module state the forward pass changes (batch statistics) is taken from
  the pass whose gradients are returned.

  Args:
    fun: the loss function; returns a real scalar, or `(loss, aux)` with
      `has_aux`.
    max_retries: backward passes redone at most per step (>= 1).
    argnums: which arguments to differentiate, as in `nnx_value_and_grad`.
    has_aux: whether `fun` returns `(loss, aux)`.
    axis_name: inside `shard_map`, the axis name(s) the shards agree across.

  Returns:
    `(optimizer, *args, **kwargs) -> (value, scaled_grads)`, for
    `optimizer.update(model, scaled_grads)`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import nnx_retry_on_overflow
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0), dtype=jnp.float16)
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**24))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> loss_fn = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)
    >>> loss, grads = nnx_retry_on_overflow(loss_fn)(optimizer, model, jnp.ones((1, 2)))
    >>> m = ols.metrics(optimizer)
    >>> int(m['retries']) > 0, float(m['loss_scale']) < 2.0**24
    (True, True)
    >>> _ = optimizer.update(model, grads)
    >>> bool(ols.metrics(optimizer)['last_step_applied'])
    True
  """
  value_and_grad = nnx_value_and_grad(fun, argnums=argnums, has_aux=has_aux)
  max_retries = validation.check_int("max_retries", max_retries, low=1, accepted="an integer >= 1")

  def retrying(optimizer: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    # Modules cannot be closed over by the retry loop's body: it works on their
    # state, merged into fresh modules on every pass.
    graphdef, state = nnx.split(args)
    is_box = lambda x: isinstance(x, nnx.Variable)
    state = jax.tree.map(lambda v: _get(v) if is_box(v) else v, state, is_leaf=is_box)

    def compute(ls: Any) -> tuple[Any, Any]:
      fresh = nnx.merge(graphdef, state)
      value, grads = value_and_grad(ls, *fresh, **kwargs)
      return (value, nnx.state(fresh, nnx.Variable)), grads

    loss_of = lambda out: out[0][0] if has_aux else out[0]
    ls = state_access.get_loss_scale(optimizer)
    (value, new_state), grads, ls, retries = retry.retry_loop(
      compute, ls, max_retries, axis_name, loss_of
    )
    nnx.update(args, new_state)
    _assign_loss_scale(optimizer, ls, retries)
    return value, grads

  return retrying


def _assign_loss_scale(optimizer: Any, ls: Any, retries: Any) -> None:
  """Writes `ls` and `retries` into the `nnx.Optimizer`'s loss-scale state, in place."""
  is_state = lambda x: isinstance(x, LossScaleOptimizerState)
  (node,) = [x for x in jax.tree.leaves(optimizer.opt_state, is_leaf=is_state) if is_state(x)]
  is_box = lambda x: isinstance(x, nnx.Variable)
  for box, value in zip(
    jax.tree.leaves(node.loss_scale, is_leaf=is_box), jax.tree.leaves(ls), strict=True
  ):
    _set(box, value)
  _set(node.total_retries, _get(node.total_retries) + retries)
  _set(node.retries, retries)


def _get(box: Any) -> Any:
  # `.value` is deprecated since flax 0.12 in favour of get_value/set_value.
  return box.get_value() if hasattr(box, "get_value") else box.value


def _set(box: Any, value: Any) -> None:
  if hasattr(box, "set_value"):
    box.set_value(value)
  else:
    box.value = value


def nnx_convert_optimizer(
  optimizer: nnx.Optimizer, model: nnx.Module, tx: optax.GradientTransformation
) -> nnx.Optimizer:
  """A new `nnx.Optimizer` for `model` with `tx`, the guards switched on or off.

  Carries over `step` and the inner optimizer's state bit for bit
  (`ols.convert_state`); the wrappers of `tx` start fresh.

  Args:
    optimizer: the `nnx.Optimizer` so far (bare or wrapped).
    model: the model it optimizes.
    tx: the transformation to continue with.

  Returns:
    An `nnx.Optimizer` with the same `wrt`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import nnx_convert_optimizer
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> bare = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> guarded = nnx_convert_optimizer(bare, model, ols.skip_bad_steps(optax.adam(1e-3)))
    >>> sorted(ols.metrics(guarded))[:2]
    ['consecutive_skips', 'consecutive_spike_skips']
  """
  new = nnx.Optimizer(model, tx, wrt=optimizer.wrt)
  is_box = lambda x: isinstance(x, nnx.Variable)
  pure = lambda tree: jax.tree.map(lambda v: _get(v) if is_box(v) else v, tree, is_leaf=is_box)
  params = pure(nnx.state(model, optimizer.wrt))
  converted = state_conversion.convert_state(tx, pure(optimizer.opt_state), params)
  boxes = jax.tree.leaves(new.opt_state, is_leaf=is_box)
  for box, value in zip(boxes, jax.tree.leaves(converted), strict=True):
    _set(box, value)
  _set(new.step, _get(optimizer.step))
  return new
