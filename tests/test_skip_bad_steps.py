"""Tests for skip_bad_steps: fault-injected runs against an independent reference."""

from __future__ import annotations

import math

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

WARMUP = 4
THRESHOLD = 6.0
DECAY = 0.9
MIN_STD = 0.05

INNERS = {
  "sgd": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


def make_params():
  return {
    "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4),
    "b": jnp.array([0.5, -0.25, 0.125, 1.0], jnp.float32),
  }


def make_grads(step, fault=None):
  """Gradients whose norm wobbles by a few percent; `fault` injects a bad step."""
  base = make_params()
  wobble = 1.0 + 0.03 * math.sin(1.7 * step)
  grads = jax.tree.map(lambda p: (p + 0.1 * step % 1) * wobble, base)
  if fault == "nan":
    grads = {**grads, "w": grads["w"].at[1, 2].set(jnp.nan)}
  elif fault == "inf":
    grads = {**grads, "b": grads["b"].at[0].set(-jnp.inf)}
  elif fault == "spike":
    grads = jax.tree.map(lambda g: g * 100.0, grads)
  return grads


class ReferenceStatistic:
  """The documented running mean/variance and z-score, in float64 Python."""

  def __init__(self):
    self.count, self.mean, self.var = 0, 0.0, 0.0

  def zscore(self, x, relative):
    floor = MIN_STD * abs(self.mean) if relative else MIN_STD
    std = max(math.sqrt(self.var), floor)
    return (x - self.mean) / std if std > 0 else 0.0

  def feed(self, x):
    self.count += 1
    alpha = max(1.0 - DECAY, 1.0 / self.count)
    delta = x - self.mean
    self.mean += alpha * delta
    self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)

  def rebase(self, x):
    self.count += 1
    self.mean = x


def reference_decisions(values, max_streak=10, on_streak="accept", relative=False):
  """'apply', 'nonfinite', 'spike' or 'rebase' for each watched value (None: non-finite)."""
  stat, streak, out = ReferenceStatistic(), 0, []
  for v in values:
    if v is None or not math.isfinite(v):
      out.append("nonfinite")
      continue
    x = v if relative else math.log(v)
    spike = stat.count >= WARMUP and stat.zscore(x, relative) > THRESHOLD
    if spike and streak >= max_streak and on_streak == "accept":
      stat.rebase(x)
      streak = 0
      out.append("rebase")
    elif spike:
      streak += 1
      out.append("spike")
    else:
      stat.feed(x)
      streak = 0
      out.append("apply")
  return out, stat


def global_norm(grads):
  return math.sqrt(
    sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in jax.tree.leaves(grads))
  )


FAULTS = {2: "nan", 6: "spike", 7: "inf", 9: "spike", 10: "spike"}
STEPS = 13


def make_tx(inner, **kw):
  kw = {
    "spike_threshold": THRESHOLD,
    "warmup_steps": WARMUP,
    "ema_decay": DECAY,
    "min_std": MIN_STD,
    **kw,
  }
  return ols.skip_bad_steps(inner, **kw)


