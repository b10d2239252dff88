"""Optimizer state in 8 bits: blockwise quantization with a float32 scale per block.

An array is cut into blocks of 256 consecutive elements (row-major order, in
rows of the fewest trailing axes that hold 256 elements, so that a block
never crosses the leading axes a parameter is usually sharded along). Each
block keeps one float32 scale, its largest magnitude, and one byte per
element. Two formats:

  'q8'   a logarithmic code relative to the block's largest magnitude `a`:
         byte m > 0 stands for a * 2**(-(L - m) / k), byte 0 for zero.
         8 codes per binade (k = 8). A block holding a negative value is
         signed (a sign bit and 7 bits: L = 127, down to 2**-15.75 * a); a
         block of non-negative values (Adam's second moment) is unsigned
         (L = 255, down to 2**-31.75 * a). The scale's sign says which.
  'fp8'  float8_e4m3fn values of x / (a / 448): e4m3's 3-bit mantissa over
         the block's range.

Rounding is to the nearest code (in log2 for 'q8'), except that a nonzero
value never becomes zero: below the smallest code it takes the smallest code
of its sign. (A second moment rounded to zero would turn Adam's update into
m / eps.) The bound this gives, for every element x of a block with largest
magnitude a (`ERROR_BOUNDS`):

  |dequantize(quantize(x)) - x| <= max(rel * |x|, floor * a)

  q8 signed:    rel = 2**(1/16) - 1 = 0.0443  floor = 2**-15.75 = 1.8e-5
  q8 unsigned:  rel = 2**(1/16) - 1 = 0.0443  floor = 2**-31.75 = 2.8e-10
  fp8:          rel = 2**-4 = 0.0625           floor = 2**-9 / 448 = 4.4e-6

(plus float32's own rounding, below 1e-6 relative). The largest magnitude of
a block is stored exactly. A block holding a NaN or an infinity comes back
as NaN.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 256
FORMATS = ("q8", "fp8")
_FP8 = np.dtype(jnp.float8_e4m3fn)
_FP8_MAX = 448.0
# (levels L, steps per binade k) of the signed and the unsigned 'q8' code.
_SIGNED, _UNSIGNED = (127, 8), (255, 8)

#: format -> (rel, floor) of the bound above, with float32's rounding added.
ERROR_BOUNDS = {
  "q8 signed": (2 ** (1 / 16) - 1 + 1e-6, 2 ** (-(_SIGNED[0] - 1) / _SIGNED[1])),
  "q8 unsigned": (2 ** (1 / 16) - 1 + 1e-6, 2 ** (-(_UNSIGNED[0] - 1) / _UNSIGNED[1])),
  "fp8": (2**-4 + 1e-6, 2**-9 / _FP8_MAX),
}


class QuantizedArray(NamedTuple):
  """An array stored in 8 bits per element and a float32 scale per block of 256.

  What `ols.state_dtypes` stores for a state leaf given the format `'q8'` or
  `'fp8'`: a pytree of two arrays, so that `jit`, sharding and checkpointers
  handle it as any state.

  Attributes:
    codes: one byte per element, shaped like the array: `uint8` for `'q8'`,
      `float8_e4m3fn` for `'fp8'`.
    scales: float32, one per block: the block's largest magnitude (`'q8'`,
      negative for a signed block) or that over 448 (`'fp8'`).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.state_dtypes(optax.adam(1e-3), {'mu': 'q8', 'nu': 'q8'})
    >>> state = tx.init({'w': jnp.zeros((64, 512))})
    >>> q = state[0].nu['w']
    >>> q.codes.dtype, q.codes.shape, q.scales.shape, q.format
    (dtype('uint8'), (64, 512), (64, 2), 'q8')
    >>> q.dequantize().shape
    (64, 512)
  """

  codes: jax.Array
  scales: jax.Array

  @property
  def format(self) -> str:
    """`'q8'` or `'fp8'`, read off the codes' dtype."""
    return "fp8" if np.dtype(self.codes.dtype) == _FP8 else "q8"

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the array."""
    return tuple(self.codes.shape)

  def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
    """The array in `dtype` (float32 by default)."""
    return dequantize(self).astype(dtype)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedArray)


def _layout(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
  """(leading shape, row length, blocks per row): rows span the fewest trailing axes
  that hold a block, all axes when the array is smaller."""
  row, lead = 1, len(shape)
  while lead > 0 and row < BLOCK:
    lead -= 1
    row *= shape[lead]
  return tuple(shape[:lead]), row, max(1, math.ceil(row / BLOCK))


def _to_blocks(x: jax.Array) -> jax.Array:
  lead, row, blocks = _layout(x.shape)
  x = x.reshape(*lead, row)
  if blocks * BLOCK != row:
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, blocks * BLOCK - row)])
  return x.reshape(*lead, blocks, BLOCK)


def _from_blocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  lead, row, blocks = _layout(shape)
  x = x.reshape(*lead, blocks * BLOCK)
  if blocks * BLOCK != row:
    x = x[..., :row]
  return x.reshape(shape)


def _largest(blocks: jax.Array) -> jax.Array:
  """Each block's largest magnitude, NaN where the block holds a NaN or an infinity."""
  largest = jnp.max(jnp.abs(blocks), axis=-1)
  finite = jnp.all(jnp.isfinite(blocks), axis=-1)
  return jnp.where(finite, largest, jnp.float32(jnp.nan))


