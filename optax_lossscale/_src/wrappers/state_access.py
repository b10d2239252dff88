"""Finding the loss-scale state inside any optax state, and reading it.

Optax states nest: `chain` makes tuples, `named_chain` dicts, `MultiSteps`
and `inject_hyperparams` NamedTuples. These helpers search the whole tree, so
user code never hard-codes where the wrapper sits in the chain. Objects with
an `opt_state` attribute (Flax's `TrainState`, `nnx.Optimizer`) are searched
through it, without importing Flax.
"""

from __future__ import annotations

import functools
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.step import composition
from optax_lossscale._src.utils import tree_utils
from optax_lossscale._src.wrappers import state_conversion
from optax_lossscale._src.wrappers.optimizer import LossScaleOptimizerState
from optax_lossscale._src.wrappers.skip_bad_steps import SkipBadStepsState


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
    retries=_unwrap(state.retries),
    total_retries=_unwrap(state.total_retries),
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


def composition_problem(opt_state: Any) -> str | None:
  """Says why the wrappers' places in `opt_state` give wrong results, or None."""
  if isinstance(opt_state, optax.GradientTransformation):
    return None
  if not isinstance(opt_state, (LossScaleOptimizerState, SkipBadStepsState)) and hasattr(
    opt_state, "opt_state"
  ):
    opt_state = opt_state.opt_state
  return composition.composition_problem(
    opt_state,
    {composition.LOSS_SCALE: LossScaleOptimizerState, composition.SKIP: SkipBadStepsState},
  )


def check_composition(opt_state: Any) -> None:
  """Raises if the optimizer state shows a wrapper where it gives wrong results.

  The wrappers refuse such compositions themselves when they are built,
  initialised or first updated; this check reads a state that was built
  elsewhere (restored, or made by older code). From the state it sees: two
  `loss_scale_optimizer` states in one optimizer (the loss is scaled once);
  one nested in another or in `skip_bad_steps`; one inside
  `optax.apply_if_finite` (overflows hidden from it), `optax.MultiSteps`
  (one overflow poisons the accumulator for good), `optax.masked` or
  `optax.multi_transform` (other leaves get scaled gradients), or after a
  stateful transformation in a chain (which sees scaled gradients); and a
  `skip_bad_steps` state inside `optax.MultiSteps`. A stateless
  transformation before the wrapper leaves no trace in the state: a harmless
  `optax.identity()` passes, and a clipping is refused by the wrapper's
  `update`. `get_scaled_loss` and `value_and_grad` warn about the same cases.

  Args:
    opt_state: the optimizer state (or a `TrainState` / `nnx.Optimizer`).

  Returns:
    None, when nothing is wrong.

  Raises:
    ValueError: naming the problem and the fix.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> ok = optax.chain(optax.identity(), ols.loss_scale_optimizer(optax.sgd(0.1)))
    >>> ols.check_composition(ok.init(jnp.ones(2)))
    >>> inner_first = ols.loss_scale_optimizer(optax.adam(1e-3))
    >>> stacked = (inner_first.init(jnp.ones(2)), inner_first.init(jnp.ones(2)))
    >>> try:
    ...   ols.check_composition(stacked)
    ... except ValueError as e:
    ...   print(str(e)[:44])
    2 loss_scale_optimizer states (at [0], [1]):
  """
  problem = composition_problem(opt_state)
  if problem is not None:
    raise ValueError(problem)


def warn_composition(opt_state: Any) -> None:
  problem = composition_problem(opt_state)
  if problem is not None:
    warnings.warn(problem, UserWarning, stacklevel=3)


