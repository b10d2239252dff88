"""`jax.jit` over a Mesh of 8 devices: the wrapper needs no axis_name there.

Under jit the finiteness check is a reduction over global arrays, so XLA
inserts the cross-device all-reduce itself; these tests prove that every
device makes the same skip decision and that shardings survive the wrapper.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
import md_model
import numpy as np
import optax
import pytest

import optax_lossscale as ols

STEPS = 5
NAN_STEPS = (2,)
NAN_ROW = 11  # the second row of device 5's slice of the batch

LAYOUTS = {
  "replicated": {"w1": P(), "b1": P(), "w2": P()},
  "fsdp": {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None)},
}


def _mesh(axis_type: AxisType) -> jax.sharding.Mesh:
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def _mesh_context(mesh: jax.sharding.Mesh) -> Any:
  # Explicit meshes must be ambient for jit; Auto ones work from the inputs alone.
  if mesh.axis_types[0] == AxisType.Explicit:
    return jax.set_mesh(mesh)
  return contextlib.nullcontext()


def _assert_same_shardings(got: Any, want: Any) -> None:
  """Leaf by leaf, the same devices hold the same slices (P('d') is P('d', None))."""
  for path, a, b in zip(
    [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)],
    jax.tree.leaves(got),
    jax.tree.leaves(want),
    strict=True,
  ):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (path, a.sharding, b.sharding)


def _assert_replicas_agree(x: jax.Array) -> None:
  """Every device holds the same bits of a replicated array."""
  assert x.sharding.is_fully_replicated, x.sharding
  copies = [np.asarray(s.data) for s in x.addressable_shards]
  assert len(copies) == 8
  for c in copies[1:]:
    np.testing.assert_array_equal(c, copies[0])


def _init_on_mesh(tx: ols.LossScaleOptimizer, params: Any, mesh: jax.sharding.Mesh) -> Any:
  """The optimizer state with moments sharded like `params` and scalars replicated."""
  if mesh.axis_types[0] == AxisType.Explicit:
    # Sharding is part of the type: jit's outputs follow the parameters.
    return jax.jit(tx.init)(params)
  # Under Auto, jit would put zeros_like(params) on one device; eager init keeps
  # the moments where the parameters are, and the scalars go on every device.
  replicated = NamedSharding(mesh, P())
  state = tx.init(params)
  return jax.device_put(
    state,
    jax.tree.map(
      lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, state
    ),
  )


@functools.cache
def _reference_run(skip_mode: str) -> tuple[Any, list[bool], list[float]]:
  """The same training on one device, no sharding."""
  tx = md_model.make_tx(skip_mode)
  step = jax.jit(md_model.make_train_step(tx))
  params = jax.device_put(md_model.init_params(), jax.devices()[0])
  opt_state = tx.init(params)
  applied, scales = [], []
  for i in range(STEPS):
    batch = md_model.make_batch(i, NAN_ROW if i in NAN_STEPS else None)
    params, opt_state = step(params, opt_state, jax.device_put(batch, jax.devices()[0]))
    applied.append(bool(ols.metrics(opt_state)["last_step_applied"]))
    scales.append(float(ols.get_loss_scale(opt_state)()))
  return params, applied, scales


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("skip_mode", ["cond", "select"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_jit_sharded_training_skips_everywhere_and_keeps_shardings(
  axis_type: AxisType, layout: str, skip_mode: str, fused: bool
) -> None:
  mesh = _mesh(axis_type)
  param_shardings = {k: NamedSharding(mesh, spec) for k, spec in LAYOUTS[layout].items()}
  batch_sharding = NamedSharding(mesh, P("data"))
  tx = md_model.make_tx(skip_mode)
  with _mesh_context(mesh):
    params = jax.device_put(md_model.init_params(), param_shardings)
    opt_state = _init_on_mesh(tx, params, mesh)
    gather = lambda p: p
    if axis_type == AxisType.Explicit:
      # Explicit sharding makes the FSDP all-gather part of the model code.
      gather = lambda p: jax.tree.map(lambda x: jax.reshard(x, P()), p)
    step = jax.jit(md_model.make_train_step(tx, gather, fused))
    params_in, state_in = params, opt_state
    # Adam's moments live where their parameters live.
    adam = opt_state.inner_state[0]
    _assert_same_shardings(adam.mu, params)
    _assert_same_shardings(adam.nu, params)

    expected = md_model.expected_scales(STEPS, NAN_STEPS)
    for i in range(STEPS):
      batch = md_model.make_batch(i, NAN_ROW if i in NAN_STEPS else None)
      batch = jax.device_put(batch, batch_sharding)
      new_params, new_state = step(params, opt_state, batch)

      ls = ols.get_loss_scale(new_state)
      for leaf in (ls.loss_scale, ls.counter, new_state.last_step_applied, new_state.total_skips):
        _assert_replicas_agree(leaf)
      want_scale, want_counter, want_applied = expected[i]
      assert bool(new_state.last_step_applied) is want_applied, i
      assert float(ls()) == want_scale and int(ls.counter) == want_counter, i
      if not want_applied:
        # Every shard of every parameter and moment is untouched, bit for bit.
        for new, old in ((new_params, params), (new_state.inner_state, opt_state.inner_state)):
          for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
            for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
              assert sa.device == sb.device
              np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))
      params, opt_state = new_params, new_state
      _assert_same_shardings(params, params_in)
      _assert_same_shardings(opt_state, state_in)

  assert int(opt_state.total_skips) == len(NAN_STEPS)
  ref_params, ref_applied, ref_scales = _reference_run(skip_mode)
  assert ref_applied == [e[2] for e in expected]
  assert ref_scales == [e[0] for e in expected]
  # Sharded reductions sum in another order than one device does.
  chex.assert_trees_all_close(
    jax.device_get(params), jax.device_get(ref_params), rtol=1e-5, atol=1e-7
  )


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_jit_nan_in_one_gradient_shard_skips_on_every_device(skip_mode: str) -> None:
  """Only device 3 holds a non-finite gradient entry; all 8 devices still skip."""
  mesh = _mesh(AxisType.Auto)
  sharded = NamedSharding(mesh, P("data"))
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), ols.DynamicLossScale(4.0), skip_mode=skip_mode)
  w = jax.device_put(jnp.arange(16.0), sharded)
  opt_state = jax.jit(tx.init)(w)

  @jax.jit
  def step(w: jax.Array, opt_state: Any, x: jax.Array) -> tuple[jax.Array, Any]:
    grads = jax.grad(lambda w: ols.get_scaled_loss(jnp.sum(w * x), opt_state))(w)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state

  x = np.ones(16, np.float32)
  x[7] = np.inf  # d loss / d w[7] lives on device 3 only
  x = jax.device_put(x, sharded)
  assert [bool(np.isinf(np.asarray(s.data)).any()) for s in x.addressable_shards] == [
    d == 3 for d in range(8)
  ]
  new_w, new_state = step(w, opt_state, x)
  assert not bool(new_state.last_step_applied)
  np.testing.assert_array_equal(np.asarray(new_w), np.arange(16.0))
  _assert_replicas_agree(new_state.loss_scale.loss_scale)
  assert float(ols.get_loss_scale(new_state)()) == 2.0
  _assert_same_shardings(new_w, w)

  # The same step with finite inputs moves every shard: the skip was the NaN's doing.
  new_w, new_state = step(w, opt_state, jax.device_put(jnp.ones(16), sharded))
  assert bool(new_state.last_step_applied)
  np.testing.assert_array_equal(np.asarray(new_w), np.arange(16.0) - 0.5)
