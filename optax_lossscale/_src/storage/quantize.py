"""Optimizer state in 8 bits: blockwise quantization with a float32 scale per block.

An array is cut into blocks of 256 consecutive elements (row-major order, in
rows of the fewest trailing axes that hold 256 elements, so that a block
never crosses the leading axes a parameter is usually sharded along). Each
block keeps one float32 scale, its largest magnitude, and one byte per
element. Two formats:

  'q8'   a dynamic-exponent code of |x| / a, `a` the block's largest
         magnitude: a binary exponent and 3 mantissa bits, counted down from
         a itself (the top code, exact), 8 codes per binade. A block holding
         a negative value is signed (a sign bit and 7 bits: 127 codes, down
         to 1.25 * 2**-16 * a); a block of non-negative values (Adam's second
         moment) is unsigned (255 codes, down to 1.25 * 2**-32 * a). The
         scale's sign says which. Byte 0 is zero.
  'fp8'  float8_e4m3fn values of x / (a / 448): e4m3 over the block's range
         (with its subnormals).

Both are integer work on the float32 bits: no logarithm, no table. Rounding
is stochastic, to one of the two neighbouring codes with the odds that make
it unbiased, so that a moving average stored in 8 bits follows the float32
one: Adam's second moment moves by 0.1% of itself a step, far below half a
code step, and rounded to nearest it would stay where it is (measured: the
digits MLP then trains as with a larger learning rate; rounded
stochastically, as float32 does). The random bits are a hash of each
element's index, how many times the array was quantized (the count is kept
with the codes) and a salt per array (`_noise`): no key, and the same state
rounds alike, on any layout. A nonzero value never becomes zero: below the
smallest code it takes the smallest code of its sign (a second moment
rounded to zero would turn Adam's update into m / eps), however far below
its block's largest (float32's subnormals, under 2**-126 = 1.2e-38, are
flushed to zero by XLA:CPU and GPUs, on the way in and out: a value under
2**-125 may come back as zero). The bound this gives, for every element x
of a block with largest magnitude a (`ERROR_BOUNDS`), a anywhere in
float32's range:

  |dequantize(quantize(x)) - x| <= max(rel * |x|, floor * a)

  q8 signed:    rel = 2**-3 = 0.125   floor = 1.25 * 2**-16 = 1.9e-5
  q8 unsigned:  rel = 2**-3 = 0.125   floor = 1.25 * 2**-32 = 2.9e-10
  fp8:          rel = 2**-3 = 0.125   floor = 2**-9 / 448 = 4.4e-6

(one step of the 3-bit mantissa, 2**-3 of a value at the bottom of its binade
and 2**-4 at its top; the median error is about 2.5%), plus float32's own
rounding (below 1e-6 relative). The largest magnitude of a block is stored exactly
('q8'; 'fp8' holds it as 448 times its scale, within float32's rounding), and
no code exceeds the format's largest (e4m3's 448: a quotient one ulp above,
as a product with a reciprocal gives, would round to 480, a NaN in e4m3).
A block holding a NaN or an infinity comes back as NaN; a block whose largest
magnitude is below 2**-100 (7.9e-31) comes back as zeros: its quotients would
reach float32's subnormals, which XLA:CPU flushes to zero (a moment decaying
there, as Adam's of a weight no longer used, would have turned into x / 0).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.storage import rounding, schedule

BLOCK = 256
FORMATS = ("q8", "fp8")
_FP8 = np.dtype(jnp.float8_e4m3fn)
_FP8_MAX = 448.0
# The top 12 bits of 1.0 in float32 (sign, exponent, 3 mantissa bits): the
# code of a block's largest magnitude, before the offset to its top code.
_ONE = 0x3F8
_SHIFT = 20  # float32's mantissa bits below the 3 kept
_UNSIGNED = 255  # the top code of an unsigned block (127 for a signed one)
_NEGLIGIBLE = 2.0**-100  # a block below this largest magnitude is stored as zeros
_SALT = np.uint32(0x9E3779B9)  # the hash's second word (any odd constant)
_GOLDEN = np.uint32(0x9E3779B1)  # 2**32 / the golden ratio, odd: each element's hash

#: format -> (rel, floor) of the bound above, with float32's rounding added.
ERROR_BOUNDS = {
  "q8 signed": (2**-3 + 1e-6, 1.25 * 2**-16),
  "q8 unsigned": (2**-3 + 1e-6, 1.25 * 2**-32),
  "fp8": (2**-3 + 1e-6, 2**-9 / _FP8_MAX),
}


class QuantizedArray(NamedTuple):
  """An array stored in 8 bits per element and a float32 scale per block of 256.

  What `ols.state_dtypes` stores for a state leaf given the format `'q8'` or
  `'fp8'`: a pytree of arrays, so that `jit`, sharding and checkpointers
  handle it as any state.

  Attributes:
    codes: one byte per element, shaped like the array: `uint8` for `'q8'`,
      `float8_e4m3fn` for `'fp8'`.
    scales: float32, one per block: the block's largest magnitude (`'q8'`,
      negative for a signed block) or that over 448 (`'fp8'`).
    count: how many times the array was quantized (a uint32 scalar): it
      salts the random bits of the stochastic rounding, so that a value
      that comes back unchanged is still rounded afresh each step.

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
  count: jax.Array

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