class SkipBadStepsTest(chex.TestCase, parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(inner=tuple(INNERS), skip_mode=("cond", "select"))
  def test_matches_bare_inner_on_finite_steps_and_skips_the_rest(self, inner, skip_mode):
    tx = make_tx(INNERS[inner](), skip_mode=skip_mode)
    bare = INNERS[inner]()
    update = self.variant(tx.update)
    # The reference runs as the inner update runs: `lax.cond` compiles its
    # branches even without jit, and eager op-by-op arithmetic may round
    # differently from compiled arithmetic.
    bare_update = jax.jit(bare.update) if skip_mode == "cond" else self.variant(bare.update)
    params = make_params()
    state, bare_state = tx.init(params), bare.init(params)
    grads = [make_grads(t, FAULTS.get(t)) for t in range(STEPS)]
    norms = [
      None if FAULTS.get(t) in ("nan", "inf") else global_norm(g) for t, g in enumerate(grads)
    ]
    expected, ref_stat = reference_decisions(norms)
    assert expected.count("spike") == 3 and expected.count("nonfinite") == 2, expected
    for t, g in enumerate(grads):
      old_inner = state.inner_state
      updates, state = update(g, state, params)
      if expected[t] == "apply":
        want, bare_state = bare_update(g, bare_state, params)
        chex.assert_trees_all_equal(updates, want)
        chex.assert_trees_all_equal(state.inner_state, bare_state)
        params = optax.apply_updates(params, updates)
      else:
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
        chex.assert_trees_all_equal(state.inner_state, old_inner)  # bit-identical
        assert jax.tree.map(lambda x: x.dtype, state.inner_state) == jax.tree.map(
          lambda x: x.dtype, old_inner
        )
      assert bool(state.last_step_applied) == (expected[t] == "apply"), t
    self.assertEqual(int(state.nonfinite_skips), 2)
    self.assertEqual(int(state.spike_skips), 3)
    self.assertEqual(int(state.total_skips), 5)
    self.assertEqual(int(state.spike_rebases), 0)
    self.assertEqual(int(state.grad_norm.count), ref_stat.count)
    np.testing.assert_allclose(float(state.grad_norm.mean), ref_stat.mean, rtol=1e-5)
    np.testing.assert_allclose(float(state.grad_norm.var), ref_stat.var, rtol=1e-3)

  @chex.variants(with_jit=True, without_jit=True)
  def test_without_spike_threshold_only_nonfinite_steps_are_skipped(self):
    tx = ols.skip_bad_steps(optax.adam(1e-2))
    update = self.variant(tx.update)
    params = make_params()
    state = tx.init(params)
    self.assertIsNone(state.grad_norm)
    for t in range(STEPS):
      _, state = update(make_grads(t, FAULTS.get(t)), state, params)
    self.assertEqual(int(state.nonfinite_skips), 2)
    self.assertEqual(int(state.spike_skips), 0)
    self.assertEqual(int(state.inner_state[0].count), STEPS - 2)
    self.assertNotIn("grad_norm", ols.metrics(state))

  @chex.variants(with_jit=True, without_jit=True)
  def test_apply_gradients_is_fused_and_returns_params_untouched_on_skips(self):
    tx = make_tx(optax.adam(1e-2))
    step = self.variant(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    params = {**make_params(), "z": jnp.array([-0.0, 0.0])}  # -0.0 + 0.0 would be +0.0
    state = tx.init(params)
    ref_params, ref_state = params, tx.init(params)
    ref_update, ref_apply = jax.jit(tx.update), jax.jit(optax.apply_updates)
    for t in range(STEPS):
      g = {**make_grads(t, FAULTS.get(t)), "z": jnp.zeros(2)}
      new_params, state = step(g, state, params)
      updates, ref_state = ref_update(g, ref_state, ref_params)
      ref_params = ref_apply(ref_params, updates)
      if not bool(state.last_step_applied):
        chex.assert_trees_all_equal(new_params, params)
        assert np.signbit(new_params["z"][0])
      chex.assert_trees_all_close(new_params, ref_params, rtol=1e-6, atol=0)
      params = new_params
    self.assertEqual(int(ols.metrics(state)["total_skips"]), 5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_loss_spikes_and_nonfinite_losses_are_skipped(self):
    tx = make_tx(optax.sgd(0.1), monitor="loss")
    update = self.variant(lambda g, s, p, loss: tx.update(g, s, p, loss=loss))
    params = make_params()
    state = tx.init(params)
    losses = [1.0, 0.98, 1.01, 0.97, 0.99, 50.0, 0.96, float("nan"), 0.95]
    expected, _ = reference_decisions(losses, relative=True)
    assert expected.count("spike") == 1, expected
    for t, loss in enumerate(losses):
      _, state = update(make_grads(t), state, params, jnp.float32(loss))
      assert bool(state.last_step_applied) == (expected[t] == "apply"), t
    m = ols.metrics(state)
    self.assertEqual((int(m["spike_skips"]), int(m["nonfinite_skips"])), (1, 1))
    self.assertEqual(float(m["loss"]), np.float32(0.95))
    self.assertNotIn("grad_norm", m)

  def test_a_zero_gradient_is_applied_without_feeding_the_statistic(self):
    tx = make_tx(optax.sgd(0.1))
    params = make_params()
    state = tx.init(params)
    for t in range(WARMUP):
      _, state = tx.update(make_grads(t), state, params)
    before = state.grad_norm
    zeros = jax.tree.map(jnp.zeros_like, params)
    _, state = tx.update(zeros, state, params)
    assert bool(state.last_step_applied) and float(state.grad_norm.last) == 0.0
    chex.assert_trees_all_equal(state.grad_norm._replace(last=0.0), before._replace(last=0.0))
    _, state = tx.update(make_grads(WARMUP), state, params)  # still judged as before
    assert bool(state.last_step_applied) and np.isfinite(float(state.grad_norm.mean))

  def test_missing_or_bad_loss_is_a_clear_error(self):
    tx = make_tx(optax.sgd(0.1), monitor=("grad_norm", "loss"))
    params = make_params()
    state = tx.init(params)
    with pytest.raises(ValueError, match="loss=loss"):
      tx.update(make_grads(0), state, params)
    with pytest.raises(ValueError, match="real floating scalar"):
      tx.update(make_grads(0), state, params, loss=jnp.ones(2))

  @parameterized.parameters(1, 3)
  def test_a_spike_streak_is_accepted_and_rebased(self, max_streak):
    tx = make_tx(optax.sgd(0.1), max_consecutive_spike_skips=max_streak)
    update = jax.jit(tx.update)
    params = make_params()
    state = tx.init(params)
    # A change of regime: from step 6 on, every gradient is 100 times larger.
    grads = [make_grads(t, "spike" if t >= 6 else None) for t in range(16)]
    norms = [global_norm(g) for g in grads]
    expected, ref = reference_decisions(norms, max_streak=max_streak)
    assert expected[6 : 7 + max_streak] == ["spike"] * max_streak + ["rebase"], expected
    assert all(e == "apply" for e in expected[7 + max_streak :]), expected
    for t, g in enumerate(grads):
      _, state = update(g, state, params)
      assert bool(state.last_step_applied) == (expected[t] != "spike"), t
    m = ols.metrics(state)
    self.assertEqual(int(m["spike_skips"]), max_streak)
    self.assertEqual(int(m["spike_rebases"]), 1)
    self.assertEqual(int(m["consecutive_spike_skips"]), 0)
    np.testing.assert_allclose(float(m["grad_norm_mean"]), math.exp(ref.mean), rtol=1e-5)

  def test_a_spike_streak_raises_with_a_report_when_asked(self):
    tx = make_tx(optax.sgd(0.1), max_consecutive_spike_skips=2, on_spike_streak="raise")
    update = jax.jit(tx.update)
    params = make_params()
    state = tx.init(params)
    for t in range(8):
      _, state = update(make_grads(t, "spike" if t >= 6 else None), state, params)
    self.assertEqual(int(state.spike_skips), 2)
    with pytest.raises(Exception, match="OverflowGuardError") as info:
      jax.block_until_ready(update(make_grads(8, "spike"), state, params))
    message = str(info.value)
    assert "max_consecutive_spike_skips=2" in message and "grad_norm" in message
    assert "['w']" in message  # the gradient report names the leaves

  def test_max_consecutive_skips_raises_on_a_nonfinite_streak(self):
    tx = ols.skip_bad_steps(optax.sgd(0.1), max_consecutive_skips=2)
    params = make_params()
    state = tx.init(params)
    for t in range(2):
      _, state = tx.update(make_grads(t, "nan"), state, params)
    self.assertEqual(int(state.consecutive_skips), 2)
    with pytest.raises(Exception, match="max_consecutive_skips=2"):
      jax.block_until_ready(tx.update(make_grads(2, "nan"), state, params))

  @parameterized.named_parameters(
    ("inner", dict(inner=optax.sgd(0.1).init), TypeError, "inner must be"),
    ("threshold", dict(spike_threshold=0.0), ValueError, "spike_threshold"),
    ("threshold_str", dict(spike_threshold="6"), ValueError, "spike_threshold"),
    ("monitor", dict(spike_threshold=6.0, monitor="norm"), ValueError, "monitor"),
    ("monitor_repeat", dict(monitor=("loss", "loss")), ValueError, "monitor"),
    ("warmup", dict(warmup_steps=0), ValueError, "warmup_steps"),
    ("decay", dict(ema_decay=1.0), ValueError, "ema_decay"),
    ("min_std", dict(min_std=-1.0), ValueError, "min_std"),
    ("streak", dict(max_consecutive_spike_skips=0), ValueError, "max_consecutive_spike_skips"),
    ("on_streak", dict(on_spike_streak="ignore"), ValueError, "on_spike_streak"),
    ("max_skips", dict(max_consecutive_skips=0), ValueError, "max_consecutive_skips"),
    ("skip_mode", dict(skip_mode="where"), ValueError, "skip_mode"),
    ("axis_name", dict(axis_name=[]), TypeError, "axis_name"),
  )
  def test_bad_arguments_are_rejected_at_construction(self, kwargs, error, match):
    kwargs = {"inner": optax.sgd(0.1), **kwargs}
    with pytest.raises(error, match=match):
      ols.skip_bad_steps(**kwargs)

  def test_get_config_and_inner_optimizer(self):
    inner = optax.sgd(0.1)
    tx = ols.skip_bad_steps(inner, spike_threshold=5, axis_name=("a", "b"))
    assert tx.inner_optimizer is inner
    config = tx.get_config()
    assert config["spike_threshold"] == 5.0 and config["monitor"] == ["grad_norm"]
    assert config["axis_name"] == ["a", "b"] and config["skip_mode"] == "auto"


class CompositionTest(chex.TestCase):
  """loss_scale_optimizer(skip_bad_steps(inner)): the one supported order."""

  def test_overflow_is_the_loss_scales_and_spikes_are_the_guards(self):
    scale = 2.0**10
    ls = ols.DynamicLossScale(scale, increment_period=1000)
    tx = ols.loss_scale_optimizer(make_tx(optax.adam(1e-2)), ls)
    bare = optax.adam(1e-2)
    params = make_params()
    state, bare_state = tx.init(params), bare.init(params)
    update, bare_update = jax.jit(tx.update), jax.jit(bare.update)
    faults = {3: "inf", 6: "spike", 8: "nan"}
    for t in range(10):
      current = float(ols.get_loss_scale(state)())
      unscaled = make_grads(t, faults.get(t))
      scaled = jax.tree.map(lambda g, s=current: g * s, unscaled)
      old_inner = state.inner_state.inner_state
      updates, state = update(scaled, state, params)
      if t in faults:
        chex.assert_trees_all_equal(state.inner_state.inner_state, old_inner)
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
      else:
        want, bare_state = bare_update(unscaled, bare_state, params)
        chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=0)
        params = optax.apply_updates(params, updates)
    m = ols.metrics(state)
    # The overflows back the scale off and never reach the spike guard.
    self.assertEqual(int(m["overflow_skips"]), 2)
    self.assertEqual(int(m["nonfinite_skips"]), 0)
    self.assertEqual(int(m["spike_skips"]), 1)
    self.assertEqual(int(m["total_skips"]), 3)
    self.assertEqual(float(m["loss_scale"]), scale / 4)
    assert bool(m["last_step_applied"])
    assert {"grad_norm", "grad_norm_mean", "grad_norm_log_std", "loss_scale"} <= set(m)

  def test_spike_skip_inside_the_loss_scale_shows_in_last_step_applied(self):
    tx = ols.loss_scale_optimizer(make_tx(optax.sgd(0.1)), 1.0)
    params = make_params()
    state = tx.init(params)
    for t in range(7):
      _, state = tx.update(make_grads(t, "spike" if t == 6 else None), state, params)
    m = ols.metrics(state)
    assert not bool(m["last_step_applied"]) and int(m["total_skips"]) == 1

  def test_fused_step_leaves_params_bit_identical_on_a_spike_skip(self):
    tx = ols.loss_scale_optimizer(make_tx(optax.sgd(0.1)), 1.0)
    params = {**make_params(), "z": jnp.array([-0.0])}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    for t in range(7):
      g = {**make_grads(t, "spike" if t == 6 else None), "z": jnp.zeros(1)}
      new_params, state = step(g, state, params)
      if t < 6:
        params = new_params
    assert not bool(ols.metrics(state)["last_step_applied"])
    chex.assert_trees_all_equal(new_params, params)
    assert np.signbit(new_params["z"][0])  # returned as it was, not p + 0

  def test_the_other_order_is_rejected(self):
    with pytest.raises(ValueError, match="inside the loss-scale wrapper"):
      ols.skip_bad_steps(ols.loss_scale_optimizer(optax.sgd(0.1)))
    chained = ols.skip_bad_steps(optax.chain(ols.loss_scale_optimizer(optax.sgd(0.1))))
    with pytest.raises(ValueError, match="must go inside the loss-scale wrapper"):
      chained.init(make_params())

  def test_metrics_without_either_state_is_a_clear_error(self):
    with pytest.raises(ValueError, match="skip_bad_steps"):
      ols.metrics(optax.sgd(0.1).init(make_params()))
