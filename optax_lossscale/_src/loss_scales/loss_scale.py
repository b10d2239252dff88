"""Loss scales: immutable pytrees with a pure, jit-compatible `update`.

Loss scaling multiplies the loss by a factor `S` before differentiation, so that
small float16 gradients do not underflow to zero, and divides the gradients by
`S` afterwards. This module holds the common base class and the two static
scales that never skip a step; `SkippingFixedLossScale` (constant, skips
non-finite steps) and `DynamicLossScale` (adapts `S`) have modules of their own.

Every class is a pytree whose leaves are only the state that changes (for the
dynamic scale: `loss_scale` as float32, `counter` and `hysteresis_tracker` as
int32 scalars; the static scales have none); hyper-parameters are static
auxiliary data and survive `jit`, `tree_map`, `eval_shape` and
flatten/unflatten unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
import types
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.loss_scales import scaling_record
from optax_lossscale._src.utils import tree_utils, validation

_Self = TypeVar("_Self", bound="LossScale")


def _scale_leaf(x: jax.Array, factor: jax.Array, keep_dtype: bool = True) -> jax.Array:
  """Multiplies `x` by the float32 `factor` in at least float32.

  A float16 leaf is never multiplied by a scale that float16 cannot represent
  (2**16 is inf there). The result has `x`'s dtype (for scales float16 can
  hold, bit-identical to float16 math), or with `keep_dtype=False` the
  promoted one.
  """
  x = jnp.asarray(x)
  compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
  product = x.astype(compute_dtype) * factor.astype(compute_dtype)
  return product.astype(x.dtype) if keep_dtype else product


class _LossScaleType(abc.ABCMeta):
  """Metaclass of the loss scales: a constructed instance becomes its class's node.

  Every public class `C` has a private twin `C._Node`, a subclass that adds no
  behaviour and is the type JAX sees. `C(...)` runs `C.__init__` (which
  validates), then re-classes the instance as `C._Node`.
  """

  def __call__(cls, *args: Any, **kwargs: Any) -> Any:
    if cls.__abstractmethods__:
      missing = ", ".join(sorted(cls.__abstractmethods__))
      raise TypeError(f"Can't instantiate abstract class {cls.__name__} (missing: {missing}).")
    obj = super().__call__(*args, **kwargs)
    object.__setattr__(obj, "__class__", cls._Node)
    return obj


class _NodeType(_LossScaleType):
  """Metaclass of the twins: plain `type.__call__`, so JAX's rebuild runs no Python."""

  __call__ = type.__call__


