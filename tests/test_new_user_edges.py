"""What a new user hit at the edges (issue 25), item by item.

Each test states its expectation independently of the implementation: jmp's
own recipe run beside ours, Keras 3's documented rule
(`reference_models.keras3_trajectory`), a schedule's values computed by hand,
a retry run simulated halving by halving, the counters of Flax's and NNX's own
classes.
"""

import dataclasses
import functools
import json
import math
import pathlib
import pickle
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests import reference_models

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARAMS = {"w": jnp.array([1.0, -2.0, 0.5])}


def _grads(values):
  return {"w": jnp.asarray(values, jnp.float32)}


def _nan_run_grads():
  """Unscaled gradients, with NaN/Inf at steps 1, 3 and 4."""
  rng = np.random.default_rng(25)
  out = []
  for i in range(7):
    g = rng.standard_normal(3).astype(np.float32)
    if i in (1, 3, 4):
      g[i % 3] = np.nan if i % 2 else np.inf
    out.append(_grads(g))
  return out


# -- 1. jmp's static scale skips non-finite steps; TensorFlow's fixed scale does not.


class SkippingFixedLossScaleTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_jmp_static_recipe_and_ours_agree_on_nan_batches(self):
    jmp = pytest.importorskip("jmp")
    inner = optax.adam(0.1)
    scale = 2.0**10
    tx = ols.loss_scale_optimizer(inner, ols.SkippingFixedLossScale(scale), skip_mode="cond")
    update = self.variant(tx.update)
    ours_params, ours_state = PARAMS, tx.init(PARAMS)
    their_ls = jmp.StaticLossScale(jnp.float32(scale))
    their_params, their_opt = PARAMS, inner.init(PARAMS)

    # jmp's recipe in one XLA program, as ours: eager optax rounds Adam's moments differently.
    their_step = jax.jit(functools.partial(reference_models.jmp_recipe_step, jmp, inner))

    skipped, previous_params = 0, PARAMS
    for grads in _nan_run_grads():
      scaled = jax.tree.map(lambda g: g * jnp.float32(scale), grads)
      finite, their_ls, their_params, their_opt = their_step(
        their_ls, scaled, their_params, their_opt
      )
      skipped += int(not bool(finite))
      # Ours.
      before = ours_state
      updates, ours_state = update(scaled, ours_state, ours_params)
      ours_params = optax.apply_updates(ours_params, updates)
      chex.assert_trees_all_equal(ours_state.inner_state, their_opt)  # bit for bit
      # jmp's recipe adds the updates inside its program, where XLA may fuse
      # Adam's last multiply into the add: within an ulp.
      chex.assert_trees_all_close(ours_params, their_params, rtol=2.5e-7, atol=0)
      assert bool(ours_state.last_step_applied) == bool(finite)
      if not bool(finite):  # untouched, bit for bit
        chex.assert_trees_all_equal(ours_state.inner_state, before.inner_state)
        chex.assert_trees_all_equal(ours_params, previous_params)
      previous_params = ours_params
    assert skipped == 3
    m = ols.metrics(ours_state)
    assert int(m["total_skips"]) == 3 and float(m["loss_scale"]) == scale
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(ours_params))

  def test_fixed_loss_scale_keeps_tensorflows_rule(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.FixedLossScale(8.0))
    params, state = ols.apply_gradients(tx, _grads([1.0, np.nan, 0.0]), tx.init(PARAMS), PARAMS)
    assert bool(jnp.isnan(params["w"][1]))  # TensorFlow applies every step
    assert bool(state.last_step_applied) and int(state.total_skips) == 0
    assert not tx.skips and not ols.FixedLossScale(8.0).skips

  @chex.variants(with_jit=True, without_jit=True)
  def test_the_wrapper_skips_and_counts_in_both_skip_modes(self):
    for mode in ("cond", "select"):
      tx = ols.loss_scale_optimizer(
        optax.sgd(0.5),
        ols.SkippingFixedLossScale(4.0),
        skip_mode=mode,
        record_nonfinite_leaves=True,
      )
      step = self.variant(lambda g, s, p, tx=tx: ols.apply_gradients(tx, g, s, p))
      state = tx.init(PARAMS)
      params, state = step(_grads([4.0, 8.0, 0.0]), state, PARAMS)
      np.testing.assert_array_equal(params["w"], [0.5, -3.0, 0.5])  # w - 0.5 * g / 4
      for k in (1, 2):
        same, state = step(_grads([np.inf, 0.0, 0.0]), state, params)
        chex.assert_trees_all_equal(same, params)
        m = ols.metrics(state)
        assert (int(m["consecutive_skips"]), int(m["total_skips"])) == (k, k)
        assert not bool(m["last_step_applied"]) and float(m["loss_scale"]) == 4.0
        assert bool(m["nonfinite_leaves"]["['w']"])
      _, state = step(_grads([4.0, 4.0, 4.0]), state, params)
      assert int(state.consecutive_skips) == 0 and int(state.total_skips) == 2

  def test_below_one_the_unscaled_gradients_are_checked(self):
    # Scaled by 0.5, a float16 gradient of 40000 unscales to 80000: Inf in the
    # float16 the inner optimizer would receive, though the scaled one is finite.
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.SkippingFixedLossScale(0.5))
    params = {"w": jnp.zeros(2, jnp.float16)}
    scaled = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
    assert bool(ols.all_finite(scaled))
    assert not bool(ols.all_finite(ols.SkippingFixedLossScale(0.5).unscale(scaled)))
    updates, state = tx.update(scaled, tx.init(params), params)
    assert int(state.total_skips) == 1
    np.testing.assert_array_equal(updates["w"], [0, 0])
    _, state = tx.update({"w": jnp.array([0.5, 1.0], jnp.float16)}, state, params)
    assert bool(state.last_step_applied)

  def test_config_serialization_and_get(self):
    ls = ols.SkippingFixedLossScale(2**12)
    assert (ls.dynamic, ls.skips, ls.counter) == (False, True, None)
    assert ls.get_config() == {"loss_scale_value": 4096.0}
    config = ols.serialize(ls)
    assert config == {
      "class_name": "SkippingFixedLossScale",
      "config": {"loss_scale_value": 4096.0},
    }
    assert ols.deserialize(json.loads(json.dumps(config))) == ls
    assert ols.get(config) == ls and ols.get(ls) is ls
    assert ls != ols.FixedLossScale(2**12)
    assert pickle.loads(pickle.dumps(ls)) == ls
    assert jax.tree.leaves(ls) == [] and jax.jit(lambda s: s)(ls) == ls
    tx = ols.loss_scale_optimizer(optax.adam(1e-3), ls)
    config = tx.get_config()
    assert (config["dynamic"], config["initial_scale"], config["dynamic_growth_steps"]) == (
      False,
      4096.0,
      None,
    )
    again = ols.LossScaleOptimizer.from_config(json.loads(json.dumps(config)), optax.adam(1e-3))
    assert again.get_config() == config and again.skips and not again.dynamic
    assert ols.loss_scale_optimizer(optax.adam(1e-3), **config).get_config() == config
    for bad in (0, -1.0, math.inf, math.nan, "8", True):
      with pytest.raises(ValueError, match="loss_scale_value must be a finite number > 0"):
        ols.SkippingFixedLossScale(bad)

  def test_flax_serialization_round_trip(self):
    serialization = pytest.importorskip("flax.serialization")
    import optax_lossscale.flax  # noqa: F401  (registers the loss scales)

    tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.SkippingFixedLossScale(16.0))
    _, state = tx.update(_grads([np.nan, 0, 0]), tx.init(PARAMS), PARAMS)
    restored = serialization.from_bytes(tx.init(PARAMS), serialization.to_bytes(state))
    assert int(restored.total_skips) == 1 and restored.loss_scale == state.loss_scale

  def test_compositions_guards_and_retry_treat_it_as_a_skipping_scale(self):
    skipping = lambda: ols.loss_scale_optimizer(optax.sgd(0.1), ols.SkippingFixedLossScale(2.0))
    with pytest.raises(ValueError, match=r"inside optax\.MultiSteps"):
      optax.MultiSteps(skipping(), 2).init(PARAMS)
    with pytest.raises(ValueError, match=r"inside optax\.apply_if_finite"):
      optax.apply_if_finite(skipping(), 2).init(PARAMS)
    state = skipping().init(PARAMS)
    with pytest.raises(ValueError, match="apply_if_finite"):
      ols.check_composition(optax.ApplyIfFiniteState(0, 0, 0, state))
    chained = optax.chain(skipping(), optax.trace(0.9))
    with pytest.warns(UserWarning, match=r"optax\.trace comes after"):
      chained.update(_grads([1.0, 1.0, 1.0]), chained.init(PARAMS), PARAMS)
    guarded = ols.loss_scale_optimizer(
      optax.sgd(0.1), ols.SkippingFixedLossScale(2.0), max_consecutive_skips=1
    )
    state = guarded.init(PARAMS)
    _, state = guarded.update(_grads([np.nan, 0, 0]), state, PARAMS)
    with pytest.raises(Exception, match="Loss scaling cannot recover"):
      jax.block_until_ready(guarded.update(_grads([np.nan, 0, 0]), state, PARAMS))
    with pytest.raises(TypeError, match="dynamic loss scale"):
      ols.retry_on_overflow(ols.value_and_grad(lambda p: jnp.sum(p["w"])))(
        skipping().init(PARAMS), PARAMS
      )

  def test_flax_train_state_and_nnx_count_its_skips(self):
    pytest.importorskip("flax")
    from flax import nnx

    from optax_lossscale.flax import TrainState

    tx = ols.loss_scale_optimizer(optax.sgd(0.5), ols.SkippingFixedLossScale(2.0))
    state = TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    skipped = state.apply_gradients(grads=_grads([np.nan, 0.0, 0.0]))
    chex.assert_trees_all_equal(skipped.params, PARAMS)
    assert int(skipped.step) == 0 and int(ols.metrics(skipped)["total_skips"]) == 1
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    kernel = np.asarray(model.kernel[...])
    grads = jax.tree.map(lambda v: jnp.full_like(v, jnp.nan), nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    np.testing.assert_array_equal(model.kernel[...], kernel)
    assert int(ols.metrics(optimizer)["total_skips"]) == 1

  def test_jmp_row_and_docs_name_the_skipping_scale(self):
    jmp_doc = (ROOT / "docs" / "migration" / "jmp.md").read_text()
    row = next(line for line in jmp_doc.splitlines() if line.startswith("| `jmp.StaticLossScale"))
    assert "`ols.SkippingFixedLossScale(s)`" in row.split(" | ")[1]
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"Which scales skip a non-finite step: (.*?)\n\n", readme, re.S).group(1)
    assert re.search(r"`SkippingFixedLossScale`.*\bdo\b.*`FixedLossScale`.*never skip", said, re.S)
    guide = (ROOT / "docs" / "guides" / "optax.md").read_text()
    rows = {r.split(" | ")[0]: r for r in guide.splitlines() if r.startswith("| ")}
    (skipping,) = [r for k, r in rows.items() if k.startswith("| `SkippingFixedLossScale(S)`")]
    (fixed,) = [r for k, r in rows.items() if "`FixedLossScale(S)` (TensorFlow's rule)" in k]
    assert "skipped" in skipping and skipping.endswith("| True |")
    assert "**applied**" in fixed and fixed.endswith("| False |")


