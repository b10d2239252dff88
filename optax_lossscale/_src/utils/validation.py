"""Early, explicit validation of hyper-parameters, shared by the loss scales.

Errors are raised at construction, name the argument, and say what was given
and what is accepted: never a traced failure deep inside `jit`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)


def check_float(
  name: str,
  value: Any,
  *,
  low: float,
  low_inclusive: bool,
  high: float = math.inf,
  high_inclusive: bool = True,
  accepted: str,
  not_one_in_float32: bool = False,
) -> float:
  """Converts a concrete number to float and checks its range, or raises.

  The number must also survive the conversion to float32, the dtype the
  scale is stored and computed in: finite there, and not flushed to zero
  when it must be positive. With `not_one_in_float32` (factors the scale is
  multiplied by) it must also differ from 1 once rounded to float32: 1.00000001
  would be accepted as "> 1" and then never change the scale.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Real, np.ndarray, np.generic, jax.Array)
  ):
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  if np.ndim(value) != 0:
    raise ValueError(f"{name} must be a scalar ({accepted}); got {value!r}.")
  try:
    number = float(value)
  except (TypeError, OverflowError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"{name} must be a concrete number ({accepted}); got {value!r}.") from e
  above = number >= low if low_inclusive else number > low
  below = number <= high if high_inclusive else number < high
  as_float32 = float(np.float32(number)) if abs(number) <= FLOAT32_MAX else math.inf
  positive_lost = number > 0 and as_float32 == 0
  if not (math.isfinite(number) and above and below) or math.isinf(as_float32) or positive_lost:
    raise ValueError(f"{name} must be {accepted}, representable as a float32; got {value!r}.")
  if not_one_in_float32 and as_float32 == 1.0:
    raise ValueError(
      f"{name} must be {accepted} and differ from 1 in float32 (the dtype the scale is"
      f" computed in); got {value!r}, which rounds to exactly 1.0, so the scale would"
      " never change."
    )
  return number


def check_bool(name: str, value: Any, *, error: type[Exception] = TypeError) -> bool:
  """Checks that `value` is True or False (NumPy's bool too) and returns it."""
  if not isinstance(value, (bool, np.bool_)):
    raise error(f"{name} must be True or False; got {value!r}.")
  return bool(value)


def check_int(name: str, value: Any, *, low: int, accepted: str) -> int:
  """Checks that `value` is a whole number in [low, int32 max] and returns it as an int.

  A float with no fractional part (`2.0`, as configs read back from JSON
  carry it; TensorFlow and jmp accept it) is taken; `2.5` is refused, not
  truncated. NumPy and JAX scalars are read as the numbers they hold.
  """
  number = value
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.ndim(value) == 0:
    if not jnp.issubdtype(value.dtype, jnp.integer) and not jnp.issubdtype(
      value.dtype, jnp.floating
    ):
      raise ValueError(f"{name} must be {accepted}; got {value!r}.")
    try:
      number = value.item()
    except jax.errors.ConcretizationTypeError as e:
      raise ValueError(f"{name} must be a concrete integer ({accepted}); got {value!r}.") from e
  if isinstance(number, (bool, np.bool_)) or not isinstance(number, numbers.Real):
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  if not isinstance(number, numbers.Integral):
    if not (math.isfinite(number) and float(number).is_integer()):
      raise ValueError(f"{name} must be {accepted}, a whole number; got {value!r}.")
  number = int(number)
  if not low <= number <= INT32_MAX:
    raise ValueError(f"{name} must be {accepted}; got {value!r}.")
  return number
