"""`stochastic_rounding`: 16-bit parameters that learn, with no master copy.

A bfloat16 weight near 1.0 rounds every update below 2**-8 away. Rounded
stochastically instead, it moves by a whole ulp with the probability the
update is of an ulp, so it moves by the update on average (Gupta et al.
2015; Zamirai et al. 2020, "Revisiting BFloat16 Training"):

  updates, inner_state = inner.update(f32(grads), f32(inner_state), f32(params))
  inner_state = inner_state stored back in its dtypes      (round to nearest)
  step_key, key = split(key)
  words = bits(step_key, (number of rounded leaves, 2))      (one draw a step)
  for each bfloat16 or float16 parameter p (the j-th rounded leaf):
    new = p.astype(float32) + updates
    bits = hash(index of each element, words[j])
    p = round_with_bits(new, bits, p.dtype)                 (E[p] = new)

The state holds `inner`'s state (of the parameters' dtypes, as without this
wrapper) and the key: nothing of the parameters' size is added. The key
advances once per applied step; inside `loss_scale_optimizer` or
`skip_bad_steps` a skipped step leaves it, like any inner state, untouched.

The random bits are not threefry's: drawing 32 of them per parameter cost
6 to 8 times the rest of the step on a CPU. Rounding needs bits that are
uniform for each element and look independent between elements and steps,
not a cryptographic generator: `rounding.hash_bits` mixes each element's
index with two words drawn (by the key's own generator) for each leaf and
step, 7 to 50 times cheaper than threefry on a CPU, and exactly uniform for each
element over the seeds. The words of every leaf come from one draw: on a CPU
each draw is a small loop of its own, and a draw per leaf (a `fold_in`, then
two words) took 1.3 ms a step for 256 leaves, one draw for all 0.06 ms.
Inside `shard_map`, the leaves that vary over the same mesh axes share a draw
from the step key with those axes' indices folded in (each shard its own
bits); a replicated leaf's words are the same on every device, so it stays
replicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._src.step import composition, skip_branch
from optax_lossscale._src.storage import master_weights as master_lib
from optax_lossscale._src.storage import param_write, quantize, rounding, schedule
from optax_lossscale._src.utils import params_check


class StochasticRoundingState(NamedTuple):
  """State of `stochastic_rounding`.

  Attributes:
    inner_state: the wrapped transformation's state, built on the parameters
      as they are (bfloat16 parameters give `optax.adam` bfloat16 moments;
      see `state_dtypes` to keep some in float32).
    key: the PRNG key of the next applied step, as raw uint32 key data
      (`jax.random.key_data`), so that every checkpointer stores it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.stochastic_rounding(optax.sgd(1e-3), key=0)
    >>> state = tx.init({'w': jnp.ones(2, jnp.bfloat16)})
    >>> state.key.dtype, state.key.shape
    (dtype('uint32'), (2,))
  """

  inner_state: optax.OptState
  key: jax.Array


def _check_key(key: Any) -> Any:
  """Validates `key` at construction: a typed key, a raw uint32 key or an int seed."""
  accepted = (
    "a PRNG key (jax.random.key(0), or a raw uint32 key such as jax.random.PRNGKey(0)) or"
    " an int seed"
  )
  if isinstance(key, (bool, np.bool_)):
    raise ValueError(f"key must be {accepted}; got {key!r}.")
  if isinstance(key, (int, np.integer)):
    if not 0 <= int(key) < 2**63:
      raise ValueError(f"key must be {accepted}; got the seed {key!r}, outside [0, 2**63).")
    return int(key)
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if shape == ():
      return key
  elif dtype is not None and np.dtype(dtype) == np.uint32 and shape == (2,):
    return key
  elif dtype is not None and jnp.issubdtype(dtype, jnp.integer) and shape == ():
    return key  # a seed held in an array (a traced one too)
  raise ValueError(
    f"key must be {accepted}, one key (not a batch of them); got"
    f" {type(key).__name__}{f' of dtype {dtype} and shape {shape}' if dtype else ''}."
  )


def _is_typed(key: Any) -> bool:
  return hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)


def _key_data(key: Any) -> jax.Array:
  """The raw uint32 data of a key checked by `_check_key` (a seed makes a default key)."""
  if _is_typed(key):
    return jax.random.key_data(key)
  if hasattr(key, "dtype") and np.dtype(key.dtype) == np.uint32 and key.shape == (2,):
    return jnp.asarray(key)  # (a uint32 scalar is a seed, as any integer scalar)
  return jax.random.key_data(jax.random.key(key))


def _rounded(leaf: Any, path: Any) -> bool:
  """Whether a parameter is rounded stochastically; raises for a dtype it cannot round to."""
  dtype = np.dtype(jnp.result_type(leaf))
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
    return False
  if dtype not in rounding.SUPPORTED:
    raise ValueError(
      "stochastic_rounding rounds bfloat16 and float16 parameters; the parameter at"
      f" {jax.tree_util.keystr(path) or '<root>'} is {dtype}. Keep it in one of those"
      " dtypes, or out of the tree this transformation steps."
    )
  return True


def stochastic_rounding(
  inner: optax.GradientTransformation, key: Any
) -> optax.GradientTransformationExtraArgs:
  """Writes each 16-bit parameter as its float32 update, rounded stochastically.

  Runs `inner` in float32 on the parameters, the gradients and its state
  (stored back in the dtypes `inner.init` gave it, so bfloat16 parameters
  keep bfloat16 moments), computes each bfloat16 or float16 parameter's new
  value in float32 (`p + update`) and rounds it stochastically to the
  parameter's dtype (as `ols.stochastic_round` does): up or down, with the
  expected value the float32 result, so updates far below half an ulp still
  move the parameter on average. Wider parameters are stepped as `inner`
  steps them; an integer or bool gradient raises a `TypeError` naming it.
  No copy of the parameters is kept: the state is `inner`'s and one key.

  The key advances once per applied step and is folded with each leaf's
  index, so every leaf gets its own bits: a hash of each element's index
  keyed by two words drawn from that key (cheaper than drawing every bit
  from the key; uniform for each element, and, by the statistical checks of
  the tests, as good as independent between elements and steps; elements
  2**32 apart in one leaf would share bits). Under `jit` over a mesh each
  shard hashes its own elements where it lives: the same bits as on one
  device. Inside `shard_map`, a parameter varying over mesh axes also folds
  in its shard's `axis_index` along them (a replicated one does not, so its
  replicas stay equal): reproducible for a given mesh.

  The write is exact (the rounded value, bit for bit) through
  `ols.apply_gradients`, `optax_lossscale.flax.TrainState` and an outer
  wrapper; through `tx.update` and `optax.apply_updates` the updates are
  float32, with the caveat of `master_weights` (the sign of a zero; a
  parameter that shrinks by over 2**15 in one step). Put it inside the
  wrappers, `loss_scale_optimizer(stochastic_rounding(inner, key))`, so that
  a skipped step leaves the key untouched; the other order is refused, as
  is a transformation after it in a chain.

  Args:
    inner: the transformation to run, e.g. `optax.adam(1e-3)`.
    key: a PRNG key (`jax.random.key(0)`, or a raw uint32 key such as
      `jax.random.PRNGKey(0)`) or an int seed: the same key gives the same
      run, bit for bit.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `StochasticRoundingState`; `ols.apply_gradients(tx, ...)` writes the
    parameters in the same step.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> params = {'w': jnp.ones(1000, jnp.bfloat16)}
    >>> grads = {'w': jnp.ones(1000, jnp.bfloat16)}
    >>> tx = ols.stochastic_rounding(optax.sgd(1e-3), key=0)
    >>> state = tx.init(params)
    >>> for _ in range(10):
    ...   params, state = ols.apply_gradients(tx, grads, state, params)
    >>> round(float(params['w'].astype(jnp.float32).mean()), 2)  # 1 - 10 * 1e-3 on average
    0.99

  References:
    Gupta et al., 2015, "Deep Learning with Limited Numerical Precision",
    https://arxiv.org/abs/1502.02551; Zamirai et al., 2020, "Revisiting
    BFloat16 Training", https://arxiv.org/abs/2010.06192; Salmon et al.,
    2011, "Parallel Random Numbers: As Easy as 1, 2, 3" (counter-based
    generators); Appleby's MurmurHash3 finalizer (the hash's mixing step).
  """
  kind = composition.STOCHASTIC_ROUNDING
  user_inner = master_lib.check_inner(inner, kind)
  key = _check_key(key)
  # A typed key names its implementation (threefry, rbg, ...); a seed or raw key is the
  # default's. Read off the dtype: no backend is started here.
  impl = jax.random.key_impl(key) if _is_typed(key) else None
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> StochasticRoundingState:
    params_check.check_params_are_arrays(params, "stochastic_rounding.init")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      _rounded(leaf, path)
    # Fresh buffers: a donated state must not delete the caller's key.
    return StochasticRoundingState(
      inner.init(params), jnp.array(_key_data(key), jnp.uint32, copy=True)
    )

  composition.register_init(init_fn, kind)

  def compute(
    grads: Any, state: Any, params: Any, extra_args: dict[str, Any], fused: bool
  ) -> tuple[list[Any], list[Any], StochasticRoundingState, list[Any]]:
    del fused  # the new values are computed from the updates, so inner always updates
    if not isinstance(state, StochasticRoundingState):
      raise TypeError(
        "stochastic_rounding's update expects the StochasticRoundingState that its init"
        f" returned; got {type(state).__name__}. Pass this transformation's state,"
        " opt_state = tx.init(params) with tx the stochastic_rounding transformation."
      )
    params_check.check_float_grads(
      grads, "stochastic_rounding", "It has no float32 value to round."
    )
    params_check.check_params_are_arrays(params, "stochastic_rounding.update")
    # The inner transformation computes in float32 (16-bit arithmetic is no more
    # exact, and on a CPU slower); its state is stored back in its own dtypes.
    updates, inner_state = inner.update(
      _widened(grads), _widened(state.inner_state), _widened(params), **extra_args
    )
    inner_state = jax.tree.map(
      _narrowed, inner_state, state.inner_state, is_leaf=quantize.is_quantized
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    typed = jax.random.wrap_key_data(state.key, **({} if impl is None else {"impl": impl}))
    step_key, next_key = jax.random.split(typed)
    leaves = list(zip(flat, treedef.flatten_up_to(updates), strict=True))
    rounds = [_rounded(p, path) for (path, p), _ in leaves]
    seeds = _leaf_seeds(
      step_key, [jnp.asarray(p) for ((_, p), _), r in zip(leaves, rounds, strict=True) if r]
    )
    new_params, own_updates = [], []
    for ((_, p), u), r in zip(leaves, rounds, strict=True):
      if not r:
        new_params.append(optax.apply_updates(p, u))
        own_updates.append(u)
        continue
      p = jnp.asarray(p)
      exact = rounding.cast(p, jnp.float32) + jnp.asarray(u).astype(jnp.float32)
      seed = next(seeds)
      bits = rounding.hash_bits(seed, p.shape, rounding.explicit_sharding(p))
      # Its loop ends in the rounding's select in the parameter's dtype (see
      # `round_with_bits`), which XLA:CPU does not repeat in the one-element read the
      # state waits for (`schedule.after`).
      new_params.append(rounding.round_with_bits(exact, bits, p.dtype))
      own_updates.append(None)
    inner_state = _after_their_parameters(inner_state, params, new_params, own_updates)
    new_state = StochasticRoundingState(inner_state, jax.random.key_data(next_key))
    return new_params, own_updates, new_state, new_params

  update_fn = param_write.attach_write(kind, compute, {"inner": user_inner})
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _after_their_parameters(
  state: Any, params: Any, new_params: list[Any], own_updates: list[Any]
) -> Any:
  """`state`, each leaf written after the rounded new parameter it belongs to.

  A new parameter reads the old state (its float32 update comes from it); written
  after it, the state overwrites its donated buffers in place instead of copies
  (`schedule.after`). A leaf of a parameter's own (Adam's `mu` and `nu` of a weight,
  `quantize.owners`) waits for that parameter only, so that XLA:CPU can step one leaf
  after another while its gradient and moments are still cached: on 64 leaves of
  256 x 256, a barrier after every parameter cost x1.3 of `master_weights`' time.
  Any other leaf (a count) waits for every rounded parameter.
  """
  rounded = [n for n, u in zip(new_params, own_updates, strict=True) if u is None]
  owner = quantize.owners(params)

  def one(path: tuple[Any, ...], x: Any) -> Any:
    k = owner(path, x.shape if quantize.is_quantized(x) else np.shape(x))
    if k is None:
      return schedule.after(x, rounded)
    return schedule.after(x, [new_params[k]] if own_updates[k] is None else [])

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=quantize.is_quantized)


def _widened(tree: Any) -> Any:
  """`tree` with its floating leaves narrower than float32 in float32 (quantized ones kept)."""

  def one(x: Any) -> Any:
    if quantize.is_quantized(x) or not hasattr(x, "dtype"):
      return x
    if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype).itemsize < 4:
      return rounding.cast(x, jnp.float32)
    return x

  return jax.tree.map(one, tree, is_leaf=quantize.is_quantized)


def _narrowed(new: Any, old: Any) -> Any:
  """A new state leaf back in the dtype of the old one (round to nearest)."""
  if quantize.is_quantized(new) or not hasattr(old, "dtype") or not hasattr(new, "dtype"):
    return new
  return rounding.cast(new, old.dtype) if new.dtype != old.dtype else new


def _leaf_seeds(step_key: jax.Array, params: list[Any]) -> Iterator[jax.Array]:
  """Two uint32 words for each of `params`, in order: one draw for all of them, or
  inside `shard_map` one per set of mesh axes that parameters vary over, with the
  shard's index on each of those axes folded into its key."""
  groups: dict[tuple[Any, ...], list[int]] = {}
  for j, p in enumerate(params):
    groups.setdefault(tuple(sorted(skip_branch.varying_axes(p), key=str)), []).append(j)
  if len(groups) <= 1:
    keys = [step_key] * len(groups)
  else:
    keys = list(jax.random.split(step_key, len(groups)))
  seeds: list[Any] = [None] * len(params)
  for key, (axes, members) in zip(keys, groups.items(), strict=True):
    for axis in axes:
      key = jax.random.fold_in(key, jax.lax.axis_index(axis))
    words = jax.random.bits(key, (len(members), 2), jnp.uint32)
    for row, j in enumerate(members):
      seeds[j] = words[row]
  return iter(seeds)
