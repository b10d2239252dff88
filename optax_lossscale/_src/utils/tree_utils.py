"""Pytree helpers shared by the loss scales and the optimizer wrapper.

Gradient trees are not always homogeneous: `jax.grad(..., allow_int=True)`
yields `float0` leaves for integer inputs, users keep integer or boolean
buffers beside their parameters, and Keras-style code passes `None` for
variables without a gradient. The rule used everywhere in this package is:

* `None` is an empty subtree, so it stays `None` and is never inspected;
* floating and complex leaves are scaled, unscaled and checked for finiteness;
* every other leaf (integer, bool, `float0`, non-numeric) passes through
  untouched and never makes a step non-finite.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
import functools
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

AxisName: TypeAlias = Hashable | Sequence[Hashable] | None


def _leaf_dtype(x: Any) -> np.dtype | None:
  """Returns the dtype `x` would have as a JAX value, or None if it has none."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None:
    return np.dtype(dtype)
  if isinstance(x, (bool, int, float, complex)):
    return np.dtype(jnp.result_type(x))
  return None


def is_inexact(x: Any) -> bool:
  """Whether `x` is a floating or complex array or scalar (float0 is not)."""
  dtype = _leaf_dtype(x)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def map_inexact(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
  """Applies `fn` to the inexact leaves of `tree`; other leaves pass through."""
  return jax.tree.map(lambda x: fn(x) if is_inexact(x) else x, tree)


def _check_axis_name(axis_name: AxisName) -> None:
  if axis_name is None:
    return
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  # A mesh or pmap axis is named by a string (or another hashable); None, a
  # bool or a nested sequence would only fail later, inside the traced step.
  valid = lambda n: isinstance(n, Hashable) and not isinstance(n, (bool, tuple, type(None)))
  if not names or not all(valid(n) for n in names):
    raise TypeError(
      "axis_name must be None, an axis name (a string such as 'data') or a non-empty"
      f" tuple of axis names; got {axis_name!r}."
    )


def normalize_axis_name(axis_name: AxisName) -> Hashable | tuple[Hashable, ...] | None:
  """Validates `axis_name` and returns it in the form JAX collectives accept."""
  _check_axis_name(axis_name)
  if isinstance(axis_name, list):
    return tuple(axis_name)
  return axis_name


# Leaf dtypes whose finiteness is read with one sum of `x - x` (see below).
_SUM_CHECKED = frozenset(
  np.dtype(t) for t in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.complex64, jnp.complex128)
)


def leaf_all_finite(x: jax.Array) -> jax.Array:
  """Whether every element of the non-empty array `x` is finite, as a bool scalar."""
  # Each leaf is read once, by a reduction that writes no temporary where
  # XLA:CPU allows (docs/benchmark_findings.md, finding 3: past 32 MiB a flags array costs
  # page faults, several times a plain read). `x - x` is 0 for finite x and NaN
  # for NaN or +-Inf, and a sum keeps any NaN, so one sum decides:
  # XLA folds `x - x` to 0 only under fast-math, which would fold `isfinite`
  # too. XLA:CPU sums float16 through a float32 temporary, so float16 and the
  # 8-bit floats take a min over uint8 flags (an integer min has no NaN
  # semantics to get wrong, unlike a max over |x|).
  if x.dtype in _SUM_CHECKED:
    return jnp.isfinite(jnp.sum(x - x))
  return jnp.min(jnp.isfinite(x).astype(jnp.uint8)) == 1


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """Returns a scalar bool array: True iff every inexact leaf is finite.

  `None` leaves and non-float leaves (integers, bools, `float0`) are ignored,
  so a tree with no floating leaves at all, or an empty tree, is finite.

  Args:
    tree: any pytree of arrays, e.g. the unscaled gradients.
    axis_name: inside `shard_map` or `pmap`, the mapped axis name (or a tuple
      of names) across which the answer must agree: the result is True only
      if every shard along those axes is finite. Costs one all-reduce of one
      int32 scalar.

  Returns:
    A scalar `bool` array.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import all_finite
    >>> bool(all_finite({'w': jnp.ones(3), 'b': None}))
    True
    >>> bool(all_finite([jnp.array([1.0, jnp.inf]), jnp.arange(3)]))
    False
  """
  axis_name = normalize_axis_name(axis_name)
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree) if is_inexact(x)]
  per_leaf = [leaf_all_finite(x) for x in leaves if x.size]
  finite = functools.reduce(jnp.logical_and, per_leaf, jnp.asarray(True))
  if axis_name is not None:
    # One all-reduce of a scalar: the minimum is 1 only if every shard is finite.
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) == 1
  return finite


def select_tree(pred: jax.typing.ArrayLike, on_true: Any, on_false: Any) -> Any:
  """Selects `on_true` where the scalar `pred` holds, else `on_false`, leafwise.

  Both trees must have the same structure and, leaf by leaf, the same shape
  and dtype: mismatches are errors, never silent promotions. `None` leaves
  stay `None`.

  Args:
    pred: a scalar boolean.
    on_true: the tree returned when `pred` is True.
    on_false: the tree returned when `pred` is False.

  Returns:
    A tree with the structure of `on_true`.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import select_tree
    >>> select_tree(jnp.array(False), {'w': jnp.ones(2)}, {'w': jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = jnp.asarray(pred)
  if pred.shape != () or pred.dtype != jnp.bool_:
    raise TypeError(f"pred must be a scalar bool; got shape {pred.shape} and dtype {pred.dtype}.")
  true_leaves, true_def = jax.tree_util.tree_flatten_with_path(on_true)
  false_leaves, false_def = jax.tree.flatten(on_false)
  if true_def != false_def:
    raise ValueError(
      f"on_true and on_false must have the same tree structure; got {true_def} and {false_def}."
    )
  selected = []
  for (path, a), b in zip(true_leaves, false_leaves, strict=True):
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
      raise TypeError(
        f"select_tree leaf {jax.tree_util.keystr(path)} differs in shape or dtype"
        f" between the branches: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}."
      )
    selected.append(jax.lax.select(pred, a, b))
  return jax.tree.unflatten(true_def, selected)
