"""bfloat16 parameters through Flax: the Linen TrainState, NNX, Orbax resume."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests import assert_trees_equal_across_programs

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
from flax import linen as nn
from flax import nnx

from optax_lossscale.flax import (
  TrainState,
  nnx_value_and_grad,
  restore_checkpoint,
  save_checkpoint,
)

BF16 = jnp.bfloat16
SCALE = 2.0**8
MODEL = nn.Sequential(
  [nn.Dense(16, param_dtype=BF16), nn.tanh, nn.Dense(1, param_dtype=BF16)]
)  # bfloat16 parameters, float32 compute
N, M = 5, 4  # steps before and after the checkpoint
FAULTS = {2: np.nan, 6: np.inf}


def _batches():
  out = []
  for i, key in enumerate(jax.random.split(jax.random.PRNGKey(1), N + M)):
    x = jax.random.normal(key, (8, 3))
    if i in FAULTS:
      x = x.at[0, 1].set(FAULTS[i])
    out.append((x, jnp.sum(x, axis=1, keepdims=True)))
  return out


BATCHES = _batches()


def _loss(params, x, y):
  return jnp.mean((MODEL.apply({"params": params}, x).astype(jnp.float32) - y) ** 2)


def _params(seed=0):
  return MODEL.init(jax.random.PRNGKey(seed), jnp.ones((1, 3)))["params"]


def reference_run(inner, batches, scale=None):
  """The hand-written master loop over `batches`, skipping the non-finite ones."""
  params = _params()
  master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state = inner.init(master)

  @jax.jit
  def step(params, master, state, x, y):
    if scale is None:
      grads = jax.grad(_loss)(params, x, y)
    else:
      grads = jax.grad(lambda p: _loss(p, x, y) * scale)(params)
      grads = jax.tree.map(lambda g: g * jnp.asarray(1 / scale, g.dtype), grads)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = inner.update(grads, state, master)
    master = optax.apply_updates(master, updates)
    return jax.tree.map(lambda m: m.astype(BF16), master), master, state

  history = []
  for i, (x, y) in enumerate(batches):
    if i not in FAULTS:
      params, master, state = step(params, master, state, x, y)
    history.append((params, master, state))
  return history


# -- Linen TrainState ---------------------------------------------------------

TXS = {
  "wrapped": ols.loss_scale_optimizer(
    ols.master_weights(optax.adam(1e-3)), ols.DynamicLossScale(SCALE, increment_period=1000)
  ),
  "alone": ols.master_weights(optax.adam(1e-3)),
  "rounded": ols.loss_scale_optimizer(
    ols.stochastic_rounding(optax.adam(1e-3), key=0),
    ols.DynamicLossScale(SCALE, increment_period=1000),
  ),
  # 8-bit moments (every leaf: the model is small) and a 16-bit master remainder.
  "quantized": ols.loss_scale_optimizer(
    ols.master_weights(
      ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "fp8"}, quantize_min_size=0),
      store="remainder",
    ),
    ols.DynamicLossScale(SCALE, increment_period=1000),
  ),
}


def _make_state(name, seed=0):
  return TrainState.create(apply_fn=MODEL.apply, params=_params(seed), tx=TXS[name])


@jax.jit
def _train_step(state, x, y):
  if isinstance(state.opt_state, ols.LossScaleOptimizerState):
    _, grads = ols.value_and_grad(_loss)(state, state.params, x, y)
  else:
    grads = jax.grad(_loss)(state.params, x, y)
  return state.apply_gradients(grads=grads)


def _run(state, batches):
  history = []
  for x, y in batches:
    state = _train_step(state, x, y)
    history.append(state)
  return history


def test_train_state_with_loss_scaled_master_weights_is_the_master_loop_bit_for_bit():
  reference = reference_run(optax.adam(1e-3), BATCHES, scale=SCALE)
  states = _run(_make_state("wrapped"), BATCHES)
  for i, (state, (params, master, inner_state)) in enumerate(zip(states, reference, strict=True)):
    # Two programs: bit for bit on CPU (see assert_trees_equal_across_programs),
    # elsewhere within units of the bfloat16 parameters the float32 state follows.
    assert_trees_equal_across_programs(state.params, params, narrowest=BF16)
    chex.assert_trees_all_equal_dtypes(state.params, params)
    assert_trees_equal_across_programs(state.opt_state.inner_state.master, master, narrowest=BF16)
    inner = state.opt_state.inner_state.inner_state
    assert_trees_equal_across_programs(inner, inner_state, narrowest=BF16)
    assert bool(state.opt_state.last_step_applied) == (i not in FAULTS)
    assert int(state.step) == sum(j not in FAULTS for j in range(i + 1))
  assert not bool(
    jnp.all(states[-1].params["layers_0"]["kernel"] == _params()["layers_0"]["kernel"])
  )


def test_train_state_with_master_weights_alone_applies_every_step():
  clean = [(x, y) for i, (x, y) in enumerate(BATCHES) if i not in FAULTS]
  reference = [r for i, r in enumerate(reference_run(optax.adam(1e-3), BATCHES)) if i not in FAULTS]
  states = _run(_make_state("alone"), clean)
  for i, (state, (params, master, _)) in enumerate(zip(states, reference, strict=True)):
    chex.assert_trees_all_equal(state.params, params)
    chex.assert_trees_all_equal(state.opt_state.master, master)
    assert int(state.step) == i + 1


def test_train_state_refuses_what_it_cannot_step():
  with pytest.raises(ValueError, match="or a master_weights"):
    TrainState.create(apply_fn=MODEL.apply, params=_params(), tx=optax.adam(1e-3))
  fp8 = {**_params(), "_overwrite_with_gradient": {"kernel_scale": jnp.ones(1)}}
  with pytest.raises(ValueError, match="fp8 'overwrite with gradient' collection"):
    TrainState.create(apply_fn=None, params=fp8, tx=ols.master_weights(optax.adam(1e-3)))


# -- Orbax: resume exactly ----------------------------------------------------


@pytest.mark.parametrize("name", ["wrapped", "rounded", "quantized"])
def test_orbax_resume_is_exact(tmp_path, name):
  uninterrupted = _run(_make_state(name), BATCHES)[-1]
  at_checkpoint = _run(_make_state(name), BATCHES[:N])[-1]
  save_checkpoint(tmp_path / "ckpt", at_checkpoint)
  # The target comes from the code alone (another seed: only shapes and dtypes count).
  restored = restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(lambda: _make_state(name, 7)))
  chex.assert_trees_all_equal(restored, at_checkpoint)
  chex.assert_trees_all_equal_dtypes(restored, at_checkpoint)
  resumed = _run(restored, BATCHES[N:])[-1]
  chex.assert_trees_all_equal(resumed, uninterrupted)
  if name == "wrapped":
    assert restored.opt_state.inner_state.master["layers_0"]["kernel"].dtype == jnp.float32
  elif name == "quantized":
    adam = restored.opt_state.inner_state.inner_state[0]
    assert restored.opt_state.inner_state.master["layers_0"]["kernel"].dtype == jnp.int16
    assert isinstance(adam.mu["layers_0"]["kernel"], ols.QuantizedArray)
    assert adam.nu["layers_0"]["kernel"].codes.dtype == jnp.float8_e4m3fn
  else:
    assert restored.opt_state.inner_state.key.dtype == jnp.uint32


def test_msgpack_round_trip_of_quantized_state_is_exact():
  from flax import serialization

  at_checkpoint = _run(_make_state("quantized"), BATCHES[:N])[-1]
  target = jax.eval_shape(lambda: _make_state("quantized", 7))
  restored = serialization.from_bytes(target, serialization.to_bytes(at_checkpoint))
  chex.assert_trees_all_equal(restored.opt_state, at_checkpoint.opt_state)
  chex.assert_trees_all_equal_dtypes(restored.opt_state, at_checkpoint.opt_state)


# -- NNX ----------------------------------------------------------------------


class Net(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 16, param_dtype=BF16, rngs=rngs)
    self.out = nnx.Linear(16, 1, param_dtype=BF16, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def _nnx_loss(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def _pure(model):
  state = nnx.state(model, nnx.Param)
  return jax.tree.map(lambda v: v, nnx.to_pure_dict(state))


def test_nnx_optimizer_writes_the_master_rounded_through_update_and_apply_updates():
  model = Net(nnx.Rngs(0))
  start = _pure(model)
  optimizer = nnx.Optimizer(model, ols.master_weights(optax.adam(1e-3)), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(_nnx_loss)(model, x, y))

  master = jax.tree.map(lambda p: p.astype(jnp.float32), start)
  inner = optax.adam(1e-3)
  inner_state = inner.init(master)
  params = start
  for i, (x, y) in enumerate(BATCHES):
    if i in FAULTS:
      continue
    step(model, optimizer, x, y)
    reference = Net(nnx.Rngs(0))
    nnx.update(reference, nnx.State(params))
    grads = _pure_state(nnx.grad(_nnx_loss)(reference, x, y))
    updates, inner_state = inner.update(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), inner_state, master
    )
    master = optax.apply_updates(master, updates)
    params = jax.tree.map(lambda m: m.astype(BF16), master)
    # A jitted step and eager ops: bit for bit on CPU (a GPU differed by one
    # bfloat16 ulp in 2 of 16 biases: see assert_trees_equal_across_programs).
    assert_trees_equal_across_programs(_pure(model), params)
  assert not bool(jnp.all(_pure(model)["hidden"]["kernel"] == start["hidden"]["kernel"]))


def _pure_state(state):
  return nnx.to_pure_dict(state)


def test_nnx_loss_scaled_master_weights_skip_a_nan_step():
  model = Net(nnx.Rngs(0))
  tx = ols.loss_scale_optimizer(ols.master_weights(optax.adam(1e-3)), ols.DynamicLossScale(SCALE))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    _, grads = nnx_value_and_grad(_nnx_loss)(optimizer, model, x, y)
    optimizer.update(model, grads)

  x, y = BATCHES[0]
  step(model, optimizer, x, y)
  before, master = _pure(model), jax.tree.map(jnp.copy, _master(optimizer))
  step(model, optimizer, x.at[0, 0].set(jnp.nan), y)
  chex.assert_trees_all_equal(_pure(model), before)
  chex.assert_trees_all_equal(_master(optimizer), master)
  assert int(ols.metrics(optimizer)["total_skips"]) == 1


def _master(optimizer):
  inner = optimizer.opt_state.inner_state
  return nnx.to_pure_dict(nnx.state(inner.master)) if hasattr(inner, "master") else None
