"""Gradient accumulation with the wrappers: `optax.MultiSteps` inside, `optax.microbatch` before.

`loss_scale_optimizer(MultiSteps(inner, k).gradient_transformation())` checks
every micro-batch: an overflowing one is skipped before it reaches the
accumulator, which keeps its dtype (float32 by default since optax 0.2.8,
the params' dtype before). `optax.microbatch` (public since optax 0.2.7)
accumulates inside one step: the wrapper sees the accumulated gradients, so one
bad micro-batch skips the whole step.
"""

from __future__ import annotations

import inspect

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

K = 3
SCALE = 2.0**4
# True gradients of three finite micro-batches: exactly representable in
# float16 and bfloat16, their mean [3, 4] too.
TRUE_GRADS = ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0])
# optax 0.2.8 made MultiSteps accumulate in float32 (`accumulator_dtype`);
# before, the accumulator had the params' dtype.
FLOAT32_ACCUMULATOR = "accumulator_dtype" in inspect.signature(optax.MultiSteps).parameters
needs_microbatch = pytest.mark.skipif(
  not hasattr(optax, "microbatch"),
  reason=f"optax.microbatch is public since optax 0.2.7; this is optax {optax.__version__}",
)


def _multisteps(k=K):
  return optax.MultiSteps(optax.sgd(1.0), k).gradient_transformation()


def _expected_accumulator_dtype(params_dtype):
  return jnp.float32 if FLOAT32_ACCUMULATOR else params_dtype


class MultiStepsInsideTheWrapperTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_overflowing_micro_batch_is_skipped_not_accumulated(self, dtype):
    params = {"w": jnp.zeros(2, dtype)}
    tx = ols.loss_scale_optimizer(_multisteps(), ols.DynamicLossScale(SCALE))
    state = tx.init(params)
    step = self.variant(tx.update)
    g1, g2, g3 = (jnp.asarray(g, dtype) for g in TRUE_GRADS)

    _, state = step({"w": g1 * SCALE}, state, params)
    before = state.inner_state
    updates, state = step({"w": jnp.array([jnp.inf, 1.0], dtype)}, state, params)
    # Skipped before MultiSteps saw it: accumulator and micro-step untouched.
    chex.assert_trees_all_equal(state.inner_state, before)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    self.assertEqual(float(ols.get_loss_scale(state)()), SCALE / 2)

    _, state = step({"w": g2 * (SCALE / 2)}, state, params)  # the scale backed off
    updates, state = step({"w": g3 * (SCALE / 2)}, state, params)
    # Emitted after three finite micro-batches: SGD on their mean, [3, 4].
    self.assertEqual(updates["w"].dtype, dtype)
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-3.0, -4.0])
    self.assertEqual(int(state.inner_state.mini_step), 0)
    self.assertEqual(int(ols.metrics(state)["total_skips"]), 1)

  @parameterized.parameters(jnp.float16, jnp.bfloat16, jnp.float32)
  def test_accumulator_dtype_survives_applied_and_skipped_micro_batches(self, dtype):
    params = {"w": jnp.zeros(2, dtype)}
    tx = ols.loss_scale_optimizer(_multisteps(), ols.DynamicLossScale(SCALE))
    state = tx.init(params)
    expected = _expected_accumulator_dtype(dtype)
    self.assertEqual(state.inner_state.acc_grads["w"].dtype, expected)
    step = jax.jit(tx.update)
    for grads in ([1.0, 2.0], [jnp.nan, 0.0], [3.0, 4.0], [5.0, 6.0], [jnp.inf, 0.0]):
      _, state = step({"w": jnp.asarray(grads, dtype) * SCALE}, state, params)
      self.assertEqual(state.inner_state.acc_grads["w"].dtype, expected)

  def test_float32_accumulator_holds_what_float16_would_round_away(self):
    if not FLOAT32_ACCUMULATOR:
      pytest.skip(f"MultiSteps accumulates in the params' dtype in optax {optax.__version__}")
    # The running mean of the float16 gradients 1 and 1 + 2**-10 is
    # 1 + 2**-11: not a float16 (its spacing at 1 is 2**-10), kept exactly by
    # the float32 accumulator.
    params = {"w": jnp.zeros(1, jnp.float16)}
    tx = ols.loss_scale_optimizer(_multisteps(), ols.DynamicLossScale(SCALE))
    state = tx.init(params)
    for g in (1.0, 1.0 + 2.0**-10):
      _, state = tx.update({"w": jnp.full(1, g * SCALE, jnp.float16)}, state, params)
    self.assertEqual(float(state.inner_state.acc_grads["w"][0]), 1.0 + 2.0**-11)
    self.assertNotEqual(float(jnp.float16(1.0 + 2.0**-11)), 1.0 + 2.0**-11)


class SkipBadStepsAroundMultiStepsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_nan_micro_batch_is_skipped_not_accumulated_in_bfloat16(self):
    params = {"w": jnp.zeros(2, jnp.bfloat16)}
    tx = ols.skip_bad_steps(_multisteps())
    state = tx.init(params)
    step = self.variant(tx.update)
    g1, g2, g3 = (jnp.asarray(g, jnp.bfloat16) for g in TRUE_GRADS)
    _, state = step({"w": g1}, state, params)
    before = state.inner_state
    _, state = step({"w": jnp.array([jnp.nan, 1.0], jnp.bfloat16)}, state, params)
    chex.assert_trees_all_equal(state.inner_state, before)
    _, state = step({"w": g2}, state, params)
    updates, state = step({"w": g3}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-3.0, -4.0])
    self.assertEqual(int(ols.metrics(state)["nonfinite_skips"]), 1)

  def test_inside_the_loss_scale_wrapper_with_float16(self):
    # The nesting the docs recommend for float16 with spike detection.
    params = {"w": jnp.zeros(2, jnp.float16)}
    tx = ols.loss_scale_optimizer(ols.skip_bad_steps(_multisteps()), ols.DynamicLossScale(SCALE))
    state = tx.init(params)
    step = jax.jit(tx.update)
    g1, g2, g3 = (jnp.asarray(g, jnp.float16) for g in TRUE_GRADS)
    _, state = step({"w": g1 * SCALE}, state, params)
    _, state = step({"w": jnp.array([jnp.inf, 1.0], jnp.float16)}, state, params)
    _, state = step({"w": g2 * (SCALE / 2)}, state, params)
    updates, state = step({"w": g3 * (SCALE / 2)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-3.0, -4.0])
    metrics = ols.metrics(state)
    # The overflow is the loss scale's: the guard never saw that step.
    self.assertEqual((int(metrics["overflow_skips"]), int(metrics["nonfinite_skips"])), (1, 0))


def _linear_loss(params, x, y):
  w = params["w"].astype(jnp.float16)  # float32 master weights, float16 compute
  pred = x.astype(jnp.float16) @ w
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def _batch():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
  return x, jnp.sum(x, axis=1)


@needs_microbatch
class MicrobatchTest(chex.TestCase):
  def _microbatched(self, fun, argnums):
    return optax.microbatch(
      fun,
      argnums=argnums,
      microbatch_size=2,
      accumulator=optax.microbatching.AccumulationType.MEAN,
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_mean_over_micro_batches_matches_the_full_batch(self):
    params = {"w": jnp.zeros(4)}
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
    state = tx.init(params)
    x, y = _batch()
    full_loss, full_grads = ols.value_and_grad(_linear_loss)(state, params, x, y)
    grad_fn = self.variant(self._microbatched(ols.value_and_grad(_linear_loss), argnums=(2, 3)))
    loss, grads = grad_fn(state, params, x, y)
    # float16 compute rounds each micro-batch's sum differently: close, not equal.
    np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], full_grads["w"], rtol=1e-3)
    self.assertEqual(grads["w"].dtype, jnp.float32)
    updates, state = tx.update(grads, state, params)
    self.assertTrue(bool(ols.metrics(state)["last_step_applied"]))
    np.testing.assert_allclose(updates["w"], -0.1 * full_grads["w"] / 2**10, rtol=1e-3)

  def test_one_bad_micro_batch_skips_the_whole_step(self):
    params = {"w": jnp.zeros(4)}
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
    state = tx.init(params)
    x, y = _batch()
    grad_fn = jax.jit(self._microbatched(ols.value_and_grad(_linear_loss), argnums=(2, 3)))
    _, grads = grad_fn(state, params, x.at[5, 0].set(jnp.nan), y)
    updates, state = tx.update(grads, state, params)
    np.testing.assert_array_equal(updates["w"], np.zeros(4))
    metrics = ols.metrics(state)
    self.assertFalse(bool(metrics["last_step_applied"]))
    self.assertEqual(float(metrics["loss_scale"]), 2.0**9)

  def test_float16_gradients_are_summed_in_float16(self):
    # Each micro-batch's scaled gradient (40 * 1024 = 40960) fits float16;
    # their sum does not, so the accumulated gradient overflows and the step
    # is skipped. Float32 master params give float32 gradients, which do not.
    scale = ols.DynamicLossScale(2.0**10)
    loss = lambda params, x: jnp.sum(params["w"] * x)
    grad_fn = self._microbatched(ols.value_and_grad(loss), argnums=2)
    x = jnp.full(4, 20.0, jnp.float16)
    _, one = ols.value_and_grad(loss)(scale, {"w": jnp.ones((), jnp.float16)}, x[:2])
    self.assertEqual(float(one["w"]), 40960.0)
    _, grads16 = grad_fn(scale, {"w": jnp.ones((), jnp.float16)}, x)
    self.assertEqual(float(grads16["w"]), np.inf)
    _, grads32 = grad_fn(scale, {"w": jnp.ones((), jnp.float32)}, x)
    self.assertEqual((grads32["w"].dtype, float(grads32["w"])), (jnp.float32, 40960.0))
