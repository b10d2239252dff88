"""fp8 metadata on 8 devices: `jit` over a mesh with the batch sharded (issue 18).

The overwrite-with-gradient leaves (Flax's `_overwrite_with_gradient`
collection) are replicated; a NaN in one device's rows of the batch must make
every device skip and leave them untouched, and an applied step must write
exactly the values `jax.grad` computed, on every device.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_lossscale as ols

nn = pytest.importorskip("flax.linen")
fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
from optax_lossscale.flax import TrainState  # noqa: E402

OWG = "_overwrite_with_gradient"


class Fp8Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 4))
    return fp8_ops.Fp8Einsum()(
      "bi,io->bo",
      x.astype(jnp.bfloat16),
      kernel.astype(jnp.bfloat16),
      preferred_element_type=jnp.float32,
    )


def _bits(tree):
  return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("kind", ["loss_scale", "skip_bad_steps"])
def test_fp8_metadata_on_eight_devices(kind):
  # Auto axes: Flax's fp8 backward contracts over the batch, which Explicit
  # sharding types refuse without an out_sharding.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  model = Fp8Net()
  x = jax.random.normal(jax.random.key(0), (16, 6))
  y = jax.random.normal(jax.random.key(1), (16, 4))
  variables = model.init(jax.random.key(2), x[:1])
  scale = 2.0**8 if kind == "loss_scale" else 1.0
  tx = (
    ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(scale, min_loss_scale=1.0))
    if kind == "loss_scale"
    else ols.skip_bad_steps(optax.adam(1e-2))
  )
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  state = jax.device_put(
    TrainState.create(apply_fn=model.apply, params=variables, tx=tx), replicated
  )
  loss_fn = lambda v, x: jnp.mean((model.apply(v, x).astype(jnp.float32) - y) ** 2)

  @jax.jit
  def step(state, x):
    grads = ols.mark_scaled(jax.grad(lambda v: loss_fn(v, x) * scale)(state.params))  # by hand
    return state.apply_gradients(grads=grads), grads

  new, grads = step(state, jax.device_put(x, rows))
  assert int(new.step) == 1
  for a, b in zip(_bits(new.params[OWG]), _bits(grads[OWG]), strict=True):
    np.testing.assert_array_equal(a, b)
  for leaf in jax.tree.leaves(new.params[OWG]):
    copies = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(copies) == 8 and all(np.array_equal(c, copies[0]) for c in copies)
  bad = jax.device_put(x.at[11, 0].set(jnp.nan), rows)  # a row of device 5
  skipped, _ = step(new, bad)
  assert int(skipped.step) == 1
  chex.assert_trees_all_equal(skipped.params["params"], new.params["params"])
  if kind == "skip_bad_steps":
    for a, b in zip(_bits(skipped.params[OWG]), _bits(new.params[OWG]), strict=True):
      np.testing.assert_array_equal(a, b)
