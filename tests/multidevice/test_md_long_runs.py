"""Retries and clipped spikes on 8 devices: every device retries and clips the same steps."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_lossscale as ols

HOT_DEVICE = 5


def _rows(scale_hot: float) -> np.ndarray:
  """16 rows of 3 features, two rows a device; device 5's rows scaled by `scale_hot`."""
  x = np.tile(np.array([[1.0, 0.5, -0.25]], np.float32), (16, 1))
  x[2 * HOT_DEVICE : 2 * HOT_DEVICE + 2] *= scale_hot
  return x


def _loss(params, x):
  """float16 forward: the gradient of the scaled loss is S * sum of rows, in float16."""
  return jnp.sum(x.astype(jnp.float16) @ params["w"].astype(jnp.float16))


def _expected_scale(x: np.ndarray, start: float) -> float:
  """The largest power of two below `start` whose scaled gradient fits float16."""
  g = np.abs(x.sum(0)).max()
  scale = start
  while scale * g > 65504:
    scale /= 2
  return scale


def test_jit_on_a_mesh_retries_once_for_all_devices() -> None:
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params = {"w": jnp.ones(3)}
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**16))
  x = _rows(8.0)
  rows = NamedSharding(mesh, P("data"))
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

  @jax.jit
  def step(state, params, x):
    _, grads, state = ols.retry_on_overflow(ols.value_and_grad(_loss), 16)(state, params, x)
    return ols.apply_gradients(tx, grads, state, params)

  params, state = step(state, params, jax.device_put(x, rows))
  m = ols.metrics(state)
  assert float(m["loss_scale"]) == _expected_scale(x, 2.0**16)
  assert int(m["retries"]) == int(np.log2(2.0**16 / _expected_scale(x, 2.0**16))) > 0
  assert bool(m["last_step_applied"])
  for leaf in jax.tree.leaves(state):
    copies = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(copies) == 8 and all(np.array_equal(c, copies[0]) for c in copies)


def test_shard_map_retries_agree_through_axis_name() -> None:
  mesh = jax.make_mesh((8,), ("data",))
  params = {"w": jnp.ones(3)}
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**16), axis_name="data")
  state = tx.init(params)
  specs = jax.tree.map(lambda _: P(), state)

  def local(state, params, x):
    retrying = ols.retry_on_overflow(ols.value_and_grad(_loss), 16, axis_name="data")
    _, grads, state = retrying(state, params, x)
    grads = jax.lax.psum(grads, "data")
    params, state = ols.apply_gradients(tx, grads, state, params)
    return params, state

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(specs, P(), P("data")),
      out_specs=(P(), specs),
    )
  )
  x = _rows(200.0)
  with jax.set_mesh(mesh):
    _, state = step(state, params, jax.device_put(x, NamedSharding(mesh, P("data"))))
  # Only device 5's rows overflow at first; every device backs off to the scale
  # at which device 5's rows fit (the others would have kept a higher one).
  hot = _expected_scale(x[2 * HOT_DEVICE : 2 * HOT_DEVICE + 2], 2.0**16)
  m = ols.metrics(state)
  assert float(m["loss_scale"]) == hot < 2.0**16
  assert bool(m["last_step_applied"])


def test_shard_map_clips_the_same_spike_on_every_device() -> None:
  mesh = jax.make_mesh((8,), ("d",))
  tx = ols.skip_bad_steps(
    optax.sgd(0.1), spike_threshold=3.0, warmup_steps=3, on_spike="clip", axis_name="d"
  )
  params = np.zeros(16, np.float32)
  state = tx.init(params)
  specs = jax.tree.map(lambda _: P(), state)
  step = jax.jit(
    jax.shard_map(tx.update, mesh=mesh, in_specs=(P("d"), specs, P("d")), out_specs=(P("d"), specs))
  )
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))
  reference = jax.jit(
    ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=3.0, warmup_steps=3, on_spike="clip").update
  )
  ref_state = state
  with jax.set_mesh(mesh):
    for t in range(6):
      g = np.linspace(-1.0, 1.0, 16, dtype=np.float32) * np.float32(1.0 + 0.02 * t)
      if t == 5:
        g[2 * HOT_DEVICE : 2 * HOT_DEVICE + 2] *= 1000.0  # a spike on one device's shard
      updates, state = step(put(g), state, put(params))
      ref_updates, ref_state = reference(g, ref_state, params)
      np.testing.assert_allclose(updates, ref_updates, rtol=1e-5)
  assert int(state.spike_clips) == int(ref_state.spike_clips) == 1
  chex.assert_trees_all_close(state.grad_norm, ref_state.grad_norm, rtol=1e-6)
