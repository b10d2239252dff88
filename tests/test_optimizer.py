"""Tests for loss_scale_optimizer: equivalence, skip semantics, composition."""

from __future__ import annotations

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests import reference_models

SCALE = 2.0**12  # a power of two: grad(S * loss) == S * grad(loss) bit for bit


def make_params(dtype=jnp.float32):
  return {
    "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype),
    "b": jnp.array([0.5, -0.25, 0.125, 1.0], dtype),
  }


def loss_fn(params, x):
  pred = jnp.tanh(x @ params["w"].astype(jnp.float32) + params["b"].astype(jnp.float32))
  return jnp.mean((pred - 0.3) ** 2)


def batch(step):
  return jnp.cos(jnp.arange(6.0).reshape(2, 3) + step)


def global_norm(tree):
  """The L2 norm over all leaves, computed in float64 NumPy."""
  return float(np.sqrt(sum(np.sum(np.square(np.float64(x))) for x in jax.tree.leaves(tree))))


def corrupt(grads, kind):
  """Puts one non-finite value into the weight gradient."""
  value = {"nan": jnp.nan, "inf": jnp.inf, "-inf": -jnp.inf}[kind]
  return {**grads, "w": grads["w"].at[1, 2].set(value)}


INNERS = {
  "sgd": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1e-3), optax.adam(1e-2)),
  "adamw_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=1e-2
  ),
}


# Gradients, optimizer update and parameter update are compiled separately in
# both runs: XLA may fuse one program differently from another (and contract
# multiply-adds differently), so bit-for-bit comparisons need equal programs.
grads_of_scaled_loss = jax.jit(jax.grad(lambda p, x, s: loss_fn(p, x) * s))
apply_updates = jax.jit(optax.apply_updates)


@jax.jit
def scaled_grads(params, state, step, bad):
  scaled = lambda p: ols.get_scaled_loss(loss_fn(p, batch(step)), state)
  grads = jax.grad(scaled)(params)
  return jax.lax.cond(bad, lambda g: corrupt(g, "nan"), lambda g: g, grads)


def reference_run(inner, params, steps, bad_steps):
  """The inner optimizer on unscaled gradients, applied only on finite steps.

  Each applied step is `inner.update(grads * (1/S), ...)` as one program, the
  unscaling fused into the update as the wrapper's is. The scale follows
  TensorFlow's rules, tracked here in Python.
  """
  state = inner.init(params)

  @jax.jit
  def update(scaled, state, params, scale):
    unscaled = jax.tree.map(lambda g: g * (jnp.float32(1) / scale), scaled)
    return inner.update(unscaled, state, params)

  flags = [step not in bad_steps for step in range(steps)]
  scales = [SCALE] + [float(s) for s, _ in reference_models.tensorflow_trajectory(flags, SCALE, 3)]
  history = []
  for step in range(steps):
    if step not in bad_steps:
      scale = jnp.float32(scales[step])
      updates, state = update(
        grads_of_scaled_loss(params, batch(step), scale), state, params, scale
      )
      params = apply_updates(params, updates)
    history.append((params, state))
  return history


def wrapped_run(tx, params, steps, bad_steps, jit=True):
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  history = []
  for step in range(steps):
    grads = scaled_grads(params, state, step, step in bad_steps)
    updates, state = update(grads, state, params)
    params = apply_updates(params, updates)
    history.append((params, state))
  return history


class EquivalenceTest(parameterized.TestCase):
  @parameterized.product(inner=sorted(INNERS), skip_mode=["cond", "select", "auto"])
  def test_fault_injected_run_equals_inner_on_finite_steps(self, inner, skip_mode):
    bad_steps = {2, 5, 6}
    tx = ols.loss_scale_optimizer(
      INNERS[inner](), ols.DynamicLossScale(SCALE, 3), skip_mode=skip_mode
    )
    ours = wrapped_run(tx, make_params(), 10, bad_steps)
    ref = reference_run(INNERS[inner](), make_params(), 10, bad_steps)
    flags = [step not in bad_steps for step in range(10)]
    expected_scales = reference_models.tensorflow_trajectory(flags, SCALE, 3)
    skips = 0
    for step, ((params, state), (ref_params, ref_state)) in enumerate(zip(ours, ref, strict=True)):
      chex.assert_trees_all_equal(params, ref_params)
      chex.assert_trees_all_equal(state.inner_state, ref_state)
      chex.assert_trees_all_equal_dtypes(state.inner_state, ref_state)
      self.assertEqual(float(state.loss_scale()), float(expected_scales[step][0]))
      self.assertEqual(int(state.loss_scale.counter), expected_scales[step][1])
      skips = 0 if flags[step] else skips + 1
      metrics = ols.metrics(state)
      self.assertEqual(bool(metrics["last_step_applied"]), flags[step])
      self.assertEqual(int(metrics["consecutive_skips"]), skips)
      self.assertEqual(int(metrics["total_skips"]), sum(not f for f in flags[: step + 1]))

  def test_clipping_sees_unscaled_gradients(self):
    # With a tiny clip norm the clipped update is grads / ||grads||: identical
    # for scaled and unscaled inputs. A large norm leaves unscaled grads alone
    # but would clip scaled ones, so compare against the unscaled reference.
    inner = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = ols.loss_scale_optimizer(inner(), ols.FixedLossScale(SCALE))
    params = make_params()
    state = tx.init(params)
    grads = jax.grad(lambda p: ols.get_scaled_loss(loss_fn(p, batch(0)), state))(params)
    updates, _ = tx.update(grads, state, params)
    true_grads = jax.grad(loss_fn)(params, batch(0))
    assert global_norm(true_grads) < 1.0 < global_norm(grads)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.negative, true_grads))


class SkipSemanticsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(skip_mode=["cond", "select"], kind=["nan", "inf", "-inf"])
  def test_skipped_step_leaves_inner_state_untouched(self, skip_mode, kind):
    inner = INNERS["adamw_schedule"]()
    tx = ols.loss_scale_optimizer(inner, skip_mode=skip_mode)
    params = make_params()
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params, batch(0))
    # One applied step first so the state is not all zeros.
    _, state = self.variant(tx.update)(grads, state, params)
    updates, new_state = self.variant(tx.update)(corrupt(grads, kind), state, params)
    applied_updates, _ = inner.update(grads, state.inner_state, params)

    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    chex.assert_trees_all_equal_dtypes(new_state.inner_state, state.inner_state)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, applied_updates)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, applied_updates))
    self.assertEqual(int(new_state.inner_state.count), 1)  # schedule did not advance
    self.assertFalse(bool(new_state.last_step_applied))
    self.assertEqual(float(new_state.loss_scale()), 2.0**14)

  @parameterized.parameters("cond", "select")
  def test_bf16_params_with_f32_gradients(self, skip_mode):
    tx = ols.loss_scale_optimizer(optax.adam(1e-2), skip_mode=skip_mode)
    params = make_params(jnp.bfloat16)
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    state = tx.init(params)
    step = jax.jit(tx.update)
    applied_updates, applied_state = jax.jit(optax.adam(1e-2).update)(
      grads, state.inner_state, params
    )

    scaled = jax.tree.map(lambda g: g * 2.0**15, grads)  # the default initial scale
    updates, skipped = step(corrupt(scaled, "nan"), state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, applied_updates)
    chex.assert_trees_all_equal_dtypes(skipped.inner_state, applied_state)
    # Values are the old ones: casting bf16 moments up to f32 is exact.
    chex.assert_trees_all_equal(
      jax.tree.map(lambda x: x.astype(jnp.float32), skipped.inner_state),
      jax.tree.map(lambda x: x.astype(jnp.float32), state.inner_state),
    )
    updates, applied = step(scaled, state, params)
    chex.assert_trees_all_equal((updates, applied.inner_state), (applied_updates, applied_state))
    # The state's types are now stable: the next step reuses the executable.
    step(scaled, applied, params)

  @parameterized.product(skip_mode=["cond", "select"], fused=[False, True])
  def test_a_scale_below_one_overflows_in_the_unscaling(self, skip_mode, fused):
    # 1/S = 2 turns a finite 3e38 into Inf: TensorFlow checks the unscaled
    # gradients, so the step is skipped although the scaled ones are finite.
    # (With min_loss_scale >= 1 the wrapper may check the scaled ones instead.)
    ls = ols.DynamicLossScale(0.5, min_loss_scale=0.25)
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ls, skip_mode=skip_mode)
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.array([3e38, 1.0], jnp.float32)}
    if fused:
      new_params, state = jax.jit(ols.apply_gradients, static_argnums=0)(
        tx, grads, tx.init(params), params
      )
      chex.assert_trees_all_equal(new_params, params)
    else:
      _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    self.assertFalse(bool(state.last_step_applied))
    self.assertEqual(float(state.loss_scale()), 0.25)
    # At S = 1 the same gradients are finite and applied.
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(1.0))
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    self.assertTrue(bool(state.last_step_applied))

  def test_a_subclass_with_its_own_update_sees_unscaled_gradients(self):
    seen = []

    class Recording(ols.DynamicLossScale):
      def update(self, grads, axis_name=None):
        seen.append(grads)
        return super().update(grads, axis_name)

    tx = ols.loss_scale_optimizer(optax.sgd(1.0), Recording(8.0))
    params = {"w": jnp.zeros(2)}
    tx.update({"w": jnp.full(2, 8.0)}, tx.init(params), params)
    chex.assert_trees_all_equal(seen, [{"w": jnp.ones(2)}])

  def test_fixed_loss_scale_never_skips(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), 8)
    params = make_params()
    state = tx.init(params)
    grads = corrupt(jax.tree.map(jnp.ones_like, params), "nan")
    updates, state = jax.jit(tx.update)(grads, state, params)
    self.assertTrue(np.isnan(np.asarray(updates["w"])).any())
    np.testing.assert_array_equal(updates["b"], -np.ones(4, np.float32) / 8)
    self.assertTrue(bool(ols.metrics(state)["last_step_applied"]))
    self.assertEqual(float(ols.metrics(state)["loss_scale"]), 8.0)

  def test_none_and_integer_gradient_leaves(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(4.0))
    params = {"w": jnp.ones(2), "frozen": None}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.full(2, 8.0), "frozen": None}, state, params)
    np.testing.assert_array_equal(updates["w"], [-2.0, -2.0])
    self.assertIsNone(updates["frozen"])
    _, state = jax.jit(tx.update)({"w": jnp.full(2, jnp.nan), "frozen": None}, state, params)
    self.assertFalse(bool(state.last_step_applied))

  def test_all_none_gradients_are_finite(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(4.0, 1))
    state = tx.init({"a": None})
    updates, state = tx.update({"a": None}, state)
    self.assertEqual(updates, {"a": None})
    self.assertTrue(bool(state.last_step_applied))
    self.assertEqual(float(state.loss_scale()), 8.0)


