"""`state_dtypes`: an optimizer's state stored in chosen dtypes, leaf kind by leaf kind.

An optax optimizer builds its state with `zeros_like(params)`, so bfloat16
parameters get bfloat16 moments, and a float32 master copy float32 ones.
Neither is always what a run wants: Adam's first moment tolerates bfloat16,
its second moment (squares of gradients, read through a square root in the
denominator) is where low precision hurts, and optax's `mu_dtype` covers only
the first moment of the Adam family. This wrapper works for any optimizer:

  init:    state = inner.init(params), each chosen floating leaf cast to its dtype
  update:  each chosen leaf cast up to float32 (or its own dtype if wider)
           updates, state = inner.update(grads, state, params)
           each chosen leaf cast back to its dtype (round to nearest)

A leaf is chosen by the names on its path in the state (a NamedTuple field
such as Adam's `mu` and `nu`, a dict key such as a `named_chain`'s), by a
predicate, or all floating leaves at once. The state keeps the inner
optimizer's structure: only the dtypes of the chosen leaves change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

_ACCEPTED = (
  "a floating dtype (for every floating leaf of the state), a mapping from state field"
  " names to floating dtypes (e.g. {'mu': jnp.bfloat16, 'nu': jnp.float32}), or a"
  " function (path, leaf) -> dtype or None"
)

Dtypes = Any | Mapping[str, Any] | Callable[[tuple[Any, ...], Any], Any]


def _floating_dtype(value: Any, what: str) -> np.dtype:
  try:
    dtype = None if value is None else np.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{what} must be a floating dtype such as jnp.bfloat16; got {value!r}.")
  return dtype


def _check_dtypes(dtypes: Any) -> Any:
  if isinstance(dtypes, Mapping):
    if not dtypes:
      raise ValueError(f"dtypes must be {_ACCEPTED}; got an empty mapping.")
    for name, value in dtypes.items():
      if not isinstance(name, str):
        raise ValueError(f"dtypes must be {_ACCEPTED}; got the key {name!r}, not a name.")
      _floating_dtype(value, f"dtypes[{name!r}]")
    return {name: np.dtype(value) for name, value in dtypes.items()}
  try:
    if dtypes is None:
      raise TypeError
    np.dtype(dtypes)
  except TypeError:
    if callable(dtypes):
      return dtypes
    raise ValueError(f"dtypes must be {_ACCEPTED}; got {dtypes!r}.") from None
  return _floating_dtype(dtypes, "dtypes")


def _key_name(key: Any) -> Any:
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.DictKey):
    return key.key
  return None


def _is_floating(leaf: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def state_dtypes(
  inner: optax.GradientTransformation, dtypes: Dtypes
) -> optax.GradientTransformationExtraArgs:
  """Keeps `inner`'s state in the dtypes `dtypes` chooses, leaf kind by leaf kind.

  Chosen floating leaves of the state are stored in their dtype, and cast up
  to float32 (or kept, if wider) for each update, so that `inner` computes
  as usual; after the update they are rounded back (to nearest). Integer
  leaves (step counts) are never cast. The state keeps `inner`'s structure.

  Unlike optax's `scale_by_adam(mu_dtype=...)`, which sets the first moment
  of the Adam family only, this works for any optax optimizer and any state
  leaf: Adam's `nu` in float32 next to a bfloat16 `mu`, a momentum `trace`,
  Adafactor's factors, a `named_chain` part by its name.

  With `master_weights`, put it inside: `master_weights(state_dtypes(adam,
  {'mu': jnp.bfloat16}))` keeps the first moment of the float32 master in
  bfloat16. With bfloat16 parameters and no master copy,
  `stochastic_rounding(state_dtypes(adam, {'nu': jnp.float32}), key)` keeps
  the second moment in float32.

  Args:
    inner: the transformation whose state to store, e.g. `optax.adam(1e-3)`.
    dtypes: a floating dtype for every floating leaf of the state; or a
      mapping from names to floating dtypes, where a leaf takes the dtype of
      the outermost name on its path in the state (a NamedTuple field such
      as `mu`, `nu` or `trace`, or a dict key), and unnamed leaves keep
      theirs; or a function `(path, leaf) -> dtype or None` (None: keep).
      A name that matches no floating leaf raises a `ValueError` at `init`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `inner`'s state
    structure.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.state_dtypes(optax.adam(1e-3), {'mu': jnp.bfloat16, 'nu': jnp.float32})
    >>> state = tx.init({'w': jnp.ones(3, jnp.bfloat16)})
    >>> state[0].mu['w'].dtype, state[0].nu['w'].dtype, state[0].count.dtype
    (dtype(bfloat16), dtype('float32'), dtype('int32'))
    >>> _, state = tx.update({'w': jnp.ones(3, jnp.bfloat16)}, state)
    >>> state[0].mu['w'].dtype, state[0].nu['w'].dtype
    (dtype(bfloat16), dtype('float32'))

  References:
    optax's `scale_by_adam(mu_dtype=...)` and its issue #1552; Rae et al.,
    2021 (Gopher), on float32 optimizer state with bfloat16 parameters.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3));"
      f" got {type(inner).__name__}."
    )
  dtypes = _check_dtypes(dtypes)
  inner = optax.with_extra_args_support(inner)

  def storage(path: tuple[Any, ...], leaf: Any) -> np.dtype | None:
    """The dtype a state leaf is stored in, or None to leave it."""
    if not _is_floating(leaf):
      return None
    if isinstance(dtypes, Mapping):
      for key in path:
        name = _key_name(key)
        if isinstance(name, str) and name in dtypes:
          return dtypes[name]
      return None
    if callable(dtypes) and not isinstance(dtypes, np.dtype):
      chosen = dtypes(path, leaf)
      return None if chosen is None else _floating_dtype(chosen, "the dtype dtypes returned")
    return dtypes

  def cast(state: Any, to_compute: bool) -> Any:
    def one(path: tuple[Any, ...], leaf: Any) -> Any:
      dtype = storage(path, leaf)
      if dtype is None:
        return leaf
      if to_compute:
        return jnp.asarray(leaf).astype(jnp.promote_types(dtype, jnp.float32))
      return jnp.asarray(leaf).astype(dtype)

    return jax.tree_util.tree_map_with_path(one, state)

  def init_fn(params: optax.Params) -> Any:
    state = inner.init(params)
    if isinstance(dtypes, Mapping):
      flat = jax.tree_util.tree_flatten_with_path(state)[0]
      names = {_key_name(k) for path, leaf in flat if _is_floating(leaf) for k in path} - {None}
      missing = sorted(set(dtypes) - names)
      if missing:
        raise ValueError(
          f"state_dtypes: no floating leaf of the inner optimizer's state is named"
          f" {', '.join(map(repr, missing))}; the names on the paths of its floating"
          f" leaves are {sorted(map(str, names))}."
        )
    return cast(state, to_compute=False)

  def update_fn(
    updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
  ) -> tuple[optax.Updates, Any]:
    updates, state = inner.update(updates, cast(state, to_compute=True), params, **extra_args)
    return updates, cast(state, to_compute=False)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
