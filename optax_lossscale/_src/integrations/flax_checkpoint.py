"""Checkpoints of loss-scaled training: msgpack state dicts and Orbax.

A checkpoint holds the state (the loss scale and its counters as named leaves
`loss_scale`, `counter`, `hysteresis_tracker`, next to the skip counters of
`LossScaleOptimizerState`), never hyper-parameters: those come back from the
code that builds the restore target. A restore target may be abstract
(`jax.eval_shape` of the code that creates the state).

The one thing a checkpoint can get wrong silently or confusingly is the kind
of loss scale: a `DynamicLossScale` has three state leaves, `FixedLossScale`
and `NoOpLossScale` none. Both paths here check that the saved state matches
the target's kind and name both in the error.
"""

from __future__ import annotations

import os
from typing import Any

from flax import serialization
import jax

from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib


def _kinds_with(fields: set[str]) -> str:
  """Names the loss-scale classes whose state has exactly these fields.

  The library's own kinds are named first; user subclasses (registered as they
  are defined) only when no built-in kind matches, so the hint stays the same
  whatever else the program has defined.
  """
  matching = [
    cls for cls in loss_scale_lib.LossScale._registry.values() if set(cls._state_fields) == fields
  ]
  builtin = [c for c in matching if c.__module__.startswith("optax_lossscale.")]
  kinds = sorted(c.__name__ for c in (builtin or matching))
  return " or ".join(kinds) if kinds else "no known loss scale"


def _mismatch(where: str, saved: set[str], target: loss_scale_lib.LossScale) -> ValueError:
  return ValueError(
    f"The checkpoint's loss scale at {where} does not match the target's: it holds"
    f" the state of a {_kinds_with(saved)} (keys {sorted(saved)}), the target is"
    f" a {type(target).__name__} (keys {sorted(target._state_fields)}). Build the"
    " target with the loss-scale kind the checkpoint was saved with."
  )


def _to_state_dict(ls: loss_scale_lib.LossScale) -> dict[str, Any]:
  return {f: serialization.to_state_dict(getattr(ls, f)) for f in ls._state_fields}


def _from_state_dict(
  target: loss_scale_lib.LossScale, state: dict[str, Any]
) -> loss_scale_lib.LossScale:
  saved = set(state)
  if saved != set(target._state_fields):
    raise _mismatch(serialization.current_path() or "<root>", saved, target)
  return target.replace(
    **{
      f: serialization.from_state_dict(getattr(target, f), state[f], name=f)
      for f in target._state_fields
    }
  )


def register_loss_scale_serialization(cls: type[loss_scale_lib.LossScale]) -> None:
  """Registers a `LossScale` class with `flax.serialization`.

  Every loss scale defined in optax_lossscale is registered when
  `optax_lossscale.flax` is imported; call this for your own subclasses.
  The state dict has one entry per state field (`loss_scale`, `counter`, ...);
  restoring into a target of another kind raises `ValueError`.

  Args:
    cls: a subclass of `LossScale`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import serialization
    >>> import optax_lossscale as ols
    >>> import optax_lossscale.flax
    >>> serialization.to_state_dict(ols.DynamicLossScale(4.0))
    {'loss_scale': Array(4., dtype=float32), 'counter': Array(0, dtype=int32), 'hysteresis_tracker': Array(1, dtype=int32)}
  """  # noqa: E501
  if not (isinstance(cls, type) and issubclass(cls, loss_scale_lib.LossScale)):
    raise TypeError(f"cls must be a subclass of LossScale; got {cls!r}.")
  # Instances are of the class's pytree twin (see `LossScale`): register both.
  for kind in {cls, cls._Node}:
    serialization.register_serialization_state(
      kind, _to_state_dict, _from_state_dict, override=True
    )


for _cls in list(loss_scale_lib.LossScale._registry.values()):
  register_loss_scale_serialization(_cls)