class TransformationsTest(chex.TestCase):
  def test_one_trace_per_gradient_structure(self):
    traces = []
    tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale(4.0, 2))

    @jax.jit
    def step(grads, state, params):
      traces.append(1)
      return tx.update(grads, state, params)

    params = make_params()
    state = tx.init(params)
    for i in range(6):
      fill = jnp.nan if i % 3 == 1 else 1.0
      grads = jax.tree.map(lambda p, fill=fill: jnp.full_like(p, fill), params)
      _, state = step(grads, state, params)
    self.assertLen(traces, 1)

  def test_donated_state(self):
    tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(SCALE, 2))

    def step(params, state, i):
      grads = jax.grad(lambda p: ols.get_scaled_loss(loss_fn(p, batch(i)), state))(params)
      grads = jax.lax.cond(i == 2, lambda g: corrupt(g, "inf"), lambda g: g, grads)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    donating = jax.jit(step, donate_argnums=(0, 1))
    plain = jax.jit(step)
    params_a, params_b = make_params(), make_params()
    state_a, state_b = tx.init(params_a), tx.init(params_b)
    for i in range(5):
      # The full-size buffers are donated: parameters and Adam's moments.
      old_leaves = jax.tree.leaves((params_a, state_a.inner_state[0].mu, state_a.inner_state[0].nu))
      params_a, state_a = donating(params_a, state_a, i)
      params_b, state_b = plain(params_b, state_b, i)
      self.assertTrue(all(leaf.is_deleted() for leaf in old_leaves))
    chex.assert_trees_all_equal((params_a, state_a), (params_b, state_b))
    # init hands out fresh buffers: the prototype survived the donations.
    self.assertEqual(float(tx.init(make_params()).loss_scale()), SCALE)

  def test_lax_scan_training_loop(self):
    bad_steps = {1, 4}
    tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(SCALE, 2))
    expected = wrapped_run(tx, make_params(), 8, bad_steps)[-1]

    def body(carry, step):
      params, state = carry
      grads = jax.grad(lambda p: ols.get_scaled_loss(loss_fn(p, batch(step)), state))(params)
      bad = jnp.isin(step, jnp.array(sorted(bad_steps)))
      grads = jax.lax.cond(bad, lambda g: corrupt(g, "nan"), lambda g: g, grads)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), ols.metrics(state)["loss_scale"]

    params = make_params()
    (params, state), scales = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), jnp.arange(8.0)))(
      params, tx.init(params)
    )
    chex.assert_trees_all_equal((params, state), expected)
    flags = [s not in bad_steps for s in range(8)]
    expected_scales = [s for s, _ in reference_models.tensorflow_trajectory(flags, SCALE, 2)]
    np.testing.assert_array_equal(scales, expected_scales)

  def test_extra_args_reach_the_inner_transformation(self):
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
    tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(2.0))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    grads = {"w": jnp.full(2, 2.0)}
    updates, state = tx.update(grads, state, params, value=jnp.float32(1.0))
    updates, state = tx.update(grads, state, params, value=jnp.float32(2.0))  # plateau
    updates, state = tx.update(grads, state, params, value=jnp.float32(3.0))
    np.testing.assert_array_equal(updates["w"], [-0.5, -0.5])


