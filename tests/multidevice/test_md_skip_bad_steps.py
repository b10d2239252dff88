"""skip_bad_steps on 8 devices: shards agree through `axis_name`; sharded jit needs nothing."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_lossscale as ols

BAD_SHARD = 5
STEPS = 9
FAULTS = {4: "spike", 6: "nan"}


def _grads(step: int, fault: str | None = None, shard: int | None = BAD_SHARD) -> np.ndarray:
  """16 entries, two per device; a fault hits only `shard`'s entries (all if None)."""
  g = np.linspace(-1.0, 1.0, 16, dtype=np.float32) * np.float32(1.0 + 0.03 * np.sin(step))
  where = slice(None) if shard is None else slice(2 * shard, 2 * shard + 2)
  if fault == "spike":
    g[where] *= 1000.0
  elif fault == "nan":
    g[where] = np.nan
  return g


def _tx(axis_name: Any = None, skip_mode: str = "cond") -> ols.SkipBadSteps:
  return ols.skip_bad_steps(
    optax.sgd(0.1),
    spike_threshold=6.0,
    warmup_steps=3,
    ema_decay=0.9,
    axis_name=axis_name,
    skip_mode=skip_mode,
  )


def _run(update: Any, state: Any, params: Any, put: Any = lambda x: x) -> tuple[list, Any, Any]:
  applied = []
  for t in range(STEPS):
    updates, state = update(put(_grads(t, FAULTS.get(t))), state, params)
    params = optax.apply_updates(params, updates)
    applied.append(bool(state.last_step_applied))
  return applied, state, params


def test_shard_map_decisions_agree_with_axis_name_and_match_one_device() -> None:
  mesh = jax.make_mesh((8,), ("d",))
  params = np.zeros(16, np.float32)
  ref_applied, ref_state, ref_params = _run(jax.jit(_tx().update), _tx().init(params), params)
  assert ref_applied == [t not in FAULTS for t in range(STEPS)]

  for skip_mode in ("cond", "select"):
    tx = _tx("d", skip_mode)
    state = tx.init(params)
    specs = jax.tree.map(lambda _: P(), state)
    step = jax.jit(
      jax.shard_map(
        tx.update, mesh=mesh, in_specs=(P("d"), specs, P("d")), out_specs=(P("d"), specs)
      )
    )
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
      applied, state, out_params = _run(step, state, put(params), put)
    assert applied == ref_applied, skip_mode
    # The psum of squares gives every shard the global norm: the same statistic.
    chex.assert_trees_all_close(state, ref_state, rtol=1e-6)
    np.testing.assert_allclose(out_params, ref_params, rtol=1e-6)
    assert int(state.spike_skips) == 1 and int(state.nonfinite_skips) == 1


def test_shard_map_without_axis_name_shards_disagree_on_a_one_shard_spike() -> None:
  mesh = jax.make_mesh((8,), ("d",))

  def per_shard(axis_name: Any) -> np.ndarray:
    tx, warm = _tx(axis_name), _tx()
    state = warm.init(np.zeros(16, np.float32))
    for t in range(4):  # warmed up on the global norm, then replicated
      _, state = jax.jit(warm.update)(_grads(t), state)

    def f(g: jax.Array, state: Any) -> jax.Array:
      _, new_state = tx.update(g, state)
      return new_state.last_step_applied[None]

    specs = jax.tree.map(lambda _: P(), state)
    f = jax.shard_map(f, mesh=mesh, in_specs=(P("d"), specs), out_specs=P("d"))
    with jax.set_mesh(mesh):
      g = jax.device_put(_grads(4, "spike"), NamedSharding(mesh, P("d")))
      return np.asarray(jax.jit(f)(g, state))

  # Alone, each shard compares its local norm (about 1/sqrt(8) of the global
  # one) with the global statistic: only the spiking shard skips.
  np.testing.assert_array_equal(per_shard(None), [d != BAD_SHARD for d in range(8)])
  np.testing.assert_array_equal(per_shard("d"), [False] * 8)


def test_sharded_jit_needs_no_axis_name_and_keeps_shardings() -> None:
  mesh = jax.make_mesh((8,), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  inner = optax.adam(1e-2)
  tx = ols.skip_bad_steps(inner, spike_threshold=6.0, warmup_steps=3, ema_decay=0.9)
  params = jnp.zeros(16, jnp.float32)
  ref_applied, ref_state, ref_params = _run(jax.jit(tx.update), tx.init(params), params)
  step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
  applied = []
  with jax.set_mesh(mesh):
    params = jax.device_put(params, sharding)
    state = jax.jit(tx.init)(params)
    for t in range(STEPS):
      params, state = step(jax.device_put(_grads(t, FAULTS.get(t)), sharding), state, params)
      applied.append(bool(state.last_step_applied))
  assert applied == ref_applied == [t not in FAULTS for t in range(STEPS)]
  assert params.sharding.is_equivalent_to(sharding, 1)
  assert state.inner_state[0].mu.sharding.is_equivalent_to(sharding, 1)
  np.testing.assert_allclose(params, ref_params, rtol=1e-6)
  chex.assert_trees_all_close(state, ref_state, rtol=1e-5)


def test_shard_map_loss_is_averaged_across_shards_so_all_skip_a_one_shard_loss_spike() -> None:
  mesh = jax.make_mesh((8,), ("d",))
  tx = ols.skip_bad_steps(
    optax.sgd(0.1), spike_threshold=6.0, monitor="loss", warmup_steps=3, axis_name="d"
  )
  state = tx.init(np.zeros(16, np.float32))
  specs = jax.tree.map(lambda _: P(), state)

  def f(g: jax.Array, loss: jax.Array, state: Any) -> tuple[jax.Array, Any]:
    _, state = tx.update(g, state, loss=loss[0])
    return state.last_step_applied[None], state

  f = jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d"), specs), out_specs=(P("d"), specs))
  )
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
  with jax.set_mesh(mesh):
    for t in range(5):
      losses = np.linspace(1.0, 2.0, 8, dtype=np.float32) * np.float32(1.0 + 0.01 * t)
      if t == 4:
        losses[BAD_SHARD] = 500.0  # one shard's batch is bad
      applied, state = f(put(_grads(t)), put(losses), state)
      np.testing.assert_array_equal(applied, [t != 4] * 8)
  np.testing.assert_allclose(float(state.loss.last), np.mean(losses), rtol=1e-6)
  assert int(state.spike_skips) == 1