# -- 2. inject_hyperparams around a skipping wrapper counts skipped steps.


SCHEDULE = optax.linear_schedule(1.0, 0.0, transition_steps=10)
CALLS = [1.0, np.nan, np.nan, 1.0]  # calls 2 and 3 overflow


def _fourth_update(tx, update=None):
  update = update or tx.update
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  for g in CALLS:
    updates, state = update({"w": jnp.full(1, g, jnp.float32)}, state, params)
  return float(updates["w"][0])


class InjectHyperparamsTest(chex.TestCase):
  def test_the_right_order_uses_the_schedule_of_the_applied_steps(self):
    right = ols.loss_scale_optimizer(
      optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE), ols.DynamicLossScale(1.0)
    )
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      got = _fourth_update(right)
    assert got == pytest.approx(-float(SCHEDULE(1)))  # two applied steps: 0.9
    assert float(SCHEDULE(1)) == pytest.approx(0.9)

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_schedule_around_a_skipping_wrapper_warns(self):
    wrong = optax.inject_hyperparams(
      lambda lr: ols.loss_scale_optimizer(optax.sgd(lr), ols.DynamicLossScale(1.0))
    )(lr=SCHEDULE)
    with pytest.warns(UserWarning, match=r"inside optax\.inject_hyperparams.*\blr\b.*skipped"):
      got = _fourth_update(wrong, self.variant(wrong.update))
    assert got == pytest.approx(-float(SCHEDULE(3)))  # what the warning is about: 0.7

  def test_skip_bad_steps_and_the_skipping_fixed_scale_warn_too(self):
    for build in (
      lambda lr: ols.skip_bad_steps(optax.sgd(lr)),
      lambda lr: ols.loss_scale_optimizer(optax.sgd(lr), ols.SkippingFixedLossScale(1.0)),
    ):
      with pytest.warns(UserWarning, match=r"inside optax\.inject_hyperparams"):
        optax.inject_hyperparams(build)(lr=SCHEDULE).init(PARAMS)

  def test_no_warning_without_a_schedule_or_without_skips(self):
    for tx in (
      optax.inject_hyperparams(lambda lr: ols.loss_scale_optimizer(optax.sgd(lr)))(lr=0.1),
      optax.inject_hyperparams(lambda lr: ols.loss_scale_optimizer(optax.sgd(lr), 8.0))(
        lr=SCHEDULE
      ),
    ):
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = tx.init(PARAMS)
        tx.update(ols.mark_scaled(_grads([1.0, 1.0, 1.0])), state, PARAMS)

  def test_the_optax_guide_no_longer_lists_it_as_accepted(self):
    text = (ROOT / "docs" / "guides" / "optax.md").read_text()
    assert "So are `optax.named_chain` and `optax.inject_hyperparams` around" not in text
    assert "loss_scale_optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))" in (
      text
    )


