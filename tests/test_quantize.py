"""Blockwise 8-bit optimizer state: the stated error bound, the codes, and `state_dtypes`.

The codes are checked against an independent reference: NumPy enumerates
every code value a block can hold (`code_values`, from the documented
definition: 8 codes per binade counted down from the block's largest
magnitude); `quantize` must pick one of the two around each value, the upper
as often as unbiased rounding does. The round-trip error is checked against
the bound the module states (`quantize.ERROR_BOUNDS`), on N(0, 1), on its
squares and on a block with one outlier 1e4 times the rest.
"""

from __future__ import annotations

import itertools
from unittest import mock
import zlib

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from benchmarks import hlo_stats
import optax_lossscale as ols
from optax_lossscale._src.storage import quantize, schedule

BF16 = jnp.bfloat16
RNG = np.random.default_rng(0)
NORMAL = RNG.standard_normal((32, 1024)).astype(np.float32)
OUTLIER = RNG.standard_normal((8, 256)).astype(np.float32)
OUTLIER[:, 17] = 1e4  # one element of each block 1e4 times the rest
# Compiled once per shape: op by op, each of the many small ops would compile alone.
quantize_ = jax.jit(quantize.quantize, static_argnums=1)
dequantize_ = jax.jit(quantize.dequantize)


def code_values(top: int) -> np.ndarray:
  """The magnitudes (relative to the block's largest) of codes 0..top, from their definition:
  code `top` is 1, each code below is the next float with 3 mantissa bits down, 0 is 0."""
  values = [1.0]
  while len(values) < top:
    v = values[-1]
    exponent = np.floor(np.log2(v))
    step = 2.0 ** (exponent - 3)
    below = v - step if v > 2.0**exponent else v - step / 2
    values.append(below)
  return np.array([0.0, *values[::-1]])


def neighbours(r: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The table's values around each r (both the value itself when it is in the table)."""
  upper = np.searchsorted(table, r, side="left")
  lower = np.where(table[np.minimum(upper, len(table) - 1)] == r, upper, upper - 1)
  return table[np.maximum(lower, 0)], table[np.minimum(upper, len(table) - 1)]


def block_max(x: np.ndarray, width: int = 256) -> np.ndarray:
  """Each element's block's largest magnitude, for rows whose length is a multiple of 256."""
  blocks = np.abs(x).reshape(*x.shape[:-1], -1, width)
  return np.broadcast_to(blocks.max(-1, keepdims=True), blocks.shape).reshape(x.shape)


class BoundTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("normal", NORMAL, "q8", "q8 signed"),
    ("squares", NORMAL**2, "q8", "q8 unsigned"),
    ("outlier", OUTLIER, "q8", "q8 signed"),
    ("normal_fp8", NORMAL, "fp8", "fp8"),
    ("squares_fp8", NORMAL**2, "fp8", "fp8"),
    ("outlier_fp8", OUTLIER, "fp8", "fp8"),
  )
  def test_one_round_trip_is_within_the_stated_bound(self, x, fmt, kind):
    q = quantize_(jnp.asarray(x), fmt)
    back = np.asarray(dequantize_(q), np.float64)
    rel, floor = quantize.ERROR_BOUNDS[kind]
    error = np.abs(back - x)
    bound = np.maximum(rel * np.abs(x), floor * block_max(x))
    self.assertTrue(np.all(error <= bound), float(np.max(error / bound)))
    # Not a vacuous bound: most elements err by a few percent, some near the bound.
    relative = error / np.abs(x)
    self.assertLess(float(np.median(relative)), 0.035)
    self.assertGreater(float(np.max(error / bound)), 0.9)
    # The largest magnitude of each block survives exactly ('q8'), and no nonzero
    # element became zero.
    if fmt == "q8":
      np.testing.assert_array_equal(block_max(back), block_max(x))
    self.assertFalse(np.any((back == 0) & (x != 0)))

  def test_outlier_block_keeps_the_rest_to_the_relative_bound(self):
    # With one element 1e4 times the others, a linear 8-bit code of the block would
    # hold every other element as 0; here each keeps the relative bound unless it
    # is below the floor (1.9e-5 of the outlier, 0.19 here).
    back = np.asarray(dequantize_(quantize_(jnp.asarray(OUTLIER), "q8")))
    rel, floor = quantize.ERROR_BOUNDS["q8 signed"]
    small = np.abs(OUTLIER) >= floor * 1e4
    np.testing.assert_array_less(
      np.abs(back - OUTLIER)[small], rel * np.abs(OUTLIER)[small] + 1e-12
    )
    self.assertGreater(small.mean(), 0.8)

  def test_codes_are_a_neighbour_in_an_independent_table_unbiased(self):
    # Signed blocks (N(0,1)) and unsigned ones (squares, down to 1e-12 of the max).
    unsigned = np.concatenate([NORMAL[:, :200] ** 2, 10.0 ** -RNG.uniform(0, 12, (32, 56))], 1)
    for x, top in ((NORMAL[:, :256], 127), (unsigned.astype(np.float32), 255)):
      q = quantize_(jnp.asarray(x), "q8")
      codes = np.asarray(q.codes).astype(np.int64)
      table = code_values(top)
      m = codes & 0x7F if top == 127 else codes
      np.testing.assert_array_equal(np.sign(x) < 0, (codes >= 0x80) if top == 127 else False)
      r = np.abs(x) / np.abs(x).max(axis=1, keepdims=True).astype(np.float32)
      lower, upper = neighbours(r.astype(np.float64), table)
      got = table[m]
      # Below the smallest code: the smallest code (never zero).
      lower = np.where(r < table[1], table[1], lower)
      upper = np.where(r < table[1], table[1], upper)
      self.assertTrue(np.all((got == lower) | (got == upper)))
      # Up with probability (r - lower) / (upper - lower): over 8192 elements
      # the mean of (got - r) / step is 0 within five standard errors.
      step = upper - lower
      inside = step > 0
      self.assertGreater(inside.mean(), 0.9)
      bias = np.mean((got - r)[inside] / step[inside])
      self.assertLess(abs(bias), 5 * 0.5 / np.sqrt(inside.sum()))

  def test_fp8_codes_are_an_e4m3_neighbour_of_the_block_scaled_to_448(self):
    x = NORMAL[:4]
    q = quantize_(jnp.asarray(x), "fp8")
    self.assertEqual(q.codes.dtype, jnp.float8_e4m3fn)
    y = (x / (block_max(x) / np.float32(448))).astype(np.float32)
    near = y.astype(ml_dtypes.float8_e4m3fn)
    away = np.nextafter(near, np.where(near.astype(np.float32) < y, 448, -448).astype(near.dtype))
    got = np.asarray(q.codes)
    self.assertTrue(np.all((got == near) | (got == away) | ((near == 0) & (np.abs(got) == 2**-9))))
    np.testing.assert_allclose(np.asarray(q.scales), block_max(x)[:, ::256] / 448, rtol=1e-7)

  def test_a_moving_average_stored_in_8_bits_follows_the_float32_one(self):
    # Adam's second moment moves by 0.1% of itself a step, below half a code step
    # (3% to 6%): rounded to nearest it would stay where it is. Each element starts
    # at 1.0, its block's largest at 2.0 (held), and sees g**2 = 0.5 every step.
    def run(fmt):
      def step(q, _):
        nu = quantize.dequantize(q)
        return quantize.quantize(0.999 * nu + 0.001 * target, fmt, q.count + 1), None

      start = np.ones((16, 256), np.float32)
      start[:, 0] = 2.0
      target = np.full((16, 256), 0.5, np.float32)
      target[:, 0] = 2.0
      q, _ = jax.lax.scan(step, quantize.quantize(jnp.asarray(start), fmt), None, length=2000)
      return quantize.dequantize(q)[:, 1:]

    expected = 0.5 + 0.5 * 0.999**2000  # 0.568
    for fmt in quantize.FORMATS:
      got = np.asarray(jax.jit(run, static_argnums=0)(fmt))
      self.assertAlmostEqual(float(got.mean()), expected, delta=0.01)


