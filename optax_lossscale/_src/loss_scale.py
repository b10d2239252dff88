"""Loss scales: immutable pytrees with a pure, jit-compatible `update`.

Loss scaling multiplies the loss by a factor `S` before differentiation, so that
small float16 gradients do not underflow to zero, and divides the gradients by
`S` afterwards. This module holds the common base class and the two static
scales; `DynamicLossScale`, which adapts `S`, has a module of its own.

Every class is a pytree whose leaves are only the state that changes (for the
dynamic scale: `loss_scale` as float32, `counter` and `hysteresis_tracker` as
int32 scalars; the static scales have none); hyper-parameters are static
auxiliary data and survive `jit`, `tree_map`, `eval_shape` and
flatten/unflatten unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src import tree_utils, validation

_Self = TypeVar("_Self", bound="LossScale")


def _scale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
  """Multiplies `x` by the float32 `factor`, returning `x`'s dtype.

  The arithmetic runs in at least float32 so that a float16 leaf is never
  multiplied by a scale that float16 cannot represent (2**16 is inf there);
  for scales float16 can hold the result is bit-identical to float16 math.
  """
  x = jnp.asarray(x)
  compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
  return (x.astype(compute_dtype) * factor.astype(compute_dtype)).astype(x.dtype)


class LossScale(abc.ABC):
  """Base class of the loss scales: a frozen pytree with a common interface.

  Subclasses list their array leaves in `_state_fields` and their static
  hyper-parameters in `_config_fields`; this base class provides the pytree
  registration (with named keys), immutability, equality, `scale`, `unscale`
  and serialization.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale import DynamicLossScale, LossScale
    >>> ls = DynamicLossScale(2**10)
    >>> isinstance(ls, LossScale), ls.dynamic
    (True, True)
    >>> ls.unscale(ls.scale({'w': jnp.float16(0.5)}))
    {'w': Array(0.5, dtype=float16)}
    >>> [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(ls)]
    ['.loss_scale', '.counter', '.hysteresis_tracker']
  """

  _state_fields: ClassVar[tuple[str, ...]] = ()
  _config_fields: ClassVar[tuple[str, ...]] = ()
  _registry: ClassVar[dict[str, type[LossScale]]] = {}
  # The current scale, a float32 scalar: a leaf of the dynamic scales, a
  # constant property of the static ones.
  loss_scale: jax.Array

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    # First come: a later class of the same name (a user's shim, a reloaded
    # module) never takes over the name `deserialize` resolves.
    LossScale._registry.setdefault(cls.__name__, cls)
    jax.tree_util.register_pytree_with_keys(
      cls, cls._tree_flatten_with_keys, cls._tree_unflatten, cls._tree_flatten
    )

  # -- pytree protocol: no validation or conversion in unflatten, so that JAX
  # can rebuild the object with tracers, `object()` or `ShapeDtypeStruct`.

  def _tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    children = tuple(getattr(self, f) for f in self._state_fields)
    return children, tuple(getattr(self, f) for f in self._config_fields)

  def _tree_flatten_with_keys(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    children, aux = self._tree_flatten()
    keys = tuple(jax.tree_util.GetAttrKey(f) for f in self._state_fields)
    return tuple(zip(keys, children, strict=True)), aux

  @classmethod
  def _tree_unflatten(cls: type[_Self], aux: tuple[Any, ...], children: Any) -> _Self:
    obj = object.__new__(cls)
    for name, value in zip(cls._config_fields, aux, strict=True):
      object.__setattr__(obj, name, value)
    for name, value in zip(cls._state_fields, children, strict=True):
      object.__setattr__(obj, name, value)
    return obj

  def __setattr__(self, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(
      f"{type(self).__name__} is immutable; use .replace({name}=...) or"
      " .update(grads) to make a new one."
    )

  def __delattr__(self, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is immutable.")

  def _set(self, **fields: Any) -> None:
    """Sets fields during construction, bypassing immutability."""
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  def replace(self: _Self, **state: Any) -> _Self:
    """Returns a copy with some state leaves replaced (as Flax's `.replace`).

    Only the array state can be replaced; hyper-parameters are fixed at
    construction, where they are validated: build a new object to change one.
    The new state is not validated (it may be traced): a `DynamicLossScale`'s
    scale must stay within [min_loss_scale, max_loss_scale], which
    `loss_scale_optimizer` relies on.
    """
    unknown = set(state) - set(self._state_fields)
    if unknown:
      raise TypeError(
        f"{type(self).__name__}.replace accepts only the state fields"
        f" {list(self._state_fields)}; got {sorted(unknown)}."
      )
    children, aux = self._tree_flatten()
    children = tuple(state.get(f, c) for f, c in zip(self._state_fields, children, strict=True))
    return self._tree_unflatten(aux, children)

  # -- the common interface.

  @property
  def dynamic(self) -> bool:
    """Whether `update` can change the scale and ask to skip a step."""
    return False

  def __call__(self) -> jax.Array:
    """Returns the current loss scale as a float32 scalar array."""
    return self.loss_scale

  def scale(self, tree: Any) -> Any:
    """Multiplies every floating leaf of `tree` (or a loss) by the loss scale.

    Each leaf keeps its dtype; `None`, integer, bool and `float0` leaves pass
    through untouched.
    """
    factor = jnp.asarray(self.loss_scale, jnp.float32)
    return tree_utils.map_inexact(lambda x: _scale_leaf(x, factor), tree)

  def unscale(self, tree: Any) -> Any:
    """Divides every floating leaf of `tree` by the loss scale.

    The division is a multiplication by the float32 reciprocal `1 / S`, as in
    Keras, and as XLA compiles `x / S` for a scalar `S` anyway: the bits are
    the same on every backend, and exactly `x / S` for power-of-two scales.
    Each leaf keeps its dtype; `None`, integer, bool and `float0` leaves pass
    through untouched.
    """
    reciprocal = 1.0 / jnp.asarray(self.loss_scale, jnp.float32)
    return tree_utils.map_inexact(lambda x: _scale_leaf(x, reciprocal), tree)

  @abc.abstractmethod
  def update(
    self: _Self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[_Self, jax.Array]:
    """Returns `(new_loss_scale, should_apply)` for the unscaled `grads`.

    Pure and jit-compatible. `should_apply` is a scalar bool array; when it is
    False the caller must skip this step's update.

    Args:
      grads: the **unscaled** gradients, any pytree; `None` leaves are ignored.
      axis_name: inside `shard_map`/`pmap`, the axis name (or tuple of names)
        across which the finiteness check must agree.
    """

  def get_config(self) -> dict[str, Any]:
    """Returns the hyper-parameters as a JSON-serializable dict."""
    return {f: getattr(self, f) for f in self._config_fields}

  @classmethod
  def from_config(cls: type[_Self], config: dict[str, Any]) -> _Self:
    """Creates a fresh loss scale from `get_config()`'s output."""
    return cls(**config)

  def __eq__(self, other: object) -> bool:
    if type(self) is not type(other):
      return NotImplemented
    assert isinstance(other, LossScale)
    if self._tree_flatten()[1] != other._tree_flatten()[1]:
      return False
    return all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(self._tree_flatten()[0], other._tree_flatten()[0], strict=True)
    )

  __hash__ = None  # type: ignore[assignment]  # state arrays are mutable-by-value

  def __repr__(self) -> str:
    fields = [*self._state_fields, *self._config_fields]
    body = ", ".join(f"{f}={getattr(self, f)!r}" for f in fields)
    return f"{type(self).__name__}({body})"


