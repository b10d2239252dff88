"""A running mean and variance that decides whether a value is a spike.

`skip_bad_steps` keeps one `RunningStatistic` per monitored quantity (the
global gradient norm, the loss). The algorithm, per accepted step with value
`x` (the log of the norm, or the loss as it is):

  alpha = max(1 - decay, 1 / (count + 1))   # exact mean/variance while count < 1/(1-decay)
  delta = x - mean
  mean  = mean + alpha * delta
  var   = (1 - alpha) * (var + alpha * delta**2)
  count = count + 1

and a value is a spike once `count >= warmup_steps` and

  (x - mean) / max(sqrt(var), floor) > threshold

with `floor = min_std` for the log-norm (a relative change, since it is a log)
and `min_std * |mean|` for the loss. Only values above the mean are spikes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RunningStatistic(NamedTuple):
  """An exponential moving mean and variance of one monitored quantity.

  Attributes:
    count: int32 scalar, the values that fed the statistic (accepted steps).
    mean: float32 scalar, the running mean (of the log for the gradient norm).
    var: float32 scalar, the running variance (same units as `mean`).
    last: float32 scalar, the quantity at the last update (the norm itself,
      not its log), whether or not the step was accepted.
  """

  count: jax.Array
  mean: jax.Array
  var: jax.Array
  last: jax.Array


def init() -> RunningStatistic:
  """An empty statistic (no value seen)."""
  zero = jnp.zeros((), jnp.float32)
  return RunningStatistic(jnp.zeros((), jnp.int32), zero, zero, zero)


def zscore(stat: RunningStatistic, x: jax.Array, min_std: float, relative: bool) -> jax.Array:
  """How many (floored) standard deviations `x` lies above the mean."""
  floor = min_std * jnp.abs(stat.mean) if relative else jnp.float32(min_std)
  std = jnp.maximum(jnp.sqrt(stat.var), floor)
  # A zero floor (|mean| == 0 for the loss) with zero variance: never a spike.
  return jnp.where(std > 0, (x - stat.mean) / jnp.where(std > 0, std, 1.0), 0.0)


def threshold(stat: RunningStatistic, z: float, min_std: float, relative: bool) -> jax.Array:
  """The value whose z-score is `z`: where spikes start (`mean + z * floored std`)."""
  floor = min_std * jnp.abs(stat.mean) if relative else jnp.float32(min_std)
  return stat.mean + jnp.float32(z) * jnp.maximum(jnp.sqrt(stat.var), floor)


def accumulate(stat: RunningStatistic, x: jax.Array, decay: float) -> RunningStatistic:
  """The statistic after feeding it `x` (see the module docstring)."""
  count = stat.count + 1
  alpha = jnp.maximum(jnp.float32(1.0 - decay), 1.0 / count.astype(jnp.float32))
  delta = x - stat.mean
  mean = stat.mean + alpha * delta
  var = (1.0 - alpha) * (stat.var + alpha * delta * delta)
  return stat._replace(count=count, mean=mean, var=var)


def rebase(stat: RunningStatistic, x: jax.Array) -> RunningStatistic:
  """The statistic re-centred on `x`, keeping its spread and warm-up.

  Used when a streak of spikes is accepted as a new regime: the mean jumps to
  the new level so that the values that follow are judged against it.
  """
  return stat._replace(count=stat.count + 1, mean=x)
