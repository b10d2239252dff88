"""What a new user hit (issue 14): leaf paths, composition traps, arguments, configs."""

import json
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

NAN = jnp.array([jnp.nan, 1.0])


class NonfiniteLeafPathsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_one_leaf_subtrees_keep_their_full_path(self):
    params = {
      "dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)},
      "head": {"kernel": jnp.ones(2)},
    }
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), record_nonfinite_leaves=True)
    grads = {**params, "head": {"kernel": NAN}}
    _, state = self.variant(tx.update)(grads, tx.init(params), params)
    flags = {k: bool(v) for k, v in ols.metrics(state)["nonfinite_leaves"].items()}
    assert flags == {
      "['dense']['bias']": False,
      "['dense']['kernel']": False,
      "['head']['kernel']": True,
    }

  def test_a_single_named_leaf_keeps_its_name(self):
    params = {"w": jnp.ones(2)}
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), record_nonfinite_leaves=True)
    _, state = tx.update({"w": NAN}, tx.init(params), params)
    assert list(ols.metrics(state)["nonfinite_leaves"]) == ["['w']"]


class CompositionTest(chex.TestCase):
  def test_a_clipping_before_the_wrapper_is_refused_when_it_runs(self):
    tx = optax.chain(optax.clip_by_global_norm(1.0), ols.loss_scale_optimizer(optax.sgd(1.0)))
    state = tx.init(jnp.ones(2))
    for update in (tx.update, jax.jit(tx.update)):
      with pytest.raises(ValueError, match=r"after optax.clip_by_global_norm.*\*scaled\*"):
        update(jnp.ones(2), state, jnp.ones(2))

  def test_a_stateful_transformation_before_the_wrapper_is_reported_from_the_state(self):
    adam, ls = optax.adam(1e-3), ols.loss_scale_optimizer(optax.sgd(1.0))
    state = (adam.init(jnp.ones(2)), ls.init(jnp.ones(2)))  # as chain(adam, ls) builds it
    with pytest.raises(ValueError, match=r"not first in its chain.*scaled"):
      ols.check_composition(state)
    with pytest.warns(UserWarning, match="not first in its chain"):
      ols.get_scaled_loss(jnp.float32(1.0), state)
    with pytest.warns(UserWarning, match="not first in its chain"):
      ols.value_and_grad(lambda p: jnp.sum(p))(state, jnp.ones(2))

  def test_named_chain_and_apply_if_finite_and_multisteps_are_refused(self):
    cases = {
      "after optax.clip": optax.named_chain(
        ("clip", optax.clip_by_block_rms(1.0)), ("ls", ols.loss_scale_optimizer(optax.sgd(1.0)))
      ),
      "apply_if_finite": optax.apply_if_finite(ols.loss_scale_optimizer(optax.adam(1e-3)), 3),
      "MultiSteps": optax.MultiSteps(ols.loss_scale_optimizer(optax.sgd(1.0)), 2),
    }
    for match, tx in cases.items():
      with pytest.raises(ValueError, match=match):
        state = tx.init(jnp.ones(2))
        tx.update(jnp.ones(2), state, jnp.ones(2))

  def test_the_right_compositions_pass_without_warning(self):
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    for tx in (
      ols.loss_scale_optimizer(inner),
      optax.chain(ols.loss_scale_optimizer(optax.sgd(1.0)), optax.scale(0.5)),
      ols.loss_scale_optimizer(optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()),
    ):
      state = tx.init(jnp.ones(2))
      ols.check_composition(state)
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        ols.get_scaled_loss(jnp.float32(1.0), state)


