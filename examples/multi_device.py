"""Loss scaling on many devices: `jit` with shardings, or `shard_map` with `axis_name`.

Trains a small float16 MLP with float32 master weights, FSDP-style (every
parameter and Adam moment sharded over the devices, the batch split across
them), starting from a loss scale so large that the first steps overflow. It
prints the loss scale and, each step, checks that every device holds the same
loss scale and made the same skip decision.

* `--mode jit`: plain `jax.jit` over a `Mesh`; XLA inserts the cross-device
  reduction of the finiteness check itself, so the wrapper needs no argument.
* `--mode shard_map`: the step runs per device on its own gradient shard, so
  the wrapper gets `axis_name='data'` to agree across shards.

The two modes sum the float16 gradients in different orders and precisions
(under shard_map each device sums its own rows, then the shards are reduced),
so they may overflow on a different number of initial steps; within a mode,
every device always agrees.

It runs unchanged on a laptop, where it asks for `--devices` simulated CPU
devices (default 8), and on a multi-GPU or TPU host, where that flag is
ignored and every accelerator is used::

  python examples/multi_device.py
  python examples/multi_device.py --mode shard_map --steps 100
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def simulate_cpu_devices(count: int) -> None:
  """Asks XLA for `count` host devices; must run before JAX is imported.

  Only the CPU platform reads this flag, so on a GPU or TPU host JAX still
  uses the accelerators.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def run(mode: str, steps: int, initial_scale: float) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax

  import optax_lossscale as ols

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
  features, hidden, batch_size = 16, 16 * n, 8 * n
  # FSDP: each parameter is split over the devices along one axis.
  specs = {"w1": P(None, "data"), "w2": P("data", None)}

  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch_size, features)).astype(np.float32)
  y = np.tanh(x @ rng.standard_normal((features, 1))).astype(np.float32)
  init = {
    "w1": (rng.standard_normal((features, hidden)) * 0.25).astype(np.float32),
    "w2": (rng.standard_normal((hidden, 1)) * 0.1 / np.sqrt(n)).astype(np.float32),
  }

  def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)  # float16 compute
    pred = jnp.tanh(x.astype(jnp.float16) @ half["w1"]) @ half["w2"]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  loss_scale = ols.DynamicLossScale(initial_loss_scale=initial_scale, increment_period=20)
  # Only shard_map needs the axis name: there each device sees its own shard.
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), loss_scale, axis_name="data" if mode == "shard_map" else None
  )

  with jax.set_mesh(mesh):
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in init.items()}
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    opt_state = jax.jit(tx.init)(params)

    def jit_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
      def scaled_loss(p: Any) -> tuple[jax.Array, jax.Array]:
        full = jax.tree.map(lambda a: jax.reshard(a, P()), p)  # the FSDP all-gather
        loss = loss_fn(full, *batch)
        return ols.get_scaled_loss(loss, opt_state), loss

      grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    def local_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
      # Runs on every device with its own shards of params, state and batch.
      def scaled_loss(p: Any) -> tuple[jax.Array, jax.Array]:
        full = {
          "w1": jax.lax.all_gather(p["w1"], "data", axis=1, tiled=True),
          "w2": jax.lax.all_gather(p["w2"], "data", axis=0, tiled=True),
        }
        loss = jax.lax.pmean(loss_fn(full, *batch), "data")
        return ols.get_scaled_loss(loss, opt_state), loss

      # all_gather's transpose reduce-scatters: each device gets its shard of the gradient.
      grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    if mode == "jit":
      step = jax.jit(jit_step)
    else:
      state_specs = jax.tree.map(lambda a: a.sharding.spec, opt_state)
      step = jax.jit(
        jax.shard_map(
          local_step,
          mesh=mesh,
          in_specs=(specs, state_specs, P("data")),
          out_specs=(specs, state_specs, P()),
        )
      )

    def per_device(a: jax.Array) -> set[Any]:
      """The distinct values this host's devices hold of a replicated scalar."""
      return {np.asarray(s.data).item() for s in a.addressable_shards}

    print(f"{mode}: {n} {jax.devices()[0].platform} devices, FSDP-sharded parameters")
    print(f"{'step':>5} {'loss':>9} {'scale':>10} {'applied':>8} {'devices agreeing':>17}")
    for i in range(steps):
      params, opt_state, loss = step(params, opt_state, batch)
      scale = ols.get_loss_scale(opt_state).loss_scale
      copies, decisions = per_device(scale), per_device(opt_state.last_step_applied)
      loss_scale_value = next(iter(copies))
      if len(copies) != 1 or len(decisions) != 1:
        raise RuntimeError(f"devices disagree at step {i}: scales {copies}, applied {decisions}")
      if i < 8 or i % 20 == 0 or i == steps - 1:
        applied = decisions.pop()
        agreeing = sum(
          np.asarray(s.data).item() == float(loss_scale_value) for s in scale.addressable_shards
        )
        print(f"{i:>5} {float(loss):>9.5f} {copies.pop():>10.0f} {applied!s:>8} {agreeing:>17}")
    metrics = ols.metrics(opt_state)
    print(f"final loss scale {float(metrics['loss_scale']):.0f},", end=" ")
    print(f"skipped steps {int(metrics['total_skips'])}\n")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", choices=["jit", "shard_map", "both"], default="both")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
  parser.add_argument("--initial-scale", type=float, default=2.0**24)
  args = parser.parse_args()
  simulate_cpu_devices(args.devices)
  for mode in ("jit", "shard_map") if args.mode == "both" else (args.mode,):
    run(mode, args.steps, args.initial_scale)


if __name__ == "__main__":
  main()
