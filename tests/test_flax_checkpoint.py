"""Exact resume of loss-scaled training through Orbax and flax.serialization (msgpack)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
from flax import linen as nn
from flax import nnx, serialization
import orbax.checkpoint as ocp

from optax_lossscale.flax import (
  TrainState,
  check_loss_scale_kind,
  nnx_value_and_grad,
  restore_checkpoint,
  save_checkpoint,
)

N, M = 5, 4  # steps before and after the checkpoint
# Faults on both sides of the checkpoint, one right before it.
FAULTS = {1: np.nan, 4: np.inf, 6: np.nan}

pytestmark = pytest.mark.filterwarnings("ignore")


def _batches():
  out = []
  for i, key in enumerate(jax.random.split(jax.random.PRNGKey(1), N + M)):
    x = jax.random.normal(key, (4, 3))
    if i in FAULTS:
      x = x.at[0, 1].set(FAULTS[i])
    out.append((x, jnp.sum(x, axis=1, keepdims=True)))
  return out


BATCHES = _batches()


def _tx(loss_scale=None):
  if loss_scale is None:
    loss_scale = ols.DynamicLossScale(initial_loss_scale=2.0**6, increment_period=2)
  return ols.loss_scale_optimizer(optax.adam(1e-2), loss_scale)


# -- TrainState (linen) -------------------------------------------------------

MODEL = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(1)])


# One transformation object: TrainState keeps `tx` in its treedef, so a fresh
# one per state would retrace the jitted step (and make treedefs unequal).
TX = _tx()


def _make_state(loss_scale=None, seed=0):
  params = MODEL.init(jax.random.PRNGKey(seed), jnp.ones((1, 3)))["params"]
  tx = TX if loss_scale is None else _tx(loss_scale)
  return TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


def _loss(params, x, y):
  return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


@jax.jit
def _train_step(state, x, y):
  _, grads = ols.value_and_grad(_loss)(state, state.params, x, y)
  return state.apply_gradients(grads=grads)


def _run(state, batches):
  for x, y in batches:
    state = _train_step(state, x, y)
  return state


@pytest.fixture(scope="module")
def uninterrupted():
  state = _run(_make_state(), BATCHES)
  assert int(ols.metrics(state)["total_skips"]) == len(FAULTS)
  return state


@pytest.fixture(scope="module")
def at_checkpoint():
  return _run(_make_state(), BATCHES[:N])


def _abstract_target():
  # Process-independent: only the code that builds the state, never its values.
  return jax.eval_shape(lambda: _make_state(seed=123))


def _assert_resumed_exactly(restored, at_checkpoint, uninterrupted):
  chex.assert_trees_all_equal(restored, at_checkpoint)
  chex.assert_trees_all_equal_dtypes(restored, at_checkpoint)
  resumed = _run(restored, BATCHES[N:])
  chex.assert_trees_all_equal(resumed, uninterrupted)  # params, opt_state, scale, counters, step
  assert resumed.loss_scale.get_config() == uninterrupted.loss_scale.get_config()


def test_orbax_standard_checkpointer_resumes_exactly(tmp_path, at_checkpoint, uninterrupted):
  path = tmp_path / "plain"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, at_checkpoint)
    checkpointer.wait_until_finished()
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, _abstract_target())
  _assert_resumed_exactly(restored, at_checkpoint, uninterrupted)


def test_orbax_helpers_resume_exactly_with_readable_keys(tmp_path, at_checkpoint, uninterrupted):
  path = tmp_path / "helpers"
  save_checkpoint(path, at_checkpoint)
  with ocp.StandardCheckpointer() as checkpointer:
    tree = checkpointer.metadata(path).item_metadata.tree
  assert set(tree["opt_state"]) == {
    "inner_state",
    "loss_scale",
    "last_step_applied",
    "consecutive_skips",
    "total_skips",
    "nonfinite_leaves",  # None unless record_nonfinite_leaves=True
    "retries",
    "total_retries",
  }
  assert set(tree["opt_state"]["loss_scale"]) == {"loss_scale", "counter", "hysteresis_tracker"}
  _assert_resumed_exactly(
    restore_checkpoint(path, _abstract_target()), at_checkpoint, uninterrupted
  )


def test_msgpack_resumes_exactly_with_readable_keys(tmp_path, at_checkpoint, uninterrupted):
  state_dict = serialization.to_state_dict(at_checkpoint)
  assert set(state_dict["opt_state"]["loss_scale"]) == {
    "loss_scale",
    "counter",
    "hysteresis_tracker",
  }
  assert int(state_dict["opt_state"]["total_skips"]) == 2
  path = tmp_path / "state.msgpack"
  path.write_bytes(serialization.to_bytes(at_checkpoint))
  restored = serialization.from_bytes(_abstract_target(), path.read_bytes())
  restored = jax.tree.map(jnp.asarray, restored)  # msgpack gives numpy arrays
  _assert_resumed_exactly(restored, at_checkpoint, uninterrupted)


def test_hyper_parameters_come_from_the_code(tmp_path, at_checkpoint):
  path = tmp_path / "ckpt"
  save_checkpoint(path, at_checkpoint)
  code_scale = ols.DynamicLossScale(initial_loss_scale=2.0**6, increment_period=7, multiplier=4)
  target = jax.eval_shape(lambda: _make_state(code_scale))
  restored = restore_checkpoint(path, target)
  assert restored.loss_scale.get_config() == code_scale.get_config()
  chex.assert_trees_all_equal(jax.tree.leaves(restored), jax.tree.leaves(at_checkpoint))


@pytest.mark.parametrize(
  ("saved", "target", "saved_name", "target_name"),
  [
    (None, 8.0, "DynamicLossScale", "FixedLossScale"),
    (ols.NoOpLossScale(), None, "FixedLossScale or NoOpLossScale", "DynamicLossScale"),
  ],
)
def test_loss_scale_kind_mismatch_is_a_clear_error(
  tmp_path, saved, target, saved_name, target_name
):
  state = _make_state(saved)
  abstract = jax.eval_shape(lambda: _make_state(target))
  pattern = rf"opt_state\.loss_scale.*a {saved_name} .*the target is a {target_name}"
  save_checkpoint(tmp_path / "ckpt", state)
  with pytest.raises(ValueError, match=pattern):
    restore_checkpoint(tmp_path / "ckpt", abstract)
  with pytest.raises(ValueError, match=rf"a {saved_name} .*the target is a {target_name}"):
    serialization.from_bytes(abstract, serialization.to_bytes(state))
  check_loss_scale_kind(state, jax.eval_shape(lambda: _make_state(saved)))  # same kind: fine


def test_mismatch_hint_names_built_in_kinds_whatever_user_subclasses_exist(tmp_path):
  class SameFieldsAsDynamic(ols.DynamicLossScale):  # registered as it is defined
    pass

  state = _make_state(None)
  abstract = jax.eval_shape(lambda: _make_state(8.0))
  with pytest.raises(ValueError, match=r"it holds the state of a DynamicLossScale \(keys"):
    serialization.from_bytes(abstract, serialization.to_bytes(state))
  assert ols.LossScale._registry["SameFieldsAsDynamic"] is SameFieldsAsDynamic


# -- NNX ----------------------------------------------------------------------


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _make_nnx(seed=0):
  model = MLP(nnx.Rngs(seed))
  return model, nnx.Optimizer(model, _tx(), wrt=nnx.Param)


@nnx.jit
def _nnx_step(model, optimizer, x, y):
  loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
  _, grads = nnx_value_and_grad(loss_fn)(optimizer, model)
  optimizer.update(model, grads)


def _nnx_run(model, optimizer, batches):
  for x, y in batches:
    _nnx_step(model, optimizer, x, y)


def _keys_as(tree, key):
  """`tree`'s nested dicts with every key mapped by `key`."""
  if isinstance(tree, dict):
    return {key(k): _keys_as(v, key) for k, v in tree.items()}
  return tree


