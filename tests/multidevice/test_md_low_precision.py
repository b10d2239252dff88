"""16-bit parameters on 8 devices: the master copy sharded like its parameter, and
stochastic rounding's bits drawn per shard, reproducibly.

The gradients are given arrays (not computed from a loss, whose reductions a
sharded program may order differently), so every step is elementwise and a
sharded run must equal the single-device one bit for bit.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_lossscale as ols

BF16 = jnp.bfloat16
SPECS = {"w": P(None, "data"), "b": P("data"), "c": P()}


def _mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((8,), ("data",))


def _params() -> dict[str, jax.Array]:
  return {
    "w": (1.0 + jnp.linspace(-0.1, 0.1, 16 * 64).reshape(16, 64)).astype(BF16),
    "b": jnp.linspace(-1.0, 1.0, 64).astype(BF16),
    "c": jnp.linspace(0.0, 1.0, 8),  # float32: no master copy
  }


def _grads(step: int) -> dict[str, jax.Array]:
  return jax.tree.map(
    lambda p: (
      (jnp.cos(jnp.arange(p.size, dtype=jnp.float32) + step) * 1e-2)
      .reshape(p.shape)
      .astype(p.dtype)
    ),
    _params(),
  )


def _place(tree, mesh):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, SPECS)


def _run(tx, params, grads_of, steps=4):
  step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
  state = tx.init(params)
  for i in range(steps):
    params, state = step(grads_of(i), state, params)
  return params, state


def test_master_copy_is_sharded_like_its_parameter_and_steps_like_one_device():
  mesh = _mesh()
  tx = ols.loss_scale_optimizer(ols.master_weights(optax.adam(1e-3)), ols.DynamicLossScale(1.0))
  sharded = _place(_params(), mesh)
  state = tx.init(sharded)
  for name in ("w", "b"):
    master = state.inner_state.master[name]
    assert master.dtype == jnp.float32
    assert master.sharding.is_equivalent_to(sharded[name].sharding, master.ndim), name
  assert state.inner_state.master["c"] is None
  params, state = _run(tx, sharded, lambda i: _place(_grads(i), mesh))
  for name in ("w", "b"):
    master = state.inner_state.master[name]
    assert master.sharding.is_equivalent_to(sharded[name].sharding, master.ndim), name
    assert params[name].sharding.is_equivalent_to(sharded[name].sharding, master.ndim), name
  one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), _params())
  expected, expected_state = _run(tx, one_device, _grads)
  chex.assert_trees_all_equal(params, expected)
  chex.assert_trees_all_equal(state.inner_state, expected_state.inner_state)


def test_stochastic_rounding_under_jit_draws_each_shard_where_it_lives_reproducibly():
  mesh = _mesh()
  tx = ols.stochastic_rounding(optax.sgd(2.0**-10), key=jax.random.key(3))
  ones = {"w": jnp.ones((8, 1024), BF16)}
  specs = {"w": P("data")}
  sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), ones, specs)
  grads = lambda i: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), ones, specs
  )
  first, _ = _run(tx, sharded, grads, steps=1)
  again, _ = _run(tx, sharded, grads, steps=1)
  chex.assert_trees_all_equal(first, again)
  assert first["w"].sharding.is_equivalent_to(sharded["w"].sharding, 2)
  # Each shard got its own bits: eight different patterns of about a quarter down.
  shards = [np.asarray(s.data) for s in first["w"].addressable_shards]
  assert len(shards) == 8
  for a, b in itertools.combinations(shards, 2):
    assert not np.array_equal(a, b)
  for s in shards:
    assert abs(np.mean(s.astype(np.float32) < 1) - 0.25) < 0.06
  # The bits of an element do not depend on the layout: one device draws the same.
  alone, _ = _run(tx, jax.device_put(ones, jax.devices()[0]), lambda i: ones, steps=1)
  chex.assert_trees_all_equal(first, alone)


def test_stochastic_rounding_in_shard_map_folds_in_the_shard_of_a_varying_parameter():
  mesh = jax.make_mesh((8,), ("d",))
  tx = ols.stochastic_rounding(optax.sgd(2.0**-10), key=0)
  params = {"sharded": jnp.ones((8, 512), BF16), "replicated": jnp.ones(512, BF16)}
  specs = {"sharded": P("d"), "replicated": P()}
  put = lambda tree, specs: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  params = put(params, specs)
  state = tx.init(params)
  state_specs = jax.tree.map(lambda _: P(), state)
  state = put(state, state_specs)

  def step(params, state):
    return ols.apply_gradients(tx, jax.tree.map(jnp.ones_like, params), state, params)

  mapped = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs), out_specs=(specs, state_specs))
  )
  new, new_state = mapped(params, state)
  again, _ = mapped(params, state)
  chex.assert_trees_all_equal(new, again)  # reproducible for this mesh
  shards = [np.asarray(s.data) for s in new["sharded"].addressable_shards]
  for a, b in itertools.combinations(shards, 2):
    assert not np.array_equal(a, b)
  # The replicated parameter was rounded with the same bits on every device
  # (out_specs P() is checked by shard_map), and the key advanced once.
  copies = [np.asarray(s.data) for s in new["replicated"].addressable_shards]
  for c in copies[1:]:
    np.testing.assert_array_equal(c, copies[0])
  assert 0.15 < float(jnp.mean(new["replicated"] < 1)) < 0.35
  expected = jax.random.split(jax.random.wrap_key_data(state.key))[1]
  np.testing.assert_array_equal(new_state.key, jax.random.key_data(expected))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_quantized_moments_and_remainder_are_sharded_like_the_parameter(axis_type):
  # Rows of 512 sharded over 'data': each block (256 along a row) lies within a
  # shard, so the codes, the scales and the remainder stay where the parameter is;
  # a parameter sharded along its last axis still steps as on one device (its
  # blocks then span shards: with Explicit axes its rows are gathered for it).
  axis_type = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  specs = {"rows": P("data", None), "cols": P(None, "data")}
  params = {
    "rows": (1.0 + jnp.linspace(-0.1, 0.1, 64 * 512).reshape(64, 512)).astype(BF16),
    "cols": jnp.linspace(-1.0, 1.0, 16 * 512).reshape(16, 512).astype(BF16),
  }
  grads = lambda i: jax.tree.map(
    lambda p: (
      (jnp.cos(jnp.arange(p.size, dtype=jnp.float32) * 0.1 + i) * 1e-2)
      .reshape(p.shape)
      .astype(BF16)
    ),
    params,
  )
  place = lambda tree: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  tx = ols.loss_scale_optimizer(
    ols.master_weights(
      ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "q8"}), store="remainder"
    ),
    ols.DynamicLossScale(1.0),
  )
  sharded, state = _run(tx, place(params), lambda i: place(grads(i)))
  inner = state.inner_state
  for name in specs:
    want = sharded[name].sharding
    assert inner.master[name].dtype == jnp.int16
    assert inner.master[name].sharding.is_equivalent_to(want, 2), name
    for moment in (inner.inner_state[0].mu[name], inner.inner_state[0].nu[name]):
      assert isinstance(moment, ols.QuantizedArray)
      assert moment.codes.sharding.is_equivalent_to(want, 2), name
  scales = inner.inner_state[0].mu["rows"].scales
  assert scales.shape == (64, 2)
  assert scales.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
  one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), params)
  expected, expected_state = _run(tx, one_device, grads)
  chex.assert_trees_all_equal(sharded, expected)
  chex.assert_trees_all_equal(state.inner_state, expected_state.inner_state)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_8_bit_moments_of_float32_parameters_step_sharded_as_on_one_device(axis_type):
  # state_dtypes' own fused step (no writer around it) writes each parameter's codes
  # after its new value and before the next parameter's loops (schedule.after_whole,
  # a one-element read through a conditional): sharded, the same as on one device.
  axis_type = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  specs = {"rows": P("data", None), "cols": P(None, "data"), "small": P()}
  params = {
    "rows": jnp.linspace(-1.0, 1.0, 64 * 512).reshape(64, 512),
    "cols": jnp.linspace(0.5, 1.0, 16 * 512).reshape(16, 512),
    "small": jnp.ones(8),  # under quantize_min_size: float32 moments
  }
  grads = lambda i: jax.tree.map(lambda p: jnp.cos(p * 37.0 + i) * 1e-2, params)
  place = lambda tree: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  tx = ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "fp8"})
  with jax.set_mesh(mesh):
    sharded, state = _run(tx, place(params), lambda i: place(grads(i)))
  for name in ("rows", "cols"):
    assert isinstance(state[0].mu[name], ols.QuantizedArray), name
    assert sharded[name].sharding.is_equivalent_to(NamedSharding(mesh, specs[name]), 2)
  one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), params)
  expected, expected_state = _run(tx, one_device, grads)
  chex.assert_trees_all_equal(sharded, expected)
  chex.assert_trees_all_equal(state, expected_state)