class LossScale(types.SimpleNamespace, metaclass=_LossScaleType):
  """Base class of the loss scales: a frozen pytree with a common interface.

  Subclasses list their array leaves in `_state_fields` and their static
  hyper-parameters in `_config_fields`, and set both in `__init__` with
  `self._set(...)`; this base class provides the pytree registration (with
  named keys), immutability, equality, `scale`, `unscale` and serialization.

  Calling a jitted step flattens and rebuilds the loss scale on every call,
  so that path runs no Python: an instance's type is a twin of its class
  (`type(ls)` is `DynamicLossScale._Node`; `isinstance` works as usual)
  whose construction is `types.SimpleNamespace`'s, written in C, and which is
  registered with `jax.tree_util.register_dataclass`, flattened in C++.
  Hyper-parameters are its static fields; validation runs in the public
  constructor only, never when JAX rebuilds the object from tracers,
  `object()` or `ShapeDtypeStruct` leaves.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale import DynamicLossScale, LossScale
    >>> ls = DynamicLossScale(2**10)
    >>> isinstance(ls, LossScale), ls.dynamic
    (True, True)
    >>> ls.scale({'w': jnp.float16(0.5)})
    {'w': Array(512., dtype=float32)}
    >>> ls.unscale({'w': jnp.float16(512.0)})
    {'w': Array(0.5, dtype=float16)}
    >>> [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(ls)]
    ['.loss_scale', '.counter', '.hysteresis_tracker']
  """

  _state_fields: ClassVar[tuple[str, ...]] = ()
  _config_fields: ClassVar[tuple[str, ...]] = ()
  _registry: ClassVar[dict[str, type[LossScale]]] = {}
  _Node: ClassVar[type[LossScale]]
  # The current scale, a float32 scalar: a leaf of the dynamic scales, a
  # constant property of the static ones.
  loss_scale: jax.Array

  def __init_subclass__(cls, _node: bool = False, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    if _node:
      return
    # First come: a later class of the same name (a user's shim, a reloaded
    # module) never takes over the name `deserialize` resolves.
    LossScale._registry.setdefault(cls.__name__, cls)
    # C-implemented construction, so rebuilding a node calls no Python; the
    # qualified name lets pickle find the twin as `C._Node`.
    namespace = {
      "__init__": types.SimpleNamespace.__init__,
      "__module__": cls.__module__,
      "__qualname__": f"{cls.__qualname__}._Node",
      "__doc__": cls.__doc__,
      "_Public": cls,
    }
    cls._Node = _NodeType(cls.__name__, (cls,), namespace, _node=True)
    jax.tree_util.register_dataclass(
      cls._Node, data_fields=list(cls._state_fields), meta_fields=list(cls._config_fields)
    )

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
    return type(self)._Node(**{**vars(self), **state})

  # -- the common interface.

  @property
  def dynamic(self) -> bool:
    """Whether `update` can change the scale (Keras's `dynamic`)."""
    return False

  @property
  def skips(self) -> bool:
    """Whether `update` can return `should_apply=False`, so that a step is skipped.

    True for `DynamicLossScale` and `SkippingFixedLossScale`; False for
    `FixedLossScale` (TensorFlow's rule: every step is applied) and
    `NoOpLossScale`. By default, a subclass skips when it is `dynamic`.
    """
    return self.dynamic

  def __call__(self) -> jax.Array:
    """Returns the current loss scale as a float32 scalar array."""
    return self.loss_scale

  def scale(self, tree: Any) -> Any:
    """Multiplies every floating leaf of `tree` (a loss) by the loss scale.

    As in jmp and Keras 3, a leaf narrower than float32 (float16, bfloat16,
    the 8-bit floats) is promoted to float32 first, so that a float16 loss
    times a large scale is not `inf`; wider leaves keep their dtype. `None`,
    integer, bool and `float0` leaves pass through untouched.

    Each call (or trace) counts as a scaled loss for `loss_scale_optimizer`'s
    check against gradients of the plain loss (`UnscaledGradientsWarning`).
    """
    scaling_record.note_scaled()
    factor = jnp.asarray(self.loss_scale, jnp.float32)
    return tree_utils.map_inexact(lambda x: _scale_leaf(x, factor, keep_dtype=False), tree)

  def unscale(self, tree: Any) -> Any:
    """Divides every floating leaf of `tree` by the loss scale.

    The division is a multiplication by the float32 reciprocal `1 / S`, as in
    Keras, and as XLA compiles `x / S` for a scalar `S` anyway; exactly `x / S`
    for power-of-two scales. A `FixedLossScale` takes the correctly rounded
    reciprocal from the host, so eager and jitted code give the same bits on
    every backend; a dynamic scale's reciprocal is computed on the device,
    whose float32 division is not correctly rounded on every GPU (exact for
    the power-of-two scales of the default `DynamicLossScale`).
    Each leaf keeps its dtype; `None`, integer, bool and `float0` leaves pass
    through untouched.
    """
    reciprocal = self._reciprocal()
    return tree_utils.map_inexact(lambda x: _scale_leaf(x, reciprocal), tree)

  def _reciprocal(self) -> jax.Array:
    """`1 / S` as a float32 scalar."""
    return 1.0 / jnp.asarray(self.loss_scale, jnp.float32)

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
    # Through the public class, which validates (also when called on a twin).
    return getattr(cls, "_Public", cls)(**config)

  def __eq__(self, other: object) -> bool:
    if type(self) is not type(other):
      return NotImplemented
    assert isinstance(other, LossScale)
    if self.get_config() != other.get_config():
      return False
    return all(
      np.array_equal(np.asarray(getattr(self, f)), np.asarray(getattr(other, f)))
      for f in self._state_fields
    )

  def __ne__(self, other: object) -> bool:
    # Explicit: SimpleNamespace's own `__ne__` would compare the attribute dicts.
    equal = self.__eq__(other)
    return equal if equal is NotImplemented else not equal

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

  @property
  def counter(self) -> None:
    """None: a static scale counts no steps (Keras's `dynamic_counter`)."""
    return None

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


class ConstantScale:
  """What the constant scales share: the scale from `loss_scale_value`, no counter.

  A mixin of `FixedLossScale` and `SkippingFixedLossScale`, which differ in
  whether `update` skips a non-finite step and in the smallest scale they
  accept (TensorFlow's 1; jmp's any positive number), set by `_low`.
  """

  _config_fields = ("loss_scale_value",)
  loss_scale_value: float
  # The smallest scale accepted, and whether it is itself accepted.
  _low: ClassVar[float]
  _low_inclusive: ClassVar[bool]

  def __init__(self, loss_scale_value: float) -> None:
    self._set(  # type: ignore[attr-defined]  # LossScale's
      loss_scale_value=validation.check_float(
        "loss_scale_value",
        loss_scale_value,
        low=self._low,
        low_inclusive=self._low_inclusive,
        accepted=f"a finite number {'>=' if self._low_inclusive else '>'} {self._low:g}",
      )
    )

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.asarray(self.loss_scale_value, jnp.float32)

  @property
  def counter(self) -> None:
    """None: a fixed scale counts no steps (Keras's `dynamic_counter` is None too)."""
    return None

  def _reciprocal(self) -> jax.Array:
    # NumPy's division is correctly rounded; a device's may not be (GPUs).
    return jnp.asarray(np.float32(1) / np.float32(self.loss_scale_value))


class FixedLossScale(ConstantScale, LossScale):
  """A loss scale with a constant value (TensorFlow's `FixedLossScale`).

  `update` never changes the scale and always returns `should_apply=True`,
  even for non-finite gradients (TensorFlow's rule): `loss_scale_optimizer`
  applies every step, NaN included. Use `SkippingFixedLossScale` for a
  constant scale that skips non-finite steps (jmp's recipe), or
  `DynamicLossScale` to skip them and back off.

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

  _low, _low_inclusive = 1.0, True

  def update(
    self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[FixedLossScale, jax.Array]:
    del grads
    tree_utils.normalize_axis_name(axis_name)
    return self, jnp.asarray(True)
