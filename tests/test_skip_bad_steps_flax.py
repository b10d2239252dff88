"""skip_bad_steps with Flax: `TrainState`, `nnx.Optimizer` and an exact Orbax resume."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
from flax import nnx

from optax_lossscale.flax import TrainState, restore_checkpoint, save_checkpoint

FAULTS = {2: "nan", 6: "spike", 8: "inf"}
STEPS = 10


def make_params():
  return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([-0.0, 0.5, 1.0])}


def make_batch(step):
  x = jnp.cos(jnp.arange(8.0).reshape(4, 2) + step)
  fault = FAULTS.get(step)
  if fault == "nan":
    x = x.at[0, 0].set(jnp.nan)
  elif fault == "inf":
    x = x.at[1, 1].set(jnp.inf)
  elif fault == "spike":
    x = x * 300.0
  return x


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def make_guard(inner=None):
  return ols.skip_bad_steps(
    inner or optax.adam(1e-2), spike_threshold=5.0, warmup_steps=3, ema_decay=0.9
  )


@pytest.mark.parametrize("composed", [False, True], ids=["alone", "in_loss_scale"])
def test_train_state_keeps_params_and_step_on_every_skip(composed):
  tx = make_guard()
  if composed:
    tx = ols.loss_scale_optimizer(tx, ols.DynamicLossScale(2.0**8, increment_period=1000))
  state = TrainState.create(apply_fn=None, params=make_params(), tx=tx)

  @jax.jit
  def step(state, x):
    if composed:
      grads = ols.value_and_grad(loss_fn)(state, state.params, x)[1]
    else:
      grads = jax.grad(loss_fn)(state.params, x)
    return state.apply_gradients(grads=grads)

  for t in range(STEPS):
    new = step(state, make_batch(t))
    if t in FAULTS:
      chex.assert_trees_all_equal(new.params, state.params)  # bit for bit, -0.0 included
      assert int(new.step) == int(state.step)
    else:
      assert int(new.step) == int(state.step) + 1
    state = new
  m = ols.metrics(state)
  assert int(state.step) == STEPS - 3
  assert int(m["total_skips"]) == 3 and int(m["spike_skips"]) == 1
  if composed:  # the loss scale catches the non-finite steps first
    assert int(m["overflow_skips"]) == 2 and int(m["nonfinite_skips"]) == 0
  else:
    assert int(m["nonfinite_skips"]) == 2


def test_train_state_without_a_skipping_wrapper_is_rejected():
  with pytest.raises(ValueError, match="skip_bad_steps"):
    TrainState.create(apply_fn=None, params=make_params(), tx=optax.sgd(0.1))


class Linear(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(2, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)


def test_nnx_optimizer_skips_and_reports_metrics():
  model = Linear(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, make_guard(), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return ols.metrics(optimizer)

  for t in range(STEPS):
    before = nnx.state(model, nnx.Param)
    m = train_step(model, optimizer, make_batch(t))
    if t in FAULTS:
      chex.assert_trees_all_equal(nnx.state(model, nnx.Param), before)
    assert bool(m["last_step_applied"]) == (t not in FAULTS)
  assert int(m["nonfinite_skips"]) == 2 and int(m["spike_skips"]) == 1
  assert float(m["grad_norm"]) > 0


def test_orbax_resume_is_exact(tmp_path):
  tx = make_guard()
  make = lambda: TrainState.create(apply_fn=None, params=make_params(), tx=tx)
  step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(loss_fn)(s.params, x)))
  state = make()
  for t in range(5):
    state = step(state, make_batch(t))
  save_checkpoint(tmp_path / "ckpt", state)
  restored = restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(make))
  chex.assert_trees_all_equal(restored.opt_state, state.opt_state)
  for t in range(5, STEPS):
    state = step(state, make_batch(t))
    restored = step(restored, make_batch(t))
  chex.assert_trees_all_equal(restored.params, state.params)
  chex.assert_trees_all_equal(restored.opt_state, state.opt_state)
  assert int(ols.metrics(restored)["total_skips"]) == 3


def test_nnx_optimizer_passes_the_loss_on():
  model = Linear(nnx.Rngs(0))
  tx = ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=6.0, monitor="loss", warmup_steps=2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.mean(m(make_batch(0)) ** 2))(model)
  for loss in (1.0, 1.02, 0.99, 100.0):
    optimizer.update(model, grads, loss=jnp.float32(loss))
  m = ols.metrics(optimizer)
  assert int(m["spike_skips"]) == 1 and float(m["loss"]) == 100.0
