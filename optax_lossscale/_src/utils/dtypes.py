"""The one reader of dtype arguments for the whole API.

NumPy reads strings its own way: `np.dtype('f16')` is float128 (16 bytes),
`np.dtype('f8')` float64, `np.dtype(None)` float64. Every argument of this
package that names a dtype (a policy's three, `state_dtypes`'s, a master
copy's, a report's target) goes through `read_dtype` instead, which accepts

  jmp's names        'f16', 'bf16', 'f32', 'f64', 'float16', 'bfloat16',
                     'float32', 'float64', 'full' (float32), 'half' (the
                     backend's half precision: bfloat16 on TPU, else float16)
  dtypes             np.dtype('float32'), jnp.dtype('bfloat16'), x.dtype
  scalar types       jnp.bfloat16, np.float32, ml_dtypes.float8_e4m3fn

and refuses anything else with an error that names the argument and lists
these. The error is a `DtypeError`, both a `TypeError` (jmp's policy raises
one) and a `ValueError` (the optimizers' arguments raise those).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BF16, F16, F32, F64 = (np.dtype(t) for t in (jnp.bfloat16, np.float16, np.float32, np.float64))

#: jmp's dtype names (but 'half', which depends on the backend).
NAMES: dict[str, np.dtype] = {
  "bf16": BF16,
  "bfloat16": BF16,
  "f16": F16,
  "float16": F16,
  "full": F32,
  "f32": F32,
  "float32": F32,
  "f64": F64,
  "float64": F64,
}
ACCEPTED_NAMES = "full, half, f32, float32, f16, float16, bf16, bfloat16, f64, float64"


class DtypeError(TypeError, ValueError):
  """A dtype argument that is not one: both a TypeError and a ValueError."""


def half_dtype() -> np.dtype:
  """The half-precision dtype of the default backend: bfloat16 on TPU, else float16.

  As jmp's `half_dtype`, it asks the first local device, so it initialises the
  backend.

  Returns:
    `np.dtype(jnp.bfloat16)` on TPU, `np.dtype(jnp.float16)` elsewhere.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ols.half_dtype() in (jnp.float16, jnp.bfloat16)
    True
  """
  on_tpu = jax.local_devices()[0].platform == "tpu"
  return BF16 if on_tpu else F16


def _describe(among: Collection[np.dtype] | None, extra: str) -> str:
  if among is not None:
    names = ", ".join(d.name for d in among)
    what = f"one of the dtypes {names} (a dtype, a scalar type such as jnp.{names.split(',')[0]}"
    what += " or its name)"
  else:
    what = (
      "a floating dtype (a dtype or scalar type such as jnp.bfloat16 or np.float32, or one"
      f" of the names {ACCEPTED_NAMES})"
    )
  return what + (f", or {extra}" if extra else "")


def read_dtype(
  value: Any,
  argument: str,
  *,
  among: Collection[Any] | None = None,
  usable: bool = False,
  extra: str = "",
) -> np.dtype:
  """`value` read as a floating `np.dtype`, or a `DtypeError` naming `argument`.

  Args:
    value: a name of `NAMES` or 'half', an `np.dtype`, or a scalar type.
    argument: the argument's name, for the error.
    among: if given, the dtypes accepted (e.g. bfloat16 and float16).
    usable: refuse a 64-bit dtype while JAX runs without `jax_enable_x64`
      (it would silently make 32-bit arrays).
    extra: other accepted values to list in the error (e.g. "'q8'").

  Returns:
    The dtype.
  """
  allowed = None if among is None else [np.dtype(d) for d in among]
  dtype = None
  if isinstance(value, str):
    dtype = half_dtype() if value == "half" else NAMES.get(value)
  elif isinstance(value, np.dtype):
    dtype = value
  elif isinstance(value, type) and not issubclass(value, (bool, np.bool_)):
    try:
      dtype = np.dtype(value)
    except TypeError:
      dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise DtypeError(f"{argument} must be {_describe(allowed, extra)}; got {value!r}.")
  if allowed is not None and dtype not in allowed:
    raise DtypeError(f"{argument} must be {_describe(allowed, extra)}; got {value!r} ({dtype}).")
  if usable and dtype.itemsize == 8 and jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise DtypeError(
      f"{argument} is {dtype}, but JAX runs without 64-bit types (jax_enable_x64 is off), so"
      f" its arrays would be {jax.dtypes.canonicalize_dtype(dtype)}: enable them"
      " (jax.config.update('jax_enable_x64', True)) before building it, or pick a 32-bit"
      " or narrower dtype."
    )
  return dtype
