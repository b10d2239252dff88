"""Runs tests/multidevice in a pytest session of its own, on 8 simulated CPU devices.

JAX reads XLA_FLAGS once, when it starts, and this process may already have
started it with one device (other test files share the worker), so the
8-device tests get a fresh interpreter. See tests/multidevice/conftest.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import child_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # the session takes ~30 s alone; a loaded 2-core machine is slower


def test_eight_device_session() -> None:
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env["XLA_FLAGS"] = child_xla_flags(8)
  env["JAX_PLATFORMS"] = "cpu"  # simulated devices even on an accelerator host
  env["OLS_MULTIDEVICE_SESSION"] = "1"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
  cmd.append(str(ROOT / "tests" / "multidevice"))
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
    pytest.fail(f"the 8-device session timed out after {TIMEOUT_S} s:\n{out}")
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output
  summary = output.strip().splitlines()[-1]
  # Every test ran and passed: nothing skipped, deselected or xfailed.
  assert re.fullmatch(r"\d+ passed(, \d+ warnings?)? in [\d.]+s( \(.*\))?", summary), summary


def test_multi_device_example_runs_on_simulated_devices() -> None:
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env["XLA_FLAGS"] = child_xla_flags()  # the example sets its device count
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "multi_device.py"), "--steps", "12"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT_S,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  # The example sets XLA_FLAGS itself and raises if any two devices disagree.
  assert "jit: 8 cpu devices" in proc.stdout and "shard_map: 8 cpu devices" in proc.stdout
  finals = re.findall(r"final loss scale (\d+), skipped steps (\d+)", proc.stdout)
  assert len(finals) == 2, proc.stdout
  # 2**24 overflows float16 at first: both modes back off and skip.
  assert all(int(scale) < 2**24 and int(skips) > 0 for scale, skips in finals), finals