# -- 3. A Keras 3 config keeps Keras 3's rule.

KERAS3_CONFIG = {
  "name": "loss_scale_optimizer",
  "inner_optimizer": {"module": "keras.optimizers", "class_name": "SGD", "config": {}},
  "initial_scale": 2.0**15,
  "dynamic_growth_steps": 2000,
  # Keras 3's base-optimizer options, at their defaults.
  "weight_decay": None,
  "clipnorm": None,
  "global_clipnorm": None,
  "clipvalue": None,
  "use_ema": False,
  "ema_momentum": 0.99,
  "ema_overwrite_frequency": None,
  "loss_scale_factor": None,
  "gradient_accumulation_steps": None,
}


class Keras3ConfigTest(chex.TestCase):
  def _overflows(self, tx, n):
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for _ in range(n):
      _, state = update(_grads([np.inf, 0.0, 0.0]), state, PARAMS)
    return float(ols.get_loss_scale(state)())

  def test_twenty_overflows_from_two_to_the_fifteen_hold_two_to_the_minus_five(self):
    expected = reference_models.keras3_trajectory([False] * 20, initial_scale=2.0**15)
    assert expected[-1] == np.float32(2.0**-5)
    tx = ols.LossScaleOptimizer.from_config(KERAS3_CONFIG, optax.sgd(0.1))
    assert self._overflows(tx, 20) == 2.0**-5
    ls = ols.get_loss_scale(tx.init(PARAMS))
    got = []
    for _ in range(20):
      ls = ls.adjust(False)
      got.append(np.float32(ls()))
    assert got == expected

  def test_keras3_growth_and_back_off_below_one(self):
    flags = [False] * 6 + [True] * 3 + [False] + [True] * 7
    config = {**KERAS3_CONFIG, "initial_scale": 4.0, "dynamic_growth_steps": 3}
    ls = ols.get_loss_scale(ols.LossScaleOptimizer.from_config(config, optax.sgd(0.1)).init(PARAMS))
    got = []
    for finite in flags:
      ls = ls.adjust(finite)
      got.append(np.float32(ls()))
    assert got == reference_models.keras3_trajectory(flags, 4.0, 3)

  def test_get_config_round_trips_with_the_keras3_rule(self):
    tx = ols.LossScaleOptimizer.from_config(KERAS3_CONFIG, optax.sgd(0.1))
    config = tx.get_config()
    assert (config["dynamic"], config["initial_scale"], config["dynamic_growth_steps"]) == (
      True,
      2.0**15,
      2000,
    )
    for again_config in (config, json.loads(json.dumps(config))):
      again = ols.LossScaleOptimizer.from_config(again_config, optax.sgd(0.1))
      assert again.get_config() == config
      assert self._overflows(again, 20) == 2.0**-5
    assert ols.loss_scale_optimizer(optax.sgd(0.1), **config).get_config() == config

  def test_keras2_configs_keep_tensorflows_floor(self):
    keras2 = {
      "inner_optimizer": {},
      "dynamic": True,
      "initial_scale": 2.0**15,
      "dynamic_growth_steps": 2000,
    }
    tx = ols.LossScaleOptimizer.from_config(keras2, optax.sgd(0.1))
    assert self._overflows(tx, 20) == 1.0
    with pytest.raises(ValueError, match="initial_scale"):
      ols.LossScaleOptimizer.from_config({**KERAS3_CONFIG, "initial_scale": -1.0}, optax.sgd(1))


