"""One of the two processes that tests/test_multi_process.py launches.

Usage: two_process_worker.py PROCESS_ID PORT OUT_DIR

Each process owns 4 CPU devices (the launcher sets XLA_FLAGS); together they
form a global mesh of 8 over gloo collectives. The process trains the tiny
MLP of md_model with FSDP-sharded parameters and a data-parallel batch in
which only process 1's rows hold a NaN on NAN_STEPS, then writes what it saw
to OUT_DIR/process_<id>.json for the launcher to compare.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
STEPS = 7
NAN_STEPS = (2, 5)
NAN_ROW = 13  # a row of process 1's half of the batch (rows 8..15)
TIMEOUT_S = 90  # every wait inside jax.distributed; the launcher bounds the whole run


def _log(msg: str) -> None:
  print(f"[worker] {msg}", flush=True)


def main(process_id: int, port: int, out_dir: str) -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=NUM_PROCESSES,
    process_id=process_id,
    initialization_timeout=TIMEOUT_S,
    heartbeat_timeout_seconds=TIMEOUT_S,
    shutdown_timeout_seconds=TIMEOUT_S,
  )
  _log(f"initialized: process {jax.process_index()} of {jax.process_count()}")

  from jax.experimental import multihost_utils
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  import md_model
  import numpy as np

  import optax_lossscale as ols

  assert jax.local_device_count() == LOCAL_DEVICES, jax.local_devices()
  assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES, jax.devices()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  fsdp = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None)}
  local_rows = slice(8 * process_id, 8 * process_id + 8)

  def global_array(value: np.ndarray, spec: P) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  def local_copy(x: jax.Array) -> Any:
    """This process's copy of a replicated value."""
    assert x.sharding.is_fully_replicated
    return np.asarray(x.addressable_data(0)).item()

  tx = md_model.make_tx()
  gather = lambda p: jax.tree.map(lambda x: jax.reshard(x, P()), p)
  with jax.set_mesh(mesh):
    init = md_model.init_params()
    params = {k: global_array(v, fsdp[k]) for k, v in init.items()}
    opt_state = jax.jit(tx.init)(params)
    step = jax.jit(md_model.make_train_step(tx, gather))
    in_specs = jax.tree.map(lambda x: x.sharding.spec, (params, opt_state))
    record: dict[str, Any] = {"applied": [], "scales": [], "counters": [], "saw_nan": []}
    for i in range(STEPS):
      nan_row = NAN_ROW if i in NAN_STEPS else None
      full = md_model.make_batch(i, nan_row)
      # Each process contributes only its own rows: process 0 never sees the NaN.
      local = {k: v[local_rows] for k, v in full.items()}
      record["saw_nan"].append(bool(np.isnan(local["x"]).any()))
      batch = {
        k: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), v)
        for k, v in local.items()
      }
      params, opt_state = step(params, opt_state, batch)
      ls = ols.get_loss_scale(opt_state)
      record["applied"].append(local_copy(opt_state.last_step_applied))
      record["scales"].append(local_copy(ls.loss_scale))
      record["counters"].append(local_copy(ls.counter))
      _log(f"step {i}: applied={record['applied'][-1]} scale={record['scales'][-1]}")
    out_specs = jax.tree.map(lambda x: x.sharding.spec, (params, opt_state))
    record["shardings_preserved"] = out_specs == in_specs
    record["total_skips"] = local_copy(opt_state.total_skips)
    record["consecutive_skips"] = local_copy(opt_state.consecutive_skips)
    record["adam_count"] = local_copy(opt_state.inner_state[0].count)
    # FSDP shards live on both processes: gather the whole parameters here.
    gathered = multihost_utils.process_allgather(params, tiled=True)
    record["params"] = {k: np.asarray(v).tolist() for k, v in gathered.items()}

    # shard_map over the same global mesh: process 1 holds the only NaN shard.
    grads = np.ones(16, np.float32)
    grads[2 * 6] = np.nan  # device 6, on process 1
    grads = global_array(grads, P("data"))
    for axis_name in (None, "data"):
      flags = jax.jit(
        jax.shard_map(
          lambda g, a=axis_name: ols.all_finite(g, axis_name=a)[None],
          mesh=mesh,
          in_specs=P("data"),
          out_specs=P("data"),
        )
      )(grads)
      key = f"shard_map_local_flags_axis_{axis_name}"
      record[key] = [bool(np.asarray(s.data)[0]) for s in flags.addressable_shards]

  record["process_id"] = jax.process_index()
  record["process_count"] = jax.process_count()
  record["device_count"] = jax.device_count()
  record["local_device_count"] = jax.local_device_count()
  path = os.path.join(out_dir, f"process_{process_id}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(path + ".tmp", path)  # the launcher never reads a half-written file
  _log(f"wrote {path}")
  jax.distributed.shutdown()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
