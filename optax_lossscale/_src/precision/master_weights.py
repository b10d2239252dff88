"""`master_weights`: 16-bit parameters that learn, through a float32 master copy.

With round-to-nearest, a bfloat16 weight near 1.0 cannot move by less than
2**-8: Adam at a learning rate of 1e-3 leaves it where it was, step after
step. Mixed-precision training's answer (Micikevicius et al. 2018) keeps a
float32 master copy of every 16-bit parameter and steps that copy:

  init:    master = p.astype(float32)              for each floating p narrower than float32
           inner_state = inner.init(master)        (other leaves: the param itself)
  update:  updates, inner_state = inner.update(g.astype(float32), inner_state, master)
           master = master + updates               (optax.apply_updates, in float32)
           p = master.astype(p.dtype)              (round to nearest)

The parameters the model reads stay 16-bit; only the optimizer holds the
master copy, in its state, next to the inner optimizer's state. Inside a
`loss_scale_optimizer` or `skip_bad_steps`, a skipped step leaves both
untouched, as it leaves any inner state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._src.precision import param_write
from optax_lossscale._src.step import composition, conditional_step
from optax_lossscale._src.utils import params_check


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    inner_state: the wrapped transformation's state, built on the master
      copy (so Adam's moments of a bfloat16 parameter are float32).
    master: a tree shaped like the parameters: the master copy (of
      `master_dtype`, sharded like its parameter) of each floating parameter
      narrower than `master_dtype`, and None for every other leaf, which is
      stepped as it is.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.master_weights(optax.sgd(1e-3))
    >>> state = tx.init({'w': jnp.ones(2, jnp.bfloat16), 'b': jnp.zeros(2)})
    >>> state.master
    {'b': None, 'w': Array([1., 1.], dtype=float32)}
  """

  inner_state: optax.OptState
  master: Any


def _check_master_dtype(master_dtype: Any) -> np.dtype:
  accepted = "a floating dtype such as jnp.float32"
  try:
    dtype = None if master_dtype is None else np.dtype(master_dtype)
  except TypeError:
    raise ValueError(f"master_dtype must be {accepted}; got {master_dtype!r}.") from None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"master_dtype must be {accepted}; got {master_dtype!r}.")
  return dtype


def check_inner(inner: Any, kind: str) -> optax.GradientTransformation:
  """Validates the transformation a parameter writer `kind` wraps."""
  if not isinstance(inner, optax.GradientTransformation):
    hint = ""
    if hasattr(inner, "gradient_transformation"):
      hint = " Pass optax.MultiSteps(...).gradient_transformation()."
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3));"
      f" got {type(inner).__name__}.{hint}"
    )
  inner_kind = (conditional_step.settings_of(inner) or {}).get("kind")
  if inner_kind in (composition.LOSS_SCALE, composition.SKIP):
    raise ValueError(
      f"{kind} goes inside the {inner_kind} wrapper, not around it:"
      f" {inner_kind}({kind}(inner, ...)). A skipped step then leaves the parameters"
      f" and {kind}'s state untouched."
    )
  if inner_kind in composition.PARAM_WRITERS:
    raise ValueError(
      f"{kind} cannot wrap {inner_kind}: both compute the new 16-bit parameters (a"
      " master copy leaves nothing to round stochastically, and the other way round)."
      f" Use one: {kind}(inner, ...)."
    )
  return inner


def _has_master(leaf: Any, master_dtype: np.dtype) -> bool:
  dtype = np.dtype(jnp.result_type(leaf))
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < master_dtype.itemsize


