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
optimizer's structure: only the dtypes of the chosen leaves change, or, for
a quantized format ('q8', 'fp8': one byte per element and a float32 scale
per block of 256, `storage/quantize.py`), a leaf becomes a
`QuantizedArray` of codes and scales, dequantized to float32 for the update
and quantized again after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._src.step import conditional_step
from optax_lossscale._src.storage import param_write, quantize, rounding, schedule
from optax_lossscale._src.utils import dtypes as dtypes_lib

_ACCEPTED = (
  "a floating dtype or a format 'q8' or 'fp8' (for every floating leaf of the state), a"
  " mapping from state field names to those (e.g. {'mu': 'q8', 'nu': jnp.float32}), or a"
  " function (path, leaf) -> dtype, format or None"
)
_FORMATS = "a format 'q8' or 'fp8'"

Dtypes = Any | Mapping[str, Any] | Callable[[tuple[Any, ...], Any], Any]
Storage = np.dtype | str | None  # a dtype, a format of `quantize.FORMATS`, or as it is


def _storage(value: Any, what: str) -> np.dtype | str:
  """A dtype or a quantized format, read from `value`, or an error naming `what`."""
  if isinstance(value, str) and value in quantize.FORMATS:
    return value
  return dtypes_lib.read_dtype(value, what, usable=True, extra=_FORMATS)


def _check_dtypes(dtypes: Any) -> Any:
  if isinstance(dtypes, Mapping):
    if not dtypes:
      raise ValueError(f"dtypes must be {_ACCEPTED}; got an empty mapping.")
    for name in dtypes:
      if not isinstance(name, str):
        raise ValueError(f"dtypes must be {_ACCEPTED}; got the key {name!r}, not a name.")
    return {name: _storage(value, f"dtypes[{name!r}]") for name, value in dtypes.items()}
  if isinstance(dtypes, (str, np.dtype, type)):
    return _storage(dtypes, "dtypes")
  if callable(dtypes):
    return dtypes
  raise ValueError(f"dtypes must be {_ACCEPTED}; got {dtypes!r}.")


def _key_name(key: Any) -> Any:
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.DictKey):
    return key.key
  return None


