"""The wrapper's diagnostics: recorded non-finite leaves, and the overflow guard."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols

PARAMS = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}, "head": jnp.ones(3)}
FINITE = jax.tree.map(jnp.ones_like, PARAMS)
NAN_HEAD = {**FINITE, "head": jnp.array([1.0, jnp.nan, 1.0])}
INF_KERNEL = {**FINITE, "dense": {**FINITE["dense"], "kernel": -jnp.full((2, 3), jnp.inf)}}
PATHS = ["['dense']['bias']", "['dense']['kernel']", "['head']"]
# jax 0.10 raises a failed host callback as JaxRuntimeError from its Python
# dispatch path (e.g. the call that compiles) and as ValueError from its C++ one.
CALLBACK_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


def run(tx, grads_seq, jit=True):
  """Applies the updates for each gradient tree; returns the states after each step."""
  update = jax.jit(tx.update) if jit else tx.update
  state, states = tx.init(PARAMS), []
  for grads in grads_seq:
    # Block: on an accelerator the guard's error surfaces when a result is read.
    _, state = jax.block_until_ready(update(grads, state, PARAMS))
    states.append(state)
  return states


def flags(state):
  return {path: bool(flag) for path, flag in ols.metrics(state)["nonfinite_leaves"].items()}


def compiled_text(tx):
  state = tx.init(PARAMS)
  return jax.jit(tx.update).lower(FINITE, state, PARAMS).compile().as_text()


class RecordTest(chex.TestCase):
  def test_flags_follow_the_last_skipped_step(self):
    tx = ols.loss_scale_optimizer(optax.adam(1e-3), record_nonfinite_leaves=True)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    assert flags(state) == dict.fromkeys(PATHS, False)
    expected_after = [
      (NAN_HEAD, {"['head']"}),
      (INF_KERNEL, {"['dense']['kernel']"}),
      (FINITE, {"['dense']['kernel']"}),  # a finite step keeps the last skipped step's flags
      (jax.tree.map(lambda g: g * jnp.nan, FINITE), set(PATHS)),
    ]
    for grads, bad in expected_after:
      _, state = update(grads, state, PARAMS)
      assert flags(state) == {p: p in bad for p in PATHS}

  def test_off_keeps_the_state_and_metrics_as_before(self):
    state = run(ols.loss_scale_optimizer(optax.sgd(1.0)), [NAN_HEAD])[-1]
    assert state.nonfinite_leaves is None
    assert sorted(ols.metrics(state)) == [
      "consecutive_skips",
      "last_step_applied",
      "loss_scale",
      "retries",
      "total_retries",
      "total_skips",
    ]

  def test_flags_survive_scan_and_none_gradients(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), record_nonfinite_leaves=True)
    grads = {**NAN_HEAD, "dense": {"kernel": NAN_HEAD["dense"]["kernel"], "bias": None}}

    def body(state, _):
      return tx.update(grads, state, PARAMS)[1], None

    state, _ = jax.lax.scan(body, tx.init(PARAMS), length=2)
    assert flags(state) == {p: p == "['head']" for p in PATHS}
    assert int(state.total_skips) == 2

  def test_mismatched_gradients_are_a_clear_error(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), record_nonfinite_leaves=True)
    with pytest.raises(ValueError, match="3 parameter leaves"):
      tx.update({"head": jnp.ones(3)}, tx.init(PARAMS), PARAMS)

  def test_flags_are_or_ed_across_the_named_axis(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), record_nonfinite_leaves=True, axis_name="i")
    # Shard 0 overflows in the kernel, shard 1 in the head: both replicas record both.
    sharded = jax.tree.map(lambda a, b: jnp.stack([a, b]), INF_KERNEL, NAN_HEAD)
    state = tx.init(PARAMS)
    new_state = jax.vmap(lambda g: tx.update(g, state, PARAMS)[1], axis_name="i")(sharded)
    for shard in range(2):
      one = jax.tree.map(lambda x, s=shard: x[s], new_state)
      assert flags(one) == {p: p != "['dense']['bias']" for p in PATHS}


class GuardTest(chex.TestCase):
  def test_max_consecutive_skips_fires_on_the_step_that_exceeds_it(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), max_consecutive_skips=2)
    run(tx, [NAN_HEAD, NAN_HEAD])  # two skips in a row are allowed
    with pytest.raises(CALLBACK_ERRORS) as info:
      run(tx, [NAN_HEAD, NAN_HEAD, INF_KERNEL])
    message = str(info.value)
    assert "OverflowGuardError: Loss scaling cannot recover: 3 consecutive steps" in message
    assert "more than max_consecutive_skips=2" in message
    assert "unscaled gradients: ['dense']['kernel']." in message
    assert "Loss scale of this step: 8192." in message  # 2**15 halved twice
    assert "NONFINITE  ['dense']['kernel']  float32  (2, 3)" in message
    assert "What to try:" in message

  def test_a_finite_step_resets_the_streak(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), max_consecutive_skips=2)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for grads in [NAN_HEAD, NAN_HEAD, FINITE, INF_KERNEL, NAN_HEAD, FINITE]:
      _, state = update(grads, state, PARAMS)
    assert int(state.total_skips) == 4 and int(state.consecutive_skips) == 0

  @chex.variants(with_jit=True, without_jit=True)
  def test_overflow_at_min_loss_scale_fires(self):
    ls = ols.DynamicLossScale(4.0, min_loss_scale=2.0)
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ls, raise_at_min_loss_scale=True)
    update = self.variant(tx.update)
    state = tx.init(PARAMS)
    _, state = update(NAN_HEAD, state, PARAMS)  # overflow at 4: backs off to the minimum
    _, state = update(FINITE, state, PARAMS)  # at the minimum but finite: fine
    assert float(ols.get_loss_scale(state)()) == 2.0
    with pytest.raises(CALLBACK_ERRORS, match="overflowed at min_loss_scale=2") as e:
      jax.block_until_ready(update(NAN_HEAD, state, PARAMS))
    assert "unscaled gradients: ['head']." in str(e.value)

  def test_under_vmap_only_the_triggered_element_raises(self):
    # vmap turns the guard's cond into a select that runs the callback for every
    # element; the callback must still raise only for a triggered one.
    ls = ols.DynamicLossScale(1.0)
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ls, raise_at_min_loss_scale=True)
    step = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(PARAMS), PARAMS)[1]))
    stack = lambda *trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    states = step(stack(FINITE, FINITE))
    assert int(states.total_skips.sum()) == 0
    with pytest.raises(CALLBACK_ERRORS, match="unscaled gradients: \\['head'\\]"):
      jax.block_until_ready(step(stack(FINITE, NAN_HEAD)))

  def test_off_by_default_and_no_host_callback_in_the_compiled_step(self):
    hlo_off = compiled_text(ols.loss_scale_optimizer(optax.adam(1e-3)))
    hlo_fixed = compiled_text(
      ols.loss_scale_optimizer(optax.adam(1e-3), 8.0, max_consecutive_skips=1)
    )
    hlo_on = compiled_text(ols.loss_scale_optimizer(optax.adam(1e-3), max_consecutive_skips=1))
    host_call = re.compile(r'custom-call\(.*custom_call_target="[^"]*callback')
    assert "custom-call(" not in hlo_off
    assert "custom-call(" not in hlo_fixed  # a fixed scale never skips: nothing to guard
    assert host_call.search(hlo_on)
    # A fixed scale never skips, so the guard cannot fire even on NaN.
    run(ols.loss_scale_optimizer(optax.sgd(1.0), 8.0, max_consecutive_skips=1), [NAN_HEAD] * 3)

  def test_bad_arguments_are_rejected_by_name(self):
    for bad in (0, -3, 1.5, True, "3"):
      with pytest.raises(ValueError, match="max_consecutive_skips must be None"):
        ols.loss_scale_optimizer(optax.sgd(1.0), max_consecutive_skips=bad)
    for name in ("raise_at_min_loss_scale", "record_nonfinite_leaves"):
      with pytest.raises(TypeError, match=f"{name} must be True or False"):
        ols.loss_scale_optimizer(optax.sgd(1.0), **{name: 1})

  def test_config_lists_the_options(self):
    tx = ols.loss_scale_optimizer(
      optax.sgd(1.0), max_consecutive_skips=5, raise_at_min_loss_scale=True
    )
    config = tx.get_config()
    assert config["max_consecutive_skips"] == 5 and config["raise_at_min_loss_scale"] is True
    assert config["record_nonfinite_leaves"] is False
    assert ols.loss_scale_optimizer(optax.sgd(1.0)).get_config()["max_consecutive_skips"] is None
