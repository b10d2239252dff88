"""Tests for apply_gradients: the fused update-and-apply step."""

from __future__ import annotations

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from tests import reference_models
from tests.test_optimizer import (
  INNERS,
  SCALE,
  batch,
  corrupt,
  grads_of_scaled_loss,
  loss_fn,
  make_params,
  scaled_grads,
)


def reference_run(inner, params, steps, bad_steps):
  """Bare optax on unscaled gradients, update and apply as one program.

  That is how a user steps without loss scaling, and what an applied step of
  `apply_gradients` must equal bit for bit; skipped steps change nothing.
  """
  state = inner.init(params)

  @jax.jit
  def step(scaled, state, params, scale):
    unscaled = jax.tree.map(lambda g: g * (jnp.float32(1) / scale), scaled)
    updates, state = inner.update(unscaled, state, params)
    return optax.apply_updates(params, updates), state

  flags = [step not in bad_steps for step in range(steps)]
  scales = [SCALE] + [float(s) for s, _ in reference_models.tensorflow_trajectory(flags, SCALE, 3)]
  history = []
  for i in range(steps):
    if flags[i]:
      scale = jnp.float32(scales[i])
      params, state = step(grads_of_scaled_loss(params, batch(i), scale), state, params, scale)
    history.append((params, state))
  return history


class EquivalenceTest(parameterized.TestCase):
  @parameterized.product(inner=sorted(INNERS), skip_mode=["cond", "select"])
  def test_fault_injected_run_equals_bare_optax_on_finite_steps(self, inner, skip_mode):
    bad_steps = {2, 5, 6}
    tx = ols.loss_scale_optimizer(
      INNERS[inner](), ols.DynamicLossScale(SCALE, 3), skip_mode=skip_mode
    )
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    params = make_params()
    state = tx.init(params)
    ours = []
    for i in range(10):
      params, state = step(scaled_grads(params, state, i, i in bad_steps), state, params)
      ours.append((params, state))
    ref = reference_run(INNERS[inner](), make_params(), 10, bad_steps)
    flags = [i not in bad_steps for i in range(10)]
    expected_scales = reference_models.tensorflow_trajectory(flags, SCALE, 3)
    for i, ((params, state), (ref_params, ref_state)) in enumerate(zip(ours, ref, strict=True)):
      chex.assert_trees_all_equal(params, ref_params)
      chex.assert_trees_all_equal(state.inner_state, ref_state)
      self.assertEqual(float(state.loss_scale()), float(expected_scales[i][0]))
      self.assertEqual(int(state.loss_scale.counter), expected_scales[i][1])
      self.assertEqual(bool(state.last_step_applied), flags[i])
      self.assertEqual(int(state.total_skips), sum(not f for f in flags[: i + 1]))

  @parameterized.parameters("cond", "select")
  def test_state_equals_update_then_apply(self, skip_mode):
    # Everything but the params is computed exactly as by `update`.
    tx = ols.loss_scale_optimizer(
      optax.adam(1e-2), skip_mode=skip_mode, record_nonfinite_leaves=True
    )
    params = make_params()
    state = tx.init(params)
    for i, bad in enumerate([False, True, False]):
      grads = scaled_grads(params, state, i, bad)
      new_params, fused_state = jax.jit(ols.apply_gradients, static_argnums=0)(
        tx, grads, state, params
      )
      updates, update_state = jax.jit(tx.update)(grads, state, params)
      chex.assert_trees_all_equal(fused_state, update_state)
      chex.assert_trees_all_close(
        new_params, optax.apply_updates(params, updates), rtol=1e-6, atol=0
      )
      params, state = new_params, fused_state


class SkipTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(skip_mode=["cond", "select"], kind=["nan", "inf", "-inf"])
  def test_skipped_step_returns_params_and_inner_state_bit_for_bit(self, skip_mode, kind):
    tx = ols.loss_scale_optimizer(INNERS["adamw_schedule"](), skip_mode=skip_mode)
    # -0.0 would become +0.0 through `params + 0`; a skipped step must not add.
    params = {**make_params(), "z": jnp.array([-0.0, 0.0, -0.0])}
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    apply = self.variant(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    params, state = apply(grads, state, params)  # one applied step first
    new_params, new_state = apply(corrupt(grads, kind), state, params)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal_dtypes(new_params, params)
    np.testing.assert_array_equal(np.signbit(new_params["z"]), np.signbit(params["z"]))
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    self.assertEqual(int(new_state.inner_state.count), 1)
    self.assertFalse(bool(new_state.last_step_applied))
    self.assertEqual(float(new_state.loss_scale()), 2.0**14)

  @parameterized.parameters("cond", "select")
  def test_bf16_params_keep_their_dtype(self, skip_mode):
    tx = ols.loss_scale_optimizer(optax.adam(1e-2), skip_mode=skip_mode)
    params = make_params(jnp.bfloat16)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**15, jnp.float32), params)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    skipped_params, _ = step(corrupt(grads, "nan"), state, params)
    chex.assert_trees_all_equal(skipped_params, params)
    applied_params, _ = step(grads, state, params)
    chex.assert_trees_all_equal_dtypes(applied_params, params)
    self.assertFalse(bool(jnp.all(applied_params["w"] == params["w"])))

  @chex.variants(with_jit=True, without_jit=True)
  def test_fixed_loss_scale_always_applies(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), 8)
    params = make_params()
    grads = corrupt(jax.tree.map(jnp.ones_like, params), "nan")
    new_params, state = self.variant(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
      grads, tx.init(params), params
    )
    self.assertTrue(np.isnan(np.asarray(new_params["w"])).any())
    np.testing.assert_array_equal(new_params["b"], np.asarray(params["b"]) - 1 / 8)
    self.assertTrue(bool(state.last_step_applied))

  @chex.variants(with_jit=True, without_jit=True)
  def test_none_leaves_pass_through(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(4.0))
    apply = self.variant(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    params = {"w": jnp.ones(2), "frozen": None}
    state = tx.init(params)
    params, state = apply({"w": jnp.full(2, 8.0), "frozen": None}, state, params)
    np.testing.assert_array_equal(params["w"], [-1.0, -1.0])
    self.assertIsNone(params["frozen"])
    skipped, state = apply({"w": jnp.full(2, jnp.nan), "frozen": None}, state, params)
    chex.assert_trees_all_equal(skipped, params)
    self.assertFalse(bool(state.last_step_applied))

  def test_extra_args_reach_the_inner_transformation(self):
    seen = []

    def update(updates, state, params=None, *, tag):
      seen.append(tag)
      return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = ols.loss_scale_optimizer(inner, 1)
    params = {"w": jnp.ones(2)}
    ols.apply_gradients(tx, {"w": jnp.ones(2)}, tx.init(params), params, tag="x")
    self.assertEqual(seen, ["x"])


class FallbackTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("bare_optax", lambda: optax.adam(1e-2)),
    (
      "chain_around_the_wrapper",
      lambda: optax.chain(optax.identity(), ols.loss_scale_optimizer(optax.adam(1e-2))),
    ),
  )
  def test_other_transformations_update_then_apply(self, make_tx):
    tx = make_tx()
    params = make_params()
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params, batch(0))

    def reference(grads, state, params):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    expected = jax.jit(reference)(grads, state, params)
    got = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(grads, state, params)
    chex.assert_trees_all_equal(got, expected)

  def test_a_wrapped_update_is_not_bypassed(self):
    # functools.wraps copies the wrapper's settings onto the new function; the
    # fused step would skip the wrapping, so apply_gradients must not take it.
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(2.0))
    calls = []

    @functools.wraps(tx.update)
    def logged_update(grads, state, params=None, **extra):
      calls.append(1)
      return tx.update(grads, state, params, **extra)

    logged = tx._replace(update=logged_update)
    params = {"w": jnp.ones(2)}
    new_params, _ = ols.apply_gradients(
      logged, {"w": jnp.full(2, 2.0)}, logged.init(params), params
    )
    self.assertEqual(calls, [1])
    np.testing.assert_array_equal(new_params["w"], [0.0, 0.0])
    self.assertTrue(logged.dynamic)  # the Keras-style attributes still work

  def test_errors(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0))
    state = tx.init({"w": jnp.ones(2)})
    with self.assertRaisesRegex(ValueError, "params must be given"):
      ols.apply_gradients(tx, {"w": jnp.ones(2)}, state, None)
    with self.assertRaisesRegex(TypeError, "optimizer must be an optax.GradientTransformation"):
      ols.apply_gradients(optax.MultiSteps(optax.sgd(1.0), 2), {"w": jnp.ones(2)}, state, {})