def _is_floating(leaf: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def state_dtypes(
  inner: optax.GradientTransformation, dtypes: Dtypes, *, quantize_min_size: int = 4096
) -> optax.GradientTransformationExtraArgs:
  """Keeps `inner`'s state in the dtypes `dtypes` chooses, leaf kind by leaf kind.

  Chosen floating leaves of the state are stored in their dtype, and cast up
  to float32 (or kept, if wider) for each update, so that `inner` computes
  as usual; after the update they are rounded back (to nearest). Integer
  leaves (step counts) are never cast. The state keeps `inner`'s structure.

  A leaf can also be stored quantized, in one byte per element and a float32
  scale per block of 256 elements (a `QuantizedArray`): `'q8'`, a
  dynamic-exponent code (3 mantissa bits, 8 codes per binade below the
  block's largest magnitude; signed where the block holds a negative value,
  unsigned otherwise, as Adam's second moment), or `'fp8'`, float8_e4m3fn
  values scaled to the block. Both round stochastically (unbiased: a moving
  average in 8 bits follows the float32 one), with bits hashed from each
  element's index, the leaf's path and a count kept with the codes. One
  round trip of an element `x` of a block whose largest magnitude is `a`
  errs by at most `max(2**-3 * |x|, floor * a)`, `floor` 1.9e-5 (signed
  `'q8'`), 2.9e-10 (unsigned) or 4.4e-6 (`'fp8'`), for any `a` in float32's
  range; a nonzero value never becomes zero (but a float32 subnormal, under
  1.2e-38, which XLA:CPU and GPUs flush), and a block whose largest is under
  2**-100 (7.9e-31) is stored as zeros. As in
  bitsandbytes and torchao, a leaf of fewer than `quantize_min_size`
  elements (biases, norms) stays as `inner` built it. The codes are shaped
  and sharded like the leaf; each row of blocks lies within the leaf's
  trailing axes. Stepped by `ols.apply_gradients` (or inside a wrapper, or
  a Flax `TrainState`), quantized state takes a fused step arranged for
  XLA:CPU, which fuses no multiple outputs (one Adam update moves 32.8
  bytes a parameter, against 82.5 unfused, and 40 for float32 Adam); the
  result is that of `tx.update` and `optax.apply_updates`, bit for bit. Its
  loops are bound by arithmetic: on a CPU with AVX-512, compile the step
  with `jax.jit(..., compiler_options={'xla_cpu_prefer_vector_width': 512})`
  (XLA:CPU's vectors are 256 bits by default), which took the q8 Adam
  update from x1.66-x1.99 to x1.34-x1.44 of float32 Adam's time (4M-16M
  parameters), the update's results the same bit for bit.

  Unlike optax's `scale_by_adam(mu_dtype=...)`, which sets the first moment
  of the Adam family only, this works for any optax optimizer and any state
  leaf: Adam's `nu` in float32 next to a bfloat16 `mu`, a momentum `trace`,
  Adafactor's factors, a `named_chain` part by its name.

  With `master_weights`, put it inside: `master_weights(state_dtypes(adam,
  {'mu': 'q8', 'nu': 'q8'}), store='remainder')` holds 6 bytes per bfloat16
  parameter with the parameter, against 12 for float32 Adam. With bfloat16
  parameters and no master copy, `stochastic_rounding(state_dtypes(adam,
  {'nu': jnp.float32}), key)` keeps the second moment in float32.

  Args:
    inner: the transformation whose state to store, e.g. `optax.adam(1e-3)`.
    dtypes: a floating dtype (or a format, `'q8'` or `'fp8'`) for every
      floating leaf of the state; or a mapping from names to those, where a
      leaf takes the choice of the outermost name on its path in the state
      (a NamedTuple field such as `mu`, `nu` or `trace`, or a dict key), and
      unnamed leaves keep theirs; or a function `(path, leaf) -> dtype,
      format or None` (None: keep). A name that matches no floating leaf
      raises a `ValueError` at `init`. Dtypes are read as `ols.Policy` reads
      them (`jnp.bfloat16`, `'bf16'`, `'f32'`, ...).
    quantize_min_size: leaves with fewer elements are not quantized (4096,
      as bitsandbytes and torchao).

  Returns:
    An `optax.GradientTransformationExtraArgs` with `inner`'s state
    structure, a quantized leaf being a `QuantizedArray`.

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
    >>> tx = ols.state_dtypes(optax.adam(1e-3), {'mu': 'q8', 'nu': 'q8'})
    >>> state = tx.init({'w': jnp.ones((64, 256)), 'b': jnp.ones(64)})
    >>> type(state[0].mu['w']).__name__, state[0].mu['b'].dtype  # 'b' is small
    ('QuantizedArray', dtype('float32'))

  References:
    optax's `scale_by_adam(mu_dtype=...)` and its issue #1552; Rae et al.,
    2021 (Gopher), on float32 optimizer state with bfloat16 parameters;
    Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization",
    https://arxiv.org/abs/2110.02861 (bitsandbytes), and torchao's
    `AdamW8bit` and `AdamWFp8`, on blockwise quantized moments.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3));"
      f" got {type(inner).__name__}."
    )
  dtypes = _check_dtypes(dtypes)
  if (
    isinstance(quantize_min_size, (bool, np.bool_))
    or not isinstance(quantize_min_size, (int, np.integer))
    or quantize_min_size < 0
  ):
    raise ValueError(f"quantize_min_size must be an int >= 0; got {quantize_min_size!r}.")
  inner = optax.with_extra_args_support(inner)

  def storage(path: tuple[Any, ...], leaf: Any) -> Storage:
    """The dtype or format a state leaf is stored in, or None to leave it."""
    if not _is_floating(leaf):
      return None
    if isinstance(dtypes, Mapping):
      chosen = next((dtypes[n] for n in map(_key_name, path) if n in dtypes), None)
    elif callable(dtypes) and not isinstance(dtypes, (np.dtype, str)):
      chosen = dtypes(path, leaf)
      chosen = None if chosen is None else _storage(chosen, "the dtype dtypes returned")
    else:
      chosen = dtypes
    if isinstance(chosen, str) and np.size(leaf) < quantize_min_size:
      return None
    return chosen

  def to_compute(state: Any) -> Any:
    def one(path: tuple[Any, ...], leaf: Any) -> Any:
      if quantize.is_quantized(leaf):
        return quantize.decode(leaf.codes, leaf.scales)
      dtype = storage(path, leaf)
      if dtype is None or isinstance(dtype, str):
        return leaf
      return rounding.cast(leaf, jnp.promote_types(dtype, jnp.float32))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=quantize.is_quantized)

  def quantized(state: Any) -> dict[str, quantize.QuantizedArray]:
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=quantize.is_quantized)[0]
    return {jax.tree_util.keystr(k): x for k, x in flat if quantize.is_quantized(x)}

  def salt(name: str) -> np.uint32:
    return np.uint32(zlib.crc32(name.encode()))  # stable across processes, unlike hash()

  def to_storage(
    state: Any, stored: Any = None, extremes: Any = None, counts: Any = None, words: Any = None
  ) -> Any:
    """`state` in its storage; a quantized leaf counts on from the one `stored` held.

    `extremes` (`block_extremes`), `counts` (the new counts) and `words`
    (`quantize.noise_word`) by path, for the quantized leaves, if taken already.
    """
    if counts is None:
      counts = {name: x.count + 1 for name, x in quantized(stored).items()}
    if extremes is None:
      extremes = block_extremes(state)
    one = lambda path, leaf: store_leaf(path, leaf, extremes, counts, words)
    return jax.tree_util.tree_map_with_path(one, state)

  def store_leaf(
    path: tuple[Any, ...], leaf: Any, extremes: Any, counts: Any, words: Any = None
  ) -> Any:
    """One leaf of `to_storage`: the leaf at `path` in its storage."""
    dtype = storage(path, leaf)
    if dtype is None:
      return leaf
    if isinstance(dtype, str):
      name = jax.tree_util.keystr(path)
      count = counts.get(name, 0)
      if name not in extremes:  # a leaf quantized alone (init's, eagerly)
        return quantize.quantize(leaf, dtype, count, salt(name))
      largest, signed = extremes[name]
      word = None if words is None else words[name]
      return quantize.encode_array(leaf, largest, signed, dtype, count, salt(name), word)
    return rounding.cast(leaf, dtype)

  def block_extremes(state: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Each quantized leaf's block extremes, by path: one reduction over the blocks of
    the leaves of one parameter (Adam's two moments: their paths differ only in a
    field name, `mu` and `nu`), which XLA:CPU computes in one pass reading their
    inputs (the gradient) once; the parameters' reductions are independent of
    each other, with two accumulators a leaf."""
    groups: dict[Any, list[tuple[str, jax.Array]]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      if isinstance(storage(path, leaf), str):
        param = tuple(k for k in path if not isinstance(k, jax.tree_util.GetAttrKey))
        key = (tuple(np.shape(leaf)), jax.tree_util.keystr(param))
        groups.setdefault(key, []).append((jax.tree_util.keystr(path), leaf))
    out = {}
    for members in groups.values():
      found = quantize.block_extremes_of([leaf for _, leaf in members])
      out.update(zip([name for name, _ in members], found, strict=True))
    return out

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
    return to_storage(state)

  def step(
    grads: Any, state: Any, params: Any, extra_args: dict[str, Any], apply_to_params: bool
  ) -> tuple[Any, Any]:
    updates, new_state = inner.update(grads, to_compute(state), params, **extra_args)
    stored = quantized(state)
    if not apply_to_params:
      return updates, to_storage(new_state, state)
    if not stored:
      return optax.apply_updates(params, updates), to_storage(new_state, state)
    # The fused step (`ols.apply_gradients`), arranged for XLA:CPU. It fuses no
    # multiple outputs: each full-size output is a fusion of its own that re-reads
    # its inputs (the gradient and the old codes). The block extremes of both
    # moments are one reduction, and the new params are written from the float32
    # moments; the codes are computed from the extremes, which come through an
    # optimization barrier, and written after the new params (`in_turn`, below,
    # one parameter after another): every reader of the old codes comes before the
    # loops that overwrite them in place. (The barrier orders nothing on XLA:CPU,
    # which expands it before its copy removal.) The gradient does not go through
    # the barrier: under `master_weights` it is a float32 conversion of a 16-bit
    # one, which jax 0.12's XLA:CPU then writes out in full (6 more B/param, and
    # every loop reading 4 bytes of it instead of 2: x1.9 the update's time).
    counts = {name: x.count + 1 for name, x in stored.items()}
    words = {name: quantize.noise_word(counts[name], salt(name)) for name in stored}
    if not param_write.nested():
      return in_turn(params, updates, new_state, state, counts, words)
    # Under a writer that returns the parameters, which orders the codes after them.
    extremes = block_extremes(new_state)
    extremes, words = jax.lax.optimization_barrier((extremes, words))
    new_params = optax.apply_updates(params, updates)
    return new_params, to_storage(new_state, state, extremes, counts, words)

  def in_turn(
    params: Any, updates: Any, new_state: Any, stored: Any, counts: Any, words: Any
  ) -> tuple[Any, Any]:
    """The fused step's new parameters and stored state, one parameter after another.

    On XLA:CPU, the loops of each parameter (its moments' block extremes, its
    new value, its moments' codes) wait for the codes of an earlier parameter
    (`schedule.after_whole`): the one before it, or for small parameters the
    one a window of elements before (`schedule.waits`), so that small loops,
    which XLA:CPU runs on one core each, still run two at a time. And the codes
    wait for the new value, which reads the old ones (`schedule.after`): XLA
    then runs a parameter's loops back to back, while the arrays they all
    read, the gradient first, are still in the caches. In
    XLA:CPU's own order the block extremes come first, then every new value,
    then every code: at 16M parameters, where the arrays no longer stay cached
    in between, the codes' loops took twice their time per element
    (`benchmarks/loop_profile.py`). A quantized leaf belongs to the parameter
    whose path ends its own and whose shape it has (Adam's `mu` and `nu` of a
    weight); one that belongs to none is stored after every new value
    (`quantize.codes_after`). Elsewhere than on a CPU, the orders are no-ops.
    """
    p_leaves, p_def = jax.tree.flatten(params)
    u_leaves = p_def.flatten_up_to(updates)
    s_leaves, s_def = jax.tree_util.tree_flatten_with_path(new_state)
    values = [leaf for _, leaf in s_leaves]
    names = [jax.tree_util.keystr(path) for path, _ in s_leaves]
    owner = quantize.owners(params)
    owned: dict[int, list[int]] = {k: [] for k in range(len(p_leaves))}
    for j, (path, leaf) in enumerate(s_leaves):
      if isinstance(storage(path, leaf), str) and names[j] in counts:
        k = owner(path, np.shape(leaf))
        if k is not None:
          owned[k].append(j)
    token = next(iter(counts.values()))
    stepped = [k for k in range(len(p_leaves)) if owned[k]]
    wait = {
      k: None if i is None else stepped[i]
      for k, i in zip(stepped, schedule.waits([np.size(p_leaves[k]) for k in stepped]), strict=True)
    }
    new_params, written = [], {}
    for k, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True)):
      mine = owned[k]
      earlier = wait.get(k)
      if earlier is not None:
        before = [written[j].codes for j in owned[earlier]]
        u, moved = schedule.after_whole((u, [values[j] for j in mine]), before, token)
        for j, v in zip(mine, moved, strict=True):
          values[j] = v
      new = optax.apply_updates(p, u)
      new_params.append(new)
      if not mine:
        continue
      found = quantize.block_extremes_of([values[j] for j in mine])
      found, mine_words = jax.lax.optimization_barrier((found, [words[names[j]] for j in mine]))
      for j, pair, word in zip(mine, found, mine_words, strict=True):
        q = store_leaf(s_leaves[j][0], values[j], {names[j]: pair}, counts, {names[j]: word})
        written[j] = q._replace(codes=schedule.after(q.codes, [new]))
    # The other leaves as `to_storage` stores them; the parameters' own are left out
    # (an empty integer array in their place, which it leaves as it is).
    taken = np.zeros(0, np.int8)
    rest = s_def.unflatten([taken if j in written else v for j, v in enumerate(values)])
    extremes, words = jax.lax.optimization_barrier((block_extremes(rest), words))
    stored_rest = to_storage(rest, stored, extremes, counts, words)
    out, out_def = jax.tree.flatten(stored_rest, is_leaf=quantize.is_quantized)
    new_leaves = [jnp.asarray(x) for x in new_params]
    out = [
      written[j] if j in written else quantize.codes_after(x, new_leaves) for j, x in enumerate(out)
    ]
    return p_def.unflatten(new_params), out_def.unflatten(out)

  update_fn = conditional_step.attach(step, {"kind": "state_dtypes", "inner": inner})

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
