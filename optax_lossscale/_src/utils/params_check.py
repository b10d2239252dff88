"""Params must be a pytree of arrays: a clear error instead of a JAX one deep inside.

An optax transformation builds its state with `zeros_like` over the params
and reads them in `update`. Handed a whole model object whose leaves include
functions or other Python objects (an Equinox module: its activation
functions, a Flax NNX module outside `nnx.Optimizer`), JAX fails in the
middle of the inner optimizer with "zeros_like requires ndarray or scalar
arguments" or "... is not a valid JAX type", naming neither the leaf nor the
fix. A module whose only non-array leaves are Python numbers (an Equinox
`Dropout`'s rate `p` and its `inference` flag) gets no error from JAX at all:
the optimizer would train its settings. This check runs when the step is
traced (Python metadata only, nothing is added to the compiled step) and
names the leaf and the fix.

Python numbers are valid JAX values, and optax accepts them as params
leaves: in a dict, list or tuple (`{'scale': 1.0}`) they pass. As a field of
an object (a module, a dataclass), a Python number is one of its settings,
not a parameter, and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_PYTHON_NUMBERS = (bool, int, float, complex)
_SCALARS = (*_PYTHON_NUMBERS, np.generic)
_HINT = (
  " Params must hold only arrays (None leaves are fine). For an Equinox module pass"
  " eqx.filter(model, eqx.is_inexact_array) and put the result back with"
  " eqx.combine (or eqx.apply_updates); for a Flax NNX module use nnx.Optimizer"
  " or nnx.state(model, nnx.Param)."
)


def _is_array_like(leaf: Any) -> bool:
  """Arrays, tracers, `ShapeDtypeStruct`s (`eval_shape`) and Python/NumPy scalars."""
  if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, *_SCALARS)):
    return True
  return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _owner(params: Any, path: tuple[Any, ...]) -> Any:
  """The node holding the leaf at `path`: a container, an object, or None if unreachable."""
  node = params
  for key in path[:-1]:
    if isinstance(key, jax.tree_util.SequenceKey):
      node = node[key.idx]
    elif isinstance(key, jax.tree_util.DictKey):
      node = node[key.key]
    elif isinstance(key, jax.tree_util.GetAttrKey):
      node = getattr(node, key.name)
    else:  # a custom node without named keys: not a plain container
      return None
  return node


def _is_container(node: Any) -> bool:
  """A dict, list or tuple (NamedTuples too), or a mapping or sequence like them."""
  return isinstance(node, (Mapping, Sequence)) and not isinstance(node, (str, bytes))


def check_params_are_arrays(params: Any, where: str) -> None:
  """Raises a `TypeError` naming the first leaf of `params` that is not an array.

  `None` leaves (what `eqx.filter` leaves where it removed a non-array) are
  not pytree leaves and pass, as do arrays, tracers and NumPy scalars.
  Python numbers pass in a dict, list or tuple; as a field of an object (a
  module's dropout rate or flag) they are refused.

  Args:
    params: the params (or gradients, or updates) pytree to check.
    where: who received it, for the message (e.g. `"loss_scale_optimizer.init"`).

  Raises:
    TypeError: if a leaf is not an array (or is a Python number held by an
      object), naming its path and type, and saying to pass only the arrays
      (for an Equinox module, `eqx.filter(model, eqx.is_inexact_array)`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale._src.utils.params_check import check_params_are_arrays
    >>> check_params_are_arrays({'w': jnp.ones(2), 'b': None}, 'tx.init')
    >>> check_params_are_arrays({'w': jnp.ones(2), 'act': jax.nn.relu}, 'tx.init')
    Traceback (most recent call last):
    ...
    TypeError: tx.init got params with a leaf that is not an array, at ['act'] (a custom_jvp)...
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, leaf in leaves:
    where_leaf = jax.tree_util.keystr(path) or "<root>"
    if isinstance(leaf, _PYTHON_NUMBERS) and path:
      owner = _owner(params, path)
      if not _is_container(owner):
        held_by = type(owner).__name__ if owner is not None else "an object"
        raise TypeError(
          f"{where} got params with a leaf that is not an array, at {where_leaf} (a"
          f" Python {type(leaf).__name__}, a field of {held_by}): a setting of the model"
          " such as a dropout rate or a flag, which the optimizer would change." + _HINT
        )
    if _is_array_like(leaf):
      continue
    raise TypeError(
      f"{where} got params with a leaf that is not an array, at {where_leaf}"
      f" (a {type(leaf).__name__})." + _HINT
    )


def check_float_grads(grads: Any, where: str, why: str) -> None:
  """Raises a `TypeError` naming the first integer or bool leaf of `grads`.

  `None` and `float0` leaves (what `jax.grad(..., allow_int=True)` gives for
  integer inputs) pass. Runs when the step is traced: nothing is added to
  the compiled step.

  Args:
    grads: the gradients pytree to check.
    where: who received it, for the message (e.g. `"loss_scale_optimizer"`).
    why: what would go wrong with such a leaf, one sentence.

  Raises:
    TypeError: naming the leaf's path and dtype, `why`, and the fix (keep
      integer arrays out of the tree that is optimized).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale._src.utils.params_check import check_float_grads
    >>> check_float_grads({'w': jnp.ones(2), 'b': None}, 'tx', 'It cannot be scaled.')
    >>> check_float_grads({'n': jnp.arange(2)}, 'tx', 'It cannot be scaled.')
    Traceback (most recent call last):
    ...
    TypeError: tx got an integer gradient leaf at ['n'] (dtype int32); it cannot be scaled. ...
  """
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    dtype = getattr(g, "dtype", None)
    if dtype is None or dtype == jax.dtypes.float0:
      continue
    if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
      raise TypeError(
        f"{where} got an integer gradient leaf at"
        f" {jax.tree_util.keystr(path) or '<root>'} (dtype {dtype}); {why[0].lower()}{why[1:]}"
        " Keep integer and bool arrays out of the tree you optimize (pass only the"
        " float parameters to init, update and jax.grad), or give that leaf a float"
        " gradient."
      )
