"""Compositions that would run and be silently wrong are refused (issue 17, items 1-3).

Each case states what went wrong before it was refused, so the expectation is
independent of the implementation: the refusal comes at construction, at
`init` or at the first `update` (traced or not), whichever first can see it.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

PARAMS = {"w": jnp.ones(2)}


def lso(inner=None, scale=2.0):
  return ols.loss_scale_optimizer(inner or optax.sgd(0.5), ols.DynamicLossScale(scale))


def first_update(tx, grads=None, jit=False):
  state = tx.init(PARAMS)
  update = jax.jit(tx.update) if jit else tx.update
  return update(grads or {"w": jnp.ones(2)}, state, PARAMS)


class NestedLossScalesTest(chex.TestCase):
  def test_a_wrapper_around_a_wrapper_is_refused_when_built(self):
    # It would divide by both scales: params moved by 0.995 where 0.5 is right.
    with pytest.raises(ValueError, match=r"cannot wrap another loss_scale_optimizer.*twice"):
      ols.loss_scale_optimizer(lso())

  def test_nesting_through_a_chain_is_refused_at_init(self):
    tx = ols.loss_scale_optimizer(optax.chain(optax.identity(), lso()))
    with pytest.raises(ValueError, match=r"nested inside another loss_scale_optimizer"):
      tx.init(PARAMS)

  @chex.variants(with_jit=True, without_jit=True)
  def test_two_wrappers_side_by_side_are_refused_at_init(self):
    for tx in (
      optax.chain(lso(), lso()),
      optax.chain(lso(), optax.chain(optax.identity(), lso())),
      optax.named_chain(("a", lso()), ("b", lso())),
    ):
      with pytest.raises(ValueError, match=r"two loss_scale_optimizers in one optax"):
        self.variant(tx.init)(PARAMS)

  def test_a_wrapper_inside_partitions_or_masks_is_refused(self):
    # The leaves outside the wrapper's partition would get the scaled gradients.
    cases = (
      optax.multi_transform({"a": lso(), "b": optax.sgd(0.1)}, {"w": "a"}),
      optax.masked(lso(), {"w": True}),
    )
    for tx in cases:
      with pytest.raises(ValueError, match=r"inside optax\.(masked|partition)"):
        tx.init(PARAMS)

  def test_the_state_check_flags_two_wrappers_however_the_state_was_built(self):
    one = lso().init(PARAMS)
    nested = one._replace(inner_state=lso().init(PARAMS))
    for state in ((one, one), {"a": one, "b": one}, nested):
      with pytest.raises(ValueError, match="2 loss_scale_optimizer states"):
        ols.check_composition(state)


class PredecessorTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_identity_before_the_wrapper_is_harmless_and_passes(self):
    tx = optax.chain(optax.identity(), lso())
    state = tx.init(PARAMS)
    ols.check_composition(state)
    updates, state = self.variant(tx.update)({"w": jnp.full(2, 2.0)}, state, PARAMS)
    alone, _ = lso().update({"w": jnp.full(2, 2.0)}, lso().init(PARAMS), PARAMS)
    chex.assert_trees_all_equal(updates, alone)

  @chex.variants(with_jit=True, without_jit=True)
  def test_any_other_transformation_before_the_wrapper_is_refused(self):
    for before in (
      optax.clip_by_global_norm(1.0),
      optax.add_decayed_weights(1e-4),
      optax.scale_by_adam(),
      optax.chain(optax.identity(), optax.clip(1.0)),
    ):
      tx = optax.chain(before, lso())
      state = tx.init(PARAMS)
      with pytest.raises(ValueError, match=r"comes after .* receive the \*scaled\* gradients"):
        self.variant(tx.update)({"w": jnp.ones(2)}, state, PARAMS)

  def test_a_stateful_transformation_after_a_skipping_wrapper_warns(self):
    # On a skipped step it still runs on the zero updates: optax.trace moves the params.
    for wrapper in (lso(), ols.skip_bad_steps(optax.sgd(0.5))):
      tx = optax.chain(wrapper, optax.trace(0.9))
      state = tx.init(PARAMS)
      with pytest.warns(UserWarning, match=r"optax\.trace comes after .* keeps\s+state"):
        _, state = tx.update({"w": jnp.ones(2)}, state, PARAMS)
        skipped, _ = tx.update({"w": jnp.array([np.nan, 1.0])}, state, PARAMS)
      assert not np.all(np.asarray(skipped["w"]) == 0)  # what the warning is about
    fixed = optax.chain(ols.loss_scale_optimizer(optax.sgd(0.5), 2.0), optax.trace(0.9))
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # a fixed scale never skips: nothing to warn about
      fixed.update(ols.mark_scaled({"w": jnp.ones(2)}), fixed.init(PARAMS), PARAMS)

  def test_after_the_wrapper_is_fine(self):
    tx = optax.chain(lso(), optax.scale(0.5))
    updates, _ = first_update(tx, {"w": jnp.full(2, 2.0)})
    np.testing.assert_array_equal(updates["w"], [-0.25, -0.25])  # -0.5 * (2 / 2) * 0.5


class AccumulationAndSkippingTest(chex.TestCase):
  def test_multisteps_around_either_wrapper_is_refused_at_init(self):
    # MultiSteps clears its accumulator by multiplying by 0: one NaN micro-batch
    # stays NaN in it and every later step is skipped, for good.
    for inner in (lso(), ols.skip_bad_steps(optax.sgd(0.1))):
      with pytest.raises(ValueError, match=r"inside optax.MultiSteps.*gradient_transformation"):
        optax.MultiSteps(inner, 2).init(PARAMS)

  def test_a_skip_bad_steps_state_inside_multisteps_is_flagged(self):
    state = optax.MultiSteps(optax.sgd(0.1), 2).init(PARAMS)
    state = state._replace(inner_opt_state=ols.skip_bad_steps(optax.sgd(0.1)).init(PARAMS))
    with pytest.raises(ValueError, match=r"skip_bad_steps .*inside optax.MultiSteps"):
      ols.check_composition(state)

  @chex.variants(with_jit=True, without_jit=True)
  def test_skip_bad_steps_around_multisteps_drops_a_nan_micro_batch_and_trains_on(self):
    inner = optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
    tx = ols.skip_bad_steps(inner)
    params, state = PARAMS, tx.init(PARAMS)
    step = self.variant(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    micro_batches = [1.0, np.nan, 3.0, 2.0, 4.0]  # the NaN one is skipped, not accumulated
    for g in micro_batches:
      params, state = step({"w": jnp.full(2, g)}, state, params)
    # Applied: mean(1, 3) = 2 after the 3rd call, mean(2, 4) = 3 after the 5th.
    np.testing.assert_array_equal(params["w"], [1.0 - 2.0 - 3.0] * 2)
    assert int(state.nonfinite_skips) == 1

  def test_apply_if_finite_around_a_dynamic_wrapper_is_refused(self):
    with pytest.raises(ValueError, match=r"inside optax\.apply_if_finite"):
      optax.apply_if_finite(lso(), 3).init(PARAMS)
    # A fixed scale never skips: apply_if_finite around it keeps its meaning.
    fixed = optax.apply_if_finite(ols.loss_scale_optimizer(optax.sgd(0.5), 2.0), 3)
    updates, state = first_update(fixed, {"w": jnp.array([np.nan, 1.0])})
    assert int(state.notfinite_count) == 1
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_norm_clipping_before_spike_detection_is_refused(self):
    # The clipped norm never exceeds the clip: no spike would ever be seen.
    for clip in (optax.clip_by_global_norm(1.0), optax.clip_by_block_rms(1.0)):
      tx = optax.chain(clip, ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=4.0))
      state = tx.init(PARAMS)
      match = r"watches the gradient norm but comes after optax\.clip"
      with pytest.raises(ValueError, match=match):
        self.variant(tx.update)({"w": jnp.ones(2)}, state, PARAMS)

  def test_clipping_before_a_guard_that_does_not_watch_the_norm_is_fine(self):
    for guard in (
      ols.skip_bad_steps(optax.sgd(0.1)),
      ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=4.0, monitor="loss"),
    ):
      tx = optax.chain(optax.clip_by_global_norm(1.0), guard)
      state = tx.init(PARAMS)
      tx.update({"w": jnp.ones(2)}, state, PARAMS, loss=jnp.float32(1.0))

  def test_clipping_inside_the_guard_sees_the_spike(self):
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    tx = ols.skip_bad_steps(inner, spike_threshold=4.0, warmup_steps=3)
    params, state = PARAMS, tx.init(PARAMS)
    for g in (1.0, 1.1, 0.9, 1.0, 1e4):
      params, state = ols.apply_gradients(tx, {"w": jnp.full(2, g)}, state, params)
    assert int(state.spike_skips) == 1 and not bool(state.last_step_applied)

  def test_nested_guards_are_refused(self):
    with pytest.raises(ValueError, match="cannot wrap another skip_bad_steps"):
      ols.skip_bad_steps(ols.skip_bad_steps(optax.sgd(0.1)))
    nested = ols.skip_bad_steps(optax.chain(ols.skip_bad_steps(optax.sgd(0.1))))
    with pytest.raises(ValueError, match="nested inside another skip_bad_steps"):
      nested.init(PARAMS)

  def test_the_recommended_nesting_passes(self):
    tx = ols.loss_scale_optimizer(ols.skip_bad_steps(optax.adam(1e-3), spike_threshold=6.0))
    _, state = first_update(tx, {"w": jnp.full(2, 2.0**15)})
    ols.check_composition(state)
    assert bool(ols.metrics(state)["last_step_applied"])


def test_the_flax_train_state_refuses_two_wrappers():
  flax_ts = pytest.importorskip("optax_lossscale.flax")
  with pytest.raises(ValueError, match="two loss_scale_optimizers"):
    flax_ts.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.chain(lso(), lso()))