class LayoutTest(parameterized.TestCase):
  @parameterized.parameters(
    ((64, 512), (64, 2)),  # rows of 512: two blocks each
    ((16, 64), (4,)),  # rows of 64 are merged: 1024 elements, four blocks
    ((3, 300), (3, 2)),  # a short last block per row
    ((5000,), (20,)),
    ((2, 8, 4, 32), (2, 4)),  # the fewest trailing axes that hold 256: 8 * 4 * 32
  )
  def test_blocks_lie_in_the_trailing_axes(self, shape, scales_shape):
    x = jax.random.normal(jax.random.key(1), shape)
    for fmt in quantize.FORMATS:
      q = quantize_(x, fmt)
      self.assertEqual(q.codes.shape, shape)
      self.assertEqual(q.scales.shape, scales_shape)
      self.assertEqual(q.scales.dtype, jnp.float32)
      back = dequantize_(q)
      chex.assert_trees_all_close(back, x, rtol=0.13, atol=1e-3)

  def test_a_block_keeps_its_own_scale_and_sign(self):
    x = np.concatenate([np.linspace(0.0, 1.0, 256), -np.linspace(0, 1e-3, 256)]).astype(np.float32)
    q = quantize_(jnp.asarray(x), "q8")
    np.testing.assert_array_equal(q.scales, np.float32([1.0, -1e-3]))  # -: a signed block
    self.assertEqual(int(q.codes[255]), 255)  # unsigned: all 8 bits for the magnitude
    self.assertEqual(int(q.codes[511]), 0x80 | 127)

  def test_every_q8_code_decodes_to_its_table_value(self):
    # All 256 codes of one block, for each kind of scale: unsigned (all 8 bits the
    # magnitude), signed (0x80 the sign: 0x80 itself is -0.0), zero of either sign
    # (a block stored as zeros), and a scale at float32's top.
    codes = jnp.asarray(np.arange(256, dtype=np.uint8))
    table = {255: code_values(255), 127: code_values(127)}
    for scale in (1.5, -1.5, 0.0, -0.0, 3e38, -3e38):
      got = np.asarray(quantize.decode(codes, jnp.float32([scale])))
      magnitude = np.float32(abs(scale))
      if np.signbit(scale) and scale != 0:
        want = (table[127][np.arange(256) & 0x7F] * magnitude).astype(np.float32)
        want = np.where(np.arange(256) >= 0x80, -want, want)
      else:
        want = (table[255] * magnitude).astype(np.float32)
      np.testing.assert_array_equal(got, want)
      np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=str(scale))

  def test_zeros_nans_infinities_and_negligible_blocks(self):
    x = np.zeros((5, 256), np.float32)
    x[1, 5], x[2, 9] = np.nan, np.inf
    # A moment decaying towards float32's subnormals (an unused weight's, after
    # ~800 Adam steps): below 2**-100 a block is stored as zeros, where its
    # quotients would have met the CPU's flush to zero (and 'fp8' turned x / 0
    # into NaN); just above, it is kept to the bound.
    x[3] = NORMAL[0, :256] * 1e-36
    x[4] = NORMAL[0, :256] * 1e-29
    for fmt in quantize.FORMATS:
      back = np.asarray(dequantize_(quantize_(jnp.asarray(x), fmt)))
      np.testing.assert_array_equal(back[[0, 3]], 0.0)
      self.assertTrue(np.all(np.isnan(back[1:3])))
      np.testing.assert_allclose(back[4], x[4], rtol=0.13, atol=1e-29 * 2e-5)

  def test_block_extremes_of_any_bits_against_numpy(self):
    # Blocks of arbitrary float32 bits, some all negative, all non-negative, or all
    # special (zeros and subnormals of both signs, infinities, NaNs, the largest
    # finite values), against the definition: a block's largest magnitude, NaN where
    # it holds a NaN or an infinity, and whether it holds a value below -2**-126
    # (subnormals count as zeros).
    rng = np.random.default_rng(7)
    special = np.array(
      [0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x80800000,
       0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000],
      np.uint32,
    )  # fmt: skip
    bits = rng.integers(0, 2**32, (512, 256), dtype=np.uint64).astype(np.uint32)
    bits = np.where(rng.random(bits.shape) < 0.05, rng.choice(special, bits.shape), bits)
    bits[0::4] |= np.uint32(0x80000000)
    bits[1::4] &= np.uint32(0x7FFFFFFF)
    bits[2::8] = rng.choice(special, bits[2::8].shape)
    bits[6::8] = rng.choice(special[:6], bits[6::8].shape)  # zeros and subnormals only
    x = bits.view(np.float32)
    flushed = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)
    with np.errstate(invalid="ignore"):
      expected = np.where(np.all(np.isfinite(x), axis=1), np.max(np.abs(flushed), 1), np.nan)
    # Both signs, in one reduction (as Adam's two moments): -x's negatives are x's positives.
    found = jax.jit(quantize.block_extremes_of)([jnp.asarray(x), -jnp.asarray(x)])
    for (largest, signed), values in zip(found, [flushed, -flushed], strict=True):
      np.testing.assert_array_equal(np.asarray(largest)[:, 0], expected)
      np.testing.assert_array_equal(np.asarray(signed)[:, 0], np.any(values < 0, axis=1))