# -- 4. A retry that runs out of budget keeps the scales it tried.


def _f16_loss(params, x):
  """float16 gradients S * x: they overflow once S * max|x| > 65504 (S <= 2**14 for x=3)."""
  return jnp.sum(params["w"].astype(jnp.float16) * x.astype(jnp.float16))


X = jnp.array([3.0, 1.0, 2.0])
STEPS = 40


def _expected_run(start, max_retries, steps=STEPS, largest_safe=2.0**14):
  """Halving by halving, the rule of the issue: (lost batches, backward passes, scale)."""
  scale, lost, passes = start, 0, 0
  for _ in range(steps):
    tried = scale
    passes += 1
    retries = 0
    while tried > largest_safe and retries < max_retries:
      tried /= 2
      retries += 1
      passes += 1
    if tried <= largest_safe:
      scale = tried  # applied
    else:
      lost += 1
      scale = tried / 2  # the lowest tried, backed off once more
  return lost, passes, scale


def _measured_run(start, max_retries, steps=STEPS):
  tx = ols.loss_scale_optimizer(optax.sgd(0.01), ols.DynamicLossScale(start))
  forward_passes = []

  def loss_fn(params, x):
    jax.debug.callback(lambda: forward_passes.append(1))  # one per pass, as it runs
    return _f16_loss(params, x)

  grad_fn = ols.retry_on_overflow(ols.value_and_grad(loss_fn), max_retries=max_retries)

  @jax.jit
  def run(params, state):
    def body(carry, x):
      params, state = carry
      _, grads, state = grad_fn(state, params, x)
      return ols.apply_gradients(tx, grads, state, params), None

    return jax.lax.scan(body, (params, state), jnp.stack([X] * steps))[0]

  _, state = run(PARAMS, tx.init(PARAMS))
  jax.effects_barrier()
  m = ols.metrics(state)
  assert len(forward_passes) == steps + int(m["total_retries"])
  return int(m["total_skips"]), len(forward_passes), float(m["loss_scale"])


