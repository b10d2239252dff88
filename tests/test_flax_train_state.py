"""Tests for `optax_lossscale.flax.TrainState` with fault-injected training runs."""

from __future__ import annotations

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytest.importorskip("flax")
from flax import linen as nn

from optax_lossscale.flax import TrainState

INITIAL_SCALE = 2.0**6
PERIOD = 3
NAN_STEPS = {1: np.nan, 4: np.inf, 5: -np.inf}  # step -> value put into the batch
STEPS = 9


MODEL = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(1)])


def _batches(steps=STEPS, faults=NAN_STEPS):
  keys = jax.random.split(jax.random.PRNGKey(1), steps)
  out = []
  for i, key in enumerate(keys):
    x = jax.random.normal(key, (4, 3))
    if i in faults:
      x = x.at[0, 1].set(faults[i])
    out.append((x, jnp.sum(x, axis=1, keepdims=True)))
  return out


def _loss(params, x, y):
  return jnp.mean((MODEL.apply({"params": params}, x).astype(jnp.float32) - y) ** 2)


def _init_params():
  return MODEL.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"]


def _tx(skip_mode="cond"):
  ls = ols.DynamicLossScale(initial_loss_scale=INITIAL_SCALE, increment_period=PERIOD)
  return ols.loss_scale_optimizer(optax.adam(1e-2), ls, skip_mode=skip_mode)


def _train_step(state, x, y):
  loss, grads = ols.value_and_grad(_loss)(state, state.params, x, y)
  return state.apply_gradients(grads=grads), loss


def _reference_run(batches):
  """Plain optax adam applied only on finite steps; the scale tracked in Python."""
  params = _init_params()
  inner = optax.adam(1e-2)
  inner_state = inner.init(params)
  scale, counter, skips, applied = INITIAL_SCALE, 0, 0, 0
  scaled_grad = jax.jit(jax.grad(lambda p, x, y, s: _loss(p, x, y) * s))
  for x, y in batches:
    grads = jax.tree.map(lambda g, s=scale: g / jnp.float32(s), scaled_grad(params, x, y, scale))
    if all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)):
      updates, inner_state = inner.update(grads, inner_state, params)
      params = optax.apply_updates(params, updates)
      applied += 1
      counter += 1
      if counter >= PERIOD:
        scale, counter = scale * 2, 0
    else:
      scale, counter, skips = max(scale / 2, 1.0), 0, skips + 1
  return params, inner_state, scale, counter, skips, applied


