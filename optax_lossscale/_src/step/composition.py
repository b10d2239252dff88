"""Where a wrapper sits in an optimizer: refuse the compositions that cannot work.

Some ways of combining our wrappers with optax's combinators run and are
silently wrong:

  loss_scale_optimizer inside another (also through a chain)   unscales twice
  two loss_scale_optimizers in one optimizer                    one loss, two scales
  loss_scale_optimizer after a transformation in a chain        it sees scaled gradients
  loss_scale_optimizer inside apply_if_finite or MultiSteps     overflows hidden, or fatal
  loss_scale_optimizer inside masked or partition               other leaves get scaled grads
  skip_bad_steps inside MultiSteps                              one NaN stalls it for good
  skip_bad_steps watching the norm after a norm clipping        never sees a spike
  skip_bad_steps around loss_scale_optimizer, or inside another
  a stateful transformation after a skipping wrapper (warned)   it advances on skipped steps
  a skipping wrapper inside inject_hyperparams with a schedule  the schedule counts skipped
    (warned)                                                    steps too
  either wrapper inside master_weights or stochastic_rounding   the parameter write, or the
                                                                random key, outlives a skip
  a transformation after master_weights or stochastic_rounding  it changes what they write

A wrapper's arguments do not show what contains it, and the state cannot tell
a harmless `optax.identity()` from a clipping (both have an empty state). So
each wrapper's `init` and `update` look at the optax combinators calling them:
a combinator is recognised by the code object of its init or update function,
which all its instances share, and its locals hold its parts. Only the frames
of optax and of this package directly above the call are read, once per trace
(never when a compiled step is called). A combinator this module does not
know is not inspected; `composition_problem` then still reads the state.

The warnings (a composition that may be meant) are given once per trace: a
jitted update runs this Python once per trace, an eager one on every call, so
eager calls warn once per wrapper (or `inject_hyperparams`) and message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import functools
import sys
import types
from typing import Any
import warnings
import weakref

import jax
import optax

LOSS_SCALE = "loss_scale_optimizer"
SKIP = "skip_bad_steps"
# The transformations that write 16-bit parameters (`precision/`): they go inside the
# wrappers, never around them, and last in a chain.
MASTER_WEIGHTS = "master_weights"
STOCHASTIC_ROUNDING = "stochastic_rounding"
PARAM_WRITERS = (MASTER_WEIGHTS, STOCHASTIC_ROUNDING)
# The wrappers' own init functions, by code object (see `register_init`).
_WRAPPER_INITS: dict[types.CodeType, str] = {}
# The warnings eager updates have given, per owner: a wrapper's update function,
# or the inner factory of an `inject_hyperparams` (which rebuilds the wrapper on
# every update).
_WARNED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
INJECT = "optax.inject_hyperparams"


def register_init(init_fn: Callable[..., Any], kind: str) -> None:
  """Lets the checks recognise `init_fn`'s frames and siblings as a `kind` wrapper."""
  _WRAPPER_INITS[init_fn.__code__] = kind


@functools.cache
def _optax_codes() -> dict[types.CodeType, str]:
  """The code objects of optax's combinators' init and update functions, by name."""
  identity = optax.identity()
  examples = {
    "optax.chain": optax.chain(identity),
    "optax.named_chain": optax.named_chain(("a", identity)),
    "optax.masked": optax.masked(identity, True),
    "optax.partition": optax.multi_transform({"a": identity}, "a"),
    "optax.apply_if_finite": optax.apply_if_finite(identity, 1),
    INJECT: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
  }
  if hasattr(optax, "inject_stateful_hyperparams"):  # in case its functions are its own
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # deprecated for inject_hyperparams
      examples[f"{INJECT}(stateful)"] = optax.inject_stateful_hyperparams(optax.sgd)(0.1)
  codes = {}
  for name, tx in examples.items():
    name = INJECT if name.startswith(INJECT) else name
    codes[tx.init.__code__] = codes[tx.update.__code__] = name
  codes[optax.MultiSteps.init.__code__] = "optax.MultiSteps"
  codes[optax.MultiSteps.update.__code__] = "optax.MultiSteps"
  return codes


@functools.cache
def _leaf_codes() -> dict[str, types.CodeType]:
  """Update-function code objects of the transformations the rules name."""
  plain = optax.GradientTransformation(optax.identity().init, optax.identity().update)
  return {
    "identity": optax.identity().update.__code__,
    "extra_args": optax.with_extra_args_support(plain).update.__code__,
    "clip_by_global_norm": optax.clip_by_global_norm(1.0).update.__code__,
    "clip_by_block_rms": optax.clip_by_block_rms(1.0).update.__code__,
    "adaptive_grad_clip": optax.adaptive_grad_clip(1.0).update.__code__,
  }


