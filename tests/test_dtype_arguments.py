"""Dtype arguments are read one way across the API, and bad ones are refused when built.

NumPy reads 'f16' as float128 and 'f8' as float64; every dtype argument of the
package goes through `utils/dtypes.read_dtype` instead, which reads jmp's
names ('f16', 'bf16', 'f32', ...), dtypes and scalar types, and names the
argument when it refuses anything else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._src.utils import dtypes

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


@pytest.mark.parametrize(
  "spelling, expected",
  [
    ("f16", F16), ("float16", F16), ("bf16", BF16), ("bfloat16", BF16), ("f32", F32),
    ("float32", F32), ("full", F32), (jnp.bfloat16, BF16), (np.float16, F16),
    (np.dtype("float32"), F32), (jnp.dtype("bfloat16"), BF16),
  ],
)  # fmt: skip
def test_every_spelling_reads_alike(spelling, expected):
  assert dtypes.read_dtype(spelling, "x") == expected
  assert ols.Policy(spelling, spelling, spelling).param_dtype == expected


@pytest.mark.parametrize("value", ["f8", "f4", "float128", "int8", "e", None, 3, jnp.int32, bool])
def test_anything_else_is_refused_naming_the_argument_and_the_names(value):
  with pytest.raises(dtypes.DtypeError, match=r"compute_dtype must be a floating dtype .* bf16"):
    ols.Policy(jnp.float32, value, jnp.float32)
  # Both kinds of error, so that callers catching either keep working.
  with pytest.raises(TypeError):
    dtypes.read_dtype(value, "x")
  with pytest.raises(ValueError):
    dtypes.read_dtype(value, "x")


def test_policy_f8_is_refused_not_float64():
  # NumPy reads 'f8' as float64: the policy was silently a float64 one.
  with pytest.raises(TypeError, match=r"param_dtype must be .*; got 'f8'"):
    ols.Policy("f8", "f32", "f32")


def test_state_dtypes_reads_f16_as_float16():
  # NumPy reads 'f16' as float128: this built, then failed at init.
  tx = ols.state_dtypes(optax.adam(1e-3), "f16")
  state = tx.init({"w": jnp.ones(3)})
  assert state[0].mu["w"].dtype == F16 and state[0].nu["w"].dtype == F16
  state = ols.state_dtypes(optax.adam(1e-3), {"mu": "bf16", "nu": "f32"}).init({"w": jnp.ones(3)})
  assert (state[0].mu["w"].dtype, state[0].nu["w"].dtype) == (BF16, F32)


def test_master_weights_reads_f16_as_float16():
  tx = ols.master_weights(optax.sgd(0.1), master_dtype="f16")
  state = tx.init({"w": jnp.ones(2, jnp.float8_e4m3fn)})
  assert state.master["w"].dtype == F16
  assert (
    ols.master_weights(optax.sgd(0.1), master_dtype="f32")
    .init({"w": jnp.ones(2, BF16)})
    .master["w"]
    .dtype
    == F32
  )


@pytest.mark.parametrize("build", ["master_weights", "state_dtypes"])
def test_float64_without_x64_is_refused_when_built(build):
  if jax.config.jax_enable_x64:
    pytest.skip("x64 is on")
  with pytest.raises(ValueError, match=r"is float64, but JAX runs without 64-bit types"):
    if build == "master_weights":
      ols.master_weights(optax.sgd(0.1), master_dtype=jnp.float64)
    else:
      ols.state_dtypes(optax.sgd(0.1, momentum=0.9), {"trace": "f64"})


def test_report_advisor_and_rounding_targets_read_the_names():
  grads = {"w": jnp.array([1.0, 1e-6, 7e4])}
  assert ols.gradient_report(grads, "f16").target_dtype == F16  # was float128: refused
  assert ols.suggest_loss_scale(grads, "bf16").scale == ols.suggest_loss_scale(grads, BF16).scale
  x = jnp.full(8, 1.0 + 2**-10)
  key = jax.random.key(0)
  np.testing.assert_array_equal(
    ols.stochastic_round(x, "bf16", key), ols.stochastic_round(x, jnp.bfloat16, key)
  )
  with pytest.raises(ValueError, match=r"dtype must be one of the dtypes float16, bfloat16\b"):
    ols.suggest_loss_scale(grads, "f32")


def test_stochastic_rounding_takes_a_seed_held_in_a_uint32_scalar():
  # A uint32 scalar was taken for raw key data and failed at the first step.
  params = {"w": jnp.ones(64, BF16)}
  grads = {"w": jnp.full(64, 0.3, BF16)}
  runs = []
  for key in (jnp.uint32(5), 5, jnp.int32(5)):
    tx = ols.stochastic_rounding(optax.sgd(2.0**-10), key=key)
    state = tx.init(params)
    runs.append(ols.apply_gradients(tx, grads, state, params))
  for run in runs[1:]:
    np.testing.assert_array_equal(run[0]["w"], runs[0][0]["w"])
    np.testing.assert_array_equal(run[1].key, runs[0][1].key)


def test_stochastic_rounding_refuses_a_batch_of_seeds_when_built():
  with pytest.raises(ValueError, match=r"key must be a PRNG key"):
    ols.stochastic_rounding(optax.sgd(0.1), key=jnp.arange(2, dtype=jnp.uint16))