def master_weights(
  inner: optax.GradientTransformation, master_dtype: Any = jnp.float32
) -> optax.GradientTransformationExtraArgs:
  """Steps 16-bit parameters through a master copy of a wider dtype.

  Keeps, in its state, a master copy of each floating parameter narrower
  than `master_dtype` (a bfloat16 or float16 parameter gets a float32 copy,
  sharded like the parameter); runs `inner` on the master copy with the
  gradients promoted to `master_dtype`, so `inner`'s state (Adam's moments)
  is of that dtype too; and writes each parameter as its master rounded to
  the parameter's dtype. A parameter of `master_dtype` or wider is stepped
  as `inner` steps it, with no copy; a non-floating leaf is left to `inner`
  too, and an integer or bool gradient raises a `TypeError` naming it.

  The write is exact (bit for bit the master rounded to nearest) through
  `ols.apply_gradients`, `optax_lossscale.flax.TrainState` and an outer
  `loss_scale_optimizer` or `skip_bad_steps` stepped either way. Through
  `tx.update` and `optax.apply_updates` (what `nnx.Optimizer.update` does)
  the updates are float32, `new - old`, which `optax.apply_updates` adds in
  float32 and casts back: the same bits, but for the sign of a zero and a
  parameter that shrinks by a factor above about 2**15 (float16: 2**12) in
  one step, which then lands within one float32 rounding of it (the master
  stays exact, and the next step writes from it again). `eqx.apply_updates`
  does not cast back: with Equinox step with `ols.apply_gradients`.

  Put it inside the wrappers, `loss_scale_optimizer(master_weights(inner))`
  (`skip_bad_steps` alike): a skipped step then leaves the master copy and
  the parameters untouched; the other order is refused. Nothing may follow
  it in an `optax.chain` (it computes the parameters; put the rest inside).
  For gradient accumulation, `master_weights(optax.MultiSteps(inner,
  k).gradient_transformation())` accumulates the promoted gradients in
  float32.

  Args:
    inner: the transformation to run on the master copy, e.g.
      `optax.adam(1e-3)`.
    master_dtype: the master copy's dtype, a floating dtype (float32 by
      default).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `MasterWeightsState`; `ols.apply_gradients(tx, ...)` writes the
    parameters in the same step.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> params = {'w': jnp.ones(3, jnp.bfloat16)}
    >>> grads = {'w': jnp.ones(3, jnp.bfloat16)}
    >>> bare = optax.sgd(1e-3)  # a step of 1e-3 is below half an ulp of 1.0 in bfloat16
    >>> p, s = params, bare.init(params)
    >>> for _ in range(10):
    ...   p, s = ols.apply_gradients(bare, grads, s, p)
    >>> p['w']
    Array([1, 1, 1], dtype=bfloat16)
    >>> tx = ols.master_weights(optax.sgd(1e-3))
    >>> p, s = params, tx.init(params)
    >>> for _ in range(10):
    ...   p, s = ols.apply_gradients(tx, grads, s, p)
    >>> p['w']  # the master, 0.99 in float32, rounded to bfloat16
    Array([0.988281, 0.988281, 0.988281], dtype=bfloat16)
    >>> bool(jnp.all(p['w'] == s.master['w'].astype(jnp.bfloat16)))
    True

  References:
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740; NVIDIA Apex's `amp` O2 master
    parameters; Megatron-LM's `Float16OptimizerWithFloat16Params`.
  """
  kind = composition.MASTER_WEIGHTS
  user_inner = check_inner(inner, kind)
  master_dtype = _check_master_dtype(master_dtype)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> MasterWeightsState:
    params_check.check_params_are_arrays(params, "master_weights.init")
    leaves, treedef = jax.tree.flatten(params)
    masters = [
      jnp.asarray(p).astype(master_dtype) if _has_master(p, master_dtype) else None for p in leaves
    ]
    on_master = [p if m is None else m for p, m in zip(leaves, masters, strict=True)]
    return MasterWeightsState(
      inner_state=inner.init(treedef.unflatten(on_master)), master=treedef.unflatten(masters)
    )

  composition.register_init(init_fn, kind)

  def compute(
    grads: Any, state: Any, params: Any, extra_args: dict[str, Any], fused: bool
  ) -> tuple[list[Any], list[Any], MasterWeightsState]:
    if not isinstance(state, MasterWeightsState):
      raise TypeError(
        "master_weights's update expects the MasterWeightsState that its init returned;"
        f" got {type(state).__name__}. Pass this transformation's state, opt_state ="
        " tx.init(params) with tx the master_weights transformation."
      )
    params_check.check_float_grads(
      grads, "master_weights", "It has no floating master copy to step."
    )
    params_check.check_params_are_arrays(params, "master_weights.update")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in flat]
    masters = treedef.flatten_up_to(state.master)
    for (path, p), m in zip(flat, masters, strict=True):
      if m is not None and not _has_master(p, np.dtype(m.dtype)):
        raise TypeError(
          f"master_weights keeps a {m.dtype} master copy of the parameter at"
          f" {jax.tree_util.keystr(path) or '<root>'}, which is now"
          f" {jnp.result_type(p)}: something cast it up since init. Its updates are"
          " float32; optax.apply_updates casts the sum back to the parameter's dtype,"
          " eqx.apply_updates does not: step with ols.apply_gradients(tx, grads, state,"
          " params), which writes the parameters in their own dtype."
        )
    promoted = [
      g if m is None or g is None else jnp.asarray(g).astype(m.dtype)
      for g, m in zip(treedef.flatten_up_to(grads), masters, strict=True)
    ]
    on_master = [p if m is None else m for p, m in zip(leaves, masters, strict=True)]
    stepped, updates, inner_state = param_write.inner_step(
      inner,
      treedef.unflatten(promoted),
      state.inner_state,
      treedef.unflatten(on_master),
      extra_args,
      fused,
    )
    stepped = treedef.flatten_up_to(stepped)
    updates = [None] * len(leaves) if updates is None else treedef.flatten_up_to(updates)
    new_params, own_updates = [], []
    for p, m, s, u in zip(leaves, masters, stepped, updates, strict=True):
      new_params.append(s if m is None else s.astype(jnp.result_type(p)))
      own_updates.append(u if m is None else None)
    new_master = [None if m is None else s for m, s in zip(masters, stepped, strict=True)]
    return (
      new_params,
      own_updates,
      MasterWeightsState(inner_state=inner_state, master=treedef.unflatten(new_master)),
    )

  update_fn = param_write.attach_write(
    kind, compute, {"inner": user_inner, "master_dtype": master_dtype}
  )
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
