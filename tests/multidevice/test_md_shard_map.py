"""`shard_map` and `pmap`: per-device gradient shards need `axis_name`.

Inside a mapped function each device sees only its own shard, so a local
finiteness check answers for that shard alone. These tests show the shards
disagree without `axis_name`, agree with it (one name or a tuple), and that
the full wrapper then skips on every shard and keeps the state replicated.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_lossscale as ols

BAD_SHARD = 5  # device holding the only non-finite gradient entry


def _mesh_1d() -> jax.sharding.Mesh:
  return jax.make_mesh((8,), ("d",))


def _grads(bad: bool = True) -> np.ndarray:
  """16 gradient entries, two per device; entry 11 (device 5) is NaN if `bad`."""
  g = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
  if bad:
    g[2 * BAD_SHARD + 1] = np.nan
  return g


def _on(mesh: jax.sharding.Mesh, x: Any, spec: P) -> Any:
  return jax.device_put(x, NamedSharding(mesh, spec))


def test_all_finite_per_shard_disagrees_without_axis_name_and_agrees_with_it() -> None:
  mesh = _mesh_1d()

  def per_shard(axis_name: Any) -> np.ndarray:
    f = jax.shard_map(
      lambda g: ols.all_finite(g, axis_name=axis_name)[None],
      mesh=mesh,
      in_specs=P("d"),
      out_specs=P("d"),  # one answer per shard, so disagreement is visible
    )
    with jax.set_mesh(mesh):
      return np.asarray(jax.jit(f)(_on(mesh, _grads(), P("d"))))

  np.testing.assert_array_equal(per_shard(None), [d != BAD_SHARD for d in range(8)])
  np.testing.assert_array_equal(per_shard("d"), [False] * 8)
  np.testing.assert_array_equal(per_shard(("d",)), [False] * 8)


def test_loss_scale_update_per_shard_with_and_without_axis_name() -> None:
  mesh = _mesh_1d()
  ls = ols.DynamicLossScale(initial_loss_scale=64.0, increment_period=1)

  def per_shard(axis_name: Any) -> tuple[np.ndarray, np.ndarray]:
    def f(g: jax.Array, ls: ols.DynamicLossScale) -> tuple[jax.Array, jax.Array]:
      new_ls, ok = ls.update(g, axis_name=axis_name)
      return new_ls.loss_scale[None], ok[None]

    f = jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P("d")))
    with jax.set_mesh(mesh):
      scales, ok = jax.jit(f)(_on(mesh, _grads(), P("d")), ls)
    return np.asarray(scales), np.asarray(ok)

  scales, ok = per_shard(None)
  # Seven shards would grow the scale and apply; one would back off and skip.
  np.testing.assert_array_equal(ok, [d != BAD_SHARD for d in range(8)])
  np.testing.assert_array_equal(scales, [32.0 if d == BAD_SHARD else 128.0 for d in range(8)])
  scales, ok = per_shard("d")
  np.testing.assert_array_equal(ok, [False] * 8)
  np.testing.assert_array_equal(scales, [32.0] * 8)


def test_tuple_of_axes_agrees_across_all_of_them_and_one_name_only_along_it() -> None:
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  g = np.ones(16, np.float32)
  g[2 * 6] = np.inf  # device (x=1, y=2) in row-major order

  def per_shard(axis_name: Any) -> np.ndarray:
    f = jax.shard_map(
      lambda g: ols.all_finite(g, axis_name=axis_name)[None],
      mesh=mesh,
      in_specs=P(("x", "y")),
      out_specs=P(("x", "y")),
    )
    with jax.set_mesh(mesh):
      return np.asarray(jax.jit(f)(_on(mesh, g, P(("x", "y"))))).reshape(2, 4)

  np.testing.assert_array_equal(per_shard(("x", "y")), np.zeros((2, 4), bool))
  np.testing.assert_array_equal(per_shard(["x", "y"]), np.zeros((2, 4), bool))
  # Reduced along y only: the x=1 row learns of the inf, the x=0 row does not.
  np.testing.assert_array_equal(per_shard("y"), [[True] * 4, [False] * 4])
  # Reduced along x only: only the y=2 column learns of it.
  np.testing.assert_array_equal(per_shard("x"), [[y != 2 for y in range(4)]] * 2)


def _sharded_step(
  tx: ols.LossScaleOptimizer, mesh: jax.sharding.Mesh, state_specs: Any, fused: bool = False
) -> Any:
  """A shard_map update: params, grads and moments sharded, scalars replicated."""

  def step(w: jax.Array, state: Any, g: jax.Array) -> tuple[jax.Array, Any]:
    if fused:
      return ols.apply_gradients(tx, g, state, w)
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  return jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P("d"), state_specs, P("d")), out_specs=(P("d"), state_specs)
    )
  )


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_wrapper_in_shard_map_skips_on_every_shard_with_axis_name(
  skip_mode: str, fused: bool
) -> None:
  mesh = _mesh_1d()
  tx = ols.loss_scale_optimizer(
    optax.adam(0.1), ols.DynamicLossScale(8.0), skip_mode=skip_mode, axis_name="d"
  )
  with jax.set_mesh(mesh):
    w = _on(mesh, jnp.arange(16.0), P("d"))
    state = jax.jit(tx.init)(w)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    assert state_specs.loss_scale.loss_scale == P()
    step = _sharded_step(tx, mesh, state_specs, fused)

    # A finite step applies on every shard exactly as one device would.
    scale = float(ols.get_loss_scale(state)())
    good = _on(mesh, _grads(bad=False) * scale, P("d"))
    w1, state1 = step(w, state, good)
    ref_tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
    ref_updates, _ = ref_tx.update(
      jnp.asarray(_grads(bad=False) * scale), ref_tx.init(jnp.arange(16.0))
    )
    chex.assert_trees_all_equal(np.asarray(w1), np.asarray(jnp.arange(16.0) + ref_updates))
    assert bool(state1.last_step_applied)

    # One NaN on device 5: every shard skips, nothing moves anywhere.
    w2, state2 = step(w1, state1, _on(mesh, _grads() * scale, P("d")))
  assert not bool(state2.last_step_applied)
  np.testing.assert_array_equal(np.asarray(w2), np.asarray(w1))
  chex.assert_trees_all_equal(
    jax.device_get(state2.inner_state), jax.device_get(state1.inner_state)
  )
  assert float(ols.get_loss_scale(state2)()) == 4.0 and int(state2.total_skips) == 1
  # The replicated leaves are replicated in fact: every device holds the same bits.
  for leaf in (state2.loss_scale.loss_scale, state2.total_skips, state2.inner_state[0].count):
    copies = {np.asarray(s.data).tobytes() for s in leaf.addressable_shards}
    assert len(copies) == 1 and leaf.sharding.is_fully_replicated
  # Output shardings equal the input ones, leaf by leaf.
  assert jax.tree.map(lambda x: x.sharding.spec, state2) == state_specs


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_replicated_params_with_per_shard_gradients(skip_mode: str, fused: bool) -> None:
  """Params enter replicated, gradients vary by shard, so the new params and
  moments vary by shard too; the skip branch's untouched params and moments
  must be typed as varying for `cond` to accept both branches."""
  mesh = _mesh_1d()
  tx = ols.loss_scale_optimizer(
    optax.adam(0.1), ols.DynamicLossScale(8.0), skip_mode=skip_mode, axis_name="d"
  )
  w = jnp.arange(2.0)

  def step(w: jax.Array, g: jax.Array) -> tuple[jax.Array, Any]:
    state = tx.init(w)
    if fused:
      return ols.apply_gradients(tx, g, state, w)
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  state_specs = jax.tree.map(lambda x: P("d") if x.ndim else P(), jax.eval_shape(tx.init, w))
  sharded = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P("d"), state_specs))
  )
  with jax.set_mesh(mesh):
    new_w, state = sharded(w, _on(mesh, _grads(bad=False) * 8.0, P("d")))
    assert bool(state.last_step_applied)
    # Adam is elementwise: each shard's step is plain Adam on its own entries.
    tiled = jnp.tile(w, 8)
    ref_updates, _ = optax.adam(0.1).update(
      jnp.asarray(_grads(bad=False)), optax.adam(0.1).init(tiled)
    )
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(tiled + ref_updates), rtol=1e-6)
    new_w, state = sharded(w, _on(mesh, _grads() * 8.0, P("d")))
  assert not bool(state.last_step_applied)
  np.testing.assert_array_equal(np.asarray(new_w), np.tile(np.arange(2.0), 8))
  np.testing.assert_array_equal(np.asarray(state.inner_state[0].mu), np.zeros(16))


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_wrapper_in_shard_map_without_axis_name_lets_shards_diverge(skip_mode: str) -> None:
  """Why axis_name is needed: each shard would decide on its own gradients."""
  mesh = _mesh_1d()
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(8.0), skip_mode=skip_mode)
  g = _on(mesh, _grads(), P("d"))
  with jax.set_mesh(mesh):
    w = _on(mesh, jnp.zeros(16), P("d"))
    state = jax.jit(tx.init)(w)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    # shard_map's replication check catches it: the new loss scale is not P().
    with pytest.raises(ValueError, match="replicat"):
      _sharded_step(tx, mesh, state_specs)(w, state, g)

    # With the check off the step runs, and it is half applied.
    def step(w: jax.Array, state: Any, g: jax.Array) -> tuple[jax.Array, Any]:
      updates, state = tx.update(g, state, w)
      return optax.apply_updates(w, updates), state

    unchecked = jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P("d"), state_specs, P("d")),
      out_specs=(P("d"), state_specs),
      check_vma=False,
    )
    new_w, new_state = jax.jit(unchecked)(w, state, g)
  # Seven shards applied their update (-grad / scale); device 5's shard skipped.
  want = np.where(np.arange(16) // 2 == BAD_SHARD, 0.0, -_grads(bad=False) / 8.0)
  np.testing.assert_array_equal(np.asarray(new_w), want.astype(np.float32))
  # The "replicated" loss scale holds different values on different devices.
  copies = [np.asarray(s.data).item() for s in new_state.loss_scale.loss_scale.addressable_shards]
  assert copies == [4.0 if d == BAD_SHARD else 8.0 for d in range(8)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pmap_with_and_without_axis_name() -> None:
  grads = _grads().reshape(8, 2)
  w = jnp.zeros((8, 2))

  def run(axis_name: Any) -> tuple[np.ndarray, np.ndarray]:
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(1.0), axis_name=axis_name)

    def step(w: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
      updates, state = tx.update(g, tx.init(w), w)
      return optax.apply_updates(w, updates), state.last_step_applied

    new_w, applied = jax.pmap(step, axis_name="i")(w, grads)
    return np.asarray(new_w), np.asarray(applied)

  new_w, applied = run(None)
  np.testing.assert_array_equal(applied, [d != BAD_SHARD for d in range(8)])
  # Devices that did not see the NaN applied their shard of the update.
  np.testing.assert_array_equal(new_w[0], -grads[0])
  new_w, applied = run("i")
  np.testing.assert_array_equal(applied, [False] * 8)
  np.testing.assert_array_equal(new_w, np.zeros((8, 2), np.float32))