def inner_state(opt_state: Any) -> Any:
  """Returns the state of the optimizer inside the wrappers, from any of our states.

  The wrappers keep the state of the transformation they wrap in their
  `inner_state` field; code that reads an optax state by its type or fields
  (`optax.contrib.schedule_free_eval_params`, `optax.tree_utils.tree_get`,
  a schedule's `count`) needs that state, not the wrapper's. This finds it
  wherever the wrapper sits: a `LossScaleOptimizerState` or
  `SkipBadStepsState` itself, one nested in an optax state (`optax.chain`,
  `named_chain`, ...), a Flax `TrainState` or an `nnx.Optimizer` (through
  their `opt_state`). Through nested wrappers
  (`loss_scale_optimizer(skip_bad_steps(inner))`) it returns `inner`'s state.
  The leaves an `nnx.Optimizer` boxes in `nnx.Variable` objects are returned as
  plain arrays.

  It reads; to replace the inner state, use the wrapper state's
  `._replace(inner_state=...)`, or `ols.convert_state`.

  Args:
    opt_state: a wrapper's state, an optax state holding exactly one
      (outermost) wrapper state, a Flax `TrainState` or an `nnx.Optimizer`.

  Returns:
    The innermost optimizer's state, as its own `init` built it.

  Raises:
    ValueError: if `opt_state` holds no wrapper state, or several side by
      side (their paths are listed).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> sf = optax.contrib.schedule_free_sgd(0.5)
    >>> tx = ols.loss_scale_optimizer(sf, initial_scale=2.0**10)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for scaled in (2.0**10, jnp.inf):  # one applied step, one skipped
    ...   grads = ols.mark_scaled({'w': jnp.full(2, scaled)})  # scaled by hand
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> optax.contrib.schedule_free_eval_params(ols.inner_state(state), params)
    {'w': Array([0.5, 0.5], dtype=float32)}
    >>> int(optax.tree_utils.tree_get(ols.inner_state(state), 'step_count'))  # 1 at init
    2
  """
  if isinstance(opt_state, optax.GradientTransformation):
    _search(opt_state, LossScaleOptimizerState)  # raises, naming the mix-up
  wrapper_types = (LossScaleOptimizerState, SkipBadStepsState)
  tree = opt_state
  if not isinstance(tree, wrapper_types) and hasattr(tree, "opt_state"):
    tree = tree.opt_state
  is_wrapper = lambda x: isinstance(x, wrapper_types)
  found = [
    (path, node)
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_wrapper)[0]
    if is_wrapper(node)
  ]
  if not found:
    raise ValueError(_NEITHER.format(type(opt_state).__name__))
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) or "<root>" for p, _ in found)
    raise ValueError(
      f"Found {len(found)} wrapper states side by side (at {paths}); inner_state reads"
      " one. Pass the one you mean, e.g. inner_state(opt_state[0])."
    )
  inner = state_conversion.innermost_state(found[0][1])
  # An nnx.Optimizer boxes each leaf in a Variable: hand back plain arrays.
  return jax.tree.map(_unwrap, inner, is_leaf=_is_box)


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
    >>> tx = optax.named_chain(('scaled', ols.loss_scale_optimizer(optax.adam(1e-3))),
    ...                        ('halved', optax.scale(0.5)))
    >>> state = tx.init({'w': jnp.ones(3)})
    >>> float(ols.get_loss_scale(state)())
    32768.0
  """
  if isinstance(opt_state, loss_scale_lib.LossScale):
    return opt_state
  return find_state(opt_state).loss_scale


def get_scaled_loss(loss: Any, opt_state: Any) -> Any:
  """Multiplies `loss` by the current loss scale found in `opt_state`.

  As in jmp and Keras 3, a loss in a floating dtype narrower than float32
  (float16, bfloat16) is promoted to float32 before it is scaled, so a
  float16 loss of 16 at the default scale 2**15 is 524288, not `inf`; the
  gradients still flow back into the model in its own dtypes. As in
  TensorFlow, a callable is scaled lazily: the result is a function
  returning the callable's loss times the scale read now.

  Args:
    loss: the loss: a floating array or Python number, a pytree of them, or
      a callable returning one.
    opt_state: the state of a `loss_scale_optimizer`, possibly nested (or a
      `LossScale`).

  Returns:
    `loss` times the current scale (in float32 or wider), or for a callable
    a callable returning it.

  Raises:
    TypeError: if a leaf of `loss` is not a floating number or array (an
      integer loss, a string, an object), naming its path.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(1.0), 8).init(jnp.ones(2))
    >>> ols.get_scaled_loss(jnp.float32(0.5), state)
    Array(4., dtype=float32)
    >>> ols.get_scaled_loss(jnp.float16(0.5), state)
    Array(4., dtype=float32)
    >>> ols.get_scaled_loss(lambda: jnp.float32(0.25), state)()
    Array(2., dtype=float32)
  """
  if not isinstance(opt_state, loss_scale_lib.LossScale):
    warn_composition(opt_state)
  ls = get_loss_scale(opt_state)
  if callable(loss) and not hasattr(loss, "dtype"):
    loss_fn = loss

    @functools.wraps(loss_fn)
    def scaled_loss(*args: Any, **kwargs: Any) -> Any:
      return ls.scale(_checked_loss(loss_fn(*args, **kwargs)))

    return scaled_loss
  return ls.scale(_checked_loss(loss))


def _checked_loss(loss: Any) -> Any:
  """`loss`, after checking that every leaf is a floating number or array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(loss)[0]:
    if isinstance(leaf, (bool, np.bool_)) or not (
      isinstance(leaf, (float, int)) or tree_utils.is_inexact(leaf)
    ):
      where = f" at {jax.tree_util.keystr(path)}" if path else ""
      raise TypeError(
        f"get_scaled_loss needs a floating loss (an array, a Python number, a pytree of"
        f" them, or a callable returning one); got {type(leaf).__name__}"
        f"{' of dtype ' + str(leaf.dtype) if hasattr(leaf, 'dtype') else ''}{where}."
      )
  return jax.tree.map(lambda x: float(x) if isinstance(x, int) else x, loss)


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
    "spike_clips": state.spike_clips,
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
  (bool), `consecutive_skips`, `total_skips`, `retries` (backward passes redone
  on the last step by `retry_on_overflow`) and `total_retries` (int32). With
  `record_nonfinite_leaves=True` there is one more key, `nonfinite_leaves`:
  a dict from each parameter leaf's path (`jax.tree_util.keystr`) to a bool
  scalar, True if that leaf's gradient held NaN/Inf on the last skipped step.

  For `skip_bad_steps`: `last_step_applied`, `consecutive_skips`,
  `total_skips`, the skips by reason `nonfinite_skips` and `spike_skips`,
  `consecutive_spike_skips`, `spike_rebases`, `spike_clips`, and for each watched quantity
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
    >>> sorted(ols.metrics(state))  # doctest: +NORMALIZE_WHITESPACE
    ['consecutive_skips', 'last_step_applied', 'loss_scale', 'retries',
     'total_retries', 'total_skips']
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
  if state.retries is not None:  # None in states built before retries were counted
    out["retries"] = state.retries
    out["total_retries"] = state.total_retries
  if state.nonfinite_leaves is not None:
    flat = jax.tree_util.tree_flatten_with_path(state.nonfinite_leaves)[0]
    out["nonfinite_leaves"] = {jax.tree_util.keystr(p) or "<root>": flag for p, flag in flat}
  if skip_state is not None:
    out["last_step_applied"] = state.last_step_applied & skip_state.last_step_applied
    out["overflow_skips"] = state.total_skips
    out["total_skips"] = state.total_skips + skip_state.total_skips
    out.update(_skip_metrics(skip_state))
  return out