class CompositionTest(chex.TestCase):
  def test_multisteps_wrapping_the_wrapper_is_refused_at_init(self):
    tx = optax.MultiSteps(ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(4.0)), 2)
    with self.assertRaisesRegex(ValueError, r"inside optax.MultiSteps.*gradient_transformation"):
      tx.init({"w": jnp.zeros(2)})
    # A fixed scale never skips, so inside MultiSteps it is a plain transformation.
    fixed = optax.MultiSteps(ols.loss_scale_optimizer(optax.sgd(1.0), 4.0), 2)
    params = {"w": jnp.zeros(2)}
    state = fixed.init(params)
    for grads in ({"w": jnp.full(2, 4.0)}, {"w": jnp.full(2, 12.0)}):
      updates, state = fixed.update(grads, state, params)
    # The mean scaled gradient 8, unscaled by 4, gives an SGD update of -2.
    np.testing.assert_array_equal(updates["w"], [-2.0, -2.0])

  def test_wrapper_around_multisteps(self):
    inner = optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
    tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(4.0))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    _, state = step({"w": jnp.full(2, 4.0)}, state, params)
    _, state = step({"w": jnp.full(2, jnp.nan)}, state, params)  # skipped micro-step
    self.assertEqual(int(state.inner_state.mini_step), 1)
    updates, state = step({"w": jnp.full(2, 6.0)}, state, params)  # unscaled by 2 now
    np.testing.assert_array_equal(updates["w"], [-2.0, -2.0])  # mean of 1 and 3

  def test_wrapper_around_multisteps_recovers_after_an_overflow(self):
    inner = optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
    tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(8.0))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    _, state = step({"w": jnp.array([jnp.inf, 1.0])}, state, params)  # scale 8 -> 4
    emitted = []
    for _ in range(4):  # finite micro-batches of scaled gradient 4 (true gradient 1)
      updates, state = step({"w": jnp.full(2, 4.0)}, state, params)
      emitted.append(np.asarray(updates["w"]))
    np.testing.assert_array_equal(emitted, [[0, 0], [-1, -1], [0, 0], [-1, -1]])
    self.assertEqual(float(ols.get_loss_scale(state)()), 4.0)
    self.assertEqual(int(ols.metrics(state)["total_skips"]), 1)

  def test_multisteps_object_gets_a_helpful_type_error(self):
    with pytest.raises(TypeError, match="gradient_transformation"):
      ols.loss_scale_optimizer(optax.MultiSteps(optax.sgd(1.0), 2))

  def test_inside_chain_named_chain_and_inject_hyperparams(self):
    params = {"w": jnp.ones(3)}
    lso = lambda: ols.loss_scale_optimizer(optax.adam(1e-3), 64)
    for tx in (
      optax.chain(optax.identity(), lso()),
      optax.named_chain(("scaled", lso()), ("decay", optax.add_decayed_weights(1e-4))),
      optax.inject_hyperparams(
        lambda learning_rate: ols.loss_scale_optimizer(optax.sgd(learning_rate), 64)
      )(learning_rate=0.1),
    ):
      state = tx.init(params)
      self.assertEqual(float(ols.get_loss_scale(state)()), 64.0)
      _, state = jax.jit(tx.update)({"w": jnp.full(3, 64.0)}, state, params)
      self.assertEqual(float(ols.get_scaled_loss(jnp.float32(2.0), state)), 128.0)
      chex.assert_trees_all_equal(
        ols.get_unscaled_gradients({"w": jnp.full(3, 64.0), "n": None}, state),
        {"w": jnp.ones(3), "n": None},
      )


