"""Finding the loss-scale state inside any optax state, and reading it.

Optax states nest: `chain` makes tuples, `named_chain` dicts, `MultiSteps`
and `inject_hyperparams` NamedTuples. These helpers search the whole tree, so
user code never hard-codes where the wrapper sits in the chain. Objects with
an `opt_state` attribute (Flax's `TrainState`, `nnx.Optimizer`) are searched
through it, without importing Flax.
"""

from __future__ import annotations

from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._src import loss_scale as loss_scale_lib
from optax_lossscale._src.optimizer import LossScaleOptimizerState
from optax_lossscale._src.skip_bad_steps import SkipBadStepsState


def _is_state(x: Any) -> bool:
  return isinstance(x, LossScaleOptimizerState)


def _is_box(x: Any) -> bool:
  """Whether `x` is a one-value box such as an `nnx.Variable`.

  `nnx.Optimizer` keeps every optimizer-state leaf in a Variable. A Variable is
  recognised by what it is (a pytree node with a `value` or `get_value`
  accessor), never by how many leaves it holds: a dict or a one-field
  NamedTuple with one leaf is a subtree, and unboxing it would cut its path.
  This keeps Flax out of the core.
  """
  if x is None or isinstance(x, (jax.Array, np.ndarray, np.generic, dict, list, tuple)):
    return False
  if not (hasattr(type(x), "get_value") or hasattr(type(x), "value")):
    return False
  return len(jax.tree.leaves(x)) == 1


def _unwrap(x: Any) -> Any:
  """Returns the array inside a one-array box, else `x` unchanged."""
  return jax.tree.leaves(x)[0] if _is_box(x) else x


def _plain(state: LossScaleOptimizerState) -> LossScaleOptimizerState:
  """Unwraps the loss scale's leaves and the counters into plain arrays."""
  ls = state.loss_scale
  if isinstance(ls, loss_scale_lib.LossScale):
    ls = ls.replace(**{f: _unwrap(getattr(ls, f)) for f in ls._state_fields})
  nonfinite = state.nonfinite_leaves
  if nonfinite is not None:
    # Stop at each one-array box, or its own path would lengthen the keys.
    nonfinite = jax.tree.map(_unwrap, nonfinite, is_leaf=_is_box)
  return state._replace(
    loss_scale=ls,
    nonfinite_leaves=nonfinite,
    last_step_applied=_unwrap(state.last_step_applied),
    consecutive_skips=_unwrap(state.consecutive_skips),
    total_skips=_unwrap(state.total_skips),
  )


def _search(opt_state: Any, kind: type) -> list[tuple[Any, Any]]:
  """Every state of type `kind` nested in `opt_state`, with its path."""
  if isinstance(opt_state, optax.GradientTransformation):
    raise TypeError(
      "Got the optimizer (a GradientTransformation), not its state: pass the"
      " optimizer state, opt_state = tx.init(params), e.g."
      " get_scaled_loss(loss, opt_state). Unlike Keras, the optax optimizer holds no"
      " loss scale; the state does."
    )
  if not isinstance(opt_state, (LossScaleOptimizerState, SkipBadStepsState)) and hasattr(
    opt_state, "opt_state"
  ):
    opt_state = opt_state.opt_state
  found = []
  is_leaf = lambda x: isinstance(x, kind)

  def search(tree: Any, prefix: tuple[Any, ...]) -> None:
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
      if is_leaf(node):
        found.append((prefix + path, node))
        # A wrapper wrapped in another is an error: look inside too.
        search(node.inner_state, (*prefix, *path, jax.tree_util.GetAttrKey("inner_state")))

  search(opt_state, ())
  return found


def _single(found: list[tuple[Any, Any]], what: str) -> Any:
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) or "<root>" for p, _ in found)
    raise ValueError(f"Found {len(found)} {what}s (at {paths}); wrap the optimizer once.")
  return found[0][1] if found else None


