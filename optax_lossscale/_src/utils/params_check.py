"""Params must be a pytree of arrays: a clear error instead of a JAX one deep inside.

An optax transformation builds its state with `zeros_like` over the params
and reads them in `update`. Handed a whole model object whose leaves include
functions or other Python objects (an Equinox module: its activation
functions, a Flax NNX module outside `nnx.Optimizer`), JAX fails in the
middle of the inner optimizer with "zeros_like requires ndarray or scalar
arguments" or "... is not a valid JAX type", naming neither the leaf nor the
fix. This check runs when the step is traced (Python metadata only, nothing
is added to the compiled step) and names both.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Python scalars are valid JAX values: optax accepts them as params leaves.
_SCALARS = (bool, int, float, complex, np.generic)


def _is_array_like(leaf: Any) -> bool:
  """Arrays, tracers, `ShapeDtypeStruct`s (`eval_shape`) and Python/NumPy scalars."""
  if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, *_SCALARS)):
    return True
  return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def check_params_are_arrays(params: Any, where: str) -> None:
  """Raises a `TypeError` naming the first leaf of `params` that is not an array.

  `None` leaves (what `eqx.filter` leaves where it removed a non-array) are
  not pytree leaves and pass, as do arrays, tracers and Python or NumPy
  scalars.

  Args:
    params: the params (or gradients, or updates) pytree to check.
    where: who received it, for the message (e.g. `"loss_scale_optimizer.init"`).

  Raises:
    TypeError: if a leaf is not an array, naming its path and type, and
      saying to pass only the arrays (for an Equinox module,
      `eqx.filter(model, eqx.is_inexact_array)`).

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
    if _is_array_like(leaf):
      continue
    raise TypeError(
      f"{where} got params with a leaf that is not an array, at"
      f" {jax.tree_util.keystr(path) or '<root>'} (a {type(leaf).__name__}). Params"
      " must hold only arrays (None leaves are fine). For an Equinox module pass"
      " eqx.filter(model, eqx.is_inexact_array) and put the result back with"
      " eqx.combine (or eqx.apply_updates); for a Flax NNX module use nnx.Optimizer"
      " or nnx.state(model, nnx.Param)."
    )
