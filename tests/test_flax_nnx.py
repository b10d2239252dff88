"""Tests for loss scaling with Flax NNX: `nnx.Optimizer` and `nnx_value_and_grad`."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytest.importorskip("flax")
from flax import nnx

from optax_lossscale.flax import nnx_value_and_grad

INITIAL_SCALE = 2.0**6
PERIOD = 3
FAULTS = {1: np.nan, 4: np.inf, 5: -np.inf}
STEPS = 9


class MLP(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    self.hidden = nnx.Linear(3, 8, **kw)
    self.out = nnx.Linear(8, 1, **kw)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _batches(steps=STEPS, faults=FAULTS):
  out = []
  for i, key in enumerate(jax.random.split(jax.random.PRNGKey(1), steps)):
    x = jax.random.normal(key, (4, 3))
    if i in faults:
      x = x.at[0, 1].set(faults[i])
    out.append((x, jnp.sum(x, axis=1, keepdims=True)))
  return out


def _loss(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def _tx(skip_mode="cond"):
  ls = ols.DynamicLossScale(initial_loss_scale=INITIAL_SCALE, increment_period=PERIOD)
  return ols.loss_scale_optimizer(optax.adam(1e-2), ls, skip_mode=skip_mode)


@nnx.jit
def _train_step(model, optimizer, x, y):
  loss, grads = nnx_value_and_grad(_loss)(optimizer, model, x, y)
  optimizer.update(model, grads)
  return loss, ols.metrics(optimizer)


def _pure_params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _reference_run(batches):
  """Plain optax adam on the pure parameters, applied only on finite steps."""
  graphdef, param_state, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)
  params = nnx.to_pure_dict(param_state)
  inner = optax.adam(1e-2)
  inner_state = inner.init(params)
  # Both trees flatten in sorted-key order, so leaves carry over one to one.
  as_state = lambda p: jax.tree.unflatten(jax.tree.structure(param_state), jax.tree.leaves(p))

  @jax.jit
  def scaled_grad(params, x, y, s):
    f = lambda p: _loss(nnx.merge(graphdef, as_state(p), rest), x, y) * s
    return jax.grad(f)(params)

  scale, skips, applied, counter = INITIAL_SCALE, 0, 0, 0
  for x, y in batches:
    grads = jax.tree.map(lambda g, s=scale: g / jnp.float32(s), scaled_grad(params, x, y, scale))
    if all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)):
      updates, inner_state = inner.update(grads, inner_state, params)
      params = optax.apply_updates(params, updates)
      applied, counter = applied + 1, counter + 1
      if counter >= PERIOD:
        scale, counter = scale * 2, 0
    else:
      scale, counter, skips = max(scale / 2, 1.0), 0, skips + 1
  return params, inner_state, scale, skips, applied


class NNXOptimizerTest(chex.TestCase):
  def test_fault_injected_run_equals_reference(self):
    batches = _batches()
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    losses = []
    for x, y in batches:
      loss, _ = _train_step(model, optimizer, x, y)
      losses.append(loss)
    params, inner_state, scale, skips, applied = _reference_run(batches)
    chex.assert_trees_all_close(_pure_params(model), params, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(
      nnx.to_pure_dict(nnx.state(optimizer.opt_state))["inner_state"][0]["mu"],
      inner_state[0].mu,
      rtol=1e-5,
      atol=1e-9,
    )
    m = ols.metrics(optimizer)
    self.assertEqual(float(m["loss_scale"]), scale)
    self.assertEqual(int(m["total_skips"]), skips)
    self.assertEqual(skips, len(FAULTS))
    self.assertEqual(int(optimizer.opt_state.inner_state[0].count[...]), applied)
    # nnx.Optimizer's own step counts calls, skipped ones included.
    self.assertEqual(int(optimizer.step[...]), STEPS)
    for i in FAULTS:
      self.assertFalse(bool(jnp.isfinite(losses[i])))

  def test_skipped_step_leaves_model_and_optimizer_state_untouched(self):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    (x, y), (bad_x, _) = _batches(2, {1: np.nan})
    _train_step(model, optimizer, x, y)
    params_before = _pure_params(model)
    inner_before = nnx.to_pure_dict(nnx.state(optimizer.opt_state))["inner_state"]
    _, m = _train_step(model, optimizer, bad_x, y)
    chex.assert_trees_all_equal(_pure_params(model), params_before)
    chex.assert_trees_all_equal(
      nnx.to_pure_dict(nnx.state(optimizer.opt_state))["inner_state"], inner_before
    )
    self.assertFalse(bool(m["last_step_applied"]))
    self.assertEqual(float(m["loss_scale"]), INITIAL_SCALE / 2)

  def test_get_loss_scale_and_metrics_return_plain_arrays(self):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    ls = ols.get_loss_scale(optimizer)
    self.assertEqual(ls, ols.DynamicLossScale(INITIAL_SCALE, PERIOD))
    leaves = [ls.loss_scale, ls.counter, ls.hysteresis_tracker, *ols.metrics(optimizer).values()]
    for leaf in leaves:
      self.assertIsInstance(leaf, jax.Array)
    # Inside nnx.jit too: the returned metrics are arrays, not Variables.
    _, m = _train_step(model, optimizer, *_batches(1, {})[0])
    for value in m.values():
      self.assertIsInstance(value, jax.Array)

  def test_value_is_the_unscaled_loss_with_aux(self):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    x, y = _batches(1, {})[0]

    def loss_with_aux(model, x, y):
      pred = model(x)
      return jnp.mean((pred - y) ** 2), pred

    fn = nnx_value_and_grad(loss_with_aux, has_aux=True)
    (loss, pred), grads = fn(optimizer, model, x, y)
    expected = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2) * INITIAL_SCALE)(model)
    chex.assert_trees_all_equal(loss, jnp.mean((model(x) - y) ** 2))
    chex.assert_trees_all_equal(pred, model(x))
    chex.assert_trees_all_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(expected), rtol=1e-6)

  def test_diff_state_argnums(self):
    model = MLP(nnx.Rngs(0))
    x, y = _batches(1, {})[0]
    only_out = nnx.DiffState(0, nnx.PathContains("out"))
    _, grads = nnx_value_and_grad(_loss, argnums=only_out)(ols.FixedLossScale(2.0), model, x, y)
    self.assertEqual(set(nnx.to_pure_dict(grads)), {"out"})

  def test_bf16_params_with_f32_grads_and_cond(self):
    model = MLP(nnx.Rngs(0), param_dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(model, _tx("cond"), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
      _, grads = nnx_value_and_grad(_loss)(optimizer, model, x, y)
      optimizer.update(model, jax.tree.map(lambda g: g.astype(jnp.float32), grads))

    for i, (x, y) in enumerate(_batches(4, {2: np.inf})):
      before = _pure_params(model)
      step(model, optimizer, x, y)
      after = _pure_params(model)
      chex.assert_trees_all_equal_dtypes(after, before)
      if i == 2:
        chex.assert_trees_all_equal(after, before)
      else:
        self.assertTrue(bool(jnp.any(after["hidden"]["kernel"] != before["hidden"]["kernel"])))
    m = ols.metrics(optimizer)
    self.assertEqual((int(m["total_skips"]), float(m["loss_scale"])), (1, INITIAL_SCALE / 2))


def test_nonfinite_leaves_metric_has_the_same_keys_as_with_plain_optax():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10, record_nonfinite_leaves=True)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  loss_fn = lambda m, x: jnp.sum(m(x) ** 2)
  _, grads = nnx_value_and_grad(loss_fn)(optimizer, model, jnp.array([[jnp.inf, 1.0]]))
  optimizer.update(model, grads)
  flags = ols.metrics(optimizer)["nonfinite_leaves"]
  assert set(flags) == {"['bias']", "['kernel']"}
  assert all(bool(v) for v in flags.values())
