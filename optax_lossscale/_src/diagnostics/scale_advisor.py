"""Suggesting a loss scale from a sample of unscaled gradients.

The loss scale `S` is a trade: every gradient is multiplied by `S` before it
is stored in float16, so a larger `S` lifts more small values out of the
underflow range, and a too-large `S` pushes the largest ones past 65504. Given
a sample of *unscaled* float32 gradients (a few batches' worth), the advisor
picks::

  limit = finfo(dtype).max / margin
  S     = the largest power of two with max|g| * S <= limit   (capped at max_scale)

Powers of two because multiplying by them is exact: scaling then only moves
the exponent. `margin` is the headroom kept for what the sample did not see:
later, larger gradients and the intermediate (activation) gradients of the
backward pass, which are often larger than the parameter gradients.
"""

from __future__ import annotations

from fractions import Fraction
import math
import numbers
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_lossscale._src.utils import dtypes, tree_utils

_DTYPES = ("float16", "bfloat16")


class ScaleAdvice(NamedTuple):
  """What `suggest_loss_scale` found.

  Attributes:
    scale: the suggested loss scale, a power of two.
    max_abs: the largest finite |g| in the sample.
    headroom: `finfo(dtype).max / (max_abs * scale)`, at least `margin`
      unless the scale was capped (inf when `max_abs` is 0).
    underflow_before: share of the nonzero finite values that become zero
      when stored in `dtype` unscaled.
    underflow_after: the same share at the suggested scale.
    subnormal_before: share of the nonzero finite values that become
      subnormal (precision lost) in `dtype` unscaled.
    subnormal_after: the same share at the suggested scale.
    num_values: the nonzero finite values the shares are taken over.
    num_nonfinite: NaN and Inf values in the sample; they are ignored.

  Example:
    >>> import numpy as np
    >>> import optax_lossscale as ols
    >>> advice = ols.suggest_loss_scale([np.array([2.0, 1e-9, np.nan], np.float32)])
    >>> advice.scale, advice.max_abs, advice.num_nonfinite
    (2048.0, 2.0, 1)
  """

  scale: float
  max_abs: float
  headroom: float
  underflow_before: float
  underflow_after: float
  subnormal_before: float
  subnormal_after: float
  num_values: int
  num_nonfinite: int

  def __str__(self) -> str:
    return (
      f"suggested loss scale 2**{int(math.log2(self.scale))} = {self.scale:g}"
      f" (max|g| = {self.max_abs:.4g}, headroom x{self.headroom:.4g});"
      f" underflow {self.underflow_before:.2%} -> {self.underflow_after:.2%},"
      f" subnormal {self.subnormal_before:.2%} -> {self.subnormal_after:.2%}"
      f" of {self.num_values} nonzero values"
      + (f"; {self.num_nonfinite} NaN/Inf ignored" if self.num_nonfinite else "")
    )


def _positive(name: str, value: Any, low: float) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be a finite number >= {low:g}; got {value!r}.")
  number = float(value)
  if not (math.isfinite(number) and number >= low):
    raise ValueError(f"{name} must be a finite number >= {low:g}; got {value!r}.")
  return number


def _largest_power_of_two_at_most(x: float) -> int:
  """The exponent e of the largest 2**e <= x, for a finite x > 0."""
  mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= mantissa < 1
  del mantissa
  return exponent - 1


def _shares(values: np.ndarray, scale: float, dtype: np.dtype) -> tuple[float, float]:
  """Shares of `values` (nonzero, finite float32) that underflow / are subnormal."""
  if values.size == 0:
    return 0.0, 0.0
  # float32 arithmetic, as on the device; a power-of-two scale is exact there.
  with np.errstate(over="ignore"):  # values beyond the dtype's range become inf: expected
    stored = np.abs((values * np.float32(scale)).astype(dtype)).astype(np.float32)
  smallest_normal = float(jax.numpy.finfo(dtype).smallest_normal)
  underflow = np.count_nonzero(stored == 0)
  subnormal = np.count_nonzero((stored != 0) & (stored < smallest_normal))
  return float(underflow / values.size), float(subnormal / values.size)