class RetryBudgetTest(chex.TestCase):
  def test_lost_batches_and_backward_passes(self):
    for start, max_retries, lost, passes in (
      (2.0**32, 8, 2, 56),
      (2.0**64, 8, 5, 85),
      (2.0**32, 1, 9, 49),
      (2.0**64, 1, 25, 65),
    ):
      assert float(np.float32(start)) == start  # 2**64 is a float32
      expected = _expected_run(start, max_retries)
      assert expected == (lost, passes, 2.0**14), (start, max_retries, expected)
      assert _measured_run(start, max_retries) == expected, (start, max_retries)
      halvings = int(math.log2(start / 2.0**14))
      assert lost <= math.ceil(halvings / (max_retries + 1))  # one per max_retries + 1 halvings

  def test_a_nan_loss_still_costs_one_back_off(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**32))
    grad_fn = ols.retry_on_overflow(ols.value_and_grad(_f16_loss), max_retries=8)
    state = tx.init(PARAMS)
    for k in (1, 2, 3):
      _, grads, state = grad_fn(state, PARAMS, X.at[1].set(jnp.nan))
      assert int(ols.metrics(state)["retries"]) == 0
      params, state = ols.apply_gradients(tx, grads, state, PARAMS)
      chex.assert_trees_all_equal(params, PARAMS)
      assert float(ols.get_loss_scale(state)()) == 2.0 ** (32 - k)

  def test_the_bound_is_documented(self):
    guide = (ROOT / "docs" / "guides" / "long_runs.md").read_text()
    assert "max_retries + 1" in guide and "lowest scale" in guide
    assert "max_retries + 1" in ols.retry_on_overflow.__doc__


