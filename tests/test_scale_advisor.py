"""suggest_loss_scale on synthetic gradients whose answers are known in closed form."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import optax_lossscale as ols

F16_MAX = 65504.0


@pytest.mark.parametrize(
  ("max_abs", "margin", "scale"),
  [
    (1.0, 8.0, 2.0**12),  # 4096 * 8 = 32768 <= 65504 < 65536
    (3.0, 8.0, 2.0**11),  # 3 * 2048 * 8 = 49152 <= 65504 < 98304
    (1.0, 1.0, 2.0**15),
    (2.0**-20, 8.0, 2.0**24),  # would be 2**32: capped at max_scale
    (1000.0, 8.0, 2.0**3),
    (4.0e4, 1.0, 1.0),
    (6.0e5, 2.0, 2.0**-5),  # gradients beyond float16's range need a scale below 1
  ],
)
def test_known_scales(max_abs, margin, scale):
  w = np.array([0.25 * max_abs, -max_abs, 0.5 * max_abs], np.float32)
  grads = {"w": w, "b": np.zeros(3, np.float32)}
  advice = ols.suggest_loss_scale(grads, margin=margin)
  assert advice.scale == scale
  assert advice.max_abs == np.float32(max_abs)
  assert advice.headroom == F16_MAX / (float(np.float32(max_abs)) * scale)
  assert math.log2(advice.scale).is_integer()


def test_boundary_is_exact():
  # max|g| * 4096 * 8 == 65504 exactly: still safe; one ulp more is not.
  at = np.float32(F16_MAX / 8 / 4096)
  assert float(at) * 4096 * 8 == F16_MAX
  assert ols.suggest_loss_scale([at]).scale == 4096.0
  assert ols.suggest_loss_scale([np.nextafter(at, np.float32(2))]).scale == 2048.0
  assert ols.suggest_loss_scale([at], margin=8.000001).scale == 2048.0


def test_underflow_shares_before_and_after():
  # 2**-30 and 2**-26 vanish in float16 (smallest subnormal 2**-24) until scaled;
  # 2**-20 is subnormal before and normal after; 1.0 bounds the scale at 2**12.
  x = np.array([2.0**-30, -(2.0**-26), 2.0**-20, 1.0, 0.0, 0.0], np.float32)
  advice = ols.suggest_loss_scale({"g": x})
  assert advice.scale == 2.0**12
  assert advice.num_values == 4  # zeros carry no signal and are not counted
  assert advice.underflow_before == 2 / 4
  assert advice.subnormal_before == 1 / 4
  # Scaled by 2**12: 2**-18 (subnormal), 2**-14 (the smallest normal), 2**-8, 2**12.
  assert advice.underflow_after == 0.0 and advice.subnormal_after == 1 / 4
  assert "underflow 50.00% -> 0.00%" in str(advice)


def test_random_sample_against_a_numpy_count():
  rng = np.random.default_rng(1)
  sample = [
    {
      "w": (rng.standard_normal((64, 64)) * 10.0 ** rng.uniform(-11, -3, (64, 64))).astype(
        np.float32
      )
    }
    for _ in range(3)
  ]
  advice = ols.suggest_loss_scale(sample, margin=4.0)
  values = np.concatenate([s["w"].ravel() for s in sample])
  max_abs = np.abs(values).max()
  expected = 2.0 ** math.floor(math.log2(F16_MAX / 4.0 / float(max_abs)))
  assert advice.scale == min(expected, 2.0**24)
  lost = lambda s: np.count_nonzero((values * np.float32(s)).astype(np.float16) == 0) / values.size
  assert advice.underflow_before == lost(1.0) > 0.3
  assert advice.underflow_after == lost(advice.scale) < advice.underflow_before


def test_non_finite_values_are_ignored_and_counted():
  grads = [jnp.array([jnp.inf, -jnp.inf, jnp.nan, 2.0]), jnp.arange(3)]
  advice = ols.suggest_loss_scale(grads)
  assert advice.num_nonfinite == 3 and advice.num_values == 1 and advice.scale == 2.0**11


def test_a_sample_with_nothing_usable_is_refused():
  # An empty, all-zero or all-overflowed sample used to be answered with the cap (2^24).
  samples = (
    {"w": np.zeros(4, np.float32)},
    {},
    [None],
    {"w": np.array([np.inf, -np.inf, np.nan], np.float32)},
    [np.zeros(2, np.float16), np.arange(3)],
  )
  for grads in samples:
    with pytest.raises(ValueError, match="no finite, nonzero floating value"):
      ols.suggest_loss_scale(grads)


def test_one_usable_value_is_enough():
  advice = ols.suggest_loss_scale({"w": np.array([0.0, np.nan, 1.0], np.float32)})
  assert advice.num_values == 1 and advice.num_nonfinite == 1


def test_bfloat16_target():
  # bfloat16 reaches float32's range, so the cap decides; its underflow starts near 1e-38.
  x = np.array([1e-39, 1e-41, 1.0], np.float32)
  advice = ols.suggest_loss_scale(x, "bfloat16")
  assert advice.scale == 2.0**24
  stored = (x * np.float32(1.0)).astype(ml_dtypes.bfloat16).astype(np.float32)
  assert advice.underflow_before == np.count_nonzero(stored == 0) / 3
  assert advice.underflow_before == advice.subnormal_before == 1 / 3
  assert advice.underflow_after == advice.subnormal_after == 0.0


def test_bad_arguments_are_rejected_by_name():
  with pytest.raises(ValueError, match="dtype must be one of"):
    ols.suggest_loss_scale([1.0], "float32")
  for bad in (0.5, math.inf, "8", True):
    with pytest.raises(ValueError, match="margin must be a finite number >= 1"):
      ols.suggest_loss_scale([1.0], margin=bad)
  with pytest.raises(ValueError, match="max_scale must be a finite number >= 1"):
    ols.suggest_loss_scale([1.0], max_scale=0.0)
