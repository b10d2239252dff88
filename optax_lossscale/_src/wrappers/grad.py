"""`value_and_grad`: the true loss and the gradients of the scaled loss in one call.

Hand-written train steps multiply the loss by the scale, differentiate, and
then divide the returned value back to log it. Dividing is not exact (and is
Inf when the scaled loss overflowed), so here the loss is carried out of the
differentiated function as auxiliary data *before* it is scaled: the value
returned is the loss the user's function computed, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.utils import validation
from optax_lossscale._src.wrappers import state_access

# Turns a function `f(*args) -> (scaled_loss, (loss, aux))` into one returning
# `((scaled_loss, (loss, aux)), grads)`: `jax.value_and_grad` with `has_aux=True`,
# or an NNX or Equinox equivalent.
Differentiate = Callable[[Callable[..., Any]], Callable[..., Any]]


def scaled_value_and_grad(
  fun: Callable[..., Any], has_aux: bool, differentiate: Differentiate
) -> Callable[..., tuple[Any, Any]]:
  """Builds `value_and_grad` on top of any differentiation transform.

  Args:
    fun: the loss function; returns a scalar loss, or `(loss, aux)` when
      `has_aux` is True.
    has_aux: whether `fun` returns auxiliary data.
    differentiate: maps a function returning `(scaled_loss, (loss, aux))` to
      its `value_and_grad` with `has_aux=True`.

  Returns:
    `(loss_scale, *args, **kwargs) -> (value, scaled_grads)`, see `value_and_grad`.
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable; got {type(fun).__name__}.")
  validation.check_bool("has_aux", has_aux)

  def wrapped(loss_scale: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    if not isinstance(loss_scale, loss_scale_lib.LossScale):
      state_access.warn_composition(loss_scale)
    ls = state_access.get_loss_scale(loss_scale)

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, Any]]:
      out = fun(*args, **kwargs)
      if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
          if hasattr(out, "shape") and hasattr(out, "dtype"):
            # Under differentiation the array is a tracer, whose type name would only confuse.
            got = f"a single array of shape {tuple(out.shape)} and dtype {out.dtype}"
            hint = " Pass has_aux=False for a function that returns only the loss."
          else:
            got = type(out).__name__
            got += f" of {len(out)}" if isinstance(out, tuple) else ""
            hint = ""
          raise TypeError(
            f"With has_aux=True, fun must return a pair (loss, aux); got {got}.{hint}"
          )
        loss, aux = out
      else:
        loss, aux = out, None
      return ls.scale(loss), (loss, aux)

    (_, (loss, aux)), grads = differentiate(scaled)(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return wrapped


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """Returns a function computing the loss and the gradients of the scaled loss.

  The returned function takes the loss scale first, then `fun`'s arguments:
  `(loss_scale, *args, **kwargs) -> (value, scaled_grads)`. `value` is the
  **unscaled** loss exactly as `fun` computed it (or `(loss, aux)` with
  `has_aux`); `scaled_grads` are the gradients of `loss * scale`, ready for
  `loss_scale_optimizer`'s update (which unscales them) or a
  `optax_lossscale.flax.TrainState`'s `apply_gradients`.

  Args:
    fun: the loss function; it must return a real scalar, or a pair
      `(loss, aux)` when `has_aux` is True.
    argnums: which positional argument(s) to differentiate, as in
      `jax.value_and_grad`.
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    A function `(loss_scale, *args, **kwargs) -> (value, scaled_grads)`.
    `loss_scale` is a `LossScale` or anything `get_loss_scale` accepts: an
    optax state holding a `loss_scale_optimizer` state, a Flax `TrainState`
    or an `nnx.Optimizer`. For NNX modules use
    `optax_lossscale.flax.nnx_value_and_grad`, which differentiates with
    `nnx.value_and_grad`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
    >>> params = {'w': jnp.array([1.0, 2.0])}
    >>> state = tx.init(params)
    >>> loss_fn = lambda p, x: jnp.sum(p['w'] * x)
    >>> loss, grads = ols.value_and_grad(loss_fn)(state, params, jnp.ones(2))
    >>> loss, grads['w']
    (Array(3., dtype=float32), Array([1024., 1024.], dtype=float32))
    >>> updates, state = tx.update(grads, state, params)
    >>> updates['w']
    Array([-0.1, -0.1], dtype=float32)
  """
  return scaled_value_and_grad(
    fun, has_aux, lambda f: jax.value_and_grad(f, argnums=argnums, has_aux=True)
  )
