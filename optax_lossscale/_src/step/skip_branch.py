"""The outputs of a skipped step, typed exactly like an applied step's.

`lax.cond` requires both branches to return the same types, and `select`
the same shapes and dtypes; inside `shard_map` the types include the mesh
axes a value varies over. The skip branch returns old values (the inner
state, or the params) and zero updates, so each is given the dtype and the
varying axes of the applied branch's result, which changes no value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._src.utils import compat


def varying_axes(x: Any) -> frozenset[Any]:
  """The `shard_map` mesh axes `x` (a value or a ShapeDtypeStruct) varies over."""
  return compat.varying_axes(x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x))


def typed_like(old: Any, shape: jax.ShapeDtypeStruct, what: str) -> jax.Array:
  """`old`, unchanged in value, typed like the apply branch's `shape`.

  Cast only where the apply branch changes a leaf's dtype (e.g. bf16 moments
  fed f32 gradients), and marked as varying over the `shard_map` axes the
  apply branch's leaf varies over (a type change only), so that both branches
  of `lax.cond` agree.
  """
  old = jnp.asarray(old)
  if old.shape != shape.shape:
    raise ValueError(
      f"The inner transformation changes a {what} leaf's shape from {old.shape}"
      f" to {shape.shape}; it cannot be skipped."
    )
  if old.dtype != shape.dtype:
    old = old.astype(shape.dtype)
  missing = varying_axes(shape) - varying_axes(old)
  if missing:
    old = compat.pvary(old, tuple(missing))
  return old


def skip_outputs(
  shapes: tuple[Any, Any], old_state: Any, old_params: Any | None
) -> tuple[Any, Any]:
  """Skip-branch outputs typed exactly like the apply branch's `shapes`.

  The inner state is returned as it was. The first output is the params as
  they were when given (`apply_gradients`), else zero updates.
  """
  out_shapes, state_shapes = shapes
  state_def = jax.tree.structure(state_shapes)
  if jax.tree.structure(old_state) != state_def:
    raise ValueError(
      "The inner transformation changed the structure of its state between"
      " init and update, so a skipped step cannot return the old state:"
      f" {jax.tree.structure(old_state)} vs {state_def}."
    )
  state = jax.tree.map(lambda x, s: typed_like(x, s, "state"), old_state, state_shapes)
  if old_params is not None:
    return jax.tree.map(lambda x, s: typed_like(x, s, "params"), old_params, out_shapes), state
  # zeros_like of a ShapeDtypeStruct keeps its sharding and, inside
  # shard_map, the mesh axes it varies over, which cond requires to match.
  return jax.tree.map(lambda s: jnp.zeros_like(s, dtype=s.dtype), out_shapes), state