def suggest_loss_scale(
  grads: Any,
  dtype: Any = "float16",
  *,
  margin: float = 8.0,
  max_scale: float = 2.0**24,
) -> ScaleAdvice:
  """Suggests the largest power-of-two loss scale the gradients can take safely.

  Host side: the sample is fetched and analysed with NumPy. Pass the
  *unscaled* gradients of a few batches (any pytree, e.g. a list of gradient
  trees); floating leaves are pooled, other leaves ignored. The shares model
  storing `g * scale` (computed in float32) in `dtype`.

  Args:
    grads: a sample of unscaled gradients, any pytree.
    dtype: the low-precision dtype, `'float16'` (default) or `'bfloat16'`.
    margin: the factor kept between `max|g| * scale` and the dtype's largest
      value, a finite number >= 1; 8 (three powers of two) by default.
    max_scale: the suggestion never exceeds this finite number >= 1 (it is
      returned, rounded down to a power of two, when no gradient bounds it).

  Raises:
    ValueError: if the sample holds no finite, nonzero floating value (it is
      empty, all zeros, or all NaN/Inf): there is nothing to base a scale on,
      and an all-overflowed sample must not be answered with the largest scale.

  Returns:
    A `ScaleAdvice`; use `advice.scale` as the initial (or fixed) scale.

  Example:
    >>> import numpy as np
    >>> import optax_lossscale as ols
    >>> grads = {'w': np.array([1.0, -0.5, 1e-8], np.float32)}
    >>> advice = ols.suggest_loss_scale(grads)
    >>> advice.scale  # 1.0 * 4096 * 8 <= 65504 < 1.0 * 8192 * 8
    4096.0
    >>> advice.underflow_before, advice.underflow_after
    (0.3333333333333333, 0.0)

  References:
    Micikevicius et al., 2018, "Mixed Precision Training", section 3.2,
    https://arxiv.org/abs/1710.03740
  """
  target = dtypes.read_dtype(dtype, "dtype", among=[np.dtype(name) for name in _DTYPES])
  margin = _positive("margin", margin, 1.0)
  max_scale = _positive("max_scale", max_scale, 1.0)

  leaves = [
    np.asarray(x) for x in jax.device_get(jax.tree.leaves(grads)) if tree_utils.is_inexact(x)
  ]
  parts = []
  for x in leaves:
    if np.iscomplexobj(x):
      x = np.stack([x.real, x.imag])
    # float64 stays float64: a finite 1e39 must not read as inf, nor 1e-50 as 0.
    parts.append(x.astype(np.promote_types(x.dtype, np.float32)).ravel())
  values = np.concatenate(parts) if parts else np.zeros((0,), np.float32)
  finite = np.isfinite(values)
  num_nonfinite = int(values.size - np.count_nonzero(finite))
  values = values[finite & (values != 0)]
  if not values.size:
    raise ValueError(
      "grads holds no finite, nonzero floating value to base a loss scale on"
      f" ({len(leaves)} floating leaves, {num_nonfinite} NaN/Inf values); pass the"
      " *unscaled* float32 gradients of a few batches. If they overflow even"
      " unscaled, loss scaling is not the cause: fix the loss or the model first."
    )

  max_abs = float(np.max(np.abs(values))) if values.size else 0.0
  dtype_max = float(jax.numpy.finfo(target).max)
  exponent = _largest_power_of_two_at_most(max_scale)
  if max_abs > 0:
    # A float64 estimate, then exact rational checks to settle the boundary.
    estimate = _largest_power_of_two_at_most(dtype_max / margin / max_abs)
    safe = lambda e: Fraction(max_abs) * Fraction(2) ** e * Fraction(margin) <= Fraction(dtype_max)
    while not safe(estimate):
      estimate -= 1
    while safe(estimate + 1):
      estimate += 1
    exponent = min(exponent, estimate)
  scale = math.ldexp(1.0, exponent)
  headroom = dtype_max / (max_abs * scale) if max_abs > 0 else math.inf
  under_before, sub_before = _shares(values, 1.0, target)
  under_after, sub_after = _shares(values, scale, target)
  return ScaleAdvice(
    scale=scale,
    max_abs=max_abs,
    headroom=headroom,
    underflow_before=under_before,
    underflow_after=under_after,
    subnormal_before=sub_before,
    subnormal_after=sub_after,
    num_values=int(values.size),
    num_nonfinite=num_nonfinite,
  )