def find_state(opt_state: Any) -> LossScaleOptimizerState:
  """Returns the single `LossScaleOptimizerState` nested in `opt_state`.

  `opt_state` may also be an object with an `opt_state` attribute (a Flax
  `TrainState` or `nnx.Optimizer`); the loss scale and counters of the result
  are plain arrays even where Flax boxes them in `nnx.Variable`s.

  Raises:
    ValueError: if there is none, or more than one (the paths are listed).
  """
  found = _search(opt_state, LossScaleOptimizerState)
  if not found:
    raise ValueError(
      "No LossScaleOptimizerState found in the given state; build the optimizer"
      " with optax_lossscale.loss_scale_optimizer(...) and pass its state"
      f" (got a {type(opt_state).__name__})."
    )
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) or "<root>" for p, _ in found)
    raise ValueError(
      f"Found {len(found)} LossScaleOptimizerStates (at {paths}); loss scaling"
      " must wrap the optimizer once."
    )
  return _plain(found[0][1])


def find_skip_state(opt_state: Any) -> SkipBadStepsState | None:
  """The single `SkipBadStepsState` nested in `opt_state` (plain arrays), or None."""
  state = _single(_search(opt_state, SkipBadStepsState), "SkipBadStepsState")
  if state is None:
    return None
  # The counters and statistics only: the inner state is returned as it is.
  fields = [f for f in state._fields if f != "inner_state"]
  return state._replace(
    **{f: jax.tree.map(_unwrap, getattr(state, f), is_leaf=_is_box) for f in fields}
  )


def find_loss_scale_state(opt_state: Any) -> LossScaleOptimizerState | None:
  """The single `LossScaleOptimizerState` nested in `opt_state`, or None."""
  found = _search(opt_state, LossScaleOptimizerState)
  return find_state(opt_state) if found else None


def step_applied(opt_state: Any) -> jax.Array:
  """Whether the last update was applied by every skipping wrapper in `opt_state`.

  Raises:
    ValueError: if `opt_state` holds neither a `loss_scale_optimizer` nor a
      `skip_bad_steps` state.
  """
  states = [s for s in (find_loss_scale_state(opt_state), find_skip_state(opt_state)) if s]
  if not states:
    raise ValueError(_NEITHER.format(type(opt_state).__name__))
  applied = states[0].last_step_applied
  for s in states[1:]:
    applied = applied & s.last_step_applied
  return applied


_NEITHER = (
  "No LossScaleOptimizerState or SkipBadStepsState found in the given state; build"
  " the optimizer with optax_lossscale.loss_scale_optimizer(...) or"
  " optax_lossscale.skip_bad_steps(...) and pass its state (got a {})."
)


def _find_path(opt_state: Any) -> tuple[Any, ...] | None:
  """The key path of the first wrapper state in `opt_state`, or None."""
  for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0]:
    if _is_state(node):
      return path
  return None


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  raise KeyError(key)


def composition_problem(opt_state: Any) -> str | None:
  """Says why the wrapper's position in `opt_state` gives wrong results, or None.

  Detectable from the state alone: a wrapper inside `optax.apply_if_finite`
  or `optax.MultiSteps`, or after another transformation in a `chain` or
  `named_chain` (that one then sees the *scaled* gradients).
  """
  if isinstance(opt_state, optax.GradientTransformation):
    return None
  if not isinstance(opt_state, LossScaleOptimizerState) and hasattr(opt_state, "opt_state"):
    opt_state = opt_state.opt_state
  path = _find_path(opt_state)
  if not path:
    return None
  node = opt_state
  for depth, key in enumerate(path):
    where = jax.tree_util.keystr(path[:depth]) or "the top level"
    if isinstance(node, optax.ApplyIfFiniteState):
      return (
        f"loss_scale_optimizer is wrapped in optax.apply_if_finite (at {where}): it"
        " hides overflows from the wrapper, so the loss scale does not back off until"
        " apply_if_finite gives up. Drop apply_if_finite: loss_scale_optimizer already"
        " skips non-finite steps."
      )
    if isinstance(node, optax.MultiStepsState):
      return (
        f"loss_scale_optimizer is wrapped in optax.MultiSteps (at {where}): one overflow"
        " poisons the accumulator. Wrap the other way round:"
        " loss_scale_optimizer(optax.MultiSteps(inner, k).gradient_transformation())."
      )
    first = (
      type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey) and key.idx > 0
    ) or (
      isinstance(node, dict)
      and isinstance(key, jax.tree_util.DictKey)
      and next(iter(node)) != key.key
    )
    if first:
      return (
        f"loss_scale_optimizer is not first in its chain (at"
        f" {jax.tree_util.keystr(path[: depth + 1])}): the"
        " transformations before it receive the *scaled* gradients (clipping clips"
        " them, weight decay is divided by the scale). Put them inside instead:"
        " loss_scale_optimizer(optax.chain(...))."
      )
    try:
      node = _child(node, key)
    except (KeyError, IndexError, AttributeError, TypeError):
      return None
  return None


