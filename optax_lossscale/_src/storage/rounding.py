"""Stochastic rounding of float32 values to bfloat16 and float16, unbiased to the bit.

A float32 value `x` lies between two neighbours `lo <= x < hi` of the target
dtype, `hi - lo` one unit in the last place (ulp) of the target at `x`.
Stochastic rounding returns `hi` with probability `(x - lo) / (hi - lo)`,
else `lo`, so its expected value is `x` (Gupta et al. 2015). With integers:

  x = M * 2**(E - 23)            M the 24-bit significand, E the exponent
  s = the bits of M below the target's ulp at x:
      23 - nmant                 in the target's normal range (16 for bfloat16, 13 for float16)
      more below it              (float16's subnormals: a fixed ulp of 2**-24)
  k = (M >> s) + carry           carry = 1 iff R + (M mod 2**s) >= 2**s, R uniform in [0, 2**s)
  result bits = the target's exponent field and k (a carry into the exponent is the next
                binade, or infinity above the largest finite value)

which is "add `s` random bits below the target's mantissa and truncate": for
bfloat16 (float32's exponent range, so `s` is always 16) exactly that on the
float32 bits. Everything is integer arithmetic on the bits: no float op that
a CPU might flush to zero on a subnormal, and the probability is exact (the
random bits are the top `s` of 32; below 1/256 of float16's smallest
subnormal, where `s` would pass 32, it is resolved to 2**-32). A value past
the largest finite one rounds to infinity with the probability it would
round up there (float16: `(x - 65504) / 32`, 1 at 65536 and beyond), as
round-to-nearest overflows from 65520 on; infinities and NaNs stay what they
are, zeros keep their sign.

Also here, the other ways a float32 value becomes 16 bits in this package:
`hash_bits`, the cheap random bits `stochastic_rounding` rounds with,
`cast`, float32 <-> bfloat16 conversions (to nearest) on the bits on a CPU,
`round_half_away_bfloat16`, how `master_weights` writes bfloat16 parameters
of a float32 master, and `split_bfloat16` / `join_bfloat16`, that master as
its bfloat16 rounding and a 16-bit remainder (`master_weights(store='remainder')`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.utils import dtypes

SUPPORTED = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_F32_MANT = 23
_F32 = np.dtype(jnp.float32)
_BF16 = np.dtype(jnp.bfloat16)


def check_dtype(dtype: Any, what: str) -> np.dtype:
  """`dtype` as a NumPy dtype if stochastic rounding supports it, else a ValueError."""
  return dtypes.read_dtype(dtype, what, among=SUPPORTED)


def round_with_bits(x: jax.Array, bits: jax.Array, dtype: Any) -> jax.Array:
  """`x` (float32) rounded stochastically to `dtype` with the uint32 random `bits`.

  The same `bits` give the same result: the randomness is all in `bits`, one
  uniform uint32 per element (`jax.random.bits`).
  """
  target = check_dtype(dtype, "dtype")
  x = jnp.asarray(x, jnp.float32)
  raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
  sign = (raw >> 16) & np.uint32(0x8000)
  if target == np.dtype(jnp.bfloat16):
    # float32's exponent range: the low 16 bits are always below the target's ulp,
    # and a carry out of them rounds up (to the next binade, or to infinity).
    magnitude = raw & np.uint32(0x7FFFFFFF)
    out = (magnitude + (bits >> 16)) >> 16
  else:
    out = _round_narrower_exponent(raw, bits, target)
  out = out | sign
  value = jax.lax.bitcast_convert_type(out.astype(jnp.uint16), target)
  nan = jax.lax.bitcast_convert_type(
    (out | np.uint32(_quiet_nan_bits(target))).astype(jnp.uint16), target
  )
  # Selected last, in the target dtype: XLA:CPU then computes the result in the loop that
  # writes it and reads it from there (schedule.after), never recomputing its last step.
  return jnp.where(jnp.isnan(x), nan, value)


def _quiet_nan_bits(target: np.dtype) -> int:
  finfo = jnp.finfo(target)
  return ((1 << finfo.nexp) - 1) << finfo.nmant | 1 << (finfo.nmant - 1)


def _round_narrower_exponent(raw: jax.Array, bits: jax.Array, target: np.dtype) -> jax.Array:
  """The target's magnitude bits, for a dtype with a narrower exponent range (float16)."""
  finfo = jnp.finfo(target)
  nmant, emin, emax = int(finfo.nmant), int(finfo.minexp), int(finfo.maxexp) - 1
  bias = 1 - emin
  inf_bits = np.uint32(((1 << finfo.nexp) - 1) << nmant)
  field = ((raw >> _F32_MANT) & np.uint32(0xFF)).astype(jnp.int32)
  fraction = raw & np.uint32((1 << _F32_MANT) - 1)
  subnormal32 = field == 0
  significand = jnp.where(subnormal32, fraction, fraction | np.uint32(1 << _F32_MANT))
  exponent = jnp.where(subnormal32, -126, field - 127)
  # Bits of the significand below the target's ulp: its mantissa's width in the
  # normal range, more where the target is subnormal (a fixed ulp of 2**(emin - nmant)).
  drop = jnp.maximum(_F32_MANT - nmant, _F32_MANT - nmant + emin - exponent)
  within = drop <= 32
  shift = jnp.minimum(drop, 31).astype(jnp.uint32)
  kept = jnp.where(drop >= 32, np.uint32(0), significand >> shift)
  mask = jnp.where(drop >= 32, np.uint32(0xFFFFFFFF), (np.uint32(1) << shift) - 1)
  below = significand & mask
  # Up with probability below / 2**drop: the top `drop` random bits R, and
  # R + below >= 2**drop, i.e. R > mask - below (no overflow).
  top = jnp.where(drop >= 32, bits, bits >> (32 - jnp.clip(drop, 1, 32)).astype(jnp.uint32))
  carry_within = (below != 0) & (top > mask - below)
  # drop > 32 (below 1/256 of the smallest subnormal): probability significand / 2**drop,
  # resolved to 2**-32.
  scaled = significand >> jnp.clip(drop - 32, 0, 31).astype(jnp.uint32)
  carry_beyond = (scaled != 0) & (bits > np.uint32(0xFFFFFFFF) - scaled)
  k = kept + jnp.where(within, carry_within, carry_beyond).astype(jnp.uint32)
  normal = exponent >= emin
  base = jnp.where(normal, (exponent + bias - 1).astype(jnp.uint32), np.uint32(0))
  out = jnp.where(normal, (base << nmant) + k, k)
  out = jnp.where((exponent > emax) | (field == 0xFF), inf_bits, out)
  return out


