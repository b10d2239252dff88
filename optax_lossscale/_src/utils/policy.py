"""A precision policy: which dtype parameters, computation and outputs use (jmp's `Policy`).

A mixed-precision step keeps three dtypes apart::

  params  = policy.cast_to_param(params)     # storage, e.g. float32
  x, p    = policy.cast_to_compute((x, p))   # the arithmetic, e.g. float16
  y       = policy.cast_to_output(model(p, x))  # what the caller gets back

`get_policy` reads jmp's strings (`"params=float32,compute=float16,output=float32"`,
`"p=f32,c=bf16,o=f32"`, `"c=half"`, `"full"`, ...) with jmp's defaults: params
float32, compute as params, output as compute. Code written for jmp keeps
working with `optax_lossscale` in its place for `Policy`, `get_policy`,
`half_dtype`, `cast_to_full` and `cast_to_half`; `docs/migration/jmp.md` lists
where we differ on purpose. `autocast` takes a policy and does the casting op
by op instead of by hand.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.utils import dtypes
from optax_lossscale._src.utils.dtypes import half_dtype

# jmp's names, first name first: `str(policy)` writes the first one.
_NAMES: dict[np.dtype, tuple[str, ...]] = {
  np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
  np.dtype(np.float16): ("f16", "float16"),
  np.dtype(np.float32): ("full", "f32", "float32"),
  np.dtype(np.float64): ("f64", "float64"),
}
_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype",
         "compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}  # fmt: skip
ACCEPTED_NAMES = dtypes.ACCEPTED_NAMES


class _DtypeNames(Mapping):
  """jmp's `dtype_to_names`, looked up by any spelling of a dtype.

  jmp keys its table by `jnp.float32` and friends, so `np.dtype('float32')`
  (what `x.dtype` gives) is not found there; here every key is normalised.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> import optax_lossscale as ols
    >>> ols.dtype_to_names[jnp.bfloat16], ols.dtype_to_names[np.dtype('float32')]
    (('bf16', 'bfloat16'), ('full', 'f32', 'float32'))
  """

  def __getitem__(self, dtype: Any) -> tuple[str, ...]:
    try:
      return _NAMES[np.dtype(dtype)]
    except TypeError:
      raise KeyError(dtype) from None

  def __iter__(self) -> Iterator[np.dtype]:
    return iter(_NAMES)

  def __len__(self) -> int:
    return len(_NAMES)


#: jmp's table of dtype names (first name first), for code that reads it; any
#: spelling of a dtype finds its entry (`jnp.float16`, `np.dtype('float16')`).
dtype_to_names: Mapping[Any, tuple[str, ...]] = _DtypeNames()


def parse_dtype(value: str) -> np.dtype:
  """A dtype from one of jmp's names: `full`, `half`, `f32`, `float16`, `bf16`, ...

  Args:
    value: the name.

  Returns:
    The `np.dtype`.

  Raises:
    ValueError: the name is unknown; the message lists the accepted names.
  """
  if value == "half":
    return half_dtype()
  try:
    return dtypes.NAMES[value]
  except (KeyError, TypeError):
    raise ValueError(f"Unknown dtype {value!r}: accepted names are {ACCEPTED_NAMES}.") from None


def _as_dtype(argument: str, value: Any) -> np.dtype:
  """`value` (a dtype, a scalar type or one of jmp's names) as a floating `np.dtype`."""
  return dtypes.read_dtype(value, argument)


def _cast_floating_to(tree: Any, dtype: np.dtype) -> Any:
  """`tree` with its floating array leaves cast to `dtype`; other leaves pass through.

  Integer, bool, `float0` and non-array leaves (Python numbers, objects) are
  returned as they are, `None` stays a node; NumPy arrays stay NumPy arrays.
  """

  def cast(x: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtypes parameters, computation and outputs use; immutable and hashable.

  Every dtype is normalised to a floating `np.dtype` at construction (a
  dtype, a scalar type such as `jnp.bfloat16` or one of jmp's names such as
  `'bf16'` or `'full'`), so policies built from different spellings compare
  equal, print, and hash alike; a policy can be a static argument of `jit`.

  Args:
    param_dtype: the dtype parameters are stored in.
    compute_dtype: the dtype the model computes in.
    output_dtype: the dtype of the model's outputs.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> policy = ols.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> str(policy)
    'p=full,c=bf16,o=full'
    >>> policy.cast_to_compute({'w': jnp.ones(2), 'step': 3})
    {'step': 3, 'w': Array([1, 1], dtype=bfloat16)}
    >>> policy == ols.get_policy('p=f32,c=bf16,o=f32')
    True

  References:
    jmp (DeepMind), `jmp.Policy`: https://github.com/google-deepmind/jmp
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype

  def __post_init__(self) -> None:
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, _as_dtype(field, getattr(self, field)))

  def cast_to_param(self, x: Any) -> Any:
    """Casts the floating array leaves of `x` to the param dtype."""
    return _cast_floating_to(x, self.param_dtype)

  def cast_to_compute(self, x: Any) -> Any:
    """Casts the floating array leaves of `x` to the compute dtype."""
    return _cast_floating_to(x, self.compute_dtype)

  def cast_to_output(self, x: Any) -> Any:
    """Casts the floating array leaves of `x` to the output dtype."""
    return _cast_floating_to(x, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    """A copy of this policy with another output dtype."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    names = (_NAMES.get(d, (d.name,))[0] for d in dataclasses.astuple(self))
    return "p={},c={},o={}".format(*names)


def get_policy(policy_name: str | Policy) -> Policy:
  """Reads a policy from a string, with jmp's grammar and defaults.

  Either one dtype name for all three (`"float32"`, `"full"`, `"bf16"`,
  `"half"`, ...), or comma-separated `key=name` parts with the keys `params`
  (`p`), `compute` (`c`) and `output` (`o`). An omitted part takes jmp's
  default: params float32, compute as params, output as compute (`"c=f16"` is
  `p=f32,c=f16,o=f16`). Spaces around parts are ignored. A `Policy` is
  returned as it is.

  Args:
    policy_name: the string, or a `Policy`.

  Returns:
    The `Policy`.

  Raises:
    ValueError: an unknown dtype name or key, a repeated key or an empty part;
      the message lists the accepted names.
    TypeError: `policy_name` is neither a string nor a `Policy`.

  Example:
    >>> import optax_lossscale as ols
    >>> str(ols.get_policy('params=float32,compute=float16,output=float32'))
    'p=full,c=f16,o=full'
    >>> str(ols.get_policy('c=bf16'))
    'p=full,c=bf16,o=bf16'
    >>> str(ols.get_policy('bfloat16'))
    'p=bf16,c=bf16,o=bf16'
  """
  if isinstance(policy_name, Policy):
    return policy_name
  if not isinstance(policy_name, str):
    raise TypeError(
      "policy_name must be a string such as 'p=f32,c=bf16,o=f32' or a Policy; got"
      f" {type(policy_name).__name__}."
    )
  if "=" not in policy_name:
    dtype = parse_dtype(policy_name.strip())
    return Policy(dtype, dtype, dtype)
  chosen: dict[str, np.dtype] = {}
  for part in policy_name.split(","):
    key, sep, value = (s.strip() for s in part.partition("="))
    if key not in _KEYS or not sep:
      raise ValueError(
        f"Unknown key {key!r} in {policy_name!r}: accepted keys are params (p),"
        " compute (c) and output (o), each as key=dtype name."
      )
    field = _KEYS[key]
    if field in chosen:
      raise ValueError(f"{policy_name!r} sets {field} twice.")
    chosen[field] = parse_dtype(value)
  param = chosen.get("param_dtype", np.dtype(np.float32))
  compute = chosen.get("compute_dtype", param)
  output = chosen.get("output_dtype", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: Any) -> Any:
  """Casts the floating array leaves of `tree` to float32 (jmp's `cast_to_full`).

  Args:
    tree: any pytree; integer, bool, `float0` and non-array leaves pass through.

  Returns:
    `tree` with its floating arrays in float32.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ols.cast_to_full({'h': jnp.ones(2, jnp.float16), 'i': jnp.ones(2, jnp.int8)})
    {'h': Array([1., 1.], dtype=float32), 'i': Array([1, 1], dtype=int8)}
  """
  return _cast_floating_to(tree, np.dtype(np.float32))


def cast_to_half(tree: Any) -> Any:
  """Casts the floating array leaves of `tree` to `half_dtype()` (jmp's `cast_to_half`).

  Args:
    tree: any pytree; integer, bool, `float0` and non-array leaves pass through.

  Returns:
    `tree` with its floating arrays in the backend's half precision.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ols.cast_to_half({'f': jnp.ones(2)})['f'].dtype == ols.half_dtype()
    True
  """
  return _cast_floating_to(tree, half_dtype())
