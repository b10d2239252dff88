"""Loss scales: immutable pytrees with a pure, jit-compatible `update`.

Loss scaling multiplies the loss by a factor `S` before differentiation, so that
small float16 gradients do not underflow to zero, and divides the gradients by
`S` afterwards. A dynamic loss scale adapts `S` as training runs::

  grads = unscale(grad(scale(loss)))       # divide by the current S
  if all grads are finite:
    counter += 1
    if counter >= increment_period:        # a whole period without overflow
      S' = S * multiplier; S = S' if S' is finite and S' <= max_loss_scale
      counter = 0; hysteresis_tracker = hysteresis
    apply the update
  else:                                    # overflow: skip the step
    counter = 0; hysteresis_tracker -= 1
    if hysteresis_tracker <= 0:            # hysteresis=1 backs off at once
      S = max(S * backoff, min_loss_scale)   # backoff defaults to 1/multiplier

With the default hyper-parameters the trajectory of `S` is bit-identical to
TensorFlow's `tf.mixed_precision.experimental.DynamicLossScale`.

Every class here is a pytree whose leaves are only the state that changes
(`loss_scale` as float32, `counter` and `hysteresis_tracker` as int32 scalars);
hyper-parameters are static auxiliary data and survive `jit`, `tree_map`,
`eval_shape` and flatten/unflatten unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src import tree_utils

_Self = TypeVar("_Self", bound="LossScale")

FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _scale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
  """Multiplies `x` by the float32 `factor`, returning `x`'s dtype.

  The arithmetic runs in at least float32 so that a float16 leaf is never
  multiplied by a scale that float16 cannot represent (2**16 is inf there);
  for scales float16 can hold the result is bit-identical to float16 math.
  """
  x = jnp.asarray(x)
  compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
  return (x.astype(compute_dtype) * factor.astype(compute_dtype)).astype(x.dtype)


def _registry() -> dict[str, type[LossScale]]:
  return LossScale._registry


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
    LossScale._registry[cls.__name__] = cls
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


def _check_float(
  name: str,
  value: Any,
  *,
  low: float,
  low_inclusive: bool,
  high: float = math.inf,
  high_inclusive: bool = True,
  accepted: str,
) -> float:
  """Converts a concrete number to float and checks its range, or raises."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Real, np.ndarray, jax.Array)
  ):
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  try:
    number = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"{name} must be a concrete number ({accepted}); got {value!r}.") from e
  above = number >= low if low_inclusive else number > low
  below = number <= high if high_inclusive else number < high
  if not (math.isfinite(number) and above and below):
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  return number