class NoOpLossScale(LossScale):
  """A loss scale of 1 that never changes: loss scaling switched off.

  `scale` and `unscale` return their input unchanged and `update` always
  applies. Useful to keep one training loop for float32 and float16 runs.

  Example:
    >>> from optax_lossscale import NoOpLossScale
    >>> ls = NoOpLossScale()
    >>> float(ls())
    1.0
    >>> ls.update({'w': float('nan')})[1]
    Array(True, dtype=bool)
  """

  def __init__(self) -> None:
    pass

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def scale(self, tree: Any) -> Any:
    return tree

  def unscale(self, tree: Any) -> Any:
    return tree

  def update(
    self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[NoOpLossScale, jax.Array]:
    del grads
    tree_utils.normalize_axis_name(axis_name)
    return self, jnp.asarray(True)


class FixedLossScale(LossScale):
  """A loss scale with a constant value (TensorFlow's `FixedLossScale`).

  `update` never changes the scale and always returns `should_apply=True`,
  even for non-finite gradients: a fixed scale cannot react to an overflow.
  Use `DynamicLossScale` to skip overflowing steps.

  Args:
    loss_scale_value: the scale, a finite number >= 1.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import FixedLossScale
    >>> ls = FixedLossScale(128)
    >>> ls.scale(jnp.float32(0.5))
    Array(64., dtype=float32)
    >>> ls.get_config()
    {'loss_scale_value': 128.0}
  """

  _config_fields = ("loss_scale_value",)
  loss_scale_value: float

  def __init__(self, loss_scale_value: float) -> None:
    self._set(
      loss_scale_value=validation.check_float(
        "loss_scale_value",
        loss_scale_value,
        low=1.0,
        low_inclusive=True,
        accepted="a finite number >= 1",
      )
    )

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.asarray(self.loss_scale_value, jnp.float32)

  def update(
    self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[FixedLossScale, jax.Array]:
    del grads
    tree_utils.normalize_axis_name(axis_name)
    return self, jnp.asarray(True)
