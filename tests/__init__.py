"""Helpers shared by the test modules."""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_xla_flags(device_count: int | None = None) -> str:
  """XLA_FLAGS for a subprocess: this process's flags without its device count.

  Keeps the compile flags conftest.py sets for the suite; a device count is the
  child's own choice (`device_count`, or none: the child or its script picks).
  """
  flags = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)
  ]
  if device_count is not None:
    flags.append(f"{DEVICE_COUNT_FLAG}={device_count}")
  return " ".join(flags)
