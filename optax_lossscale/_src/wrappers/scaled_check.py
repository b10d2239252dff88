"""Whether a `loss_scale_optimizer` is given the gradients of a loss nobody scaled.

The wrapper divides its gradients by the loss scale, so the gradients of the
plain loss (`jax.grad(loss_fn)` where `ols.value_and_grad(loss_fn)` was
meant) train with steps 2**15 times too small, and no value in them says so.
The gradients cannot carry a mark either: they are arrays, which cross `jit`
boundaries, `pmean` and sums over micro-batches as numbers. What is known is
whether any loss was scaled (`loss_scales/scaling_record.py` counts every
`LossScale.scale` and `mark_scaled`), so the check is:

  when the wrapper is built:
    site  = the line of user code that builds it (library frames passed over)
    since = the count of scaled losses when a wrapper was first built there
  when its update runs (eagerly) or is traced (under jit: never per call):
    the scale is 1 (NoOpLossScale, a constant 1, or eagerly now 1):  fine
    a loss was scaled since `since`:                                  fine
    otherwise: UnscaledGradientsWarning, naming the fix (eagerly, once per site)

Keyed by the line rather than the wrapper object because some correct
programs build the wrapper again and again: `optax.inject_hyperparams` around
it rebuilds it on every update, and a sweep rebuilds it in a loop while
reusing a compiled gradient function, which scales its loss in Python only
when it is first traced. Counted from the first build at a line, they stay
quiet. The check cannot tell which loss a gradient came from: a program
that scales one loss and forgets another is not caught.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
import weakref

import jax

from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.loss_scales import scaling_record

# Frames of these packages are passed over to find the user's line.
_LIBRARIES = ("optax_lossscale", "optax", "jax", "jaxlib", "flax", "equinox")

# A construction site: the code object and line number of the user's frame,
# or a fresh object when no frame is the user's.
Site = tuple[types.CodeType, int] | object

# The count of scaled losses when a wrapper was first built at each site.
_FIRST_BUILT: weakref.WeakKeyDictionary[types.CodeType, dict[int, int]] = (
  weakref.WeakKeyDictionary()
)
# The sites whose eager updates have warned (a jitted update warns once per trace).
_WARNED: weakref.WeakKeyDictionary[types.CodeType, set[int]] = weakref.WeakKeyDictionary()


def _library_dirs() -> tuple[str, ...]:
  dirs = []
  for name in _LIBRARIES:
    path = getattr(sys.modules.get(name), "__file__", None)
    if path:
      dirs.append(os.path.dirname(path) + os.sep)
  return tuple(dirs)


def _user_frame(frame: types.FrameType | None) -> tuple[types.FrameType | None, int]:
  """The first frame from `frame` up that is not a library's, and how many were passed."""
  dirs = _library_dirs()
  passed = 0
  while frame is not None and frame.f_code.co_filename.startswith(dirs):
    frame = frame.f_back
    passed += 1
  return frame, passed


def construction_site() -> tuple[Site, int]:
  """`(site, since)` for a wrapper being built now; called by its constructor."""
  frame, _ = _user_frame(sys._getframe(1))
  if frame is None:
    return object(), scaling_record.scaled_count()
  lines = _FIRST_BUILT.setdefault(frame.f_code, {})
  since = lines.setdefault(frame.f_lineno, scaling_record.scaled_count())
  return (frame.f_code, frame.f_lineno), since


def _known_value(ls: loss_scale_lib.LossScale) -> float | None:
  """The scale as a number, or None where it is only known when the step runs."""
  constant = getattr(ls, "loss_scale_value", None)  # FixedLossScale, SkippingFixedLossScale
  if constant is not None:
    return float(constant)
  try:
    value = ls()
    return None if isinstance(value, jax.core.Tracer) else float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def check(
  initial_ls: loss_scale_lib.LossScale,
  ls: loss_scale_lib.LossScale,
  site: Site,
  since: int,
  traced: bool,
) -> None:
  """Warns if no loss was scaled since the wrapper was built at `site` (see the module)."""
  if scaling_record.scaled_count() > since or isinstance(ls, loss_scale_lib.NoOpLossScale):
    return
  initial = _known_value(initial_ls)
  if not initial_ls.dynamic and initial == 1.0:
    return
  value = _known_value(ls)  # read only here: an eager step is not synchronised otherwise
  if value == 1.0:  # dividing by 1 is harmless, for now
    return
  if not traced and isinstance(site, tuple):
    warned = _WARNED.setdefault(site[0], set())
    if site[1] in warned:
      return
    warned.add(site[1])
  if value is not None:
    scale = f"{value:g}"
  else:
    scale = "a traced value" if initial is None else f"{initial:g} at the start"
  _, passed = _user_frame(sys._getframe(1))
  warnings.warn(_message(scale), scaling_record.UnscaledGradientsWarning, stacklevel=passed + 2)


def _message(scale: str) -> str:
  return (
    "loss_scale_optimizer was given gradients, but no loss has been scaled since it was"
    " built. If these are the gradients of the plain loss (jax.grad(loss_fn)), the"
    f" wrapper divides them by the loss scale ({scale}) and SGD's steps are that many"
    " times too small. Differentiate the scaled loss instead:"
    " `loss, grads = ols.value_and_grad(loss_fn)(opt_state, params, ...)`, or"
    " `jax.grad(lambda p: ols.get_scaled_loss(loss_fn(p), opt_state))(params)`"
    " (for NNX and Equinox: optax_lossscale.flax.nnx_value_and_grad,"
    " optax_lossscale.equinox.filter_value_and_grad). If you multiplied the loss by"
    " the scale yourself, say so with `grads = ols.mark_scaled(grads)`; to silence"
    " this check, warnings.filterwarnings('ignore', category=ols.UnscaledGradientsWarning)."
  )


def reset_sites() -> None:
  """Forgets every site and warning (for tests that build wrappers on a shared line)."""
  _FIRST_BUILT.clear()
  _WARNED.clear()