def test_nnx_orbax_and_msgpack_resume_exactly(tmp_path):
  model, optimizer = _make_nnx()
  _nnx_run(model, optimizer, BATCHES)
  uninterrupted = nnx.to_pure_dict(nnx.state((model, optimizer)))

  model, optimizer = _make_nnx()
  _nnx_run(model, optimizer, BATCHES[:N])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "nnx", nnx.state((model, optimizer)))
    checkpointer.wait_until_finished()
  pure = nnx.to_pure_dict(nnx.state((model, optimizer)))
  assert set(pure[1]["opt_state"]["loss_scale"]) == {"loss_scale", "counter", "hysteresis_tracker"}
  # Flax's msgpack restores integer keys (the tuple's and the optimizer
  # state's indices) from 0.12.8 on only: store them as strings.
  (tmp_path / "nnx.msgpack").write_bytes(serialization.msgpack_serialize(_keys_as(pure, str)))

  def resume(restore):
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: _make_nnx(seed=123)))
    model, optimizer = nnx.merge(graphdef, restore(abstract_state))
    assert int(ols.metrics(optimizer)["total_skips"]) == 2
    _nnx_run(model, optimizer, BATCHES[N:])
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state((model, optimizer))), uninterrupted)

  def from_orbax(abstract_state):
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(tmp_path / "nnx", abstract_state)

  def from_msgpack(abstract_state):
    restored = serialization.msgpack_restore((tmp_path / "nnx.msgpack").read_bytes())
    restored = _keys_as(restored, lambda k: int(k) if k.isdigit() else k)
    nnx.replace_by_pure_dict(abstract_state, jax.tree.map(jnp.asarray, restored))
    return abstract_state

  resume(from_orbax)
  resume(from_msgpack)