def _rows_unsharded(x: jax.Array) -> tuple[jax.Array, Any]:
  """`x` with the axes its rows of blocks span unsharded, and the sharding it had.

  Only for an array whose type carries its sharding over Explicit mesh axes
  (`jax.make_mesh`'s default), where a reshape across a sharded axis must be
  told its result's sharding: such rows are gathered for the quantization
  (a block spans shards there anyway). Otherwise `(x, None)`: under `jit`
  the compiler places the blocks, within the shards of the leading axes.
  """
  sharding = rounding.explicit_sharding(x)
  if sharding is None:
    return x, None
  lead = len(_layout(x.shape)[0])
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  if all(axis is None for axis in spec[lead:]):
    return x, None
  rows = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:lead]))
  return jax.sharding.reshard(x, rows), sharding


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


class _View(NamedTuple):
  """An array as the elementwise code sees it: the array itself when its rows are whole
  blocks (then an update writing its codes in place reads and writes one shape, which
  XLA needs to share the buffer), else padded into blocks."""

  values: jax.Array
  expand: Callable[[jax.Array], jax.Array]  # per block (..., blocks) -> values' shape
  back: Callable[[jax.Array], jax.Array]  # values' shape -> the array's


def _view(x: jax.Array) -> _View:
  _, row, blocks = _layout(x.shape)
  if blocks * BLOCK == row:
    shape = tuple(x.shape)

    def expand(v: jax.Array) -> jax.Array:
      return jnp.broadcast_to(v[..., None], (*v.shape, BLOCK)).reshape(shape)

    return _View(x, expand, lambda y: y)
  return _View(_to_blocks(x), lambda v: v[..., None], lambda y: _from_blocks(y, x.shape))


