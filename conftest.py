"""Pytest configuration shared by the doctests and the test suite."""

import importlib.util


def _installed(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ImportError:
    return False


# Flax is an optional extra: without it, skip the modules that need it instead
# of failing to collect their doctests (their tests skip themselves).
collect_ignore_glob = []
if not _installed("flax"):
  collect_ignore_glob += ["optax_lossscale/flax.py", "optax_lossscale/_src/flax_*.py"]