def quantize(x: jax.Array, fmt: str) -> QuantizedArray:
  """`x` (any floating dtype; computed in float32) in the format `fmt`."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}.")
  blocks = _to_blocks(jnp.asarray(x).astype(jnp.float32))
  largest = _largest(blocks)
  safe = jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)[..., None]
  if fmt == "fp8":
    scale = safe / _FP8_MAX
    codes = (blocks / scale).astype(_FP8)
    tiny = jnp.asarray(2.0**-9, _FP8)
    codes = jnp.where((codes == 0) & (blocks != 0), jnp.where(blocks < 0, -tiny, tiny), codes)
    scales = jnp.where(jnp.isnan(largest), largest, scale[..., 0])
    return QuantizedArray(_from_blocks(codes, x.shape), scales)
  signed = jnp.any(blocks < 0, axis=-1, keepdims=True)
  levels = jnp.where(signed, float(_SIGNED[0]), float(_UNSIGNED[0]))
  steps = jnp.where(signed, float(_SIGNED[1]), float(_UNSIGNED[1]))
  magnitude = jnp.abs(blocks)
  below_top = jnp.round(-jnp.log2(magnitude / safe) * steps)  # inf for a zero
  m = jnp.clip(levels - below_top, 1.0, levels)
  m = jnp.where(magnitude > 0, m, 0.0).astype(jnp.uint32)
  codes = jnp.where(signed & (blocks < 0), m | np.uint32(0x80), m).astype(jnp.uint8)
  scales = jnp.where(signed[..., 0], -largest, largest)
  return QuantizedArray(_from_blocks(codes, x.shape), scales)


def dequantize(q: QuantizedArray) -> jax.Array:
  """The float32 array `q` stands for."""
  shape = tuple(q.codes.shape)
  scale = q.scales[..., None]
  codes = _to_blocks(q.codes)
  if np.dtype(q.codes.dtype) == _FP8:
    return _from_blocks(codes.astype(jnp.float32) * scale, shape)
  codes = codes.astype(jnp.int32)
  signed = jnp.signbit(scale)
  m = jnp.where(signed, codes & 0x7F, codes)
  levels = jnp.where(signed, _SIGNED[0], _UNSIGNED[0])
  steps = jnp.where(signed, float(_SIGNED[1]), float(_UNSIGNED[1]))
  value = jnp.where(m > 0, jnp.exp2((m - levels).astype(jnp.float32) / steps), 0.0)
  value = value * jnp.abs(scale)
  negative = signed & (codes >= 0x80)
  return _from_blocks(jnp.where(negative, -value, value), shape)
