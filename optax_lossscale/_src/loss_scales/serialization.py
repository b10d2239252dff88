"""Keras-style identifiers and configs for loss scales: `get`, `serialize`, `deserialize`."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy
import numpy as np

from optax_lossscale._src.loss_scales.dynamic_loss_scale import DynamicLossScale
from optax_lossscale._src.loss_scales.loss_scale import FixedLossScale, LossScale

_ACCEPTED_FORMS = (
  "'dynamic', a number >= 1 (a FixedLossScale; a NumPy or JAX scalar too), a LossScale"
  " instance, or a"
  " dict {'class_name': ..., 'config': ...} from serialize()"
)


def serialize(loss_scale: LossScale) -> dict[str, Any]:
  """Returns `{'class_name': ..., 'config': ...}`, a JSON-serializable dict.

  Only hyper-parameters are serialized (as TensorFlow does); the current
  scale and counters are state and belong in a checkpoint.

  Args:
    loss_scale: any `LossScale`.

  Returns:
    A dict with the class name and `loss_scale.get_config()`.

  Example:
    >>> from optax_lossscale import FixedLossScale, serialize
    >>> serialize(FixedLossScale(8))
    {'class_name': 'FixedLossScale', 'config': {'loss_scale_value': 8.0}}
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(f"serialize expects a LossScale; got {type(loss_scale).__name__}.")
  return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> LossScale:
  """Rebuilds a loss scale from `serialize()`'s output.

  Args:
    config: a dict `{'class_name': ..., 'config': ...}` as `serialize` returns.

  Returns:
    A fresh `LossScale` of that class and configuration (initial state).

  Example:
    >>> from optax_lossscale import DynamicLossScale, deserialize, serialize
    >>> deserialize(serialize(DynamicLossScale(1024))) == DynamicLossScale(1024)
    True
  """
  if not isinstance(config, dict) or set(config) != {"class_name", "config"}:
    raise ValueError(
      f"deserialize expects a dict with exactly the keys 'class_name' and 'config'; got {config!r}."
    )
  cls = LossScale._registry.get(config["class_name"])
  if cls is None:
    raise ValueError(
      f"Unknown loss scale class_name {config['class_name']!r}; known:"
      f" {sorted(LossScale._registry)}."
    )
  if not isinstance(config["config"], dict):
    raise ValueError(
      f"deserialize expects config['config'] to be a dict; got {config['config']!r}."
    )
  try:
    return cls.from_config(dict(config["config"]))
  except TypeError as e:  # an unknown or missing key
    raise ValueError(f"Invalid config for {config['class_name']}: {e}") from e


def _is_real_scalar_array(x: Any) -> bool:
  """A 0-d NumPy or JAX array (or NumPy scalar) of an integer or floating dtype."""
  if not isinstance(x, (np.ndarray, np.generic, jax.Array)) or np.ndim(x) != 0:
    return False
  return np.issubdtype(x.dtype, np.integer) or jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


def get(identifier: Any) -> LossScale:
  """Returns the loss scale an identifier names, as Keras's `loss_scale=` does.

  Args:
    identifier: `'dynamic'` (a default `DynamicLossScale`), a number (a
      `FixedLossScale` of that value; a NumPy or JAX scalar such as
      `jnp.float32(128)` too), a `LossScale` (returned as is), or a dict
      produced by `serialize`.

  Returns:
    A `LossScale`.

  Example:
    >>> from optax_lossscale import get
    >>> get('dynamic')().item(), get(256)().item()
    (32768.0, 256.0)
  """
  if isinstance(identifier, LossScale):
    return identifier
  if isinstance(identifier, str):
    if identifier == "dynamic":
      return DynamicLossScale()
  elif isinstance(identifier, dict):
    return deserialize(identifier)
  elif isinstance(identifier, numbers.Real) and not isinstance(identifier, (bool, np.bool_)):
    return FixedLossScale(identifier)
  elif _is_real_scalar_array(identifier):
    return FixedLossScale(identifier.item())
  raise ValueError(f"Cannot interpret {identifier!r} as a loss scale; accepted: {_ACCEPTED_FORMS}.")
