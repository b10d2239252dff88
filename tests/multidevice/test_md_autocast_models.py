"""`autocast` on a data-parallel GPT under `shard_map` on 8 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import optax_lossscale as ols
from tests.test_autocast_models import (
  GRAD_TOL,
  MEMORY_GOAL,
  VOCAB,
  T,
  assert_products_16_bit,
  gpt_loss,
  gpt_params,
  grad_error,
  nbytes,
  residuals,
)


def test_a_gpt_under_shard_map_keeps_16_bit_products_and_residuals() -> None:
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  loss = gpt_loss()

  def data_parallel(params, tokens):  # each device its 2 sequences, the mean across devices
    per_shard = lambda p, t: jax.lax.pmean(loss(p, t), "d")
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())(
      params, tokens
    )

  mixed = ols.autocast(data_parallel, "p=f32,c=f16,o=f32")
  params = gpt_params(jax.random.key(0))
  with jax.set_mesh(mesh):
    tokens = jax.device_put(
      jax.random.randint(jax.random.key(1), (16, T), 0, VOCAB), NamedSharding(mesh, P("d"))
    )
    want, want_grads = jax.jit(jax.value_and_grad(data_parallel))(params, tokens)
    value, grads = jax.jit(jax.value_and_grad(mixed))(params, tokens)
    jaxpr = jax.make_jaxpr(jax.grad(mixed))(params, tokens)
    ratio = nbytes(residuals(mixed, params, tokens)) / nbytes(
      residuals(data_parallel, params, tokens)
    )
  np.testing.assert_allclose(value, want, rtol=2e-3)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  assert grad_error(grads, want_grads) < GRAD_TOL["float16"]
  assert_products_16_bit(jaxpr, "float16")
  assert ratio <= MEMORY_GOAL, ratio