def check_composition(opt_state: Any) -> None:
  """Raises if the wrapper sits where it gives silently wrong results.

  `optax.chain(clip, loss_scale_optimizer(sgd))` clips the *scaled*
  gradients; `optax.apply_if_finite(loss_scale_optimizer(adam), k)` hides
  overflows from the wrapper so its scale does not back off;
  `optax.MultiSteps(loss_scale_optimizer(...), k)` cannot recover from one
  overflow. Their states show it, so this check needs only the state.
  `get_scaled_loss` and `value_and_grad` warn about the same cases.

  Args:
    opt_state: the optimizer state (or a `TrainState` / `nnx.Optimizer`).

  Returns:
    None, when the wrapper is outermost (or alone).

  Raises:
    ValueError: naming the problem and the fix.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = optax.chain(optax.clip(1.0), ols.loss_scale_optimizer(optax.sgd(0.1)))
    >>> try:
    ...   ols.check_composition(tx.init(jnp.ones(2)))
    ... except ValueError as e:
    ...   print('not first in its chain' in str(e))
    True
  """
  problem = composition_problem(opt_state)
  if problem is not None:
    raise ValueError(problem)


def warn_composition(opt_state: Any) -> None:
  problem = composition_problem(opt_state)
  if problem is not None:
    warnings.warn(problem, UserWarning, stacklevel=3)


def get_loss_scale(opt_state: Any) -> loss_scale_lib.LossScale:
  """Returns the current `LossScale` from a (possibly nested) optax state.

  Works through `optax.chain`, `named_chain`, `MultiSteps` and
  `inject_hyperparams`, and accepts a Flax `TrainState` or `nnx.Optimizer`
  (returning plain arrays); a `LossScale` passed directly is returned as is.

  Args:
    opt_state: an optax state holding exactly one `LossScaleOptimizerState`.

  Returns:
    The current `LossScale`; call it for the scale as a float32 scalar.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = optax.chain(optax.add_decayed_weights(1e-4),
    ...                  ols.loss_scale_optimizer(optax.adam(1e-3)))
    >>> state = tx.init({'w': jnp.ones(3)})
    >>> float(ols.get_loss_scale(state)())
    32768.0
  """
  if isinstance(opt_state, loss_scale_lib.LossScale):
    return opt_state
  return find_state(opt_state).loss_scale


def get_scaled_loss(loss: Any, opt_state: Any) -> Any:
  """Multiplies `loss` by the current loss scale found in `opt_state`.

  Args:
    loss: the loss (or any pytree of floating arrays) to scale.
    opt_state: the state of a `loss_scale_optimizer`, possibly nested.

  Returns:
    `loss` times the current scale, in `loss`'s dtype: a float16 loss stays
    float16 (jmp promotes it to float32), so `16 * 2**15` is `inf` there.
    Compute the loss in float32.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(1.0), 8).init(jnp.ones(2))
    >>> ols.get_scaled_loss(jnp.float32(0.5), state)
    Array(4., dtype=float32)
  """
  if not isinstance(opt_state, loss_scale_lib.LossScale):
    warn_composition(opt_state)
  return get_loss_scale(opt_state).scale(loss)


def get_unscaled_gradients(grads: Any, opt_state: Any) -> Any:
  """Divides `grads` by the current loss scale found in `opt_state`.

  `None` leaves stay `None`; non-float leaves pass through. Only needed when
  the gradients are used outside the wrapper (which unscales by itself).

  Args:
    grads: gradients of the scaled loss, any pytree.
    opt_state: the state of a `loss_scale_optimizer`, possibly nested.

  Returns:
    `grads` divided by the current scale, each leaf in its own dtype.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(1.0), 8).init(jnp.ones(2))
    >>> ols.get_unscaled_gradients([jnp.float32(4.0), None], state)
    [Array(0.5, dtype=float32), None]
  """
  return get_loss_scale(opt_state).unscale(grads)


