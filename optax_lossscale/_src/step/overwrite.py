"""Overwrite-with-gradient leaves: fp8 metadata that a step writes, not optimizes.

JAX's fp8 layers keep per-tensor scaling state beside the weights: Flax's
`Fp8DirectDotGeneralOp` and `Fp8Einsum` put `input_scale`, `kernel_scale`,
`output_grad_scale` and three `*_amax_history` arrays in the
`_overwrite_with_gradient` collection, and their "gradient" from `jax.grad` is
the leaf's *new value*, computed in the layer's `custom_vjp`. A wrapper marks
such leaves and treats them apart:

  marked leaves       never unscaled, never seen by the inner optimizer (its
                      state holds no moments for them), checked for NaN/Inf
                      with the rest, left out of the spike norm
  applied step        written with the new value, bit for bit (the fused
                      `apply_gradients` and the Flax `TrainState` assign it)
  skipped step        left as they were

`tx.update` returns updates, which `optax.apply_updates` adds: a marked
leaf's update is `new - old`, and `old + (new - old)` is `new` only to within
one rounding (exactly when the two are within a factor of 2). That path warns
once; use `ols.apply_gradients` or the Flax `TrainState` for exact writes.

Which leaves are marked: `'auto'` (the default) marks every leaf under a
mapping key `_overwrite_with_gradient`, Flax's collection; a pytree of bools
shaped like the params (or a prefix of them) or a predicate
`(path, leaf) -> bool` marks others (TransformerEngine's, Praxis's); None
marks none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

FLAX_COLLECTION = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT
# Flax's fp8 metadata of the output gradients: measured in the units of the
# cotangent, so in units of the loss scale when the loss is scaled.
_FLAX_GRAD_META = ("output_grad_amax_history", "output_grad_scale")
_ACCEPTED = (
  "'auto' (Flax's _overwrite_with_gradient collection), None, a pytree of bools"
  " shaped like the params (or a prefix of them), or a predicate (path, leaf) -> bool"
)

Spec = str | None | Callable[[tuple[Any, ...], Any], bool] | Any


def check_spec(spec: Any, name: str = "overwrite_with_gradient") -> Spec:
  """Validates what can be checked of a marking before the params are known."""
  if isinstance(spec, str) and spec != "auto":
    hint = " (a config cannot hold a custom marking: pass it again)" if spec == "<custom>" else ""
    raise ValueError(f"{name} must be {_ACCEPTED}; got {spec!r}{hint}.")
  return spec


def config_value(spec: Spec) -> str | None:
  """`spec` for a JSON config: 'auto' or None as they are, '<custom>' for a mask or predicate.

  A custom marking is code, not data: `from_config` refuses '<custom>', so
  the marking must be passed again.
  """
  return spec if spec is None or isinstance(spec, str) else "<custom>"


@dataclasses.dataclass(frozen=True)
class Marked:
  """Which leaves of a params-shaped tree are marked, and how to take them apart.

  Attributes:
    treedef: the structure of the params (and of the gradients).
    flags: per leaf, whether it is marked.
    loss_scale_units: per leaf, whether a marked leaf is measured in units of
      the loss scale (Flax's output-gradient metadata).
  """

  treedef: Any
  flags: tuple[bool, ...]
  loss_scale_units: tuple[bool, ...]

  def split(self, tree: Any) -> tuple[Any, list[Any]]:
    """`tree` with the marked leaves replaced by `optax.MaskedNode()`, and those leaves."""
    leaves = self.treedef.flatten_up_to(tree)
    rest = [optax.MaskedNode() if f else x for f, x in zip(self.flags, leaves, strict=True)]
    return self.treedef.unflatten(rest), [x for f, x in zip(self.flags, leaves, strict=True) if f]

  def merge(self, rest: Any, values: Sequence[Any]) -> Any:
    """The inverse of `split`: `rest` with the marked leaves put back."""
    leaves, values = self.treedef.flatten_up_to(rest), iter(values)
    return self.treedef.unflatten(
      [next(values) if f else x for f, x in zip(self.flags, leaves, strict=True)]
    )

  def units(self, values: Sequence[Any], factor: jax.Array) -> list[Any]:
    """`values` (the marked leaves) with those in loss-scale units multiplied by `factor`."""
    in_units = [u for f, u in zip(self.flags, self.loss_scale_units, strict=True) if f]
    return [v * factor.astype(v.dtype) if u else v for v, u in zip(values, in_units, strict=True)]


def resolve(spec: Spec, params: Any, name: str = "overwrite_with_gradient") -> Marked | None:
  """The leaves of `params` that `spec` marks, or None when it marks none.

  Raises:
    ValueError: if a mask tree does not match the params' structure.
    TypeError: if a mask leaf or a predicate's answer is not a bool.
  """
  if spec is None:
    return None
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  if isinstance(spec, str):  # 'auto'
    flags = [_under_flax_collection(path) for path, _ in flat]
  elif callable(spec):
    flags = [_as_bool(spec(path, leaf), name, path) for path, leaf in flat]
  else:
    try:
      full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), spec, params)
      mask_leaves = treedef.flatten_up_to(full)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{name} does not match the params' structure: it must be a pytree of bools"
        f" shaped like the params or a prefix of them. Params: {treedef}; {name}:"
        f" {jax.tree.structure(spec)}. ({e})"
      ) from None
    flags = [_as_bool(m, name, path) for m, (path, _) in zip(mask_leaves, flat, strict=True)]
  if not any(flags):
    return None
  units = [f and _is_flax_grad_meta(path) for f, (path, _) in zip(flags, flat, strict=True)]
  return Marked(treedef, tuple(flags), tuple(units))


def _under_flax_collection(path: tuple[Any, ...]) -> bool:
  return any(isinstance(k, jax.tree_util.DictKey) and k.key == FLAX_COLLECTION for k in path)


def _is_flax_grad_meta(path: tuple[Any, ...]) -> bool:
  last = path[-1] if path else None
  key = getattr(last, "key", getattr(last, "name", None))
  return isinstance(key, str) and key in _FLAX_GRAD_META


def _as_bool(value: Any, name: str, path: tuple[Any, ...]) -> bool:
  if isinstance(value, (bool, np.bool_)) or (
    isinstance(value, (np.ndarray, jax.Array)) and value.shape == () and value.dtype == bool
  ):
    try:
      return bool(value)
    except jax.errors.ConcretizationTypeError:
      pass
  raise TypeError(
    f"{name} must give a concrete bool for each leaf; got {value!r} for"
    f" {jax.tree_util.keystr(path) or '<root>'}."
  )


def unscaled_rest(marked: Marked | None, grads: Any, unscale: Callable[[Any], Any]) -> Any:
  """`grads` with `unscale` applied to all but the marked leaves."""
  if marked is None:
    return unscale(grads)
  rest, values = marked.split(grads)
  return marked.merge(unscale(rest), values)


def exclude(marked: Marked | None, tree: Any) -> Any:
  """`tree` without its marked leaves (as `optax.MaskedNode()`), for the inner optimizer."""
  return tree if marked is None else marked.split(tree)[0]


def written(
  marked: Marked,
  should_apply: jax.Array | None,
  new_values: Sequence[Any],
  old_values: Sequence[Any],
  loss_scale_factor: jax.Array | None = None,
) -> list[Any]:
  """The marked leaves after the step: new on an applied step, old on a skipped one.

  With `loss_scale_factor` (the new loss scale over the old), those in units
  of the loss scale are multiplied by it, so that they stay in the units of
  the scale the next step uses.
  """
  if should_apply is None:
    values = list(new_values)
  else:
    values = [
      jax.lax.select(should_apply, new, jnp.asarray(old, new.dtype))
      for new, old in zip(new_values, old_values, strict=True)
    ]
  if loss_scale_factor is not None:
    values = marked.units(values, loss_scale_factor)
  return values