class ConstructionTest(parameterized.TestCase):
  def test_keras_equivalent_forms_give_equal_configs(self):
    make = ols.loss_scale_optimizer
    sgd = optax.sgd(0.1)
    self.assertEqual(make(sgd, "dynamic").get_config(), make(sgd).get_config())
    self.assertEqual(make(sgd).get_config(), make(sgd, dynamic=True).get_config())
    self.assertEqual(
      make(sgd, 123).get_config(), make(sgd, dynamic=False, initial_scale=123).get_config()
    )
    self.assertEqual(
      make(sgd, ols.DynamicLossScale(2048, 500)).get_config(),
      make(sgd, initial_scale=2048, dynamic_growth_steps=500).get_config(),
    )
    self.assertNotEqual(make(sgd, 123).get_config(), make(sgd).get_config())

  def test_keras_attributes(self):
    sgd = optax.sgd(0.1)
    tx = ols.loss_scale_optimizer(sgd, initial_scale=2048, dynamic_growth_steps=500)
    self.assertIs(tx.inner_optimizer, sgd)
    self.assertTrue(tx.dynamic)
    self.assertEqual(tx.initial_scale, 2048.0)
    self.assertEqual(tx.dynamic_growth_steps, 500)
    self.assertEqual(tx.skip_mode, "cond")
    fixed = ols.loss_scale_optimizer(sgd, 123)
    self.assertFalse(fixed.dynamic)
    self.assertEqual(fixed.initial_scale, 123.0)
    self.assertIsNone(fixed.dynamic_growth_steps)
    self.assertIsInstance(tx, optax.GradientTransformationExtraArgs)
    init, _ = tx  # still the pair optax unpacks
    self.assertIs(init, tx.init)
    with self.assertRaises(AttributeError):
      tx.dynamic = False
    # Rebuilt from its two fields (tree_map, _replace), it keeps its settings.
    for rebuilt in (jax.tree.map(lambda f: f, tx), tx._replace(init=tx.init)):
      self.assertIsInstance(rebuilt, ols.LossScaleOptimizer)
      self.assertEqual(rebuilt.get_config(), tx.get_config())

  def test_config_is_json(self):
    import json

    tx = ols.loss_scale_optimizer(optax.sgd(0.1), axis_name=("data", "model"))
    config = tx.get_config()
    self.assertEqual(json.loads(json.dumps(config, allow_nan=False)), config)
    self.assertEqual(config["axis_name"], ["data", "model"])

  @parameterized.parameters(
    (dict(dynamic=False), ValueError, "initial_scale"),
    (
      dict(dynamic=False, initial_scale=8, dynamic_growth_steps=10),
      ValueError,
      "dynamic_growth_steps",
    ),
    (dict(dynamic="yes"), TypeError, "dynamic"),
    (dict(loss_scale=5, dynamic=True), ValueError, "not both"),
    (dict(loss_scale="static"), ValueError, "accepted"),
    (dict(loss_scale=0.5), ValueError, "loss_scale_value"),
    (dict(skip_mode="where"), ValueError, "skip_mode"),
    (dict(axis_name=()), TypeError, "axis_name"),
    (dict(initial_scale=-1.0), ValueError, "^initial_scale must"),
    (dict(dynamic_growth_steps=0), ValueError, "^dynamic_growth_steps must"),
    (dict(dynamic=False, initial_scale=0.5), ValueError, "^initial_scale must"),
  )
  def test_errors(self, kwargs, error, match):
    with self.assertRaisesRegex(error, match):
      ols.loss_scale_optimizer(optax.sgd(0.1), **kwargs)

  def test_inner_must_be_a_gradient_transformation(self):
    with self.assertRaisesRegex(TypeError, "GradientTransformation"):
      ols.loss_scale_optimizer(lambda g: g)


class StateAccessTest(parameterized.TestCase):
  def test_errors_for_none_or_several_states(self):
    with self.assertRaisesRegex(ValueError, "No LossScaleOptimizerState"):
      ols.get_loss_scale(optax.adam(1e-3).init({"w": jnp.ones(2)}))
    inner = ols.loss_scale_optimizer(optax.sgd(1.0))
    # States built side by side (never one optimizer: that is refused at init).
    twice = (inner.init({"w": jnp.ones(2)}), inner.init({"w": jnp.ones(2)}))
    with self.assertRaisesRegex(ValueError, r"Found 2 .*\[0\], \[1\]"):
      ols.metrics(twice)

  def test_loss_scale_passes_through(self):
    ls = ols.DynamicLossScale(8.0)
    self.assertIs(ols.get_loss_scale(ls), ls)

  def test_metrics_are_jittable_scalars(self):
    state = ols.loss_scale_optimizer(optax.sgd(1.0)).init({"w": jnp.ones(2)})
    metrics = jax.jit(ols.metrics)(state)
    self.assertEqual(
      {k: (v.shape, v.dtype) for k, v in metrics.items()},
      {
        "loss_scale": ((), jnp.float32),
        "last_step_applied": ((), jnp.bool_),
        "consecutive_skips": ((), jnp.int32),
        "total_skips": ((), jnp.int32),
        "retries": ((), jnp.int32),
        "total_retries": ((), jnp.int32),
      },
    )
