"""The dynamic loss scale: grow while gradients stay finite, back off on overflow.

The algorithm, per step, on the unscaled gradients::

  if all grads are finite:
    if counter + 1 >= increment_period:    # a whole period without overflow
      S' = S * multiplier; S = S' if S' is finite and S' <= max_loss_scale
      counter = 0; hysteresis_tracker = hysteresis
    else:
      counter += 1                         # (consecutive_hysteresis: restore
                                           #  hysteresis_tracker here too)
    apply the update
  else:                                    # overflow: skip the step
    counter = 0; hysteresis_tracker = max(hysteresis_tracker - 1, 0)
    if hysteresis_tracker == 0:            # hysteresis=1 backs off at once
      S = max(S * backoff, min_loss_scale)   # backoff defaults to 1/multiplier

With the default hyper-parameters the trajectory of `S` is bit-identical to
TensorFlow's `tf.mixed_precision.experimental.DynamicLossScale`.
(`loss_scale_optimizer` hands `update` the scaled gradients when
`min_loss_scale >= 1`: dividing by S >= 1 changes no value's finiteness, so
the answer is the same and the check reads no product.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._src.loss_scales.loss_scale import LossScale
from optax_lossscale._src.utils import tree_utils, validation


class DynamicLossScale(LossScale):
  """A loss scale that grows while gradients stay finite and backs off on overflow.

  See the module docstring for the algorithm. With the default arguments the
  trajectory is bit-identical to TensorFlow's `DynamicLossScale`; the keyword
  arguments add the knobs of the PyTorch, Megatron-LM and DeepSpeed scalers.

  Args:
    initial_loss_scale: the starting scale, a finite number > 0 within
      [min_loss_scale, max_loss_scale]. Start high: a scale that is too high
      falls in a few steps, one that is too low takes periods to climb.
    increment_period: grow the scale after this many consecutive finite steps
      (an integer >= 1).
    multiplier: the growth factor, a finite number > 1.
    min_loss_scale: the scale never backs off below this finite number > 0.
    max_loss_scale: growth that would exceed this finite number is not taken.
    backoff_factor: the factor applied on overflow, in (0, 1). `None` uses
      `1 / multiplier`, which for TensorFlow's multiplier of 2 halves the
      scale exactly as TensorFlow does.
    hysteresis: back off only on the `hysteresis`-th non-finite step since
      the tracker was last restored (Megatron-LM); 1 backs off at once. Every
      non-finite step is skipped either way.
    consecutive_hysteresis: restore the hysteresis tracker on every finite
      step (DeepSpeed), so only consecutive overflows count; by default it is
      restored when a growth period completes.

  Attributes:
    loss_scale: the current scale (float32 scalar leaf).
    counter: finite steps since the last overflow or the end of the last
      growth period, taken or refused at `max_loss_scale` (int32 leaf).
    hysteresis_tracker: int32 leaf; the next overflow backs off when it is
      1 or 0, so `hysteresis_tracker - 1` more overflows are tolerated.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import DynamicLossScale
    >>> ls = DynamicLossScale(initial_loss_scale=2**15, increment_period=2)
    >>> ls, ok = ls.update({'w': jnp.array([1.0, jnp.inf])})
    >>> float(ls()), bool(ok)
    (16384.0, False)
    >>> for _ in range(2):
    ...   ls, ok = ls.update({'w': jnp.ones(2)})
    >>> float(ls()), int(ls.counter)
    (32768.0, 0)

  References:
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740
  """

  _state_fields = ("loss_scale", "counter", "hysteresis_tracker")
  _config_fields = (
    "initial_loss_scale",
    "increment_period",
    "multiplier",
    "min_loss_scale",
    "max_loss_scale",
    "backoff_factor",
    "hysteresis",
    "consecutive_hysteresis",
  )
  counter: jax.Array
  hysteresis_tracker: jax.Array
  initial_loss_scale: float
  increment_period: int
  multiplier: float
  min_loss_scale: float
  max_loss_scale: float
  backoff_factor: float | None
  hysteresis: int
  consecutive_hysteresis: bool

  def __init__(
    self,
    initial_loss_scale: float = 2**15,
    increment_period: int = 2000,
    multiplier: float = 2.0,
    *,
    min_loss_scale: float = 1.0,
    max_loss_scale: float = validation.FLOAT32_MAX,
    backoff_factor: float | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
  ) -> None:
    positive = "a finite number > 0"
    initial = validation.check_float(
      "initial_loss_scale",
      initial_loss_scale,
      low=0.0,
      low_inclusive=False,
      accepted=positive,
    )
    period = validation.check_int(
      "increment_period",
      increment_period,
      low=1,
      accepted=f"an integer in [1, {validation.INT32_MAX}]",
    )
    mult = validation.check_float(
      "multiplier",
      multiplier,
      low=1.0,
      low_inclusive=False,
      accepted="a finite number > 1",
      not_one_in_float32=True,
    )
    low = validation.check_float(
      "min_loss_scale", min_loss_scale, low=0.0, low_inclusive=False, accepted=positive
    )
    high = validation.check_float(
      "max_loss_scale", max_loss_scale, low=0.0, low_inclusive=False, accepted=positive
    )
    if low > high:
      raise ValueError(
        f"min_loss_scale must be <= max_loss_scale; got min_loss_scale={low}"
        f" and max_loss_scale={high}."
      )
    if not low <= initial <= high:
      raise ValueError(
        f"initial_loss_scale must lie in [min_loss_scale, max_loss_scale] ="
        f" [{low}, {high}]; got {initial}."
      )
    backoff = None
    if backoff_factor is not None:
      backoff = validation.check_float(
        "backoff_factor",
        backoff_factor,
        low=0.0,
        low_inclusive=False,
        high=1.0,
        high_inclusive=False,
        accepted="None or a number in the open interval (0, 1)",
        not_one_in_float32=True,
      )
    tolerance = validation.check_int(
      "hysteresis", hysteresis, low=1, accepted=f"an integer in [1, {validation.INT32_MAX}]"
    )
    consecutive = validation.check_bool(
      "consecutive_hysteresis", consecutive_hysteresis, error=ValueError
    )
    self._set(
      initial_loss_scale=initial,
      increment_period=period,
      multiplier=mult,
      min_loss_scale=low,
      max_loss_scale=high,
      backoff_factor=backoff,
      hysteresis=tolerance,
      consecutive_hysteresis=consecutive,
      loss_scale=jnp.asarray(initial, jnp.float32),
      counter=jnp.zeros((), jnp.int32),
      hysteresis_tracker=jnp.asarray(tolerance, jnp.int32),
    )

  @property
  def dynamic(self) -> bool:
    return True

  @property
  def backoff(self) -> float:
    """The factor applied on overflow: `backoff_factor`, else `1 / multiplier`.

    A multiplication, not a division by `multiplier`: XLA rewrites a division
    by a constant into this multiplication under `jit` anyway, and eager code
    must give the same bits. For power-of-two multipliers (TensorFlow's 2
    included) it equals TensorFlow's division exactly.
    """
    return 1.0 / self.multiplier if self.backoff_factor is None else self.backoff_factor

  def update(
    self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[DynamicLossScale, jax.Array]:
    finite = tree_utils.all_finite(grads, axis_name=axis_name)
    return self.adjust(finite), finite

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
    """Returns the next loss scale given whether this step's gradients were finite.

    Use it when the finiteness flag is already known (for example computed
    once for several loss scales, or reduced across devices by hand).

    Example:
      >>> from optax_lossscale import DynamicLossScale
      >>> ls = DynamicLossScale(2**10, increment_period=1)
      >>> float(ls.adjust(True)()), float(ls.adjust(False)())
      (2048.0, 512.0)
    """
    finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    counter = jnp.asarray(self.counter, jnp.int32)
    tracker = jnp.asarray(self.hysteresis_tracker, jnp.int32)
    restored = jnp.asarray(self.hysteresis, jnp.int32)

    # Finite step: count it; at the end of a period try to grow.
    period_done = counter + 1 >= self.increment_period
    grown = scale * jnp.float32(self.multiplier)
    can_grow = jnp.isfinite(grown) & (grown <= jnp.float32(self.max_loss_scale))
    scale_if_finite = jnp.where(period_done & can_grow, grown, scale)
    counter_if_finite = jnp.where(period_done, 0, counter + 1)
    restore = period_done | self.consecutive_hysteresis
    tracker_if_finite = jnp.where(restore, restored, tracker)

    # Non-finite step: reset the counter, spend hysteresis, then back off.
    tracker_if_not = jnp.maximum(tracker - 1, 0)
    backed_off = scale * jnp.float32(self.backoff)
    backed_off = jnp.maximum(backed_off, jnp.float32(self.min_loss_scale))
    scale_if_not = jnp.where(tracker_if_not == 0, backed_off, scale)

    return self.replace(
      loss_scale=jnp.where(finite, scale_if_finite, scale_if_not),
      counter=jnp.where(finite, counter_if_finite, 0).astype(jnp.int32),
      hysteresis_tracker=jnp.where(finite, tracker_if_finite, tracker_if_not).astype(jnp.int32),
    )