# Compiled: an eager `init` then runs one program per leaf shape, not each small op.
@functools.partial(jax.jit, static_argnums=1)
def quantize(x: jax.Array, fmt: str, count: Any = 0, salt: Any = 0) -> QuantizedArray:
  """`x` (any floating dtype; computed in float32) in the format `fmt`, the `count`-th time
  (the previous `QuantizedArray`'s count plus one) with `salt` (one per array of a state:
  its two moments round independently); both key the rounding's random bits."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}.")
  ((largest, signed),) = block_extremes_of([x])
  return encode_array(x, largest, signed, fmt, count, salt)


# Compiled, as `quantize` (under an outer `jit`, inlined): eagerly, op by op, an array
# sharded over Explicit mesh axes could not be hashed.
@jax.jit
def block_extremes_of(arrays: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
  """Each block's largest magnitude (NaN where it holds a NaN or an infinity) and whether
  it holds a negative value, for several arrays of one shape.

  One reduction, on the float32 bits as integers (which CPUs compare
  vectorized, without the NaN checks of a floating maximum), of the bits as
  they are, twice: their largest as unsigned integers (a negative value's
  where there is one, the largest magnitude among them; a NaN's or an
  infinity's bits are above every finite one's) and as signed integers (the
  largest non-negative value's, negative where there is none). Per block,
  the largest magnitude is the greater of the two magnitudes, and the block
  is signed where the unsigned largest is below -2**-126 (float32's
  subnormals, under 2**-126, counted as zeros, as XLA:CPU and GPUs flush
  them). XLA:CPU takes it in one pass that reads what the arrays are computed
  from once (Adam's gradient, for both moments), with no work an element
  beyond the two comparisons.
  """
  blocks = [_to_blocks(_rows_unsharded(jnp.asarray(x))[0].astype(jnp.float32)) for x in arrays]
  k = len(blocks)
  unsigned = [jax.lax.bitcast_convert_type(b, jnp.uint32) for b in blocks]
  signed = [jax.lax.bitcast_convert_type(b, jnp.int32) for b in blocks]
  found = jax.lax.reduce(
    (*unsigned, *signed),
    (np.uint32(0),) * k + (np.int32(np.iinfo(np.int32).min),) * k,
    lambda a, b: tuple(jax.lax.max(x, y) for x, y in zip(a, b, strict=True)),
    (blocks[0].ndim - 1,),
  )
  out = []
  for top_unsigned, top_signed in zip(found[:k], found[k:], strict=True):
    positive = jax.lax.bitcast_convert_type(jnp.maximum(top_signed, 0), jnp.uint32)
    high = jnp.maximum(positive, top_unsigned & np.uint32(0x7FFFFFFF))
    low = jnp.where(top_unsigned >= np.uint32(0x80800000), top_unsigned, np.uint32(0))
    largest = jax.lax.bitcast_convert_type(high, jnp.float32)
    largest = jnp.where(high < np.uint32(0x00800000), np.float32(0), largest)
    largest = jnp.where(high < np.uint32(0x7F800000), largest, np.float32(jnp.nan))
    out.append((largest, low > 0))
  return out


@functools.partial(jax.jit, static_argnums=3)  # compiled, as `block_extremes_of`
def encode_array(
  x: jax.Array,
  largest: jax.Array,
  signed: jax.Array,
  fmt: str,
  count: Any,
  salt: Any,
  word: jax.Array | None = None,
) -> QuantizedArray:
  """`x` in the format `fmt`, given its blocks' extremes (`block_extremes_of`).

  Elementwise but for the per-block numbers, so that under `jit` it fuses with
  whatever computes `x` (an optimizer's update) without a float32 copy.
  `word`: `noise_word(count, salt)`, if computed already.
  """
  x, sharding = _rows_unsharded(jnp.asarray(x))
  view = _view(x.astype(jnp.float32))
  v, expand = view.values, view.expand
  # A block whose largest magnitude is below _NEGLIGIBLE is stored as zero: its
  # quotients would meet float32's subnormals, which a CPU may flush (x / 0).
  kept = largest >= _NEGLIGIBLE  # False for NaN
  largest = jnp.where(kept | jnp.isnan(largest), largest, 0.0)
  count = jnp.asarray(count, jnp.uint32)
  if word is None:
    word = noise_word(count, salt)
  noise = _noise(v, word)
  magnitude = jnp.abs(v)
  # Each element reads numbers of its block, computed once per block (`materialized`)
  # and loaded (a load per element, which the elementwise work around it hides;
  # computed from the block's extremes in every element's loop, they cost about 10%
  # of a q8 Adam step on XLA:CPU): the multiplier that takes the block's largest to the top, 448
  # for e4m3 and 256 for 'q8' (the top code's value times 2**8: the multiplier
  # then stays a normal float32 for a largest up to 3.4e38, where 1 / largest is
  # a subnormal, flushed to zero, above 2**126), 0 for a block stored as zeros;
  # and for 'q8' the sign bit of a signed block's codes. A product with a
  # reciprocal lands within an ulp of the top: pinned to it (above e4m3's 448,
  # the rounding could reach 480, a NaN). A nonzero value that the product
  # flushes to zero still counts as nonzero.
  top_value = np.float32(_FP8_MAX if fmt == "fp8" else 2.0**8)
  multiplier = jnp.where(kept, top_value / jnp.where(kept, largest, 1.0), 0.0)
  per_block = expand(schedule.materialized(multiplier))
  ratio = magnitude * per_block
  near_top = np.nextafter(top_value, np.float32(0))
  ratio = jnp.where(ratio >= near_top, top_value, ratio)
  above = ((jax.lax.bitcast_convert_type(ratio, jnp.uint32) + noise) >> _SHIFT).astype(jnp.int32)
  negative = v < 0
  if fmt == "fp8":
    nonzero = (magnitude > 0) & (per_block != 0)
    # e4m3's bits from float32's: the exponent rebiased (127 -> 7) above 2**-6;
    # below, its subnormals, spaced 2**-9, up by one with the same odds.
    normal = above - ((127 - 7) << 3)
    low = jnp.floor(ratio * 2.0**9 + noise.astype(jnp.float32) * 2.0**-_SHIFT).astype(jnp.int32)
    low = jnp.where(nonzero, jnp.maximum(low, 1), 0)  # never to zero
    m = jnp.where(ratio >= 2.0**-6, normal, low)
    bits = jnp.where(negative, m | 0x80, m).astype(jnp.uint8)
    codes = jax.lax.bitcast_convert_type(view.back(bits), jnp.float8_e4m3fn)
    scales = jnp.where(kept, largest / _FP8_MAX, largest)  # 0, or NaN for a non-finite block
    return QuantizedArray(_resharded(codes, sharding), scales, count)
  scales = jnp.where(signed, -largest, largest)
  # Per block, loaded as the multiplier is: the sign bit of its codes, and what takes
  # `above` to a code, counted down from the top one (255, or 127 for a signed block).
  # No code comes above the top one: `ratio` is at most the top value, whose bits' low
  # 20 are zero, so no noise carries past its code; a nonzero value gets code 1 at
  # least. A block stored as zeros (scale 0) or as NaN (a NaN or an infinity in it)
  # decodes every code to that, whatever its codes (which are then left as they come).
  sign_bits = _sign_bits(scales)
  sign_bit = expand(sign_bits)
  offset = expand(schedule.materialized((_UNSIGNED ^ sign_bits) - (_ONE + 8 * 8)))
  m = jnp.where(magnitude > 0, jnp.maximum(above + offset, 1), 0)
  codes = (m | jnp.where(negative, sign_bit, 0)).astype(jnp.uint8)
  return QuantizedArray(_resharded(view.back(codes), sharding), scales, count)


def _sign_bits(scales: jax.Array) -> jax.Array:
  """Per block of 'q8', the sign bit of its codes: 0x80 where the block is signed (its
  scale negative; -0.0, a block stored as zeros, and NaN are not), else 0; int32, computed
  once into a buffer of its own on XLA:CPU (`schedule.materialized`), whatever the
  default integer width (`jax_enable_x64`)."""
  return schedule.materialized(jnp.where(scales < 0, np.int32(0x80), np.int32(0)))


def noise_word(count: Any, salt: Any) -> jax.Array:
  """The one word (uint32) that keys the rounding of the `count`-th quantization of the
  array salted `salt`."""
  count = jnp.asarray(count, jnp.uint32)
  return rounding.mix(rounding.mix(count ^ _SALT) ^ jnp.asarray(salt, jnp.uint32))


def _noise(values: jax.Array, word: jax.Array) -> jax.Array:
  """Uniform bits below the 3 mantissa bits kept, for rounding stochastically: a hash of
  each element's index, the count of quantizations and the array's salt.

  Not of the values themselves: a value one float32 ulp off (another program's
  fused multiply-add) then changes its rounding only where it crosses the
  threshold, as with rounding to nearest, instead of a third of the time.
  The count and the salt are hashed into one word once (`noise_word`); each
  element costs a multiplicative hash, the top bits of `(index ^ word) * C`
  (C odd): for one index, a uniformly random word gives uniformly random bits
  (a product with an odd number is a bijection of uint32), so the rounding is
  unbiased over counts. The index is the row-major one of
  the blocks, the array's own where its rows are whole blocks.
  """
  sharding = rounding.explicit_sharding(values)
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.uint32, values.shape)
  if sharding is not None:
    iota = functools.partial(iota, out_sharding=sharding)
  index = jnp.zeros(values.shape, jnp.uint32)
  for axis, size in enumerate(values.shape):
    index = index * np.uint32(size) + iota(axis)
  # Knuth's multiplicative hash, whose top bits are the well-mixed ones: a bijection
  # of uint32 (the constant is odd), one multiplication where `mix` takes two.
  return ((index ^ word) * _GOLDEN) >> (32 - _SHIFT)


@jax.jit
def dequantize(q: QuantizedArray) -> jax.Array:
  """The float32 array `q` stands for."""
  return decode(q.codes, q.scales)


@jax.jit  # compiled, as `block_extremes_of`
def decode(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """The float32 array of a `QuantizedArray`'s `codes` and `scales`, elementwise but for
  loads of numbers of the element's block (the scale; for 'q8', its magnitude and
  its sign's, each computed once per block)."""
  codes, sharding = _rows_unsharded(codes)
  view = _view(codes)
  if np.dtype(codes.dtype) == _FP8:
    # float32's bits from e4m3's (cheaper than XLA:CPU's conversion): the exponent
    # rebiased (7 -> 127), or a subnormal's mantissa times 2**-9.
    c = jax.lax.bitcast_convert_type(view.values, jnp.uint8).astype(jnp.int32)
    e, m = (c >> 3) & 0xF, c & 0x7
    normal = jax.lax.bitcast_convert_type(
      ((e + (127 - 7)) << 23 | m << 20).astype(jnp.uint32), jnp.float32
    )
    value = jnp.where(e > 0, normal, m.astype(jnp.float32) * 2.0**-9) * view.expand(scales)
    value = jnp.where(c >= 0x80, -value, value)
    return _resharded(view.back(value), sharding)
  # Per element, the block's sign bit (0x80 where signed, else 0) and the scale's
  # magnitude, each computed once per block (`materialized`) and loaded: a code's
  # magnitude is its low 7 bits (signed) or all 8, counted down from the top code,
  # 127 or 255; code 0 (0x80 signed) is zero, of the code's sign.
  c = view.values.astype(jnp.int32)
  sign_bit = view.expand(_sign_bits(scales))
  m = c & (sign_bit ^ 0xFF)
  sign = (c & sign_bit) << 24
  bits = jnp.where(m > 0, (m + (_ONE - _UNSIGNED) + sign_bit) << _SHIFT | sign, sign)
  value = jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)
  value = value * view.expand(schedule.materialized(jnp.abs(scales)))
  return _resharded(view.back(value), sharding)


def owners(params: Any) -> Callable[[tuple[Any, ...], Any], int | None]:
  """A function of a state leaf's path and shape: the index, among the leaves of
  `params` (flattened), of the parameter the leaf belongs to, the one whose path ends
  the leaf's (the longest) if it has the leaf's shape (Adam's `mu` and `nu` of a
  weight); None if none does."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  index = {tuple(path): k for k, (path, _) in enumerate(leaves)}

  def owner(path: tuple[Any, ...], shape: Any) -> int | None:
    for start in range(len(path)):
      k = index.get(tuple(path[start:]))
      if k is not None:
        return k if tuple(np.shape(leaves[k][1])) == tuple(shape) else None
    return None

  return owner


def codes_after_own(tree: Any, params: Any, written: list[jax.Array]) -> Any:
  """`tree` whose `QuantizedArray`s' codes XLA:CPU writes after `written[k]`, for the
  `k`-th leaf of `params` that each belongs to (`owner`); after every array of `written`
  for one that belongs to none (`codes_after`). The identity elsewhere than on a CPU.

  For a step whose `k`-th written array is the only reader of its parameter's old codes
  (each parameter's update reads its own moments): one element read per codes array,
  where `codes_after` reads one of every written array (a program that grows as the
  square of the leaves: under `master_weights`, 60 leaves' update compiled in 7 s
  instead of 29).
  """
  owner = owners(params)

  def one(path: tuple[Any, ...], x: Any) -> Any:
    if not is_quantized(x):
      return x
    k = owner(path, x.shape)
    return x._replace(codes=schedule.after(x.codes, written if k is None else [written[k]]))

  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_quantized)


def codes_after(tree: Any, written: list[jax.Array]) -> Any:
  """`tree` whose `QuantizedArray`s' codes XLA:CPU writes after the arrays `written`.

  For a step that writes new parameters computed from the old codes, which
  the new codes overwrite in place: ordered so (`schedule.after`), XLA reads
  the old codes before it writes over them, instead of copying each first
  (2 bytes a parameter a moment). The identity elsewhere than on a CPU.
  """

  def one(x: Any) -> Any:
    if not is_quantized(x):
      return x
    return x._replace(codes=schedule.after(x.codes, written))

  return jax.tree.map(one, tree, is_leaf=is_quantized)


def _resharded(x: jax.Array, sharding: Any) -> jax.Array:
  return x if sharding is None else jax.sharding.reshard(x, sharding)
