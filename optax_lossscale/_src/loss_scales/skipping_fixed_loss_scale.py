"""A constant loss scale that skips non-finite steps: jmp's `StaticLossScale` rule.

TensorFlow's `FixedLossScale` and jmp's `StaticLossScale` hold the same
constant scale but differ on an overflow. TensorFlow's `update` always
applies the step (`FixedLossScale` keeps that rule). jmp's loss scales have
no opinion, and its recipe decides for every kind of scale alike::

  grads = loss_scale.unscale(grads)
  finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(finite)       # a StaticLossScale returns itself
  params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state),
                                      (params, opt_state))

so a jmp user's static scale skips every non-finite step. This module's scale
is that rule as a `LossScale`: per step, on the unscaled gradients,

  S stays S
  apply the update if all grads are finite, else skip it

and `loss_scale_optimizer` skips and counts such steps as it does for a
`DynamicLossScale`.
"""

from __future__ import annotations

from typing import Any

import jax

from optax_lossscale._src.loss_scales.loss_scale import ConstantScale, LossScale
from optax_lossscale._src.utils import tree_utils


class SkippingFixedLossScale(ConstantScale, LossScale):
  """A constant loss scale that skips non-finite steps (jmp's `StaticLossScale` recipe).

  The scale never changes, as `FixedLossScale`'s; unlike it, `update` returns
  `should_apply=False` when a gradient holds NaN or Inf, so that
  `loss_scale_optimizer` skips the step (the params and the inner state stay
  as they were) and counts it in `total_skips`. This is what jmp's recipe
  (`jmp.all_finite` then `jmp.select_tree`) does with `jmp.StaticLossScale`;
  `FixedLossScale` keeps TensorFlow's rule, which applies every step.

  Its `dynamic` attribute is False (the scale is constant, Keras's meaning);
  `skips` is True.

  Args:
    loss_scale_value: the scale, a finite number > 0 (as jmp's; below 1 the
      wrapper checks the unscaled gradients, which may overflow where the
      scaled ones did not).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import SkippingFixedLossScale
    >>> ls = SkippingFixedLossScale(128)
    >>> ls.scale(jnp.float32(0.5))
    Array(64., dtype=float32)
    >>> new_ls, ok = ls.update({'w': jnp.array([1.0, jnp.nan])})
    >>> float(new_ls()), bool(ok), ls.dynamic, ls.skips
    (128.0, False, False, True)
    >>> ls.get_config()
    {'loss_scale_value': 128.0}

  References:
    jmp's README, "Loss scaling" (https://github.com/google-deepmind/jmp):
    the same `all_finite` / `select_tree` recipe for every loss scale.
  """

  _low, _low_inclusive = 0.0, False

  @property
  def skips(self) -> bool:
    return True

  def update(
    self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[SkippingFixedLossScale, jax.Array]:
    return self, tree_utils.all_finite(grads, axis_name=axis_name)