def _skip_metrics(state: SkipBadStepsState) -> dict[str, Any]:
  out: dict[str, Any] = {
    "nonfinite_skips": state.nonfinite_skips,
    "spike_skips": state.spike_skips,
    "consecutive_spike_skips": state.consecutive_spike_skips,
    "spike_rebases": state.spike_rebases,
  }
  if state.grad_norm is not None:
    stat = state.grad_norm
    out["grad_norm"] = stat.last
    out["grad_norm_mean"] = jnp.exp(stat.mean)  # geometric: the statistic is of log norms
    out["grad_norm_log_std"] = jnp.sqrt(stat.var)
  if state.loss is not None:
    out["loss"] = state.loss.last
    out["loss_mean"] = state.loss.mean
    out["loss_std"] = jnp.sqrt(state.loss.var)
  return out


def metrics(opt_state: Any) -> dict[str, Any]:
  """Returns scalars to log: the scale, the skip counters and the spike statistic.

  For a `loss_scale_optimizer`: `loss_scale` (float32), `last_step_applied`
  (bool), `consecutive_skips` and `total_skips` (int32). With
  `record_nonfinite_leaves=True` there is one more key, `nonfinite_leaves`:
  a dict from each parameter leaf's path (`jax.tree_util.keystr`) to a bool
  scalar, True if that leaf's gradient held NaN/Inf on the last skipped step.

  For `skip_bad_steps`: `last_step_applied`, `consecutive_skips`,
  `total_skips`, the skips by reason `nonfinite_skips` and `spike_skips`,
  `consecutive_spike_skips`, `spike_rebases`, and for each watched quantity
  its last value and statistic: `grad_norm`, `grad_norm_mean` (the running
  geometric mean) and `grad_norm_log_std`; `loss`, `loss_mean`, `loss_std`.

  For both (`loss_scale_optimizer(skip_bad_steps(inner))`): the union, where
  `last_step_applied` is True only if both applied the step, `total_skips`
  counts the steps either skipped, `overflow_skips` those the loss scale
  skipped, and `consecutive_skips` is the loss scale's streak of overflows.

  Jit-compatible; the values are device arrays, so logging them does not force
  a sync until read.

  Args:
    opt_state: the state, possibly nested, or a Flax `TrainState` or
      `nnx.Optimizer`.

  Returns:
    A dict of scalar arrays (plus `nonfinite_leaves` when recorded).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(1.0)).init(jnp.ones(2))
    >>> sorted(ols.metrics(state))
    ['consecutive_skips', 'last_step_applied', 'loss_scale', 'total_skips']
  """
  skip_state = find_skip_state(opt_state)
  if skip_state is not None and not _search(opt_state, LossScaleOptimizerState):
    return {
      "last_step_applied": skip_state.last_step_applied,
      "consecutive_skips": skip_state.consecutive_skips,
      "total_skips": skip_state.total_skips,
      **_skip_metrics(skip_state),
    }
  try:
    state = find_state(opt_state)
  except ValueError as e:
    if "No LossScaleOptimizerState" in str(e):
      raise ValueError(_NEITHER.format(type(opt_state).__name__)) from None
    raise
  out: dict[str, Any] = {
    "loss_scale": state.loss_scale(),
    "last_step_applied": state.last_step_applied,
    "consecutive_skips": state.consecutive_skips,
    "total_skips": state.total_skips,
  }
  if state.nonfinite_leaves is not None:
    flat = jax.tree_util.tree_flatten_with_path(state.nonfinite_leaves)[0]
    out["nonfinite_leaves"] = {jax.tree_util.keystr(p) or "<root>": flag for p, flag in flat}
  if skip_state is not None:
    out["last_step_applied"] = state.last_step_applied & skip_state.last_step_applied
    out["overflow_skips"] = state.total_skips
    out["total_skips"] = state.total_skips + skip_state.total_skips
    out.update(_skip_metrics(skip_state))
  return out