def _in_scope(frame: types.FrameType) -> bool:
  module = frame.f_globals.get("__name__", "")
  return module == "optax" or module.startswith(("optax.", "optax_lossscale."))


def _callers(frame: types.FrameType) -> Iterator[tuple[str, types.FrameType]]:
  """The known combinators and wrappers calling `frame`, innermost first."""
  frame = frame.f_back
  while frame is not None and _in_scope(frame):
    kind = _optax_codes().get(frame.f_code) or _WRAPPER_INITS.get(frame.f_code)
    if kind is not None:
      yield kind, frame
    frame = frame.f_back


def _parts(value: Any) -> Iterator[Any]:
  """Transformations and functions in a local: itself, or in a sequence or dict of them."""
  if isinstance(value, (optax.GradientTransformation, types.FunctionType)):
    yield value
  elif isinstance(value, (list, tuple, dict)):
    items = value.values() if isinstance(value, dict) else value
    for item in items:
      if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], tuple):
        item = item[1]  # named_chain's (name, transformation) pairs
      if isinstance(item, (optax.GradientTransformation, types.FunctionType)):
        yield item


def _init_of(part: Any) -> Any:
  return part.init if isinstance(part, optax.GradientTransformation) else part


def _update_of(part: Any) -> Any:
  return part.update if isinstance(part, optax.GradientTransformation) else part


_FIX = {
  LOSS_SCALE: "loss_scale_optimizer(optax.chain(...))",
  SKIP: "skip_bad_steps(optax.chain(...))",
}


