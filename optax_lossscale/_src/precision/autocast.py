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

from collections.abc import Callable, Mapping
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.precision import autocast_interpreter as interp
from optax_lossscale._src.precision import autocast_rules
from optax_lossscale._src.precision import fp8_product as fp8_lib  # fp8 hook
from optax_lossscale._src.precision import policy as policy_lib


def _check_rules(rules: Mapping[str, str] | None) -> dict[str, interp.Rule]:
  if rules is None:
    return {}
  if not isinstance(rules, Mapping):
    raise TypeError(
      f"rules must be a mapping of primitive names to kinds; got {type(rules).__name__}."
    )
  checked = {}
  for name, kind in rules.items():
    if not isinstance(name, str) or kind not in interp.KINDS:
      raise ValueError(
        f"rules maps primitive names (str) to one of {sorted(interp.KINDS)}; got"
        f" {name!r}: {kind!r}."
      )
    checked[name] = interp.KINDS[kind]
  return checked


def _is_real_float(x: Any) -> bool:
  """Floating and real: complex outputs keep their dtype (a cast would drop the imaginary part)."""
  return interp.is_float(x) and jnp.issubdtype(interp.dtype_of(x), jnp.floating)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(
  fun: Callable[..., Any],
  policy: policy_lib.Policy | str,
  *,
  rules: Mapping[str, str] | None = None,
  fp8: str | None = None,
) -> Callable[..., Any]:
  """Returns `fun` running in mixed precision, the dtype of every op decided on its jaxpr.

  Write the function in float32; `autocast` picks, per primitive of its jaxpr:

  - matrix products and convolutions (`dot_general`, `conv_general_dilated`,
    `ragged_dot_general`) take their floating inputs in the policy's compute
    dtype and accumulate in float32; in the backward pass too (under
    `jax.grad` of the returned function), where JAX alone would run them in
    float32;
  - overflow- and precision-prone ops (`exp`, `log`, `log1p`, `expm1`,
    `logistic`, `pow`, `square`, `rsqrt`, sums and products over many
    elements, the statistics of normalisation and softmax) compute in float32;
  - every other op follows its inputs' widest floating dtype, so no primitive
    receives mismatched dtypes; integer, boolean and key work is untouched.

  The floating outputs are cast to the policy's output dtype. Parameters are
  not cast (store them in `param_dtype` yourself, e.g. `policy.cast_to_param`);
  a product casts them where they are used, so with float32 params the
  gradients are float32. Explicit casts in `fun` are kept; fp8 products (an
  fp8 layer's own) run as written.

  It goes through `jit` (inlined), `jax.checkpoint` (the same policy),
  `cond`/`switch`, `while_loop` and `scan` (a loop carry keeps one dtype, the
  wider of what enters and what the body returns), `custom_jvp` (the body is
  cast, the rule kept and cast alike), `custom_vjp` (run as written, body and
  rules) and `shard_map`, and composes with `jit`, `grad`, `vmap` and
  `ols.value_and_grad`. A primitive without a rule raises an
  `UnknownPrimitiveError` naming it; `rules={'name': kind}` supplies one,
  kind one of 'compute', 'float32', 'widest', 'as_written', 'independent'.

  Arrays among the arguments (any pytree leaf that is a JAX or NumPy array)
  are traced; other leaves (Python numbers, strings, config objects) are
  static. A mutable argument that `fun` updates in place (an NNX module's
  BatchNorm statistics or RNG counts) is updated in the caller's object.

  The work happens when `fun` is traced; under `jit` the compiled function
  runs none of this package's Python. Called eagerly, `fun` is traced on every
  call: wrap the step in `jax.jit`.

  Args:
    fun: the function, written in float32.
    policy: a `Policy`, or a string `get_policy` reads, e.g.
      `'p=f32,c=f16,o=f32'` (compute in float16, return float32).
    rules: extra or overriding entries of the table, primitive name to kind.
    fp8: None, or 'tensorwise' or 'rowwise': every matrix product
      (`dot_general`) big enough to profit runs on fp8 operands with float32
      accumulation, forward (`float8_e4m3fn`) and backward (the gradient in
      `float8_e5m2`), each operand scaled by its current amax, one scale per
      tensor or one power-of-two scale per row (docs/guides/fp8_autocast.md).

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
    >>> jaxpr = jax.make_jaxpr(jax.grad(mixed))(w, x)
    >>> sorted({str(v.aval.dtype) for e in jaxpr.eqns if e.primitive.name == 'dot_general'
    ...         for v in e.invars})
    ['float16']

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
  if fp8 is not None and fp8 not in fp8_lib.RECIPES:  # fp8 hook
    raise ValueError(f"fp8 must be None or one of {fp8_lib.RECIPES}; got {fp8!r}.")
  policy = policy_lib.get_policy(policy)
  ctx = interp.Context(
    compute_dtype=policy.compute_dtype,
    rules={**autocast_rules.RULES, **_check_rules(rules)},
    fp8=fp8,  # fp8 hook
  )

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
      after = jax.tree_util.tree_leaves((inner_args, inner_kwargs))
      if len(after) != len(leaves):
        raise ValueError(
          "autocast: fun changed the structure of its arguments in place; it may update"
          " their arrays, not add or remove them."
        )
      changed[:] = [k for k, i in enumerate(traced) if after[i] is not arrays[k]]
      return out, [after[traced[k]] for k in changed]

    closed, (out_shape, _) = jax.make_jaxpr(flat_fun, return_shape=True)(
      *[leaves[i] for i in traced]
    )
    flat = interp.eval_jaxpr(ctx, closed.jaxpr, closed.consts, [leaves[i] for i in traced])
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    outs, updates = flat[: len(out_leaves)], flat[len(out_leaves) :]
    if changed:
      _write_back((args, kwargs), [traced[k] for k in changed], updates, leaves)
    outs = [interp.cast(o, policy.output_dtype) if interp.is_float(o) else o for o in outs]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return mixed


def _write_back(root: Any, positions: list[int], values: list[Any], leaves: list[Any]) -> None:
  """Stores the arrays `fun` updated in place into the caller's argument objects.

  Each is cast back to its leaf's dtype (a float32 BatchNorm statistic stays
  float32) and set on its parent container, found by its path: an attribute
  (`setattr`, or an NNX variable's `set_value`) or a dict or list entry.
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(root)[0]]
  for position, value in zip(positions, values, strict=True):
    path = paths[position]
    old = leaves[position]
    value = interp.cast(value, old.dtype) if interp.is_float(value) else value
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
