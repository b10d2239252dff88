"""Tests that need 8 devices; they run in a pytest session of their own.

JAX fixes its device count when it is first imported, and the main test run
imports it with one CPU device, so these files are skipped there and
`tests/test_multi_device.py` runs them in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`. To run them by hand::

  OLS_MULTIDEVICE_SESSION=1 JAX_PLATFORMS=cpu \
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/multidevice
"""

from __future__ import annotations

import os

import pytest

# The worker is a script for tests/test_multi_process.py, not a test module.
collect_ignore = ["two_process_worker.py"]
if os.environ.get("OLS_MULTIDEVICE_SESSION") != "1":
  # Importing these modules here would be harmless, but their tests would see
  # one device; the subprocess session owns them.
  collect_ignore_glob = ["*.py"]


@pytest.fixture(scope="session", autouse=True)
def _eight_devices() -> None:
  import jax

  if jax.device_count() < 8:
    raise RuntimeError(
      f"tests/multidevice needs 8 devices, found {jax.device_count()}: set"
      " XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts."
    )
