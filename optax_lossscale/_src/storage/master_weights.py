"""`master_weights`: 16-bit parameters that learn, through a float32 master copy.

With round-to-nearest, a bfloat16 weight near 1.0 cannot move by less than
2**-8: Adam at a learning rate of 1e-3 leaves it where it was, step after
step. Mixed-precision training's answer (Micikevicius et al. 2018) keeps a
float32 master copy of every 16-bit parameter and steps that copy:

  init:    master = p.astype(float32)              for each floating p narrower than float32
           inner_state = inner.init(master)        (other leaves: the param itself)
  update:  updates, inner_state = inner.update(g.astype(float32), inner_state, master)
           master = master + updates               (optax.apply_updates, in float32)
           p = master rounded to p.dtype           (to nearest; a bfloat16 tie away from
                                                    zero, so that 16 bits complete it)

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

from optax_lossscale._src.step import composition, conditional_step
from optax_lossscale._src.storage import param_write, rounding, schedule
from optax_lossscale._src.utils import dtypes, params_check


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    inner_state: the wrapped transformation's state, built on the master
      copy (so Adam's moments of a bfloat16 parameter are float32).
    master: a tree shaped like the parameters: the master copy (of
      `master_dtype`, sharded like its parameter) of each floating parameter
      narrower than `master_dtype`, and None for every other leaf, which is
      stepped as it is. With `store='remainder'`, in place of each float32
      copy, the master's low 16 bits (an int16) that complete the bfloat16
      parameter to it.

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


STORES = ("copy", "remainder")
_BF16, _F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _check_store(store: Any, master_dtype: np.dtype) -> str:
  if not isinstance(store, str) or store not in STORES:
    raise ValueError(f"store must be one of {STORES}; got {store!r}.")
  if store == "remainder" and master_dtype != _F32:
    raise ValueError(
      "store='remainder' keeps a float32 master as its bfloat16 parameter and 16 more bits;"
      f" master_dtype must then be float32, got {master_dtype}."
    )
  return store


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


def _written(master: jax.Array, dtype: Any) -> jax.Array:
  """The parameter of dtype `dtype` written from `master`: a bfloat16 one of a float32
  master rounded as `store='remainder'` must round it (ties away from zero), so that both
  stores write the same parameters; any other pair rounded to nearest even."""
  if np.dtype(dtype) == _BF16 and np.dtype(master.dtype) == _F32:
    return rounding.round_half_away_bfloat16(master)
  return master.astype(dtype)


def master_weights(
  inner: optax.GradientTransformation, master_dtype: Any = jnp.float32, store: str = "copy"
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

  The write is exact (bit for bit the master rounded to nearest: ties away
  from zero for a bfloat16 parameter of a float32 master, as below; to even
  for the other pairs) through
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

  With `store='remainder'`, for bfloat16 parameters, the state keeps not the
  float32 master but what the parameter lacks of it: its low 16 bits, 2
  bytes instead of 4 (the layout of Apex's and Transformer Engine's
  "parameter remainders"). Each step joins the parameter and the remainder
  into the float32 master, steps it, and splits it again. The split is exact
  for every float32 master (zeros of both signs, subnormals, infinities, a
  finite master whose parameter is infinite; a NaN stays a NaN) because the
  parameter is the master rounded to nearest with ties *away from zero*:
  every nonzero bfloat16 value is then the rounding of exactly 2**16
  masters, as many as 16 bits tell apart (to nearest even, an even value
  would be the rounding of 2**16 + 1). Both stores write bfloat16 parameters
  of a float32 master that way, so a run with `store='remainder'` is the run
  with the full copy, bit for bit, the gradients computed from its own
  parameters included. A tie (a master's low 16 bits 0x8000, about one
  element-step in 2**16) above an even value is the one place where the
  parameter differs from `master.astype(jnp.bfloat16)` (round to nearest
  even): one bfloat16 ulp up in magnitude. float16 parameters (which keep
  the cast) are refused at `init` with `store='remainder'`: float16 is not
  the top half of a float32, so no 16 bits complete it.

  Args:
    inner: the transformation to run on the master copy, e.g.
      `optax.adam(1e-3)`.
    master_dtype: the master copy's dtype, a floating dtype (float32 by
      default), read as `ols.Policy` reads dtypes ('f32', jnp.float32, ...);
      float64 needs `jax_enable_x64`.
    store: `'copy'` (the default) keeps the master copy; `'remainder'` keeps
      16 bits per bfloat16 parameter that complete it (float32 masters of
      bfloat16 parameters only).

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
    >>> bool(jnp.all(p['w'] == s.master['w'].astype(jnp.bfloat16)))  # no tie: as the cast
    True

  References:
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740; NVIDIA Apex's `amp` O2 master
    parameters; Megatron-LM's `Float16OptimizerWithFloat16Params`.
  """
  kind = composition.MASTER_WEIGHTS
  user_inner = check_inner(inner, kind)
  master_dtype = dtypes.read_dtype(master_dtype, "master_dtype", usable=True)
  store = _check_store(store, master_dtype)
  inner = optax.with_extra_args_support(inner)

  def kept(path: Any, p: Any) -> Any:
    """What the state keeps of parameter `p` at init: its master copy, remainder or None."""
    if not _has_master(p, master_dtype):
      return None
    p = jnp.asarray(p)
    if store == "copy":
      return p.astype(master_dtype)
    if p.dtype != _BF16:
      raise ValueError(
        "master_weights(store='remainder') completes bfloat16 parameters to their float32"
        f" master; the parameter at {jax.tree_util.keystr(path) or '<root>'} is {p.dtype},"
        " which is not the top half of a float32 (no 16 bits complete it). Use"
        " store='copy' (the default), or keep it in bfloat16 or float32."
      )
    return jnp.zeros(p.shape, jnp.int16)  # p.astype(float32) has 16 zero low bits

  def init_fn(params: optax.Params) -> MasterWeightsState:
    params_check.check_params_are_arrays(params, "master_weights.init")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    masters = [kept(path, p) for path, p in flat]
    on_master = [
      p if m is None else m if store == "copy" else jnp.asarray(p).astype(master_dtype)
      for (_, p), m in zip(flat, masters, strict=True)
    ]
    return MasterWeightsState(
      inner_state=inner.init(treedef.unflatten(on_master)), master=treedef.unflatten(masters)
    )

  composition.register_init(init_fn, kind)

  def compute(
    grads: Any, state: Any, params: Any, extra_args: dict[str, Any], fused: bool
  ) -> tuple[list[Any], list[Any], MasterWeightsState, list[Any]]:
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
      if m is None:
        continue
      if store == "copy" and _has_master(p, np.dtype(m.dtype)):
        continue
      if store == "remainder" and np.dtype(jnp.result_type(p)) == _BF16:
        continue
      what = f"a {m.dtype} master copy" if store == "copy" else "the 16-bit remainder"
      raise TypeError(
        f"master_weights keeps {what} of the parameter at"
        f" {jax.tree_util.keystr(path) or '<root>'}, which is now"
        f" {jnp.result_type(p)}: something cast it up since init. Its updates are"
        " float32; optax.apply_updates casts the sum back to the parameter's dtype,"
        " eqx.apply_updates does not: step with ols.apply_gradients(tx, grads, state,"
        " params), which writes the parameters in their own dtype."
      )
    promoted = [
      g if m is None or g is None else rounding.cast(g, master_dtype)
      for g, m in zip(treedef.flatten_up_to(grads), masters, strict=True)
    ]
    on_master = [
      p if m is None else m if store == "copy" else rounding.join_bfloat16(p, m)
      for p, m in zip(leaves, masters, strict=True)
    ]
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
    new_params, own_updates, new_master = [], [], []
    split = [k for k, m in enumerate(masters) if m is not None and store != "copy"]
    wait = {
      k: None if j is None else split[j]
      for k, j in zip(split, schedule.waits([np.size(leaves[k]) for k in split]), strict=True)
    }
    remainders: dict[int, jax.Array] = {}
    last: list[jax.Array] = []  # what reads the old inner state, written before its codes
    for k, (p, m, s, u) in enumerate(zip(leaves, masters, stepped, updates, strict=True)):
      if m is None:
        new_params.append(s)
        new_master.append(None)
        last.append(s)
      elif store == "copy":
        new_params.append(_written(s, jnp.result_type(p)))
        new_master.append(s)
        last.append(s)  # (the parameter is written from the new master, not the state)
      else:
        # Computed once into a buffer, which both halves read: each half recomputing it
        # would read the old parameter and remainder that the other overwrites. One
        # leaf after another (after an earlier remainder, written by a loop of its own,
        # `schedule.waits`): the 32-bit buffers of a window of leaves are live at once.
        earlier = wait[k]
        s = schedule.materialized(
          s if earlier is None else schedule.after(s, [remainders[earlier]])
        )
        param, remainder = rounding.split_bfloat16(s)
        remainder = schedule.materialized(remainder)
        remainders[k] = remainder
        new_params.append(param)
        new_master.append(remainder)
        # Both halves read the materialized master, not the inner state: the codes
        # wait for the remainder (an int16 array, read from its own buffer).
        last.append(remainder)
      own_updates.append(u if m is None else None)
    return (
      new_params,
      own_updates,
      MasterWeightsState(inner_state=inner_state, master=treedef.unflatten(new_master)),
      last,
    )

  update_fn = param_write.attach_write(
    kind, compute, {"inner": user_inner, "master_dtype": master_dtype, "store": store}
  )
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
