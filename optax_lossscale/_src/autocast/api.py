"""`autocast`: run any JAX function in mixed precision, deciding the dtype op by op.

jmp's policy casts parameters and inputs by hand, so every op then runs in
half precision, the overflow-prone ones included; `torch.autocast` decides
per op instead. `autocast` does that for JAX, on the function's jaxpr, so it
needs nothing from the model's framework (raw JAX, Flax Linen and NNX,
Equinox alike)::

  jaxpr = make_jaxpr(fun)(*arrays in args)          # the function as written
  for each equation, by the rule of its primitive:  # autocast_rules
    matrix products, convolutions  -> compute dtype, float32 accumulation
    exp, log, sums, ...            -> float32
    everything else                -> the widest floating dtype of its inputs
  outputs                          -> the policy's output dtype

It runs when `fun` is traced: under `jit` a compiled step calls none of it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
import functools
from typing import Any
import warnings

import jax
import numpy as np

from optax_lossscale._src.autocast import fp8 as fp8_lib
from optax_lossscale._src.autocast import fp8_choice, loop, report
from optax_lossscale._src.autocast import interpreter as interp
from optax_lossscale._src.autocast import rules as rules_lib
from optax_lossscale._src.utils import policy as policy_lib


def _check_rules(rules: Mapping[str, str] | None) -> dict[str, str]:
  if rules is None:
    return {}
  if not isinstance(rules, Mapping):
    raise TypeError(
      f"rules must be a mapping of primitive names to kinds; got {type(rules).__name__}."
    )
  for name, kind in rules.items():
    if not isinstance(name, str) or kind not in rules_lib.KINDS:
      raise ValueError(
        f"rules maps primitive names (str) to one of {sorted(rules_lib.KINDS)}; got"
        f" {name!r}: {kind!r}."
      )
  return dict(rules)


def _check_compute_dtype(dtype: np.dtype) -> None:
  """A compute dtype autocast can run products in: float16, bfloat16, float32, float64."""
  if dtype.itemsize == 1:
    raise ValueError(
      f"autocast's compute dtype is {dtype.name}, an 8-bit float: products whose values pass"
      " its range (448 for float8_e4m3fn) would be NaN. Use a 16-bit compute dtype (c=bf16 or"
      " c=f16) with autocast's fp8= argument, which scales each operand into fp8's range."
    )
  if dtype == np.float64 and not jax.config.jax_enable_x64:
    raise ValueError(
      "autocast's compute dtype is float64, but JAX runs without 64-bit types"
      " (jax_enable_x64 is False), so it would compute in float32. Enable x64"
      " (jax.config.update('jax_enable_x64', True)) or use c=f32."
    )


def make_context(
  compute_dtype: Any,
  rules: Mapping[str, str] | None,
  fp8: str | None = None,
  unknown_primitives: str = "warn",
  fp8_products: Any = "auto",
) -> interp.Context:
  """The interpreter's context: dtype, extra rules, fp8 recipe and products, unknown primitives."""
  extra = _check_rules(rules)
  table = {**rules_lib.RULES, **{n: rules_lib.KINDS[k] for n, k in extra.items()}}
  # A primitive given a rule by the user is a region boundary: it may have no
  # JVP or lowering rule (a region is differentiated and compiled as a whole).
  fusible = set(rules_lib.FUSIBLE) - set(extra)
  return interp.Context(
    np.dtype(compute_dtype), table, frozenset(fusible), fp8, fp8_products, unknown_primitives
  )


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(
  fun: Callable[..., Any],
  policy: policy_lib.Policy | str,
  *,
  rules: Mapping[str, str] | None = None,
  fp8: str | None = None,
  unknown_primitives: str = "warn",
  fp8_products: str | Callable[[fp8_choice.Product], bool] = "auto",
) -> Callable[..., Any]:
  r"""Returns `fun` running in mixed precision, the dtype of every op decided on its jaxpr.

  Write the function in float32; `autocast` picks, per primitive of its jaxpr,
  the way a fused kernel computes (float32 inside, 16 bits at its edges):

  - matrix products and convolutions (`dot_general`, `conv_general_dilated`,
    `ragged_dot_general`) take their floating operands in the policy's
    compute dtype, accumulate in float32 and return the type the function
    declared (float32; the compute dtype where only products read it, as they
    round it anyway); in the backward pass too (under `jax.grad` of the
    returned function), where JAX alone would run them in float32;
  - every op that rounds (arithmetic, `exp`, `log`, sums, the statistics of
    normalisation and softmax, the losses) computes in float32;
  - exact ops (data movement, comparisons, `max`, `select`) keep their
    inputs' widest floating dtype; integer, boolean and key work is
    untouched; complex values are never cast to a real dtype;
  - what the backward pass keeps of the activations is their 16-bit copy:
    each run of elementwise work between two products is a region whose
    backward pass recomputes from its 16-bit inputs (parameters,
    statistics and small values are kept exact).

  The real floating outputs are cast to the policy's output dtype. Parameters
  are not cast (store them in `param_dtype` yourself, e.g.
  `policy.cast_to_param`); a product casts them where they are used, so with
  float32 params the gradients are float32. Explicit casts in `fun` are kept;
  fp8 products (an fp8 layer's own) run as written.

  It goes through `jit` (a sub-program with products stays a cached `jit`),
  `jax.checkpoint` (the same policy), `cond`/`switch`, `while_loop` and `scan`
  (a loop carry keeps one dtype, the wider of what enters and what the body
  returns), `custom_jvp` (the body is interpreted, the rule kept and
  interpreted alike), `custom_vjp` (body and rules interpreted, rules kept) and
  `shard_map`, and composes with `jit`, `grad`, `vmap`, `jvp` and
  `ols.value_and_grad`. A primitive without a rule (a new jax release's, a
  library's own) runs as written, its inputs cast back to the dtypes the
  function declares, and `autocast` warns once per primitive, naming it;
  `rules={'name': kind}` gives it a rule, kind one of 'compute', 'float32',
  'widest', 'as_written', 'independent'.

  Arrays among the arguments (any pytree leaf that is a JAX or NumPy array)
  are traced; other leaves (Python numbers, strings, config objects) are
  static. A mutable argument that `fun` updates in place (an NNX module's
  BatchNorm statistics or RNG counts) is updated in the caller's object, in
  the dtype `fun` gave it. A function that does not trace as written because
  16-bit arguments meet float32 ones (16-bit Equinox weights, float32 data)
  is traced with those arguments as float32 and run on the 16-bit values.

  The work happens when `fun` is traced; under `jit` the compiled function
  runs none of this package's Python. Called eagerly, `fun` is traced on every
  call: wrap the step in `jax.jit`.

  Args:
    fun: the function, written in float32.
    policy: a `Policy`, or a string `get_policy` reads, e.g.
      `'p=f32,c=f16,o=f32'` (compute in float16, return float32).
    rules: extra or overriding entries of the table, primitive name to kind.
    fp8: None, or 'tensorwise' or 'rowwise': the matrix products
      (`dot_general`) `fp8_products` chooses run on fp8 operands with float32
      accumulation, forward (`float8_e4m3fn`) and backward (the gradient in
      `float8_e5m2` tensorwise, `float8_e4m3fn` rowwise), each operand scaled
      by its current amax, one scale per tensor or one power-of-two scale per
      row (docs/guides/fp8_autocast.md). Where it chooses none, a warning
      says so, once per function.
    unknown_primitives: what a primitive without a rule does: 'warn' (the
      default) runs it as written (its inputs in the dtypes the function
      declares, its outputs as it returns them) and warns once per primitive
      per process, naming the `rules=` entry that keeps its 16-bit work in 16
      bits; 'error' raises `UnknownPrimitiveError` when `fun` is traced.
    fp8_products: which products run in fp8, of those whose operands are 16-
      or 32-bit floats and whose dimensions are all at least 16: 'auto' (a
      cost model of an H100 predicts fp8 faster, forward and backward), 'all'
      (every one: to study fp8's numerics on a small model), or a callable
      taking an `fp8_choice.Product` (`name`: its module path from the jaxpr's name
      stack, e.g. 'MLP/Dense_0'; `dims`: `(batch, m, n, k)`; `dtypes`;
      `speedup`: the model's prediction) and returning whether it runs in fp8,
      as torchao's `module_filter_fn`. Chosen when `fun` is traced;
      `ols.autocast_report` shows each product's verdict and its reason.

  Returns:
    A function with `fun`'s signature.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   return jnp.mean(jax.nn.softmax(x @ w) ** 2)
    >>> mixed = ols.autocast(loss, 'p=f32,c=f16,o=f32')
    >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    >>> mixed(w, x).dtype
    dtype('float32')
    >>> import re  # the operands of every product, forward and backward:
    >>> hlo = jax.jit(jax.grad(mixed)).lower(w, x).as_text()
    >>> re.findall(r'dot_general.*\((tensor<[^)]*)\) ->', hlo)
    ['tensor<2x4xf16>, tensor<4x3xf16>', 'tensor<2x3xf16>, tensor<2x4xf16>']

  References:
    PyTorch, "Automatic Mixed Precision package - torch.amp",
    https://pytorch.org/docs/stable/amp.html;
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable; got {type(fun).__name__}.")
  if not isinstance(policy, (policy_lib.Policy, str)):
    raise TypeError(
      "policy must be an ols.Policy or a policy string such as 'p=f32,c=f16,o=f32'; got"
      f" {type(policy).__name__}."
    )
  if fp8 is not None and fp8 not in fp8_lib.RECIPES:
    raise ValueError(f"fp8 must be None or one of {fp8_lib.RECIPES}; got {fp8!r}.")
  if unknown_primitives not in interp.UNKNOWN_PRIMITIVES:
    raise ValueError(
      f"unknown_primitives must be one of {interp.UNKNOWN_PRIMITIVES}; got {unknown_primitives!r}."
    )
  fp8_choice.check_products(fp8_products)
  policy = policy_lib.get_policy(policy)
  _check_compute_dtype(np.dtype(policy.compute_dtype))
  ctx = make_context(policy.compute_dtype, rules, fp8, unknown_primitives, fp8_products)
  warned: list[bool] = []

  @functools.wraps(fun)
  def mixed(*args: Any, **kwargs: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    traced = [i for i, x in enumerate(leaves) if _is_array(x)]
    changed: list[int] = []

    def flat_fun(*arrays: Any) -> tuple[Any, list[Any]]:
      local = list(leaves)
      for i, x in zip(traced, arrays, strict=True):
        local[i] = x
      inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, local)
      out = fun(*inner_args, **inner_kwargs)
      try:
        after = jax.tree_util.tree_leaves((inner_args, inner_kwargs))
      except ValueError:  # an argument that refuses a second read once used (Equinox's
        changed[:] = []  # State): fun returns its new value, nothing to write back
        return out, []
      if len(after) != len(leaves):
        raise ValueError(
          "autocast: fun changed the structure of its arguments in place; it may update"
          " their arrays, not add or remove them."
        )
      changed[:] = [k for k, i in enumerate(traced) if after[i] is not arrays[k]]
      return out, [after[traced[k]] for k in changed]

    _check_compute_dtype(np.dtype(policy.compute_dtype))
    arrays = [leaves[i] for i in traced]
    closed, (out_shape, update_shape), promoted = _trace(flat_fun, arrays)
    report.called()
    with interp.scope(), report.recording() as rows:
      flat = loop.eval_jaxpr(ctx, closed.jaxpr, closed.consts, arrays)
    quiet = warned or report.reporting() or any(r.fp8 for r in rows.values())
    if fp8 is not None and not quiet:
      warned.append(True)
      _warn_no_fp8(fun, fp8, fp8_products, list(rows.values()))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    outs, updates = flat[: len(out_leaves)], flat[len(out_leaves) :]
    if changed:
      # An update is stored in the dtype the function gave it (an int stays an int), a
      # 16-bit argument traced as float32 in its own dtype.
      dtypes = [
        arrays[k].dtype if promoted[k] else s.dtype
        for k, s in zip(changed, update_shape, strict=True)
      ]
      updates = [interp.cast(u, d) for u, d in zip(updates, dtypes, strict=True)]
      _write_back((args, kwargs), [traced[k] for k in changed], updates)
    outs = [interp.cast(o, policy.output_dtype) if interp.is_real_float(o) else o for o in outs]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return mixed


def _warn_no_fp8(fun: Any, fp8: str, products: Any, rows: list[report.ProductRow]) -> None:
  """Says that `fp8=` changed nothing in `fun`, and why, product by product in brief."""
  reasons = collections.Counter(
    "cost model below x1" if r.reason.startswith("cost model") else repr(r.reason) for r in rows
  )
  why = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common()) or "none"
  name = getattr(fun, "__qualname__", None) or type(fun).__name__
  warnings.warn(
    f"autocast(fp8={fp8!r}, fp8_products={products!r}): no matrix product of {name} runs in"
    f" fp8; of its {len(rows)} products: {why}. It runs in the compute dtype."
    " fp8_products='all' puts every product whose dimensions allow it (all at least"
    f" {fp8_choice.MIN_DIMENSION}) in fp8; ols.autocast_report(f, *args) lists each product.",
    stacklevel=3,
  )


def _trace(flat_fun: Callable[..., Any], arrays: list[Any]) -> tuple[Any, Any, list[bool]]:
  """`fun`'s jaxpr, as written; or, when it cannot trace, with its 16-bit arrays as float32.

  A function fed 16-bit parameters and a float32 input (an Equinox model cast
  to bfloat16, called on float32 data) may not trace at all: JAX refuses a
  convolution of mixed dtypes. `torch.autocast` runs such a model; so does
  `autocast`: it traces the function with those arrays presented as float32
  (the float32 program the user meant) and runs it on the 16-bit values.
  Returns the closed jaxpr, the output and update shapes, and which arrays
  were presented as float32.
  """
  try:
    closed, shapes = jax.make_jaxpr(flat_fun, return_shape=True)(*arrays)
    return closed, shapes, [False] * len(arrays)
  except TypeError as error:
    promoted = [interp.is_real_float(a) and interp.dtype_of(a).itemsize < 4 for a in arrays]
    if not any(promoted):
      raise
    avals = [
      jax.ShapeDtypeStruct(np.shape(a), np.float32) if p else a
      for a, p in zip(arrays, promoted, strict=True)
    ]
    try:
      closed, shapes = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
    except Exception:
      raise error from None
    return closed, shapes, promoted


def _write_back(root: Any, positions: list[int], values: list[Any]) -> None:
  """Stores the arrays `fun` updated in place into the caller's argument objects.

  Each (already in the dtype the function gave it: a float32 BatchNorm
  statistic stays float32) is set on its parent container, found by its
  path: an attribute (`setattr`, or an NNX variable's `set_value`) or a dict
  or list entry.
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(root)[0]]
  for position, value in zip(positions, values, strict=True):
    path = paths[position]
    parent = root
    try:
      for key in path[:-1]:
        parent = _child(parent, key)
      _set_child(parent, path[-1], value)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
      raise ValueError(
        f"autocast: fun updated the argument array at {jax.tree_util.keystr(path)} in place,"
        f" and it cannot be written back to the caller's object ({e}). Return the new"
        " value from fun instead."
      ) from e


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  raise TypeError(f"no way to follow the path key {key!r}")


def _set_child(node: Any, key: Any, value: Any) -> None:
  if isinstance(key, jax.tree_util.GetAttrKey):
    setter = getattr(node, "set_value", None)
    if key.name == "value" and callable(setter):  # NNX variables (flax >= 0.12)
      setter(value)
    else:
      setattr(node, key.name, value)
  elif isinstance(key, jax.tree_util.DictKey) and isinstance(node, dict):
    node[key.key] = value
  elif isinstance(key, jax.tree_util.SequenceKey) and isinstance(node, list):
    node[key.idx] = value
  else:
    raise TypeError(f"{type(node).__name__} cannot be updated at {key!r}")