class ValidationTest(chex.TestCase):
  def test_factors_that_round_to_one_in_float32_are_refused(self):
    with pytest.raises(ValueError, match=r"multiplier.*rounds to exactly 1.0"):
      ols.DynamicLossScale(multiplier=1.00000001)
    with pytest.raises(ValueError, match=r"backoff_factor.*rounds to exactly 1.0"):
      ols.DynamicLossScale(backoff_factor=0.99999999)
    # The nearest float32 neighbours of 1 are still accepted, and change the scale.
    ls = ols.DynamicLossScale(
      1.0, increment_period=1, multiplier=float(np.nextafter(np.float32(1), 2))
    )
    assert float(ls.adjust(jnp.asarray(True))()) > 1.0

  def test_a_fixed_scale_with_a_guard_warns_that_it_cannot_fire(self):
    with pytest.warns(UserWarning, match=r"can never\s+fire"):
      ols.loss_scale_optimizer(optax.sgd(1.0), 8.0, max_consecutive_skips=1)
    with pytest.warns(UserWarning, match=r"can never\s+fire"):
      ols.loss_scale_optimizer(
        optax.sgd(1.0), dynamic=False, initial_scale=8, raise_at_min_loss_scale=True
      )

  def test_passing_the_optimizer_instead_of_its_state_says_so(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0))
    for call in (ols.get_scaled_loss, ols.get_unscaled_gradients):
      with pytest.raises(TypeError, match=r"pass the optimizer state, opt_state = tx.init"):
        call(jnp.float32(1.0), tx)

  def test_has_aux_with_a_scalar_loss_names_the_fix(self):
    state = ols.loss_scale_optimizer(optax.sgd(1.0)).init(jnp.ones(2))
    fn = ols.value_and_grad(lambda p: jnp.sum(p), has_aux=True)
    with pytest.raises(TypeError, match=r"single array of shape \(\) .*has_aux=False") as info:
      fn(state, jnp.ones(2))
    assert "Tracer" not in str(info.value)


class IntegerGradientTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_an_integer_gradient_leaf_is_refused_by_path(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), 4)
    params = {"w": jnp.ones(2), "n": jnp.array([1, 2])}
    grads = {"w": jnp.ones(2), "n": jnp.array([4, 8])}
    with pytest.raises(TypeError, match=r"integer gradient leaf at \['n'\]"):
      self.variant(tx.update)(grads, tx.init(params), params)

  def test_none_leaves_and_float_leaves_pass(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), 4)
    params = {"w": jnp.ones(2), "n": None}
    updates, _ = tx.update({"w": jnp.array([4.0, 8.0]), "n": None}, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])
    assert updates["n"] is None


class ConfigRoundTripTest(chex.TestCase):
  def test_from_config_rebuilds_an_equal_optimizer(self):
    for tx in (
      ols.loss_scale_optimizer(optax.adam(1e-3), dynamic_growth_steps=100, max_consecutive_skips=3),
      ols.loss_scale_optimizer(optax.adam(1e-3), dynamic=False, initial_scale=64),
      ols.loss_scale_optimizer(
        optax.sgd(1.0), ols.DynamicLossScale(8, backoff_factor=0.25), axis_name=["a", "b"]
      ),
    ):
      config = json.loads(json.dumps(tx.get_config()))
      again = ols.LossScaleOptimizer.from_config(config, optax.adam(1e-3))
      assert again.get_config() == tx.get_config()
      assert again.initial_loss_scale == tx.initial_loss_scale

  def test_keyword_splat_of_a_config_works(self):
    tx = ols.loss_scale_optimizer(optax.adam(1e-3), dynamic_growth_steps=100, skip_mode="select")
    again = ols.loss_scale_optimizer(optax.adam(1e-3), **tx.get_config())
    assert again.get_config() == tx.get_config()

  def test_a_contradicting_keyword_form_points_to_from_config(self):
    config = ols.loss_scale_optimizer(optax.adam(1e-3)).get_config()
    config["initial_scale"] = 2.0
    with pytest.raises(ValueError, match=r"LossScaleOptimizer.from_config"):
      ols.loss_scale_optimizer(optax.adam(1e-3), **config)