# Every magnitude float32 holds as a normal number, 2**-126 (1.2e-38) to 3e38, in steps of
# about 1.6% over 255 elements; with the same row in 2**-60 of its range, so that each
# element also sits at many orders of magnitude below its block's largest.
WIDE = np.geomspace(np.finfo(np.float32).tiny, 3e38, 255).astype(np.float32)


class MagnitudeTest(parameterized.TestCase):
  """Blocks anywhere in float32's range: each element within the stated bound, none NaN."""

  @parameterized.parameters(*quantize.FORMATS)
  def test_every_magnitude_from_float32s_smallest_normal_to_3e38(self, fmt):
    rows = []
    for top in np.geomspace(1e-30, 3e38, 40).astype(np.float32):  # the block's largest
      for sign in (1.0, -1.0):  # an unsigned block ('q8') and a signed one
        row = np.concatenate([[top], WIDE[WIDE < top][-255:]])
        row = np.pad(row, (0, 256 - len(row)), constant_values=0.0).astype(np.float32)
        row[1::2] *= sign
        rows.append(row)
    x = np.stack(rows)
    kind = "fp8" if fmt == "fp8" else None
    for count in range(4):
      q = quantize_(jnp.asarray(x), fmt, count)
      back = np.asarray(dequantize_(q), np.float64)
      self.assertFalse(np.any(np.isnan(back)))
      scales = np.asarray(q.scales)
      for i, row in enumerate(x):
        k = kind or ("q8 signed" if scales[i] < 0 else "q8 unsigned")
        rel, floor = quantize.ERROR_BOUNDS[k]
        a = np.abs(row).max()
        bound = np.maximum(rel * np.abs(row), floor * a)
        # A value that dequantizes below float32's smallest normal may come back as 0
        # (XLA:CPU, as GPUs, flushes subnormal results): only values under 2**-125.
        flushed = (back[i] == 0) & (row != 0) & (np.abs(row) < 2.0**-125)
        error = np.where(flushed, 0.0, np.abs(back[i] - row))
        self.assertTrue(np.all(error <= bound), (fmt, float(a), float(np.max(error / bound))))
        # The largest magnitude comes back exactly (a 'q8' scale is it; 'fp8' holds it
        # as 448 times its scale, with float32's rounding), zeros as zeros, and no
        # nonzero element as zero (but those flushed).
        if fmt == "q8":
          self.assertEqual(np.abs(back[i]).max(), a)
        else:
          np.testing.assert_allclose(np.abs(back[i]).max(), a, rtol=2e-7)
        np.testing.assert_array_equal(back[i] == 0, (row == 0) | flushed)
        self.assertLess(flushed.sum(), 3)

  @parameterized.product(fmt=quantize.FORMATS, seed=[0, 1])
  def test_random_blocks_anywhere_in_float32_s_range(self, fmt, seed):
    # 1024 blocks, each its own draw: a largest magnitude log-uniform over float32's
    # range, elements from one of six shapes (uniform, log-uniform over 12 and over 45
    # decades, arbitrary float32 bits, eighths with many ties, just below the largest),
    # a twentieth of them zero, half the blocks signed; a random count.
    rng = np.random.default_rng(seed)
    n = 1024
    top = np.minimum(10.0 ** rng.uniform(-37.5, 38.6, (n, 1)), np.finfo(np.float32).max)
    u = rng.uniform(0.0, 1.0, (n, 256))
    below_one = rng.integers(0, 0x3F800000, (n, 256)).astype(np.uint32).view(np.float32)
    shapes = np.stack([
      u,
      10.0 ** rng.uniform(-12, 0, (n, 256)),
      10.0 ** rng.uniform(-45, 0, (n, 256)),
      below_one,
      np.round(u * 8) / 8,
      1 - 10.0 ** rng.uniform(-8, 0, (n, 256)),
    ])  # fmt: skip
    r = shapes[rng.integers(0, len(shapes), n), np.arange(n)]
    r[:, 0] = 1.0
    r[rng.uniform(0.0, 1.0, (n, 256)) < 0.05] = 0.0
    signs = np.where(rng.uniform(0.0, 1.0, (n, 256)) < 0.5, -1.0, 1.0)
    r = np.where(rng.uniform(0.0, 1.0, (n, 1)) < 0.5, r * signs, r)
    x = rng.permuted(top * r, axis=1).astype(np.float32)
    q = quantize_(jnp.asarray(x), fmt, jnp.uint32(rng.integers(0, 2**32)))
    back = np.asarray(dequantize_(q), np.float64)
    x = x.astype(np.float64)
    a = np.abs(x).max(1, keepdims=True)
    signed = np.asarray(q.scales)[:, :1] < 0
    kinds = ["fp8"] if fmt == "fp8" else ["q8 unsigned", "q8 signed"]
    rel, floor = (np.choose(signed, [quantize.ERROR_BOUNDS[k][i] for k in kinds]) for i in (0, 1))
    # The bound, with float32's rounding on the floor too (the smallest code times a).
    bound = np.maximum(rel * np.abs(x), floor * a * (1 + 1e-6))
    flushed = (back == 0) & (x != 0) & (np.abs(x) < 2.0**-125)
    negligible = a < 2.0**-100  # stored as zeros
    error = np.where(flushed | negligible, 0.0, np.abs(back - x))
    self.assertFalse(np.any(np.isnan(back)))
    self.assertTrue(np.all(error <= bound), float(np.max(error / bound)))
    self.assertGreater(float(np.max(error / bound)), 0.9)  # not a vacuous bound
    self.assertFalse(np.any(np.sign(back) * np.sign(x) < 0))
    np.testing.assert_array_equal(back == 0, (x == 0) | flushed | (negligible & (x != 0)))
    if fmt == "q8":  # a block is signed where it holds a value below -2**-126
      kept = ~negligible[:, 0]
      tiny = np.finfo(np.float32).tiny
      np.testing.assert_array_equal(signed[kept, 0], np.any(x < -tiny, 1)[kept])

  def test_q8_block_above_2_to_the_126(self):
    # XLA:CPU divides by a block's largest as a product with its reciprocal, which is
    # subnormal (flushed to zero) above 2**126: every element came back as the
    # smallest code, 1e38 as 2.9e28.
    x = np.linspace(1e37, 1e38, 256, dtype=np.float32)
    back = np.asarray(dequantize_(quantize_(jnp.asarray(x), "q8")))
    self.assertEqual(back[-1], np.float32(1e38))
    np.testing.assert_allclose(back, x, rtol=0.13)

  def test_fp8_never_stores_a_nan(self):
    # The repro: with x / (a / 448) computed as a product with a reciprocal,
    # a block of 5.6760276e7 scales to 448.00003, one ulp above e4m3's largest, and
    # the stochastic rounding carried 2**-20 of those elements to 480, which
    # float8_e4m3fn cannot hold (NaN): 5 of these 300 quantizations, before.
    x = jnp.full((64, 256), np.float32(5.6760276e7))
    count_nans = jax.jit(lambda c: jnp.isnan(quantize.quantize(x, "fp8", c).codes).sum())
    self.assertEqual(sum(int(count_nans(c)) for c in range(300)), 0)
    q = quantize.quantize(x, "fp8", 13)
    np.testing.assert_allclose(np.asarray(quantize.dequantize(q)), np.asarray(x), rtol=1e-6)
    tx = ols.state_dtypes(optax.trace(decay=0.0), "fp8", quantize_min_size=1)
    state = tx.init(x)
    for _ in range(2):
      _, state = jax.jit(tx.update)(x, state)
      self.assertFalse(bool(jnp.isnan(state.trace.codes.astype(jnp.float32)).any()))

  def test_fp8_small_elements_of_a_huge_block_keep_the_smallest_code(self):
    # 1e-3 in a block of largest 3e38 scales to 1.5e-39, a float32 subnormal, which
    # XLA:CPU flushes to zero: it came back as 0. It takes e4m3's smallest code.
    x = np.full(256, 1e-3, np.float32)
    x[0] = 3e38
    back = np.asarray(dequantize_(quantize_(jnp.asarray(x), "fp8")))
    self.assertTrue(np.all(back[1:] > 0))
    np.testing.assert_allclose(back[1:], 2**-9 * np.float32(3e38) / 448, rtol=1e-6)


