"""Two processes, 4 CPU devices each, one global mesh of 8: the same skips everywhere.

The launcher starts tests/multidevice/two_process_worker.py twice on
127.0.0.1 with `jax.distributed` over gloo, waits for both with a bounded
timeout, kills them and prints their logs if anything goes wrong, then checks
that both processes skipped exactly the steps where process 1 (alone) saw a
NaN and ended with identical loss scales, counters and parameters.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np
import pytest

from tests import child_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER_DIR = ROOT / "tests" / "multidevice"
TIMEOUT_S = 180  # both processes, start to finish; a loaded 2-core machine needs ~10-40 s


def _load(name: str) -> Any:
  spec = importlib.util.spec_from_file_location(name, WORKER_DIR / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


worker = _load("two_process_worker")
md_model = _load("md_model")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env["XLA_FLAGS"] = child_xla_flags(worker.LOCAL_DEVICES)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  return env


def _logs(log_paths: list[pathlib.Path]) -> str:
  return "\n".join(f"----- {p.name} -----\n{p.read_text(errors='replace')}" for p in log_paths)


def _launch(out_dir: pathlib.Path) -> tuple[int, str]:
  """Runs both workers; returns (0, '') or (exit status, their logs) on failure."""
  port = _free_port()
  log_paths = [out_dir / f"process_{i}.log" for i in range(worker.NUM_PROCESSES)]
  procs: list[subprocess.Popen] = []
  try:
    for i, log_path in enumerate(log_paths):
      script = str(WORKER_DIR / "two_process_worker.py")
      with open(log_path, "w") as log:  # the child keeps its own handle
        procs.append(
          subprocess.Popen(
            [sys.executable, script, str(i), str(port), str(out_dir)],
            cwd=ROOT,
            env=_child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
          )
        )
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if any(c not in (None, 0) for c in codes):
        return next(c for c in codes if c not in (None, 0)), _logs(log_paths)
      if all(c == 0 for c in codes):
        return 0, ""
      time.sleep(0.2)
    return -1, f"timed out after {TIMEOUT_S} s\n" + _logs(log_paths)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)


def _reference() -> tuple[dict[str, np.ndarray], list[bool]]:
  """The same training in this process on one CPU device, whole batch at once."""
  tx = md_model.make_tx()
  step = jax.jit(md_model.make_train_step(tx))
  # The workers run on CPU; an accelerator here could round float32 matmuls.
  with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
    params = md_model.init_params()
    opt_state = tx.init(params)
    applied = []
    for i in range(worker.STEPS):
      batch = md_model.make_batch(i, worker.NAN_ROW if i in worker.NAN_STEPS else None)
      params, opt_state = step(params, opt_state, batch)
      applied.append(bool(opt_state.last_step_applied))
  return jax.device_get(params), applied


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
  out_dir = tmp_path_factory.mktemp("two_processes")
  status, logs = _launch(out_dir)
  if status != 0:
    # Most often another program took the free port in between; whatever the
    # wording of that error (gRPC, gloo), one fresh launch on a new port.
    status, logs = _launch(out_dir)
  if status != 0:
    pytest.fail(f"two-process run failed (status {status}):\n{logs}")
  return [
    json.loads((out_dir / f"process_{i}.json").read_text()) for i in range(worker.NUM_PROCESSES)
  ]


def test_topology_is_two_processes_of_four_devices(results: list[dict[str, Any]]) -> None:
  for i, r in enumerate(results):
    assert (r["process_id"], r["process_count"]) == (i, 2)
    assert (r["local_device_count"], r["device_count"]) == (4, 8)


def test_both_processes_skip_exactly_the_nan_steps(results: list[dict[str, Any]]) -> None:
  expected = md_model.expected_scales(worker.STEPS, worker.NAN_STEPS)
  p0, p1 = results
  # Only process 1 ever held a NaN; process 0 learnt of it through the collective.
  assert not any(p0["saw_nan"])
  assert [i for i, s in enumerate(p1["saw_nan"]) if s] == list(worker.NAN_STEPS)
  for r in results:
    assert r["applied"] == [e[2] for e in expected]
    assert r["scales"] == [e[0] for e in expected]
    assert r["counters"] == [e[1] for e in expected]
    assert r["total_skips"] == len(worker.NAN_STEPS)
    assert r["consecutive_skips"] == 0
    assert r["adam_count"] == worker.STEPS - len(worker.NAN_STEPS)
    assert r["shardings_preserved"]


def test_both_processes_end_with_identical_state(results: list[dict[str, Any]]) -> None:
  p0, p1 = results
  for key in ("applied", "scales", "counters", "total_skips", "consecutive_skips", "adam_count"):
    assert p0[key] == p1[key], key
  params = [{k: np.asarray(v, np.float32) for k, v in r["params"].items()} for r in results]
  for k in params[0]:
    np.testing.assert_array_equal(params[0][k], params[1][k], err_msg=k)
  ref_params, ref_applied = _reference()
  assert ref_applied == p0["applied"]
  for k, v in ref_params.items():
    # Sharded reductions sum in another order than one device does.
    np.testing.assert_allclose(params[0][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_shard_map_across_processes_needs_axis_name(results: list[dict[str, Any]]) -> None:
  p0, p1 = results
  # Device 6 (process 1's third device) holds the only NaN gradient shard.
  assert p0["shard_map_local_flags_axis_None"] == [True] * 4
  assert p1["shard_map_local_flags_axis_None"] == [True, True, False, True]
  assert p0["shard_map_local_flags_axis_data"] == [False] * 4
  assert p1["shard_map_local_flags_axis_data"] == [False] * 4