# -- 5. One way to the inner optimizer's state.


class InnerStateTest(chex.TestCase):
  def _run(self, tx, params, grads_seq):
    state = tx.init(params)
    update = jax.jit(tx.update)  # one XLA program per update, bare or wrapped
    for g in grads_seq:
      updates, state = update(g, state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  def test_schedule_free_eval_params_from_any_wrapper_state(self):
    sf = optax.contrib.schedule_free_sgd(0.1, b1=0.9)
    seq = [_grads([1.0, 2.0, 3.0]), _grads([np.nan, 0, 0]), _grads([-1.0, 0.5, 2.0])]
    bare_params, bare_state = self._run(sf, PARAMS, [seq[0], seq[2]])
    expected = optax.contrib.schedule_free_eval_params(bare_state, bare_params)
    for tx in (
      ols.loss_scale_optimizer(sf, ols.DynamicLossScale(1.0)),
      ols.loss_scale_optimizer(sf, ols.SkippingFixedLossScale(1.0)),
      ols.skip_bad_steps(sf),
      ols.loss_scale_optimizer(ols.skip_bad_steps(sf), ols.DynamicLossScale(1.0)),
    ):
      params, state = self._run(tx, PARAMS, seq)
      inner = ols.inner_state(state)
      chex.assert_trees_all_equal(inner, bare_state)
      chex.assert_trees_all_equal(optax.contrib.schedule_free_eval_params(inner, params), expected)
      assert int(optax.tree_utils.tree_get(inner, "step_count")) == 3
    with pytest.raises(AttributeError):  # why inner_state exists
      optax.contrib.schedule_free_eval_params(state, params)

  def test_through_chains_named_chains_and_nested_wrappers(self):
    adam = optax.adam(0.1)
    wrapped = ols.loss_scale_optimizer(adam)
    bare_state = adam.init(PARAMS)
    for tx in (
      wrapped,
      optax.chain(optax.identity(), wrapped, optax.scale(0.5)),
      optax.named_chain(("scaled", wrapped), ("half", optax.scale(0.5))),
      ols.loss_scale_optimizer(ols.skip_bad_steps(adam)),
    ):
      state = tx.init(PARAMS)
      chex.assert_trees_all_equal(ols.inner_state(state), bare_state)
      assert int(optax.tree_utils.tree_get(ols.inner_state(state), "count")) == 0

  def test_train_state_and_nnx_optimizer(self):
    pytest.importorskip("flax")
    from flax import nnx

    from optax_lossscale.flax import TrainState

    adam = optax.adam(0.1)
    state = TrainState.create(apply_fn=None, params=PARAMS, tx=ols.loss_scale_optimizer(adam))
    state = state.apply_gradients(grads=_grads([2.0**15, 0.0, 2.0**15]))
    assert int(ols.inner_state(state)[0].count) == 1
    chex.assert_trees_all_equal(ols.inner_state(state), state.opt_state.inner_state)

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ols.loss_scale_optimizer(adam), wrt=nnx.Param)
    grads = jax.tree.map(lambda v: jnp.full_like(v, 2.0**15), nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    inner = ols.inner_state(optimizer)
    leaves = jax.tree.leaves(inner)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)  # no nnx.Variable boxes
    assert int(optax.tree_utils.tree_get(inner, "count")) == 1
    np.testing.assert_array_equal(inner[0].mu["kernel"], jnp.full((2, 1), 0.1))  # (1 - b1) * 1

  def test_errors(self):
    with pytest.raises(ValueError, match="No LossScaleOptimizerState or SkipBadStepsState"):
      ols.inner_state(optax.adam(0.1).init(PARAMS))
    one = ols.loss_scale_optimizer(optax.sgd(0.1)).init(PARAMS)
    with pytest.raises(ValueError, match=r"2 wrapper states side by side \(at \[0\], \[1\]\)"):
      ols.inner_state((one, one))
    with pytest.raises(TypeError, match="not its state"):
      ols.inner_state(ols.loss_scale_optimizer(optax.sgd(0.1)))

  def test_documented_with_schedule_free_and_tree_get(self):
    text = (ROOT / "docs" / "guides" / "optax.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert any(
      "ols.inner_state(" in b and "schedule_free_eval_params" in b for b in blocks
    ) and any("tree_get" in b and "inner" in b for b in blocks)


