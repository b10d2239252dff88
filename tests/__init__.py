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


def assert_trees_equal_across_programs(a: object, b: object, narrowest: object = None) -> None:
  """Bit for bit on CPU; elsewhere within a few units in the last place.

  For two programs that compute the same arithmetic: a step and its
  hand-written reference, eager ops and one compiled program. XLA:CPU gives
  them identical bits (what these tests measure there); on an accelerator XLA
  may fuse a multiply-add into one instruction in one program and not in the
  other, a last-bit difference that a 16-bit rounding can carry into a
  parameter's last place, or keep a 16-bit intermediate at float32 precision
  in one program (excess precision) and round it in the other: elsewhere than
  on the CPU the tolerance is a few units of `narrowest`, the narrowest
  floating dtype the programs compute in (default: the narrowest among `a`'s
  leaves). Dtypes and integer leaves (counts, keys) are exact.
  """
  import chex
  import jax
  import numpy as np

  chex.assert_trees_all_equal_dtypes(a, b)
  if jax.default_backend() == "cpu":
    chex.assert_trees_all_equal(a, b)
    return
  floats = [x.dtype for x in jax.tree.leaves(a) if jax.numpy.issubdtype(x.dtype, np.floating)]
  floats += [] if narrowest is None else [narrowest]
  ulps = 4 * max((float(jax.numpy.finfo(d).eps) for d in floats), default=0.0)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
      np.testing.assert_array_equal(x, y)
      continue
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    np.testing.assert_allclose(x, y, rtol=ulps, atol=ulps * float(np.max(np.abs(y), initial=0.0)))
