"""Writing 16-bit parameters: the fused write, and the closest updates for optax's.

`master_weights` and `stochastic_rounding` compute each step's new parameters
themselves (the master copy rounded to the parameter's dtype; the float32 sum
rounded stochastically). Two ways lead from there to the parameters:

  ols.apply_gradients, TrainState     params = new                      (the fused step)
  tx.update + optax.apply_updates     updates = f32(new) - f32(old)     (float32 updates)
                                      params = (old + updates).astype(old.dtype)

The second is the write bit for bit (but for the sign of a zero) whenever
`f32(new) - f32(old)` is exact in float32, i.e. unless a parameter shrinks by
a factor above about 2**15 (bfloat16; 2**12 for float16) in one step: then
the parameter is within one float32 rounding of the old value of `new`, and
the next step writes it again from the exact value it computed. Updates of
the parameter's own 16-bit dtype could not land on `new` in general, so the
updates are float32 (more exactly, of the dtype the new values were computed
in); `optax.apply_updates` casts the sum back to the parameter's dtype (NNX's
`nnx.Optimizer.update` calls it), `eqx.apply_updates` does not.

This module holds that step once, for every transformation that writes
parameters: `attach_write` gives the transformation's update function, with
the fused step riding on it (`step/conditional_step.attach`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._src.step import composition, conditional_step
from optax_lossscale._src.storage import quantize

# True while an outer writer runs an inner transformation's fused step, whose new
# parameters are then not the ones returned (`nested`).
_NESTED = contextvars.ContextVar("optax_lossscale_nested_write", default=False)


def nested() -> bool:
  """Whether the fused step being traced writes parameters that an outer writer
  (`master_weights`, `stochastic_rounding`) computes from, rather than returns."""
  return _NESTED.get()


@contextlib.contextmanager
def _inside() -> Iterator[None]:
  token = _NESTED.set(True)
  try:
    yield
  finally:
    _NESTED.reset(token)


# `(grads, state, params, extra_args, fused) -> (new_params, updates, new_state, last)`:
# the new parameters leaf by leaf, and, where a leaf's update is the inner optimizer's
# own (a leaf the transformation leaves alone), that update, else None. `fused`: the
# parameters are what is returned (an inner fused step may write them). `last`: arrays
# written once every reader of the old state has read it (the new parameters, or what
# they are split from), after which the fused step writes 8-bit codes in place.
Compute = Callable[
  [Any, Any, Any, dict[str, Any], bool], tuple[list[Any], list[Any], Any, list[Any]]
]


def closest_update(new: jax.Array, old: jax.Array, dtype: Any) -> jax.Array:
  """The update (of `dtype`) that `optax.apply_updates` turns `old` into `new` with.

  `new - old`, computed in `dtype` (float32 for 16-bit parameters), and 0
  where the two are the same bits already (an infinite parameter stays
  infinite instead of becoming `inf - inf`, a NaN).
  """
  new_wide, old_wide = new.astype(dtype), old.astype(dtype)
  return jnp.where(new == old, jnp.zeros((), dtype), new_wide - old_wide)


def require_params(params: Any, kind: str) -> None:
  if params is None:
    raise ValueError(
      f"{kind} computes the new parameters from the old ones, so its update needs them:"
      " call tx.update(grads, state, params), or ols.apply_gradients(tx, grads, state,"
      " params), which writes them exactly."
    )


def attach_write(kind: str, compute: Compute, settings: dict[str, Any]) -> Callable[..., Any]:
  """The update function of a parameter-writing transformation `kind`.

  `compute` returns the new parameters (one per leaf of the params' treedef)
  and, per leaf, the update to return through `tx.update` if it is the inner
  optimizer's own, else None (then the closest update is derived). The
  fused twin that `ols.apply_gradients`, the Flax `TrainState` and an outer
  wrapper's applied branch call returns the new parameters as they are.
  """

  def step(
    grads: Any, state: Any, params: Any, extra_args: dict[str, Any], apply_to_params: bool
  ) -> tuple[Any, Any]:
    require_params(params, kind)
    if not apply_to_params:
      composition.check_last(kind, update_fn)
    old, treedef = jax.tree.flatten(params)
    new, updates, new_state, last = compute(grads, state, params, extra_args, apply_to_params)
    if apply_to_params:
      if not nested():  # the parameters returned: the new codes written after `last`
        new_state = quantize.codes_after_own(new_state, params, [jnp.asarray(x) for x in last])
      return treedef.unflatten(new), new_state
    out = [
      u if u is not None else closest_update(n, o, jnp.promote_types(n.dtype, jnp.float32))
      for n, o, u in zip(new, old, updates, strict=True)
    ]
    return treedef.unflatten(out), new_state

  update_fn = conditional_step.attach(step, {"kind": kind, **settings})
  return update_fn


def inner_step(
  inner: optax.GradientTransformationExtraArgs,
  grads: Any,
  inner_state: Any,
  params: Any,
  extra_args: dict[str, Any],
  fused: bool,
) -> tuple[Any, Any, Any]:
  """`inner`'s step on `params`: `(new_params, updates or None, new_inner_state)`.

  With `fused` and an inner transformation that has a fused step (a
  transformation of this package), that step writes the new parameters and
  the updates are None.
  """
  fused_step = conditional_step.fused_apply_gradients(inner) if fused else None
  if fused_step is not None:
    with _inside():
      new_params, inner_state = fused_step(grads, inner_state, params, **extra_args)
    return new_params, None, inner_state
  updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
  return optax.apply_updates(params, updates), updates, inner_state
