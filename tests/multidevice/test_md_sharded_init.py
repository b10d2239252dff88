"""A sharded `init` of a wrapped state on 8 devices, as the multi-device guide shows it.

A plain `jax.jit(tx.init)(params)` with Auto axes does not shard the moments
like FSDP-sharded parameters (bare optax neither); `optax.tree_map_params`
gives `jit` the state's shardings: the moments inside the wrapper follow
their parameters, the loss scale and the counters are replicated. And a
`SkippingFixedLossScale` agrees across `shard_map` shards, as the dynamic
scale does (issue 25).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_lossscale as ols


def _setup():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  fsdp, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  params = {
    "w": jax.device_put(jnp.arange(64.0).reshape(16, 4), fsdp),
    "b": jax.device_put(jnp.ones(4), replicated),
  }
  return params, fsdp, replicated


def _shardings(tx, params, replicated):
  return optax.tree_map_params(
    tx,
    lambda _, param_sharding: param_sharding,
    jax.eval_shape(tx.init, params),
    jax.tree.map(lambda a: a.sharding, params),
    transform_non_params=lambda _: replicated,
  )


def test_tree_map_params_shards_the_moments_inside_the_wrapper():
  params, fsdp, replicated = _setup()
  tx = ols.loss_scale_optimizer(optax.adam(1e-2))
  state = jax.jit(tx.init, out_shardings=_shardings(tx, params, replicated))(params)
  inner = ols.inner_state(state)[0]
  for moments in (inner.mu, inner.nu):
    assert moments["w"].sharding.is_equivalent_to(fsdp, 2)
    assert moments["b"].sharding.is_fully_replicated
  for scalar in (inner.count, state.total_skips, *jax.tree.leaves(state.loss_scale)):
    assert scalar.sharding.is_fully_replicated
  chex.assert_trees_all_equal(jax.device_get(state), jax.device_get(tx.init(params)))
  # And it steps: shardings in, equal shardings out.
  step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
  grads = jax.tree.map(lambda p: p * 2.0**15, params)
  new_params, new_state = step(grads, state, params)
  assert new_params["w"].sharding.is_equivalent_to(fsdp, 2)
  assert ols.inner_state(new_state)[0].mu["w"].sharding.is_equivalent_to(fsdp, 2)


def test_a_plain_jit_init_does_not_shard_the_moments_bare_or_wrapped():
  # What the guide says about `jax.jit(tx.init)`: an optax/JAX behaviour, the
  # same with and without the wrapper.
  params, fsdp, _ = _setup()
  bare = optax.adam(1e-2)
  wrapped = ols.loss_scale_optimizer(bare)
  for moments in (
    jax.jit(bare.init)(params)[0].mu,
    ols.inner_state(jax.jit(wrapped.init)(params))[0].mu,
  ):
    assert not moments["w"].sharding.is_equivalent_to(fsdp, 2)
    assert len(moments["w"].sharding.device_set) == 1


def test_a_skipping_fixed_scale_skips_on_every_shard_with_axis_name():
  # A NaN in one device's gradient shard: with axis_name, all 8 skip and count it.
  mesh = jax.make_mesh((8,), ("d",))
  on = lambda tree, spec: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), ols.SkippingFixedLossScale(4.0), axis_name="d")
  params = on({"w": jnp.ones(16)}, P("d"))
  state = on(tx.init(params), P())
  grads = on({"w": jnp.full(16, 4.0).at[11].set(jnp.nan)}, P("d"))  # entry 11: device 5
  specs = (jax.tree.map(lambda _: P("d"), params), jax.tree.map(lambda _: P(), state))
  step = jax.jit(
    jax.shard_map(
      lambda g, s, p: ols.apply_gradients(tx, g, s, p),
      mesh=mesh,
      in_specs=(specs[0], specs[1], specs[0]),
      out_specs=specs,
    )
  )
  with jax.set_mesh(mesh):
    new_params, state = step(grads, state, params)
    np.testing.assert_array_equal(new_params["w"], params["w"])  # no shard applied
    assert int(state.total_skips) == 1 and not bool(state.last_step_applied)
    new_params, state = step(on({"w": jnp.full(16, 4.0)}, P("d")), state, params)
  np.testing.assert_array_equal(new_params["w"], jnp.full(16, 0.5))  # 1 - 0.5 * 4 / 4
  assert int(state.total_skips) == 1 and bool(state.last_step_applied)
