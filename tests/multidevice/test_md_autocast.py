"""`autocast` on 8 devices: under `shard_map` (with collectives) and under `jit` over a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_lossscale as ols
from tests.autocast_helpers import equations, matmul_inputs, mismatched

POLICY = "p=f32,c=f16,o=f32"


def _mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))


def _params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "w1": (rng.standard_normal((4, 8)) * 0.5).astype(np.float32),
    "w2": (rng.standard_normal((8, 1)) * 0.5).astype(np.float32),
  }


def _batch() -> np.ndarray:
  return np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)


def _sharded_loss(mesh: jax.sharding.Mesh):
  """Data-parallel loss under shard_map: a per-shard MLP, its mean across devices by psum."""

  def per_shard(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jax.lax.psum(jnp.sum((h @ params["w2"]) ** 2), "d") / 16.0

  return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())


def test_autocast_goes_through_shard_map_forward_and_backward() -> None:
  mesh = _mesh()
  loss = _sharded_loss(mesh)
  mixed = ols.autocast(loss, POLICY)
  params = _params()
  x = jax.device_put(_batch(), NamedSharding(mesh, P("d")))
  with jax.set_mesh(mesh):
    want = jax.jit(loss)(params, x)
    got = jax.jit(mixed)(params, x)
    grads = jax.jit(jax.grad(mixed))(params, x)
    want_grads = jax.jit(jax.grad(loss))(params, x)
    jaxpr = jax.make_jaxpr(jax.grad(mixed))(params, x)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-2)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=3e-2, atol=1e-3)
  names = {e.primitive.name for e in equations(jaxpr)}
  assert "shard_map" in names and names & {"psum", "psum_invariant"}, names
  assert matmul_inputs(jaxpr) and set(matmul_inputs(jaxpr)) == {("float16", "float16")}
  assert mismatched(jaxpr) == []


def test_a_float16_step_on_a_mesh_with_loss_scaling() -> None:
  mesh = _mesh()
  loss = ols.autocast(_sharded_loss(mesh), POLICY)
  tx = ols.loss_scale_optimizer(optax.adam(1e-2))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = tx.init(params)
  x = jax.device_put(_batch(), NamedSharding(mesh, P("d")))

  @jax.jit
  def step(params, state, x):
    value, grads = ols.value_and_grad(loss)(state, params, x)
    params, state = ols.apply_gradients(tx, grads, state, params)
    return params, state, value

  with jax.set_mesh(mesh):
    first = None
    for _ in range(20):
      params, state, value = step(params, state, x)
      first = value if first is None else first
  assert float(value) < 0.5 * float(first)
  assert int(ols.metrics(state)["total_skips"]) <= 1  # the initial scale of 2**15 fits