# -- 6. Smaller gaps.


class ShardedInitDocTest(chex.TestCase):
  def test_the_multi_device_guide_shows_tree_map_params_for_a_sharded_init(self):
    # Checked on 8 devices by tests/multidevice/test_md_sharded_init.py.
    text = (ROOT / "docs" / "guides" / "multi_device.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert any("optax.tree_map_params(" in b and "out_shardings" in b for b in blocks)


class EquinoxModuleParamsTest(chex.TestCase):
  def test_a_module_whose_only_non_arrays_are_a_float_and_a_bool_is_refused(self):
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)), eqx.nn.Dropout(0.5)])
    kinds = {type(leaf) for leaf in jax.tree.leaves(model)} - {type(jnp.ones(1))}
    assert kinds == {float, bool}  # nothing else that JAX would refuse
    for tx in (ols.loss_scale_optimizer(optax.adam(1e-3)), ols.skip_bad_steps(optax.adam(1e-3))):
      with pytest.raises(TypeError, match=r"at \.layers\[1\]\.p \(a Python float") as e:
        tx.init(model)
      assert "eqx.filter(model, eqx.is_inexact_array)" in str(e.value)
      state = tx.init(eqx.filter(model, eqx.is_inexact_array))
      with pytest.raises(TypeError, match=r"\.layers\[1\]\.p"):
        tx.update(
          jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array)), state, model
        )

  def test_a_dataclass_holding_a_bool_is_refused_and_plain_containers_pass(self):
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Block:
      w: jax.Array
      training: bool

    tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"at \.training \(a Python bool, a field of Block\)"):
      tx.init(Block(jnp.ones(2), True))
    tx.init({"w": jnp.ones(2), "scale": 1.0, "pair": (2.0, [3])})
    tx.init(optax.ScaleByAdamState(count=0, mu=1.0, nu=2.0))  # a NamedTuple is a container