def _bits_to_bfloat16(x: jax.Array) -> jax.Array:
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  nearest = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
  nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  nearest = jnp.where(nan, ((bits >> 16) & np.uint32(0x8000)) | np.uint32(0x7FC0), nearest)
  return jax.lax.bitcast_convert_type(nearest.astype(jnp.uint16), jnp.bfloat16)


def _upper_bits(x: jax.Array) -> jax.Array:
  """A bfloat16 array's bits as the upper half of uint32 words: the float32 bits of its
  values."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16


def _bits_from_bfloat16(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(_upper_bits(x), jnp.float32)


def cast(x: jax.Array, dtype: Any) -> jax.Array:
  """`x.astype(dtype)`, bit for bit, computed on the bits between float32 and bfloat16 in a
  program traced where the default backend is a CPU.

  XLA:CPU converts float32 to bfloat16 in a loop about twice as slow as the
  same rounding (to nearest, ties to even) done on the integer bits, and
  bfloat16 to float32 slower than a shift (measured: an Adam moment's update
  stored in bfloat16, 1.65 ms against 0.83 on 4M elements). The integer
  rounding gives what XLA:CPU's conversion gives for every float32 value,
  subnormals and infinities included, and a NaN as XLA:CPU on x86 makes it
  (the quiet NaN 0x7FC0 of its sign). Other pairs of dtypes, and other backends,
  use `astype` (a GPU converts in one instruction).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale._src.storage import rounding
    >>> x = jnp.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -jnp.inf])  # two ties, to even
    >>> jax.jit(lambda x: rounding.cast(x, jnp.bfloat16))(x).tolist()
    [1.0, 1.015625, -inf]
  """
  x = jnp.asarray(x)
  source, target = np.dtype(x.dtype), np.dtype(dtype)
  if source == _F32 and target == _BF16:
    on_cpu = _bits_to_bfloat16
  elif source == _BF16 and target == _F32:
    on_cpu = _bits_from_bfloat16
  else:
    return x.astype(target)
  # Chosen when traced, by the default backend: `jax.lax.platform_dependent` would put
  # a `cond` in the program for every leaf (10 ms of tracing and lowering each,
  # measured). A program placed on a backend other than the default takes the other
  # way, which gives the same values (a NaN's payload aside), at that way's speed.
  # Eagerly (an `init`), one conversion: each operation would be compiled per shape.
  if jax.default_backend() != "cpu" or not isinstance(x, jax.core.Tracer):
    return x.astype(target)
  return on_cpu(x)


def join_bfloat16(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The float32 master of a bfloat16 `param` and its int16 `remainder`.

  The master's bits are the parameter's, shifted up 16, plus the remainder
  (sign-extended; uint32 arithmetic, wrapping): the inverse of
  `split_bfloat16` for every float32 value but a NaN's payload.
  """
  high = _upper_bits(param)
  low = jax.lax.bitcast_convert_type(remainder.astype(jnp.int32), jnp.uint32)
  return jax.lax.bitcast_convert_type(high + low, jnp.float32)