class TrainStateTest(chex.TestCase):
  @parameterized.parameters("cond", "select")
  def test_fault_injected_run_equals_reference(self, skip_mode):
    batches = _batches()
    state = TrainState.create(apply_fn=MODEL.apply, params=_init_params(), tx=_tx(skip_mode))
    step = jax.jit(_train_step)
    for x, y in batches:
      state, _ = step(state, x, y)
    params, inner_state, scale, counter, skips, applied = _reference_run(batches)
    # Two differently compiled programs: equal up to float32 rounding; the
    # counts, the scale and the step are exact.
    chex.assert_trees_all_close(state.params, params, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(state.opt_state.inner_state, inner_state, rtol=1e-5, atol=1e-9)
    self.assertEqual(int(state.opt_state.inner_state[0].count), applied)
    self.assertEqual(float(state.loss_scale()), scale)
    self.assertEqual(int(state.loss_scale.counter), counter)
    self.assertEqual(int(state.step), applied)
    self.assertEqual(int(ols.metrics(state)["total_skips"]), skips)
    self.assertEqual(skips, len(NAN_STEPS))

  @chex.variants(with_jit=True)
  def test_skipped_step_leaves_params_inner_state_and_step_untouched(self):
    state = TrainState.create(apply_fn=MODEL.apply, params=_init_params(), tx=_tx())
    (x, y), *_ = _batches(1, {})
    state, _ = self.variant(_train_step)(state, x, y)  # one applied step
    bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), state.params)
    new = self.variant(lambda s, g: s.apply_gradients(grads=g))(state, bad)
    chex.assert_trees_all_equal(new.params, state.params)
    chex.assert_trees_all_equal(new.opt_state.inner_state, state.opt_state.inner_state)
    chex.assert_trees_all_equal(new.step, state.step)
    self.assertEqual(float(new.loss_scale()), INITIAL_SCALE / 2)
    m = ols.metrics(new)
    self.assertFalse(bool(m["last_step_applied"]))
    self.assertEqual((int(m["consecutive_skips"]), int(m["total_skips"])), (1, 1))

  # The wrapper as the whole tx takes the fused `apply_gradients` path; inside
  # a chain, TrainState applies the updates itself.
  @parameterized.named_parameters(
    ("wrapper", _tx), ("chain", lambda: optax.chain(optax.identity(), _tx()))
  )
  def test_skip_keeps_a_minus_zero_param(self, make_tx):
    # `p + 0.0` would turn -0.0 into +0.0; a skipped step must not touch it.
    params = {"w": jnp.array([-0.0, 1.0])}
    state = TrainState.create(apply_fn=None, params=params, tx=make_tx())
    new = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 0.0])})
    np.testing.assert_array_equal(np.signbit(new.params["w"]), [True, False])
    self.assertEqual(int(new.step), 0)
    new = new.apply_gradients(grads={"w": jnp.array([INITIAL_SCALE, 0.0])})
    self.assertEqual(int(new.step), 1)
    self.assertLess(float(new.params["w"][0]), 0.0)

  def test_step_is_an_int32_array_from_create(self):
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=_tx())
    chex.assert_trees_all_equal(state.step, jnp.zeros((), jnp.int32))
    new = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.ones(2)}))(state)
    chex.assert_trees_all_equal(new.step, jnp.ones((), jnp.int32))

  def test_loss_scale_and_metrics_accept_the_train_state(self):
    tx = optax.chain(optax.clip_by_global_norm(1.0), _tx())
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    self.assertEqual(state.loss_scale, ols.get_loss_scale(state))
    self.assertEqual(float(state.loss_scale()), INITIAL_SCALE)
    self.assertEqual(set(ols.metrics(state)), set(ols.metrics(state.opt_state)))

  def test_fixed_scale_never_skips_and_step_always_advances(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), 4.0)
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    state = state.apply_gradients(grads={"w": jnp.array([4.0, jnp.nan])})
    self.assertEqual(int(state.step), 1)
    # TensorFlow semantics: a fixed scale applies even a NaN update.
    np.testing.assert_array_equal(state.params["w"], [np.float32(1) - np.float32(0.1), np.nan])

  def test_create_requires_a_loss_scale_optimizer(self):
    with self.assertRaisesRegex(ValueError, "tx must contain exactly one"):
      TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.adam(1e-3))

  def test_fp8_overwrite_with_gradient_needs_the_wrapper_itself(self):
    # (Handled by the wrapper itself: tests/test_fp8.py.) A chain around it could
    # not write the fp8 metadata exactly, so it is refused.
    params = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"s": jnp.ones(1)}}
    with self.assertRaisesRegex(ValueError, "overwrite with gradient"):
      TrainState.create(apply_fn=None, params=params, tx=optax.chain(_tx()))

  @pytest.mark.filterwarnings("ignore")
  def test_bf16_params_with_f32_grads_and_cond(self):
    # bf16 master params, f32 gradients: adam's moments turn f32 after the first
    # update, so the skip branch must cast the old state to match.
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _init_params())
    state = TrainState.create(apply_fn=MODEL.apply, params=params, tx=_tx("cond"))

    @jax.jit
    def step(state, x, y):
      f32 = lambda p: jax.tree.map(lambda a: a.astype(jnp.float32), p)
      _, grads = ols.value_and_grad(lambda p: _loss(f32(p), x, y))(state, state.params)
      grads = f32(grads)
      return state.apply_gradients(grads=grads)

    for i, (x, y) in enumerate(_batches(4, {2: np.nan})):
      before = state
      state = step(state, x, y)
      chex.assert_trees_all_equal_dtypes(state.params, params)
      if i == 2:
        chex.assert_trees_all_equal(state.params, before.params)
        chex.assert_trees_all_equal(state.opt_state.inner_state, before.opt_state.inner_state)
      else:
        kernel = lambda s: s.params["layers_0"]["kernel"]
        self.assertTrue(bool(jnp.any(kernel(state) != kernel(before))))
    self.assertEqual(int(state.step), 3)
    self.assertEqual(int(ols.metrics(state)["total_skips"]), 1)