class OncePerTraceWarningTest(chex.TestCase):
  def _count(self, run):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      run()
    return sum("keeps state" in str(w.message) for w in caught)

  def test_eager_updates_warn_once_and_a_new_trace_again(self):
    tx = optax.chain(ols.loss_scale_optimizer(optax.sgd(0.5)), optax.trace(0.9))
    state = tx.init(PARAMS)

    def eager():
      s = state
      for _ in range(4):
        _, s = tx.update(_grads([1.0, 1.0, 1.0]), s, PARAMS)

    assert self._count(eager) == 1
    assert self._count(eager) == 0  # the same wrapper: already warned
    jitted = jax.jit(tx.update)
    assert (
      self._count(lambda: [jitted(_grads([1.0, 1.0, 1.0]), state, PARAMS) for _ in range(3)]) == 1
    )
    other = optax.chain(ols.skip_bad_steps(optax.sgd(0.5)), optax.trace(0.9))
    other_state = other.init(PARAMS)
    assert (
      self._count(
        lambda: [other.update(_grads([1.0, 1.0, 1.0]), other_state, PARAMS) for _ in range(3)]
      )
      == 1
    )

  def test_inject_hyperparams_updates_warn_once_eagerly(self):
    wrong = optax.inject_hyperparams(lambda lr: ols.loss_scale_optimizer(optax.sgd(lr)))(
      lr=SCHEDULE
    )
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state = wrong.init(PARAMS)
      for _ in range(4):
        _, state = wrong.update(_grads([1.0, 1.0, 1.0]), state, PARAMS)
    assert sum("inject_hyperparams" in str(w.message) for w in caught) == 2  # init, update


class StepCounterTableTest(chex.TestCase):
  """docs/guides/optax.md's table of step counters, checked row by row."""

  def _rows(self):
    text = (ROOT / "docs" / "guides" / "optax.md").read_text()
    section = text.split("## Step counters", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
    return {r.split(" | ")[0][2:]: r.split(" | ")[-1].rstrip(" |") for r in rows}

  def test_the_table_says_what_each_counter_counts(self):
    pytest.importorskip("flax")
    from flax import nnx
    from flax.training import train_state

    from optax_lossscale.flax import TrainState

    calls = [2.0**15, np.inf, 2.0**15, np.nan, np.nan, 2.0**15]  # 3 applied, 3 skipped
    applied, skipped = 3, 3
    tx = ols.loss_scale_optimizer(optax.adam(0.1))
    ours = TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    flax_own = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    model = nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for g in calls:
      ours = ours.apply_gradients(grads=_grads([g, 1.0, 1.0]))
      flax_own = flax_own.apply_gradients(grads=_grads([g, 1.0, 1.0]))
      optimizer.update(
        model, jax.tree.map(lambda v, g=g: jnp.full_like(v, g), nnx.state(model, nnx.Param))
      )
    measured = {
      "inner": int(optax.tree_utils.tree_get(ols.inner_state(ours), "count")),
      "ours": int(ours.step),
      "flax": int(flax_own.step),
      "nnx": int(optimizer.step[...]),
      "total_skips": int(ols.metrics(ours)["total_skips"]),
    }
    assert int(optax.tree_utils.tree_get(ols.inner_state(optimizer), "count")) == applied
    assert int(ols.metrics(optimizer)["total_skips"]) == skipped
    assert measured == {
      "inner": applied,
      "ours": applied,
      "flax": len(calls),
      "nnx": len(calls),
      "total_skips": skipped,
    }
    assert int(ols.metrics(ours)["total_retries"]) == 0
    # The table's claims about a skipped step.
    rows = self._rows()
    claims = {
      "inner": "the inner optimizer's count",
      "ours": "`optax_lossscale.flax.TrainState.step`",
      "flax": "`flax.training.train_state.TrainState.step`",
      "nnx": "`nnx.Optimizer.step`",
      "total_skips": '`ols.metrics(state)["total_skips"]`',
    }
    for name, key in claims.items():
      (row,) = [v for k, v in rows.items() if k.startswith(key)]
      counts_skipped = not row.startswith("not counted")
      counted = measured[name] - (applied if name != "total_skips" else 0)
      assert counts_skipped == (counted == skipped), (name, row, measured[name])
