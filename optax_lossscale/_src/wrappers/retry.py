"""Retry an overflow in the same step: back the scale off and redo the backward pass.

Every loss scaler we know handles an overflow by skipping the step: the batch
is thrown away and the next batch trains at the lower scale. `retry_on_overflow`
keeps the batch. Inside the compiled step, on the same batch:

  loss, grads = value_and_grad(S, batch)
  while grads are not finite and loss is finite and retries < max_retries
        and S > min_loss_scale:
    S = S backed off (as an overflowing step would: DynamicLossScale.adjust)
    loss, grads = value_and_grad(S, batch)            # one more backward pass
  if grads are finite or loss is finite:
    the state's scale becomes S   # finite: the wrapper applies the step; else the
                                  # budget (or the floor) ran out: the wrapper skips
                                  # and backs off from the lowest scale tried
  else:
    the scale stays where it was  # a NaN loss: skipped and backed off once,
                                  # as without retry

so a step whose scale was only too high costs one backward pass per halving
and loses nothing. When the budget runs out first, the batch is skipped, but
the halvings tried are kept: the next step starts from the lowest scale
tried, backed off once more. So with a finite loss a run loses at most one
batch per `max_retries + 1` halvings (one per 9 with the default 8), where
one per halving would be lost by skipping alone; from an initial scale `k`
halvings too high, `ceil((k - max_retries) / (max_retries + 1))` batches are
lost (none for `k <= max_retries`). A real NaN (a non-finite loss: no scale
helps the forward pass) is not retried and costs one back-off, exactly as
without retry. The loop is a `lax.while_loop`: a finite step runs its
condition once and no second backward pass, and nothing leaves the device.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.utils import tree_utils, validation
from optax_lossscale._src.wrappers import state_access
from optax_lossscale._src.wrappers.optimizer import LossScaleOptimizerState


class _Carry(NamedTuple):
  loss_scale: loss_scale_lib.LossScale
  retries: jax.Array
  value: Any
  grads: Any
  finite: jax.Array


def retry_on_overflow(
  value_and_grad_fn: Callable[..., tuple[Any, Any]],
  max_retries: int = 8,
  *,
  axis_name: tree_utils.AxisName = None,
) -> Callable[..., tuple[Any, Any, Any]]:
  """Wraps a loss-scaled `value_and_grad` so that an overflow is retried on the same batch.

  See the module docstring for the algorithm. Only the step's own batch is
  recomputed, inside the compiled step; no batch is lost to a scale that was
  at most `max_retries` halvings too high. A step that runs out of retries
  (its loss finite, its gradients not) is skipped by the wrapper, and the
  next one starts from the lowest scale tried, backed off once more: at most
  one batch is lost per `max_retries + 1` halvings. A non-finite loss is not
  retried: the step is skipped and the scale backed off once, as without
  retry.

  Args:
    value_and_grad_fn: `(loss_scale, *args, **kwargs) -> (value, scaled_grads)`,
      as `ols.value_and_grad(fun)`, `optax_lossscale.flax.nnx_value_and_grad(fun)`
      and `optax_lossscale.equinox.filter_value_and_grad(fun)` return; `value`
      is the loss, or `(loss, aux)`.
    max_retries: backward passes redone at most per step (an integer >= 1).
    axis_name: inside `shard_map`/`pmap`, the axis name(s) across which the
      shards must agree to retry (the loss-scale wrapper's `axis_name`).

  Returns:
    `(state, *args, **kwargs) -> (value, scaled_grads, state)`. `state` is a
    `DynamicLossScale`, an optax state holding one `loss_scale_optimizer`
    state, or a Flax `TrainState`; the returned one is the same with the loss
    scale the gradients were computed at, and (for the optimizer state) the
    retries counted in `retries` and `total_retries`. Feed `scaled_grads`
    and that state to the wrapper's update, or `state.apply_gradients`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**20))
    >>> params = {'w': jnp.array([1.0, 2.0])}
    >>> state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p['w'].astype(jnp.float16) ** 2)  # overflows at 2**20
    >>> step = ols.retry_on_overflow(ols.value_and_grad(loss_fn))
    >>> loss, grads, state = step(state, params)
    >>> float(ols.get_loss_scale(state)()), int(ols.metrics(state)['retries'])
    (8192.0, 7)
    >>> params, state = ols.apply_gradients(tx, grads, state, params)
    >>> bool(ols.metrics(state)['last_step_applied']), params['w']
    (True, Array([0.8, 1.6], dtype=float32))

  References:
    DeepSpeed issues #931 and #4986 and metaseq PR #115 ask for fewer steps
    lost to a too-high initial scale.
  """
  if not callable(value_and_grad_fn):
    raise TypeError(
      f"value_and_grad_fn must be callable (e.g. ols.value_and_grad(loss_fn)); got"
      f" {type(value_and_grad_fn).__name__}."
    )
  max_retries = validation.check_int("max_retries", max_retries, low=1, accepted="an integer >= 1")
  axis_name = tree_utils.normalize_axis_name(axis_name)

  def retrying(state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    ls = state_access.get_loss_scale(state)
    value, grads, ls, retries = retry_loop(
      lambda ls: value_and_grad_fn(ls, *args, **kwargs), ls, max_retries, axis_name
    )
    return value, grads, _with_loss_scale(state, ls, retries)

  return retrying


def retry_loop(
  compute: Callable[[Any], tuple[Any, Any]],
  ls: loss_scale_lib.LossScale,
  max_retries: int,
  axis_name: tree_utils.AxisName,
  loss_of: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any, Any, jax.Array]:
  """The loop of the module docstring: `(value, grads, loss_scale, retries)`.

  `compute(ls) -> (value, scaled_grads)`; `loss_of(value)` is the loss (by
  default `value`, or its first element when it is a tuple `(loss, aux)`).
  """
  if not (hasattr(ls, "adjust") and hasattr(ls, "min_loss_scale")):
    raise TypeError(
      "retry_on_overflow needs a dynamic loss scale (a DynamicLossScale) to back off;"
      f" got {type(ls).__name__}."
    )
  if loss_of is None:
    loss_of = lambda value: value[0] if isinstance(value, tuple) else value
  finite = lambda grads: tree_utils.all_finite(grads, axis_name)

  def keep_going(c: _Carry) -> jax.Array:
    more = (c.retries < max_retries) & (c.loss_scale() > jnp.float32(ls.min_loss_scale))
    return ~c.finite & tree_utils.all_finite(loss_of(c.value), axis_name) & more

  def again(c: _Carry) -> _Carry:
    lower = _backed_off(c.loss_scale)
    value, grads = compute(lower)
    return _Carry(lower, c.retries + 1, value, grads, finite(grads))

  value, grads = compute(ls)
  last = jax.lax.while_loop(
    keep_going, again, _Carry(ls, jnp.zeros((), jnp.int32), value, grads, finite(grads))
  )
  # With a finite loss, the scale the last pass was computed at: the one that
  # worked, or the lowest tried, from which the wrapper backs off once more when
  # it skips the step, so the halvings tried are not tried again. A non-finite
  # loss (never retried) keeps the scale it came with, as without retry. The
  # gradients are the last pass's, non-finite either way when skipped:
  # selecting the first pass's would cost a pass.
  keep = last.finite | tree_utils.all_finite(loss_of(last.value), axis_name)
  scale = jax.tree.map(functools.partial(jnp.where, keep), last.loss_scale, ls)
  return last.value, last.grads, scale, last.retries


def _backed_off(ls: Any) -> Any:
  """`ls` after as many overflows as it takes to lower the scale (its hysteresis)."""
  start = ls()
  out = ls.adjust(False)
  for _ in range(getattr(ls, "hysteresis", 1) - 1):
    lowered = out() < start
    out = jax.tree.map(functools.partial(jnp.where, lowered), out, out.adjust(False))
  return out


def _with_loss_scale(state: Any, ls: Any, retries: jax.Array) -> Any:
  """`state` with its loss scale replaced by `ls` and `retries` counted."""
  if isinstance(state, loss_scale_lib.LossScale):
    return ls
  is_state = lambda x: isinstance(x, LossScaleOptimizerState)

  def replace(node: Any) -> Any:
    if not is_state(node):
      return node
    return node._replace(loss_scale=ls, retries=retries, total_retries=node.total_retries + retries)

  if hasattr(state, "opt_state") and hasattr(state, "replace"):  # a Flax TrainState
    return state.replace(opt_state=jax.tree.map(replace, state.opt_state, is_leaf=is_state))
  if hasattr(state, "opt_state"):
    raise TypeError(
      "retry_on_overflow returns a new state, which an nnx.Optimizer (updated in place)"
      " cannot be: use optax_lossscale.flax.nnx_retry_on_overflow(loss_fn), which"
      " writes the backed-off scale into the optimizer."
    )
  return jax.tree.map(replace, state, is_leaf=is_state)