def _check_int(name: str, value: Any, *, low: int, accepted: str) -> int:
  """Checks that `value` is an integer in [low, int32 max] and returns it."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  number = int(value)
  if not low <= number <= _INT32_MAX:
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  return number


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
      loss_scale_value=_check_float(
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


class DynamicLossScale(LossScale):
  """A loss scale that grows while gradients stay finite and backs off on overflow.

  See the module docstring for the algorithm. With the default arguments the
  trajectory is bit-identical to TensorFlow's `DynamicLossScale`; the keyword
  arguments add the knobs of the PyTorch, Megatron-LM and DeepSpeed scalers.

  Args:
    initial_loss_scale: the starting scale, a finite number > 0 within
      [min_loss_scale, max_loss_scale]. Start high: a scale that is too high
      falls in a few steps, one that is too low takes periods to climb.
    increment_period: grow the scale after this many consecutive finite steps
      (an integer >= 1).
    multiplier: the growth factor, a finite number > 1.
    min_loss_scale: the scale never backs off below this finite number > 0.
    max_loss_scale: growth that would exceed this finite number is not taken.
    backoff_factor: the factor applied on overflow, in (0, 1). `None` uses
      `1 / multiplier`, which for TensorFlow's multiplier of 2 halves the
      scale exactly as TensorFlow does.
    hysteresis: back off only on the `hysteresis`-th non-finite step since
      the tracker was last restored (Megatron-LM); 1 backs off at once. Every
      non-finite step is skipped either way.
    consecutive_hysteresis: restore the hysteresis tracker on every finite
      step (DeepSpeed), so only consecutive overflows count; by default it is
      restored when a growth period completes.

  Attributes:
    loss_scale: the current scale (float32 scalar leaf).
    counter: finite steps since the last growth or overflow (int32 leaf).
    hysteresis_tracker: overflows still tolerated before backing off (int32
      leaf; 0 means the next overflow backs off).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import DynamicLossScale
    >>> ls = DynamicLossScale(initial_loss_scale=2**15, increment_period=2)
    >>> ls, ok = ls.update({'w': jnp.array([1.0, jnp.inf])})
    >>> float(ls()), bool(ok)
    (16384.0, False)
    >>> for _ in range(2):
    ...   ls, ok = ls.update({'w': jnp.ones(2)})
    >>> float(ls()), int(ls.counter)
    (32768.0, 0)

  References:
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740
  """

  _state_fields = ("loss_scale", "counter", "hysteresis_tracker")
  _config_fields = (
    "initial_loss_scale",
    "increment_period",
    "multiplier",
    "min_loss_scale",
    "max_loss_scale",
    "backoff_factor",
    "hysteresis",
    "consecutive_hysteresis",
  )
  counter: jax.Array
  hysteresis_tracker: jax.Array
  initial_loss_scale: float
  increment_period: int
  multiplier: float
  min_loss_scale: float
  max_loss_scale: float
  backoff_factor: float | None
  hysteresis: int
  consecutive_hysteresis: bool

  def __init__(
    self,
    initial_loss_scale: float = 2**15,
    increment_period: int = 2000,
    multiplier: float = 2.0,
    *,
    min_loss_scale: float = 1.0,
    max_loss_scale: float = FLOAT32_MAX,
    backoff_factor: float | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
  ) -> None:
    positive = "a finite number > 0"
    initial = _check_float(
      "initial_loss_scale",
      initial_loss_scale,
      low=0.0,
      low_inclusive=False,
      accepted=positive,
    )
    period = _check_int(
      "increment_period",
      increment_period,
      low=1,
      accepted=f"an integer in [1, {_INT32_MAX}]",
    )
    mult = _check_float(
      "multiplier",
      multiplier,
      low=1.0,
      low_inclusive=False,
      accepted="a finite number > 1",
    )
    low = _check_float(
      "min_loss_scale", min_loss_scale, low=0.0, low_inclusive=False, accepted=positive
    )
    high = _check_float(
      "max_loss_scale", max_loss_scale, low=0.0, low_inclusive=False, accepted=positive
    )
    if low > high:
      raise ValueError(
        f"min_loss_scale must be <= max_loss_scale; got min_loss_scale={low}"
        f" and max_loss_scale={high}."
      )
    if not low <= initial <= high:
      raise ValueError(
        f"initial_loss_scale must lie in [min_loss_scale, max_loss_scale] ="
        f" [{low}, {high}]; got {initial}."
      )
    backoff = None
    if backoff_factor is not None:
      backoff = _check_float(
        "backoff_factor",
        backoff_factor,
        low=0.0,
        low_inclusive=False,
        high=1.0,
        high_inclusive=False,
        accepted="None or a number in the open interval (0, 1)",
      )
    tolerance = _check_int(
      "hysteresis", hysteresis, low=1, accepted=f"an integer in [1, {_INT32_MAX}]"
    )
    if not isinstance(consecutive_hysteresis, (bool, np.bool_)):
      raise ValueError(
        f"consecutive_hysteresis must be True or False; got {consecutive_hysteresis!r}."
      )
    self._set(
      initial_loss_scale=initial,
      increment_period=period,
      multiplier=mult,
      min_loss_scale=low,
      max_loss_scale=high,
      backoff_factor=backoff,
      hysteresis=tolerance,
      consecutive_hysteresis=bool(consecutive_hysteresis),
      loss_scale=jnp.asarray(initial, jnp.float32),
      counter=jnp.zeros((), jnp.int32),
      hysteresis_tracker=jnp.asarray(tolerance, jnp.int32),
    )

  @property
  def dynamic(self) -> bool:
    return True

  @property
  def backoff(self) -> float:
    """The factor applied on overflow: `backoff_factor`, else `1 / multiplier`.

    A multiplication, not a division by `multiplier`: XLA rewrites a division
    by a constant into this multiplication under `jit` anyway, and eager code
    must give the same bits. For power-of-two multipliers (TensorFlow's 2
    included) it equals TensorFlow's division exactly.
    """
    return 1.0 / self.multiplier if self.backoff_factor is None else self.backoff_factor

  def update(
    self, grads: Any, axis_name: tree_utils.AxisName = None
  ) -> tuple[DynamicLossScale, jax.Array]:
    finite = tree_utils.all_finite(grads, axis_name=axis_name)
    return self.adjust(finite), finite

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
    """Returns the next loss scale given whether this step's gradients were finite.

    Use it when the finiteness flag is already known (for example computed
    once for several loss scales, or reduced across devices by hand).

    Example:
      >>> from optax_lossscale import DynamicLossScale
      >>> ls = DynamicLossScale(2**10, increment_period=1)
      >>> float(ls.adjust(True)()), float(ls.adjust(False)())
      (2048.0, 512.0)
    """
    finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    counter = jnp.asarray(self.counter, jnp.int32)
    tracker = jnp.asarray(self.hysteresis_tracker, jnp.int32)
    restored = jnp.asarray(self.hysteresis, jnp.int32)

    # Finite step: count it; at the end of a period try to grow.
    period_done = counter + 1 >= self.increment_period
    grown = scale * jnp.float32(self.multiplier)
    can_grow = jnp.isfinite(grown) & (grown <= jnp.float32(self.max_loss_scale))
    scale_if_finite = jnp.where(period_done & can_grow, grown, scale)
    counter_if_finite = jnp.where(period_done, 0, counter + 1)
    restore = period_done | self.consecutive_hysteresis
    tracker_if_finite = jnp.where(restore, restored, tracker)

    # Non-finite step: reset the counter, spend hysteresis, then back off.
    tracker_if_not = jnp.maximum(tracker - 1, 0)
    backed_off = scale * jnp.float32(self.backoff)
    backed_off = jnp.maximum(backed_off, jnp.float32(self.min_loss_scale))
    scale_if_not = jnp.where(tracker_if_not == 0, backed_off, scale)

    return self.replace(
      loss_scale=jnp.where(finite, scale_if_finite, scale_if_not),
      counter=jnp.where(finite, counter_if_finite, 0).astype(jnp.int32),
      hysteresis_tracker=jnp.where(finite, tracker_if_finite, tracker_if_not).astype(jnp.int32),
    )


_ACCEPTED_FORMS = (
  "'dynamic', a number >= 1 (a FixedLossScale), a LossScale instance, or a"
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
  cls = _registry().get(config["class_name"])
  if cls is None:
    raise ValueError(
      f"Unknown loss scale class_name {config['class_name']!r}; known: {sorted(_registry())}."
    )
  return cls.from_config(dict(config["config"]))


def get(identifier: Any) -> LossScale:
  """Returns the loss scale an identifier names, as Keras's `loss_scale=` does.

  Args:
    identifier: `'dynamic'` (a default `DynamicLossScale`), a number (a
      `FixedLossScale` of that value), a `LossScale` (returned as is), or a
      dict produced by `serialize`.

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
  raise ValueError(f"Cannot interpret {identifier!r} as a loss scale; accepted: {_ACCEPTED_FORMS}.")