def is_traced(tree: Any) -> bool:
  """Whether `tree` holds a tracer: the update runs once per trace, not per call."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def _warn(owner: Any, message: str, traced: bool, stacklevel: int) -> None:
  """Warns once per trace: a traced call always, eager calls once per `owner` and message."""
  if not traced:
    try:
      seen = _WARNED.setdefault(owner, set())
    except TypeError:  # an owner that takes no weak reference: warn every time
      seen = set()
    if message in seen:
      return
    seen.add(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def _scheduled_hyperparams(frame: types.FrameType) -> list[str]:
  """The hyper-parameters an `inject_hyperparams` frame takes from schedules."""
  schedules = frame.f_locals.get("sched_hps")
  if schedules is None:
    # optax < 0.2.5: only its schedule function closes over them.
    for value in frame.f_locals.values():
      code = getattr(value, "__code__", None)
      if isinstance(value, types.FunctionType) and "sched_hps" in code.co_freevars:
        cell = value.__closure__[code.co_freevars.index("sched_hps")]
        schedules = cell.cell_contents
        break
  return sorted(schedules) if isinstance(schedules, dict) else []


def _inject_warning(kind: str, frame: types.FrameType) -> str | None:
  """The warning for a skipping wrapper in an `inject_hyperparams` frame with schedules, or None."""
  names = _scheduled_hyperparams(frame)
  if not names:
    return None  # constant hyper-parameters: nothing counts the steps
  fix = f"{kind}(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))"
  return (
    f"{kind} is inside optax.inject_hyperparams, whose schedule of {', '.join(names)}"
    " counts every update, skipped ones included: after k skipped steps it runs k steps"
    " ahead of the optimizer it drives. Put inject_hyperparams inside the wrapper,"
    f" {fix}, so that a skipped step leaves the schedule's count as it was."
  )


def check_init(kind: str, own_init: Callable[..., Any], can_skip: bool = True) -> None:
  """Raises if the optax combinators initialising `own_init` make it wrong.

  Call from the wrapper's init function. `can_skip`: whether a loss-scale
  wrapper can skip steps (a `FixedLossScale` composes like a plain
  transformation with `apply_if_finite` and `MultiSteps`). A skipping wrapper
  inside `optax.inject_hyperparams` with a schedule gets a warning.
  """
  for container, frame in _callers(sys._getframe(1)):
    if container == INJECT and can_skip:
      message = _inject_warning(kind, frame)
      if message is not None:
        warnings.warn(message, UserWarning, stacklevel=4)
    problem = _container_problem(kind, container, can_skip)
    if problem is None and container in ("optax.chain", "optax.named_chain"):
      siblings = {
        id(_init_of(p)): p
        for value in frame.f_locals.values()
        for p in _parts(value)
        if _WRAPPER_INITS.get(getattr(_init_of(p), "__code__", None)) == kind
      }
      siblings.pop(id(own_init), None)
      if siblings:
        problem = (
          f"two {kind}s in one {container}. Wrap the whole optimizer once: {_FIX[kind]}."
          + (" One loss is scaled once, by one scale." if kind == LOSS_SCALE else "")
        )
    if problem is not None:
      raise ValueError(f"{kind} cannot work here: {problem}")


def _container_problem(kind: str, container: str, can_skip: bool) -> str | None:
  if kind in (LOSS_SCALE, SKIP) and container in PARAM_WRITERS:
    return (
      f"it is inside {container}, which must go inside the wrapper instead:"
      f" {kind}({container}(inner, ...)). Then a skipped step leaves the"
      f" {'master copy' if container == MASTER_WEIGHTS else 'random key'} untouched, and"
      " the parameters are written once, by the wrapper's step."
    )
  if container == kind:
    return (
      f"it is nested inside another {kind} (possibly through an optax.chain), which"
      + (" would unscale the gradients twice" if kind == LOSS_SCALE else " skips the same steps")
      + f". Use one: {kind}(inner)."
    )
  if kind == LOSS_SCALE and container == SKIP:
    return (
      "it is inside skip_bad_steps, but skip_bad_steps must go inside the loss-scale"
      " wrapper, not around it: loss_scale_optimizer(skip_bad_steps(inner, ...)), so that"
      " an overflow backs the scale off and the spike check sees unscaled gradients."
    )
  if kind == LOSS_SCALE and can_skip and container == "optax.apply_if_finite":
    return (
      "it is inside optax.apply_if_finite, which hides each overflow from it, so the"
      " loss scale never backs off until apply_if_finite gives up. Drop apply_if_finite:"
      " loss_scale_optimizer already skips non-finite steps."
    )
  if (kind == SKIP or can_skip) and container == "optax.MultiSteps":
    return (
      "it is inside optax.MultiSteps, which clears its accumulator by multiplying by"
      " zero: one non-finite micro-batch leaves NaN in it (inf * 0), and every later"
      f" step is skipped. Wrap the other way round: {kind}(optax.MultiSteps(inner,"
      " k).gradient_transformation())."
    )
  if kind == LOSS_SCALE and container in ("optax.masked", "optax.partition"):
    return (
      f"it is inside {container} (or optax.multi_transform): the leaves it does not"
      " handle would receive the scaled gradients, and two partitions would hold two"
      " scales for one loss. Wrap the whole optimizer:"
      " loss_scale_optimizer(optax.multi_transform(...))."
    )
  return None


def check_update(
  kind: str,
  own_update: Callable[..., Any],
  watches_norm: bool = False,
  writes_values: bool = False,
  can_skip: bool = True,
  traced: bool = True,
  writes_params: str | None = None,
) -> None:
  """Raises if a transformation beside `own_update` in an optax chain makes it wrong.

  Call from the wrapper's update function. A loss-scale wrapper must come
  first (only `optax.identity()` may precede it); `skip_bad_steps` watching
  the gradient norm must not follow a clipping of that norm; a wrapper that
  writes overwrite-with-gradient leaves (`writes_values`) must come last, or
  the transformations after it would transform the values it writes; so
  must one around a parameter writer (`writes_params`, its kind). A
  stateful transformation after a wrapper that `can_skip` gets a warning: on
  a skipped step it still runs, on zero updates, and advances its state; so
  does an `optax.inject_hyperparams` with a schedule around it. Warnings are
  given once per trace: with `traced` False (an eager call), once per wrapper.
  """
  target: Any = own_update
  for container, frame in _callers(sys._getframe(1)):
    if container == INJECT and can_skip:
      message = _inject_warning(kind, frame)
      owner = frame.f_locals.get("inner_factory", own_update)
      if message is not None:
        _warn(owner, message, traced, stacklevel=4)
    if container not in ("optax.chain", "optax.named_chain"):
      target = frame.f_code
      continue
    before, after, later_states = _neighbours(frame, target)
    target = frame.f_code
    later = [_name(fn) for fn in after if not _is_identity(fn)]
    if can_skip and any(jax.tree.leaves(s) for s in later_states):
      message = (
        f"{', '.join(dict.fromkeys(later))} comes after {kind} in an {container} and keeps"
        " state: on a step the wrapper skips it still runs, on zero updates, and advances"
        " that state (optax.trace would still move the params). Put it inside the"
        f" wrapper, {_FIX[kind]}, so that a skipped step leaves it untouched."
      )
      _warn(own_update, message, traced, stacklevel=4)
    if writes_params and later:
      listed = ", ".join(dict.fromkeys(later))
      raise ValueError(
        f"{kind} wraps {writes_params}, which computes the new parameters itself, but"
        f" {listed} comes after the wrapper in an {container} and would change what it"
        f" writes. Put {listed} inside: {kind}({writes_params}(optax.chain(...,"
        f" {listed}(...))))."
      )
    if writes_values and later:
      listed = ", ".join(dict.fromkeys(later))
      raise ValueError(
        f"{kind} writes overwrite-with-gradient leaves (fp8 metadata), but {listed} comes"
        f" after it in an {container} and would transform the values it writes. Put"
        f" {listed} inside the wrapper: {_FIX[kind]}."
      )
    names = [_name(fn) for fn in before if _harms(kind, fn, watches_norm)]
    if names:
      listed = ", ".join(dict.fromkeys(names))
      if kind == LOSS_SCALE:
        raise ValueError(
          f"loss_scale_optimizer comes after {listed} in an {container}, so {listed}"
          " would receive the *scaled* gradients (a clipping clips values S times too"
          " large, weight decay is divided by S). Put it inside the wrapper:"
          f" loss_scale_optimizer(optax.chain({listed}(...), inner))."
        )
      raise ValueError(
        f"skip_bad_steps watches the gradient norm but comes after {listed} in an"
        f" {container}: it sees the norm after clipping and never sees a spike. Put the"
        f" clipping inside: skip_bad_steps(optax.chain({listed}(...), inner), ...)."
      )


def check_last(kind: str, own_update: Callable[..., Any]) -> None:
  """Raises if a transformation follows `own_update` in an optax chain.

  Call from the update function of a transformation that writes the
  parameters (`PARAM_WRITERS`): its updates are the difference between the
  parameters it computed and the old ones, so a transformation after it
  (a scaling, a weight decay) would change what is written, and the next
  step would write the parameters back. `optax.identity()` may follow.
  """
  target: Any = own_update
  for container, frame in _callers(sys._getframe(1)):
    if container not in ("optax.chain", "optax.named_chain"):
      target = frame.f_code
      continue
    _, after, _ = _neighbours(frame, target)
    target = frame.f_code
    later = [_name(fn) for fn in after if not _is_identity(fn)]
    if later:
      listed = ", ".join(dict.fromkeys(later))
      raise ValueError(
        f"{kind} computes the new parameters itself, but {listed} comes after it in an"
        f" {container} and would change what it writes (the next step would write the"
        f" parameters back). Put {listed} inside: {kind}(optax.chain(..., {listed}(...)))."
      )


def _neighbours(
  frame: types.FrameType, target: Any
) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]], list[Any]]:
  """What a chain frame runs before and after the part leading to `target`.

  `target` is the wrapper's update function, or the code object of the
  combinator frame below (the part currently running, the loop variable).
  Returns the update functions before and after it, and the states of the
  parts after it (from the chain's `state` argument, a tuple or a dict).
  """

  def leads(part: Any) -> bool:
    update = _update_of(part)
    return update is target or getattr(update, "__code__", None) is target

  direct = [
    v
    for v in frame.f_locals.values()
    if isinstance(v, (tuple, list)) and not isinstance(v, optax.GradientTransformation)
  ]
  for sequence in direct:
    parts = list(_parts(sequence))
    positions = [i for i, p in enumerate(parts) if leads(p)]
    if len(positions) == 1:
      leaves = lambda ps: [fn for p in ps for fn in _leaf_updates(_update_of(p))]
      states = frame.f_locals.get("state")
      states = list(states.values()) if isinstance(states, dict) else states
      later_states = []
      if isinstance(states, (tuple, list)) and len(states) == len(parts):
        later_states = list(states[positions[0] + 1 :])
      return leaves(parts[: positions[0]]), leaves(parts[positions[0] + 1 :]), later_states
  return [], [], []  # not found: nothing is claimed


def _leaf_updates(update: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
  """`update` with optax's extra-args wrappers and chains opened up."""
  code = getattr(update, "__code__", None)
  kind = _optax_codes().get(code)
  if code is _leaf_codes()["extra_args"] or kind in ("optax.chain", "optax.named_chain"):
    for cell in update.__closure__ or ():
      for part in _parts(cell.cell_contents):
        yield from _leaf_updates(_update_of(part))
    return
  yield update


def _is_identity(update: Callable[..., Any]) -> bool:
  return getattr(update, "__code__", None) is _leaf_codes()["identity"]


def _harms(kind: str, update: Callable[..., Any], watches_norm: bool) -> bool:
  """Whether `update`, run before the wrapper `kind`, makes it wrong."""
  if kind == LOSS_SCALE:
    return not _is_identity(update)
  norm_clips = ("clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip")
  code = getattr(update, "__code__", None)
  return watches_norm and any(code is _leaf_codes()[name] for name in norm_clips)


def _name(update: Callable[..., Any]) -> str:
  """A transformation's name for a message, e.g. 'optax.clip_by_global_norm'."""
  settings = getattr(update, "loss_scale_optimizer_settings", None)
  if settings is not None:
    return settings["kind"]
  name = getattr(update, "__qualname__", repr(update)).split(".<locals>")[0]
  module = getattr(update, "__module__", "") or ""
  return f"optax.{name}" if module.startswith("optax.") else name


# -- The state-based check: for `check_composition` and the warnings.


def composition_problem(opt_state: Any, state_types: dict[str, type]) -> str | None:
  """Says why the wrappers' places in `opt_state` give wrong results, or None.

  What the state shows: two loss-scale states; a loss-scale state inside
  `apply_if_finite`, `MultiSteps`, `masked` or `partition`, or after a
  stateful transformation of a `chain`; a `skip_bad_steps` state inside
  `MultiSteps`. A stateless transformation before the wrapper (`identity`, a
  clipping) leaves no trace in the state: the wrapper's update refuses the
  harmful ones when it runs.
  """
  kinds = {state_types[LOSS_SCALE]: LOSS_SCALE, state_types[SKIP]: SKIP}
  found = list(_wrapper_states(opt_state, tuple(kinds), ()))
  loss_scales = [
    jax.tree_util.keystr(path) or "<root>"
    for path, node in found
    if kinds[type(node)] == LOSS_SCALE
  ]
  if len(loss_scales) > 1:
    return (
      f"{len(loss_scales)} loss_scale_optimizer states (at {', '.join(loss_scales)}): one loss"
      " is scaled by one scale, so wrap the whole optimizer once, e.g."
      " loss_scale_optimizer(optax.chain(...))."
    )
  for path, node in found:
    kind = kinds[type(node)]
    can_skip = kind == SKIP or getattr(node.loss_scale, "skips", True)
    parent = opt_state
    for depth, key in enumerate(path):
      where = jax.tree_util.keystr(path[:depth]) or "the top level"
      container = kinds.get(type(parent)) or _STATE_CONTAINERS.get(type(parent))
      problem = container and _container_problem(kind, container, can_skip)
      if problem:
        return f"{kind} (at {where}): {problem}"
      if kind == LOSS_SCALE and _after_stateful(parent, key):
        return (
          f"loss_scale_optimizer is not first in its chain (at"
          f" {jax.tree_util.keystr(path[: depth + 1])}): the stateful transformations"
          " before it receive the *scaled* gradients. Put them inside instead:"
          " loss_scale_optimizer(optax.chain(...))."
        )
      try:
        parent = _child(parent, key)
      except (KeyError, IndexError, AttributeError, TypeError):
        break
  return None


def _wrapper_states(tree: Any, types_: tuple[type, ...], prefix: tuple[Any, ...]) -> Iterator[Any]:
  """Every wrapper state in `tree` with its path, those nested in another too."""
  is_wrapper = lambda x: isinstance(x, types_)
  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_wrapper)[0]:
    if is_wrapper(node):
      yield (*prefix, *path), node
      inner = (*prefix, *path, jax.tree_util.GetAttrKey("inner_state"))
      yield from _wrapper_states(node.inner_state, types_, inner)


_STATE_CONTAINERS = {
  optax.ApplyIfFiniteState: "optax.apply_if_finite",
  optax.MultiStepsState: "optax.MultiSteps",
  optax.MaskedState: "optax.masked",
  # optax 0.2.5 renamed multi_transform's state to PartitionState.
  getattr(optax, "PartitionState", None) or optax.MultiTransformState: "optax.partition",
}


def _after_stateful(node: Any, key: Any) -> bool:
  """Whether `key` selects an element of a chain state after a stateful one."""
  if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey):
    before = node[: key.idx]
  elif isinstance(node, dict) and isinstance(key, jax.tree_util.DictKey) and key.key in node:
    keys = list(node)
    before = [node[k] for k in keys[: keys.index(key.key)]]
  else:
    return False
  return any(jax.tree.leaves(state) for state in before)


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  raise KeyError(key)