def round_half_away_bfloat16(master: jax.Array) -> jax.Array:
  """`master` (float32) rounded to the nearest bfloat16 value, ties away from zero.

  On the bits: add half a bfloat16 ulp (0x8000) to the magnitude and keep the
  top 16 bits, so that every bfloat16 value is the rounding of exactly 2**16
  float32 values (round-to-nearest-even gives an even value 2**16 + 1 of
  them and an odd one 2**16 - 1), the 2**16 that its remainder in
  `split_bfloat16` can tell apart. It differs from `master.astype(bfloat16)`
  only on a tie (low 16 bits 0x8000) above an even value, rounded up here.
  Past the largest bfloat16 value by half an ulp it gives infinity, as the
  cast does; a NaN stays a NaN (quiet, of the same sign).
  """
  bits = jax.lax.bitcast_convert_type(jnp.asarray(master, jnp.float32), jnp.uint32)
  rounded = (bits + np.uint32(0x8000)) >> 16
  # A NaN's payload can carry into infinity or past the sign: keep it a NaN instead.
  nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  rounded = jnp.where(nan, (bits >> 16) | np.uint32(0x0040), rounded)
  return jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)


def split_bfloat16(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(param, remainder)`: a float32 `master` as bfloat16 and the 16 bits it lacks.

  The parameter is `round_half_away_bfloat16(master)` (to nearest, ties away
  from zero); the remainder is the master's low 16 bits as an int16, which
  is the signed difference of bit patterns `master - param << 16`, in
  [-2**15, 2**15): `join_bfloat16(param, remainder)` is `master` bit for bit,
  for every float32 value (zeros of both signs, subnormals, infinities and
  values past the largest bfloat16, whose parameter is infinite), but a
  NaN, which joins back to a NaN of its sign. The layout of Apex's and
  Transformer Engine's parameter remainders.
  """
  master = jnp.asarray(master, jnp.float32)
  bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
  remainder = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.int16)
  return round_half_away_bfloat16(master), remainder


def mix(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: a bijection of uint32 whose every output bit
  depends on every input bit (Appleby, public domain)."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def explicit_sharding(x: Any) -> Any:
  """`x`'s sharding if its type carries one over Explicit mesh axes (`jax.make_mesh`'s
  default) and it is sharded along some axis, else None (then `jit` places work)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  if not spec or mesh is None or explicit not in getattr(mesh, "axis_types", ()):
    return None
  return sharding if any(axis is not None for axis in spec) else None


def hash_bits(seed: Any, shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
  """One uint32 per element of `shape`, a hash of its index and the two words of `seed`.

  `mix(i ^ w)` for the element's row-major index `i` (modulo 2**32) and the
  word `w = mix(seed[0] ^ mix(seed[1]))`, mixed once per call from the two
  uint32 scalars of `seed`, `mix` a bijection: for one index, a uniformly
  random seed gives a uniformly random `w` and uniformly random bits, so
  rounding with them is exactly unbiased over seeds, as with any generator.
  Across indices and seeds the bits are as independent as the hash makes
  them, which statistical checks cannot tell from random at the sizes tested
  (tests/test_stochastic_rounding.py), but it is not a generator with proven
  properties: elements 2**32 apart in one array get the same bits. One round
  of the mix per element (a full-size second round cost about a tenth of
  stochastic rounding's update on a CPU); 7 to 50 times cheaper than
  threefry there. The index comes from one iota per axis, so under `jit`
  each shard hashes its own elements where it lives, the same bits as on
  one device (with Explicit mesh axes, give the parameter's `sharding`).
  """
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.uint32, shape)
  if sharding is not None:
    iota = functools.partial(iota, out_sharding=sharding)
  index = jnp.zeros(shape, jnp.uint32)
  for axis, size in enumerate(shape):
    index = index * np.uint32(size) + iota(axis)
  word = mix(jnp.asarray(seed[0], jnp.uint32) ^ mix(jnp.asarray(seed[1], jnp.uint32)))
  return mix(index ^ word)


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  """Rounds `x` to `dtype` up or down at random, with the expected value `x`.

  Each element of `x` (cast to float32) becomes one of its two neighbours in
  `dtype`, the upper with probability equal to the distance from the lower
  over their spacing: the mean over keys is `x`, where round-to-nearest
  would return the same neighbour every time. Exact for every float32 value,
  subnormals included (integer arithmetic on the bits); a value past the
  largest finite one becomes infinity with the probability of rounding up
  there; infinities, NaNs and signed zeros stay as they are.

  Args:
    x: an array; it is cast to float32 first.
    dtype: `jnp.bfloat16` or `jnp.float16`.
    key: a PRNG key (typed, or a raw uint32 key): the same key gives the
      same result.

  Returns:
    An array of `dtype` shaped like `x`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> x = jnp.full(10000, 1.0 + 2.0**-10)  # 1/8 of the way from 1 to the next bfloat16
    >>> x.astype(jnp.bfloat16)[0]  # round to nearest: always down
    Array(1, dtype=bfloat16)
    >>> y = ols.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.tolist())), round(float(y.astype(jnp.float32).mean() - 1) * 2**10, 1)
    ([1.0, 1.0078125], 1.0)

  References:
    Gupta et al., 2015, "Deep Learning with Limited Numerical Precision",
    https://arxiv.org/abs/1502.02551; Zamirai et al., 2020, "Revisiting
    BFloat16 Training", https://arxiv.org/abs/2010.06192.
  """
  target = check_dtype(dtype, "dtype")
  x = jnp.asarray(x)
  bits = jax.random.bits(key, x.shape, jnp.uint32)
  return round_with_bits(x, bits, target)