def params_of(dtype=jnp.float32):
  """One leaf large enough to quantize, one below the threshold."""
  return {
    "w": (jnp.linspace(-1.0, 1.0, 64 * 256).reshape(64, 256) + 1.0).astype(dtype),
    "b": jnp.linspace(0.0, 1.0, 64).astype(dtype),
  }


def grads_at(step, dtype=jnp.float32):
  return jax.tree.map(
    lambda p: (
      (jnp.cos(jnp.arange(p.size, dtype=jnp.float32) * 0.37 + step) * 1e-2)
      .reshape(p.shape)
      .astype(dtype)
    ),
    params_of(),
  )


def fused_and_plain(tx, params, grads_seq):
  """Steps `params` with `grads_seq` twice side by side: with the fused step
  (`ols.apply_gradients`) and with `tx.update` then `optax.apply_updates`.
  Yields `((params, state), (params, state))` of the two after each step."""
  fused = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))

  @jax.jit
  def plain(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  got = want = (params, tx.init(params))
  for grads in grads_seq:
    got = fused(grads, got[1], got[0])
    want = plain(grads, want[1], want[0])
    yield got, want


class StateDtypesTest(parameterized.TestCase):
  def test_adam_steps_equal_a_hand_written_quantized_loop(self):
    choice = {"mu": "q8", "nu": "fp8"}
    tx = ols.state_dtypes(optax.adam(1e-2), choice)
    adam = optax.adam(1e-2)
    params = ref_params = params_of()
    state = tx.init(params)
    self.assertIsInstance(state[0].mu["w"], ols.QuantizedArray)
    self.assertEqual((state[0].mu["w"].format, state[0].nu["w"].format), ("q8", "fp8"))
    self.assertEqual(state[0].mu["b"].dtype, jnp.float32)  # 64 elements < 4096: as it was
    ref_state = adam.init(params)
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))

    @jax.jit
    def ref_step(g, s, p, count):
      # The k-th quantization of a leaf keys its rounding with k (init's is the 0th) and
      # with the crc32 of the leaf's path in the state.
      u, s = adam.update(g, s, p)
      q = lambda x, fmt, path: quantize.quantize(x, fmt, count, np.uint32(zlib.crc32(path)))
      mu = {**s[0].mu, "w": quantize.dequantize(q(s[0].mu["w"], "q8", b"[0].mu['w']"))}
      nu = {**s[0].nu, "w": quantize.dequantize(q(s[0].nu["w"], "fp8", b"[0].nu['w']"))}
      return optax.apply_updates(p, u), (s[0]._replace(mu=mu, nu=nu), *s[1:])

    for i in range(5):
      params, state = step(grads_at(i), state, params)
      ref_params, ref_state = ref_step(grads_at(i), ref_state, ref_params, i + 1)
      self.assertEqual(int(state[0].mu["w"].count), i + 1)
      chex.assert_trees_all_equal(params, ref_params)
      np.testing.assert_array_equal(state[0].mu["w"].dequantize(), ref_state[0].mu["w"])
      np.testing.assert_array_equal(state[0].nu["w"].dequantize(), ref_state[0].nu["w"])
    # The second moment is non-negative: its 'q8' blocks would be unsigned.
    q = ols.state_dtypes(optax.adam(1e-2), "q8").update(grads_at(0), tx.init(params_of()))[1]
    self.assertTrue(bool(jnp.all(q[0].nu["w"].scales >= 0)))
    self.assertTrue(bool(jnp.all(q[0].nu["w"].codes <= 255)))

  def test_any_optimizer_and_the_size_threshold(self):
    params = params_of()
    for inner in (optax.sgd(0.1, momentum=0.9), optax.lion(1e-3), optax.adafactor(1e-2)):
      tx = ols.state_dtypes(inner, "q8", quantize_min_size=64)
      state = tx.init(params)
      state = jax.jit(tx.update)(grads_at(0), state, params)[1]
      leaves = jax.tree.leaves(state, is_leaf=quantize.is_quantized)
      big = [x for x in leaves if quantize.is_quantized(x)]
      self.assertNotEmpty(big)
      for x in leaves:
        if not quantize.is_quantized(x) and jnp.issubdtype(x.dtype, jnp.floating):
          self.assertLess(x.size, 64)

  def test_under_scan_and_a_skipped_step_leaves_codes_and_scales(self):
    tx = ols.loss_scale_optimizer(
      ols.master_weights(
        ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "q8"}), store="remainder"
      ),
      ols.DynamicLossScale(2.0**10),
    )
    params = params_of(BF16)
    state = tx.init(params)

    def body(carry, i):
      params, state = carry
      grads = jax.tree.map(lambda g: (g * 2.0**10).astype(BF16), grads_at(i))
      return ols.apply_gradients(tx, grads, state, params), None

    (params, state), _ = jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(3)))((params, state))
    mu = state.inner_state.inner_state[0].mu["w"]
    self.assertEqual((mu.codes.dtype, mu.scales.dtype), (jnp.uint8, jnp.float32))
    poisoned = {**grads_at(3, BF16), "w": jnp.full((64, 256), jnp.nan, BF16)}
    new_params, new_state = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
      poisoned, state, params
    )
    self.assertFalse(bool(new_state.last_step_applied))
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    chex.assert_trees_all_equal_dtypes(new_state.inner_state, state.inner_state)
    # skip_bad_steps likewise, with stochastic rounding's key.
    tx = ols.skip_bad_steps(ols.stochastic_rounding(ols.state_dtypes(optax.adam(1e-3), "q8"), 0))
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    params, state = step(grads_at(0, BF16), tx.init(params), params)
    new_params, new_state = step(poisoned, state, params)
    self.assertEqual(int(new_state.nonfinite_skips), 1)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)

  def test_bytes_per_parameter_counted_from_the_pytrees(self):
    # Adam on bfloat16 parameters, the parameters included: 12 for float32 Adam,
    # 14 with a master copy; with 'q8' moments, 6 and 4 (and the scales, 4 bytes a
    # block of 256 per moment: 1/32 byte).
    params = {"w": jnp.zeros((256, 1024), BF16), "v": jnp.zeros((1024, 512), BF16)}
    n = sum(x.size for x in jax.tree.leaves(params))
    q8 = lambda: ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "q8"})
    rows = {
      "float32 adam": (jax.tree.map(lambda p: p.astype(jnp.float32), params), optax.adam(1e-3)),
      "master_weights": (params, ols.master_weights(optax.adam(1e-3))),
      "remainder q8": (params, ols.master_weights(q8(), store="remainder")),
      "rounding q8": (params, ols.stochastic_rounding(q8(), key=0)),
    }
    per_param = {}
    for name, (p, tx) in rows.items():
      state = jax.eval_shape(tx.init, p)
      total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((p, state)))
      per_param[name] = total / n
    self.assertAlmostEqual(per_param["float32 adam"], 12, delta=1e-4)
    self.assertAlmostEqual(per_param["master_weights"], 14, delta=1e-4)
    self.assertAlmostEqual(per_param["remainder q8"], 6 + 2 / 64, delta=1e-4)
    self.assertAlmostEqual(per_param["rounding q8"], 4 + 2 / 64, delta=1e-4)

  @parameterized.parameters(1.0, 1e17)
  def test_q8_adam_moves_a_gradient_far_below_its_blocks_largest_as_float32_adam(self, scale):
    # One gradient in each block of 256 is 1.5e-4 of the block's largest: its second
    # moment is 2.25e-8 of its block's. A map that stores it as zero (torchao's 8-bit
    # Adam does: benchmarks/lowbit_optim_vs_torch.py) leaves the next step only that
    # step's share, (1 - b2) * g**2, under the square root: in a trial that zeroed what
    # lies under 1e-6 of its block's largest, those elements moved 3.07 times float32
    # Adam's distance. 'q8' keeps them to its bound (within 5.5% here). The 10% below
    # rests on q8's format (2**-3 of a value at most, each step rounded afresh), not on
    # a backend's float rounding; `scale` takes the squares near 1e30 (float32's max
    # is 3.4e38).
    g = np.full((64, 256), 1e-2 * scale, np.float32)
    g[:, 7::256] = 1.5e-6 * scale
    params = {"w": jnp.zeros((64, 256))}
    steps, lr = 20, 1e-3
    moved = {}
    for name, tx in {
      "float32": optax.adam(lr),
      "q8": ols.state_dtypes(optax.adam(lr), {"mu": "q8", "nu": "q8"}),
    }.items():
      step = jax.jit(lambda g, s, p, tx=tx: ols.apply_gradients(tx, g, s, p))
      p, state = params, tx.init(params)
      for _ in range(steps):
        p, state = step({"w": jnp.asarray(g)}, state, p)
      moved[name] = -np.asarray(p["w"])
    # float32 Adam moves every element about lr a step (sqrt(v) is far above eps).
    np.testing.assert_allclose(moved["float32"], steps * lr, rtol=0.02)
    np.testing.assert_allclose(moved["q8"], moved["float32"], rtol=0.1)

  @parameterized.parameters(*quantize.FORMATS)
  def test_apply_gradients_equals_update_then_apply_updates(self, fmt):
    # The fused step runs the inner update twice (the codes after a barrier): it must
    # give what tx.update and optax.apply_updates give, bit for bit.
    tx = ols.state_dtypes(optax.adam(1e-2), {"mu": fmt, "nu": fmt})
    for got, want in fused_and_plain(tx, params_of(), [grads_at(i) for i in range(4)]):
      chex.assert_trees_all_equal(got, want)

  @parameterized.product(
    fmt=quantize.FORMATS,
    inner=["adam", "adamw", "lion", "sgd with momentum"],
  )
  def test_apply_gradients_equals_update_on_random_magnitudes(self, fmt, inner):
    # Blocks from 1e-30 to 1e15 (squares short of float32's overflow), parameters of
    # several shapes (one not a multiple of 256 elements), any elementwise optimizer:
    # the fused step gives what tx.update and optax.apply_updates give, bit for bit,
    # and no NaN.
    make = {
      "adam": lambda: optax.adam(1e-3),
      "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
      "lion": lambda: optax.lion(1e-4),
      "sgd with momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    }[inner]
    tx = ols.state_dtypes(make(), fmt, quantize_min_size=256)
    rng = np.random.default_rng(zlib.crc32(f"{fmt} {inner}".encode()))
    shapes = {"w": (24, 512), "v": (1000,), "u": (3, 4, 256)}

    def draw():
      def one(shape):
        rows = (*shape[:-1], 1) if len(shape) > 1 else (1,)
        magnitude = 10.0 ** rng.uniform(-30, 15, rows) * 10.0 ** rng.uniform(-6, 0, shape)
        return jnp.asarray((magnitude * rng.standard_normal(shape)).astype(np.float32))

      return {k: one(v) for k, v in shapes.items()}

    for got, want in fused_and_plain(tx, draw(), [draw() for _ in range(3)]):
      chex.assert_trees_all_equal(got, want)
      for leaf in jax.tree.leaves(got):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
          self.assertFalse(bool(jnp.isnan(leaf.astype(jnp.float32)).any()))

  @parameterized.parameters(*quantize.FORMATS)
  def test_compiled_update_bytes_on_cpu(self, fmt):
    # What XLA:CPU's compiled program of one Adam update reads and writes (its cost
    # analysis), against the minimum: read the gradient, params and state, write
    # params and state. 5.14 (q8) and 3.51 (fp8) times the minimum before: the
    # dequantized moments recomputed in four fusions each, float32 block
    # temporaries, the old codes copied twice; then 2.27 with one copy of the old
    # codes (XLA:CPU expands an optimization barrier into nothing before its copy
    # removal, so the params' loop, which reads the old codes, was not ordered
    # before the codes' loops that overwrite them). Now one reduction for both
    # moments' block extremes, then the params, then each moment's codes, ordered
    # by a data dependency: the gradient read four times, no copy, 32.4 bytes a
    # parameter (x2.02); 32.8 (x2.04, 'q8') since each block's sign bit, code offset
    # and scale magnitude are small buffers that every element loads.
    if jax.default_backend() != "cpu":
      self.skipTest("XLA:CPU's fusion and cost analysis; XLA:GPU fuses multiple outputs")
    tx = ols.state_dtypes(optax.adam(1e-3), {"mu": fmt, "nu": fmt})
    params = {"w": jnp.ones((1024, 1024))}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: ols.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
    compiled = step.lower(params, state, params).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
    minimum = 2 * nbytes((params, state)) + nbytes(params)
    ratio = cost["bytes accessed"] / minimum
    self.assertLess(ratio, 2.05)
    self.assertGreater(ratio, 1.9)  # four reads of the gradient at least: not vacuous
    copies = [
      line for line in compiled.as_text().splitlines() if "[1024,1024]" in line and " copy(" in line
    ]
    self.assertEqual(copies, [])
    # No full-size float32 temporary: the only float32 array of the parameter's size
    # written is the new parameter.
    entry = compiled.as_text().split("ENTRY")[1]
    written = [
      line
      for line in entry.splitlines()
      if "= f32[1024,1024]" in line and " parameter(" not in line
    ]
    self.assertLen(written, 1)

  @parameterized.parameters(*quantize.FORMATS)
  def test_compiled_update_runs_one_parameter_after_another_on_cpu(self, fmt):
    # XLA:CPU's own order ran every parameter's new value, then every code: at 16M
    # parameters the codes' loops then read a gradient long out of the caches, and took
    # twice their time per element. In the compiled program each parameter's new value
    # now comes after the codes of the parameter before it (for parameters of at least
    # `schedule.WINDOW` elements, as these), and its own codes after it; nothing is
    # copied, and the bytes are those of one parameter alone.
    if jax.default_backend() != "cpu" or tuple(map(int, jax.__version__.split(".")[:2])) < (0, 10):
      self.skipTest("XLA:CPU's schedule of its compiled program, read with jax 0.10's XLA")
    tx = ols.state_dtypes(optax.adam(1e-3), {"mu": fmt, "nu": fmt})
    shapes = {"a": (512, 512), "b": (1024, 256), "c": (256, 1024)}
    self.assertEqual(min(np.prod(s) for s in shapes.values()), schedule.WINDOW)
    params = {k: jnp.full(s, 0.5) for k, s in shapes.items()}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: ols.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
    compiled = step.lower(params, state, params).compile()
    text = compiled.as_text()
    self.assertNotRegex(text, r"\[(512,512|1024,256|256,1024)\]\{[0-9,]*\} copy\(")
    outputs = hlo_stats.output_positions(text)
    paths = [
      jax.tree_util.keystr(path)
      for path, _ in jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, params))[0]
    ]
    self.assertLen(outputs, len(shapes) + len(paths))
    line_of = dict(zip([f"param {k}" for k in shapes] + paths, outputs, strict=True))
    codes = lambda k: [line_of[p] for p in paths if f"['{k}']" in p and p.endswith(".codes")]
    order = list(shapes)
    for k in order:
      self.assertLen(codes(k), 2)  # mu's and nu's
      self.assertLess(line_of[f"param {k}"], min(codes(k)), k)
    for before, k in itertools.pairwise(order):
      self.assertLess(max(codes(before)), line_of[f"param {k}"], k)
    # And still bit for bit the update of `tx.update` (as the test above, on these leaves).
    grads = {
      k: jnp.cos(jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s)) for k, s in shapes.items()
    }
    fused = ols.apply_gradients(tx, grads, state, params)
    u, new_state = tx.update(grads, state, params)
    chex.assert_trees_all_equal(fused, (optax.apply_updates(params, u), new_state))

  def test_small_parameters_wait_for_the_one_a_window_of_elements_before(self):
    # A chain of small parameters ran on one core of XLA:CPU (a small loop is not split):
    # each waits instead for the codes of the parameter WINDOW elements before it. Six
    # leaves of a quarter of the window: the fifth waits for the first, the sixth for
    # the second; the first four wait for none. Still bit for bit `tx.update`'s.
    tx = ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "q8"})
    side = int(np.sqrt(schedule.WINDOW // 4))
    params = {f"w{i}": jnp.full((side, side), 0.5 + i) for i in range(6)}
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.cos(p * 3.0), params)
    waited = []
    whole = schedule.after_whole

    def counting(tree, dep, token):
      waited.append(len(dep))
      return whole(tree, dep, token)

    with mock.patch.object(schedule, "after_whole", counting):
      fused = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(grads, state, params)
    self.assertEqual(waited, [2, 2])  # mu's and nu's codes of the parameter waited for
    updates, new_state = tx.update(grads, state, params)
    chex.assert_trees_all_equal(fused, (optax.apply_updates(params, updates), new_state))

  def test_apply_gradients_equals_update_with_none_and_small_leaves(self):
    # The fused step stores the parameters' own 8-bit leaves one parameter after
    # another and the rest (a leaf under quantize_min_size, float32) as `tx.update`
    # does; a None parameter has no leaf, and the state keeps its structure.
    params = {"a": jnp.full((64, 256), 0.5), "d": None, "b": {"c": jnp.full((128, 256), 0.25)}}
    params["e"] = jnp.ones(3)
    tx = ols.state_dtypes(optax.adam(1e-2), {"mu": "q8", "nu": "fp8"})
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.cos(p * 3.0), params)
    fused = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(grads, state, params)
    updates, new_state = tx.update(grads, state, params)
    chex.assert_trees_all_equal(fused, (optax.apply_updates(params, updates), new_state))
    self.assertEqual(jax.tree.structure(fused[1]), jax.tree.structure(state))
    self.assertEqual(fused[1][0].mu["e"].dtype, jnp.float32)

  def test_owners_finds_the_parameter_a_state_leaf_belongs_to(self):
    params = {"a": jnp.zeros((2, 3)), "b": {"c": jnp.zeros(4)}, "d": None}
    tx = ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "q8"}, quantize_min_size=1)
    state = jax.eval_shape(tx.init, params)
    owner = quantize.owners(params)
    found = {
      jax.tree_util.keystr(path): owner(path, leaf.shape)
      for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=quantize.is_quantized)[
        0
      ]
      if quantize.is_quantized(leaf)
    }
    # Adam's moments of each weight (the count is no array of theirs); None is no leaf.
    self.assertEqual(sorted(found.values()), [0, 0, 1, 1])
    for name, k in found.items():
      self.assertIn("['a']" if k == 0 else "['b']['c']", name)
    key = jax.tree_util.DictKey
    self.assertIsNone(owner((key("mu"), key("a")), (3, 2)))  # its path, another shape
    self.assertIsNone(owner((key("mu"), key("c")), (4,)))  # a path's end, not a parameter's
    self.assertEqual(owner((key("b"), key("c")), (4,)), 1)

  def test_formats_are_refused_where_they_do_not_belong(self):
    with self.assertRaisesRegex(ValueError, r"dtypes\['mu'\] must be .* or a format 'q8'"):
      ols.state_dtypes(optax.adam(1e-3), {"mu": "q4"})
    with self.assertRaisesRegex(ValueError, r"quantize_min_size must be an int >= 0"):
      ols.state_dtypes(optax.adam(1e-3), "q8", quantize_min_size=-1)
    with self.assertRaisesRegex(TypeError, r"compute_dtype must be a floating dtype"):
      ols.Policy("f32", "q8", "f32")