def _key_name(key: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _paths(tree: Any, is_leaf: Any = None) -> list[tuple[tuple[str, ...], Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in flat]


def check_loss_scale_kind(saved_tree: Any, target: Any) -> None:
  """Raises `ValueError` if a saved tree's loss scales differ in kind from `target`'s.

  Args:
    saved_tree: the saved pytree or its metadata (e.g. Orbax's metadata
      tree), with the keys it was saved with.
    target: the restore target (concrete or from `jax.eval_shape`). Only
      `LossScale` objects in it are checked: an `nnx.State` holds their leaves
      as plain entries, and Orbax's own structure check covers it.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import check_loss_scale_kind
    >>> make = lambda ls: ols.loss_scale_optimizer(optax.sgd(1.0), ls).init(jnp.ones(2))
    >>> check_loss_scale_kind(make('dynamic'), jax.eval_shape(lambda: make('dynamic')))
    >>> check_loss_scale_kind(make(8.0), jax.eval_shape(lambda: make('dynamic')))
    Traceback (most recent call last):
    ...
    ValueError: The checkpoint's loss scale at loss_scale does not match the target's: ...
  """
  saved_paths = [path for path, _ in _paths(saved_tree)]
  is_ls = lambda x: isinstance(x, loss_scale_lib.LossScale)
  for path, ls in _paths(target, is_leaf=is_ls):
    if not is_ls(ls):
      continue
    n = len(path)
    saved = {p[n] for p in saved_paths if len(p) == n + 1 and p[:n] == path}
    deeper = any(len(p) > n + 1 and p[:n] == path for p in saved_paths)
    if deeper or saved != set(ls._state_fields):
      raise _mismatch(".".join(path) or "<root>", saved, ls)


def save_checkpoint(directory: str | os.PathLike[str], state: Any, *, force: bool = False) -> None:
  """Saves a pytree state (e.g. a `TrainState`) with Orbax and waits for it.

  Plain `orbax.checkpoint.StandardCheckpointer` works as well; this helper
  only pairs with `restore_checkpoint`.

  Args:
    directory: where to write (made absolute, as Orbax requires); it must
      not exist unless `force` is True.
    state: the pytree to save.
    force: overwrite an existing checkpoint.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import save_checkpoint
    >>> state = ols.loss_scale_optimizer(optax.adam(1e-3)).init({'w': jnp.ones(2)})
    >>> path = os.path.join(tempfile.mkdtemp(), 'ckpt')
    >>> save_checkpoint(path, state)
    >>> os.path.isdir(path)
    True
  """
  import orbax.checkpoint as ocp  # heavy: imported only when used

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(directory), state, force=force)
    checkpointer.wait_until_finished()


def restore_checkpoint(directory: str | os.PathLike[str], target: Any) -> Any:
  """Restores an Orbax checkpoint into `target`, checking the loss-scale kind first.

  Args:
    directory: a checkpoint written by `save_checkpoint` or by Orbax's
      `StandardCheckpointer`.
    target: a concrete or abstract (`jax.eval_shape`) state built by the code:
      it supplies the structure, dtypes and all hyper-parameters.

  Returns:
    The restored state, with `target`'s structure.

  Raises:
    ValueError: if the checkpoint holds a different kind of loss scale than
      `target` (naming both), or does not match `target` otherwise.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> from optax_lossscale.flax import restore_checkpoint, save_checkpoint
    >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale(8.0))
    >>> make = lambda: tx.init({'w': jnp.ones(2)})
    >>> grads = ols.mark_scaled({'w': jnp.array([jnp.inf, 0.0])})  # scaled, and overflowed
    >>> _, state = tx.update(grads, make())  # a skip
    >>> path = os.path.join(tempfile.mkdtemp(), 'ckpt')
    >>> save_checkpoint(path, state)
    >>> restored = restore_checkpoint(path, jax.eval_shape(make))
    >>> float(ols.get_loss_scale(restored)()), int(restored.total_skips)
    (4.0, 1)
  """
  import orbax.checkpoint as ocp  # heavy: imported only when used

  directory = os.path.abspath(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(directory)
    saved_tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    check_loss_scale_kind(saved_tree, target)
    return checkpointer.restore(directory, target)
