"""Shims for the older releases inside the declared dependency ranges.

Each shim names the releases it serves, so that it can go when the lower
bounds in `pyproject.toml` pass them. CI runs the core tests on exactly those
lower bounds (`make test-lowest`, pinned by `constraints-lowest.txt`).
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(aval: Any) -> frozenset[Any]:
  """The `shard_map` mesh axes an abstract value (or ShapeDtypeStruct) varies over.

  jax 0.10 moved the set from `aval.vma` to `aval.manual_axis_type.varying`.
  """
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()) or ())  # jax < 0.10


def pvary(x: jax.Array, axis_names: tuple[Any, ...]) -> jax.Array:
  """`x` marked as varying over the `shard_map` mesh axes `axis_names`.

  A change of type only, never of value. jax 0.9 replaced `jax.lax.pvary`
  with `jax.lax.pcast(..., to="varying")`.
  """
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axis_names, to="varying")
  return jax.lax.pvary(x, axis_names)  # jax < 0.9
