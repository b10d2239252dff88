"""Errors that say what to do, and guards and checks that agree (issue 17, items 10-11)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

PARAMS = {"w": jnp.ones(2), "b": jnp.zeros(3)}


def grads_of(value, w=(1.0, 1.0)):
  return {"w": jnp.asarray(w, jnp.float32), "b": jnp.full(3, value, jnp.float32)}


class WrongStateTest(chex.TestCase):
  def test_the_inner_optimizer_state_instead_of_the_wrappers_is_named(self):
    for tx, expected in (
      (ols.loss_scale_optimizer(optax.adam(1e-3)), "LossScaleOptimizerState"),
      (ols.skip_bad_steps(optax.adam(1e-3)), "SkipBadStepsState"),
    ):
      inner_state = optax.adam(1e-3).init(PARAMS)
      with pytest.raises(TypeError, match=rf"expects the {expected} .*got tuple"):
        tx.update(grads_of(1.0), inner_state, PARAMS)

  def test_the_integer_leaf_error_recommends_what_works(self):
    tx = ols.loss_scale_optimizer(optax.adam(1e-3))
    params = {**PARAMS, "step": jnp.int32(0)}
    with pytest.raises(TypeError, match=r"\['step'\].*Keep integer and bool arrays out") as info:
      tx.update({**grads_of(1.0), "step": jnp.int32(0)}, tx.init(PARAMS), params)
    assert "float0" not in str(info.value)
    # What it recommends works: the float params alone.
    tx.update(grads_of(1.0), tx.init(PARAMS), PARAMS)

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_nan_in_a_frozen_leaf_still_skips_the_step(self):
    # Documented: the check reads every floating gradient leaf, also one the
    # inner optimizer zeroes (a frozen leaf); leave such leaves out of grads.
    inner = optax.multi_transform(
      {"train": optax.sgd(1.0), "frozen": optax.set_to_zero()}, {"w": "train", "b": "frozen"}
    )
    tx = ols.loss_scale_optimizer(inner, 1.0)  # fixed: never skips
    dynamic = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(1.0))
    grads = grads_of(np.nan)
    _, state = self.variant(dynamic.update)(grads, dynamic.init(PARAMS), PARAMS)
    assert not bool(state.last_step_applied)
    updates, _ = self.variant(tx.update)(grads, tx.init(PARAMS), PARAMS)
    np.testing.assert_array_equal(updates["b"], np.zeros(3))


class OverflowingNormTest(chex.TestCase):
  """Item 11: a finite gradient whose squares overflow float32 is not a NaN step."""

  HUGE = 3e19  # finite in float32; its square is not

  @chex.variants(with_jit=True, without_jit=True)
  def test_before_warmup_it_is_applied_as_without_spike_detection(self):
    plain = ols.skip_bad_steps(optax.sgd(1e-20))
    watched = ols.skip_bad_steps(optax.sgd(1e-20), spike_threshold=3.0, warmup_steps=5)
    for tx in (plain, watched):
      _, state = self.variant(tx.update)(grads_of(self.HUGE), tx.init(PARAMS), PARAMS)
      assert bool(state.last_step_applied) and int(state.nonfinite_skips) == 0
    assert int(state.grad_norm.count) == 0  # its norm (Inf in float32) does not feed it
    assert float(state.grad_norm.mean) == 0.0

  def test_after_warmup_it_is_a_spike_not_a_nan(self):
    tx = ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=3.0, warmup_steps=3)
    params, state = PARAMS, tx.init(PARAMS)
    for g in (1.0, 1.1, 0.9, self.HUGE, np.nan):
      params, state = ols.apply_gradients(tx, grads_of(g), state, params)
    m = ols.metrics(state)
    assert (int(m["spike_skips"]), int(m["nonfinite_skips"])) == (1, 1)
    assert np.isfinite(float(m["grad_norm_mean"]))

  @chex.variants(with_jit=True, without_jit=True)
  def test_both_skip_modes_tell_an_inf_gradient_from_an_overflowing_norm(self):
    # 'cond' reads the gradients again under a cond, 'select' decides in the one
    # reduction: the answers agree.
    for skip_mode in ("cond", "select"):
      tx = ols.skip_bad_steps(
        optax.sgd(1e-20), spike_threshold=3.0, warmup_steps=5, skip_mode=skip_mode
      )
      for g, w, applied in (
        (self.HUGE, (1.0, 1.0), True),
        (np.inf, (1.0, 1.0), False),
        (1.0, (np.inf, -np.inf), False),
        (np.nan, (1.0, 1.0), False),
        (1.0, (1.0, 1.0), True),
      ):
        _, state = self.variant(tx.update)(grads_of(g, w), tx.init(PARAMS), PARAMS)
        assert bool(state.last_step_applied) == applied, (skip_mode, g, w)
        assert int(state.nonfinite_skips) == (not applied), (skip_mode, g, w)


class GuardTest(chex.TestCase):
  def test_a_nan_streak_gets_nan_advice_and_a_bfloat16_report(self):
    tx = ols.skip_bad_steps(optax.sgd(0.1), max_consecutive_skips=1)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    grads = jax.tree.map(lambda x: x.astype(jnp.bfloat16), grads_of(np.nan))
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    with pytest.raises(Exception, match="OverflowGuardError") as info:
      jax.block_until_ready(tx.update(grads, state, params))
    message = str(info.value)
    assert "target bfloat16" in message and "target float16" not in message
    assert "held NaN/Inf" in message and "spikes is a change of regime" not in message

  def test_a_spike_streak_gets_spike_advice(self):
    tx = ols.skip_bad_steps(
      optax.sgd(0.1),
      spike_threshold=3.0,
      warmup_steps=3,
      max_consecutive_spike_skips=1,
      on_spike_streak="raise",
    )
    params, state = PARAMS, tx.init(PARAMS)
    with pytest.raises(Exception, match="OverflowGuardError") as info:
      for g in (1.0, 1.1, 0.9, 1e3, 1e3):
        params, state = jax.block_until_ready(ols.apply_gradients(tx, grads_of(g), state, params))
    assert "spikes is a change of regime" in str(info.value)

  def test_a_jitted_step_returning_only_the_params_still_fires(self):
    for tx in (
      ols.loss_scale_optimizer(optax.sgd(0.1), max_consecutive_skips=1),
      ols.skip_bad_steps(optax.sgd(0.1), max_consecutive_skips=1),
    ):
      state = tx.init(PARAMS)
      _, state = tx.update(grads_of(np.nan), state, PARAMS)
      params_only = jax.jit(lambda g, s, p, tx=tx: ols.apply_gradients(tx, g, s, p)[0])
      updates_only = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p)[0])
      for step in (params_only, updates_only):
        with pytest.raises(Exception, match="OverflowGuardError"):
          jax.block_until_ready(step(grads_of(np.nan), state, PARAMS))


def test_inside_scan_the_modes_agree_on_every_decision_and_skipped_output():
  """What holds across `skip_mode`s inside a larger program (the docstring's statement)."""
  flags = [1.0, np.inf, 2.0, 3.0, np.nan, 0.5, 1.5]
  grads = jnp.stack([jnp.full(4, g, jnp.float32) * jnp.linspace(0.5, 2.0, 4) for g in flags])

  def run(mode):
    tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(4.0, 2), skip_mode=mode)
    params = jnp.linspace(-1.0, 1.0, 4)

    def body(carry, g):
      params, state = carry
      params, state = ols.apply_gradients(tx, g, state, params)
      return (params, state), (params, ols.metrics(state))

    return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), grads)[1])(params)

  (p_cond, m_cond), (p_select, m_select) = run("cond"), run("select")
  chex.assert_trees_all_equal(m_cond, m_select)  # scales, counters, applied flags: same bits
  applied = np.asarray(m_cond["last_step_applied"])
  skipped_rows = np.flatnonzero(~applied)
  # A skipped step returns the params it was given, in both modes.
  for i in skipped_rows:
    np.testing.assert_array_equal(p_cond[i], p_cond[i - 1])
    np.testing.assert_array_equal(p_select[i], p_select[i - 1])
  # Applied steps agree to within a few ulps (XLA may fuse the Adam arithmetic differently).
  np.testing.assert_allclose(p_cond, p_select, rtol=1e-6, atol=0)
