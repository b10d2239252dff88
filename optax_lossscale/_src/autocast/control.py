"""`autocast` rules for the primitives that hold jaxprs: jit, remat, cond, loops, custom rules.

One idea serves them all: a sub-jaxpr becomes a Python function that runs the
interpreter loop on it (`loop`), and the public JAX function that made the
primitive (`jax.checkpoint`, `lax.switch`, `lax.scan`, `lax.while_loop`,
`jax.custom_jvp`, `jax.shard_map`) is called again with it, so JAX re-derives
the types. What the interpreter changes is a sub-jaxpr's dtypes, and some
primitives need types to agree:

- the branches of a `cond` return the same types: each output is promoted to
  its widest dtype over the branches;
- a loop's carry keeps its type: it starts in the dtype it arrives in, and is
  promoted until the body returns what it receives (a fixed point, reached in
  at most two rounds since dtypes only widen);
- a `custom_jvp` rule returns its function's types: the rule's jaxpr (JAX's,
  for the declared types) runs through the interpreter too, and its outputs
  are cast to what the interpreted function returns. Custom rules are kept.

A `jit` whose body holds only region work is inlined into its region; one
holding products or control flow stays a `jit` call, its interpreted jaxpr
cached by the identity of JAX's (JAX itself caches that per function and
shapes), so re-tracing a model re-uses it. A `custom_vjp` function (Equinox's
`filter_custom_vjp`, diffrax's adjoints) keeps its rules too: its body, its
forward rule and its backward rule run through the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import threading
from typing import Any
import weakref

import jax
from jax import lax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.autocast import interpreter as interp
from optax_lossscale._src.autocast import loop, regions, report
from optax_lossscale._src.utils import compat

Kind = interp.Kind
_MAX_ROUNDS = 4


def _kinds(values: Sequence[Any]) -> list[Kind]:
  return [interp.kind_of(v) for v in values]


def inline(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`closed_call` and `core_call`: the inner jaxpr evaluated in place."""
  closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if hasattr(closed, "consts"):
    return loop.eval_closed(ctx, closed, invals, _kinds(invals))
  return loop.eval_jaxpr(ctx, closed, (), invals, _kinds(invals))


_jit_cache: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
_jit_lock = threading.RLock()


def jit(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`jax.jit`: inlined inside a region; else a `jit` of the interpreted body, cached."""
  closed = eqn.params["jaxpr"]
  kinds = _kinds(invals)
  if interp.in_region() or interp.any_tangent(invals):  # (a tangent is followed inline)
    return loop.eval_closed(ctx, closed, invals, kinds)
  avals = tuple(compat.typeof(v) for v in invals)
  key = (ctx, avals, tuple(kinds))
  with _jit_lock:
    found = _jit_cache.setdefault(closed, {}).get(key)
  if found is None:
    with report.detached() as rows:  # the body's products, for every call that reuses it
      body = jax.make_jaxpr(lambda *a: loop.eval_closed(ctx, closed, a, kinds))(*invals)
    found = (body, rows)
    with _jit_lock:
      _jit_cache[closed][key] = found
  report.replay(found[1])
  return interp.bind(eqn, invals, jaxpr=found[0])


def remat(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`jax.checkpoint`: the same rematerialization policy around the interpreted body.

  What a checkpoint keeps for the backward pass is its inputs (and what its
  policy saves). An activation among them (the residual stream entering a
  checkpointed layer) enters as its 16-bit copy, so that the copy is what
  is kept: the body computes from the rounded value, and its gradient
  reaches the float32 value unrounded (`_rounded`).
  """
  jaxpr = eqn.params["jaxpr"]
  kinds = _kinds(invals)
  c = ctx.compute_dtype
  saved = [regions.saved_in_compute_dtype(v, k, c) for v, k in zip(invals, kinds, strict=True)]
  copies = [interp.compute_copy(v, c) for v, s in zip(invals, saved, strict=True) if s]
  n = len(invals)

  def body(*args: Any) -> list[Any]:
    rest = iter(args[n:])
    ins = [_rounded(x, next(rest)) if s else x for x, s in zip(args[:n], saved, strict=True)]
    return loop.eval_jaxpr(ctx, jaxpr, (), ins, kinds)

  checkpointed = jax.checkpoint(
    body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
  )
  return list(checkpointed(*invals, *copies))


def name(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`checkpoint_name`: an activation is named as its 16-bit copy.

  A remat policy that saves the named value (`save_only_these_names`) then
  keeps 16 bits, where it would keep a product's float32 result; the forward
  pass continues from the copy, and the gradient reaches the float32 value
  unrounded (`_rounded`). Other values are named as they are.
  """
  (x,) = invals
  c = ctx.compute_dtype
  if not regions.saved_in_compute_dtype(x, interp.kind_of(x), c):
    return interp.widest(ctx, eqn, invals)
  (named,) = interp.bind(eqn, [interp.compute_copy(x, c)])
  return [_rounded(x, named)]


@jax.custom_jvp
def _rounded(x: Any, copy: Any) -> Any:
  """`x` rounded to its 16-bit `copy`'s precision, with the gradient of `x` itself.

  Only the copy is read forward, so a checkpoint around it keeps the copy;
  the tangent is `x`'s, so the gradient is not rounded on its way through.
  """
  return copy.astype(x.dtype)


@_rounded.defjvp
def _rounded_jvp(primals: tuple[Any, Any], tangents: tuple[Any, Any]) -> tuple[Any, Any]:
  x, copy = primals
  return copy.astype(x.dtype), tangents[0]


def cond(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`lax.cond` and `lax.switch`: branches whose outputs meet in their widest dtypes."""
  index, *operands = invals
  kinds = _kinds(operands)
  branches = [
    functools.partial(lambda b, ops: loop.eval_closed(ctx, b, ops, kinds), b)
    for b in eqn.params["branches"]
  ]
  per_branch = [_out_dtypes(lambda *ops, b=b: b(ops), operands) for b in branches]
  dtypes = [_promote(*column) for column in zip(*per_branch, strict=True)]
  fns = [lambda *ops, b=b: interp.cast_all(b(ops), dtypes) for b in branches]
  return list(lax.switch(index, fns, *operands))


def while_loop(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`lax.while_loop`, with the carry's dtypes at their fixed point."""
  p = eqn.params
  cond_consts, rest = _split(invals, p["cond_nconsts"])
  body_consts, init = _split(rest, p["body_nconsts"])
  cond_kinds = _kinds(cond_consts) + [Kind.ACT] * len(init)
  body_kinds = _kinds(body_consts) + [Kind.ACT] * len(init)
  body = lambda carry: loop.eval_closed(ctx, p["body_jaxpr"], [*body_consts, *carry], body_kinds)
  test = lambda carry: loop.eval_closed(ctx, p["cond_jaxpr"], [*cond_consts, *carry], cond_kinds)[0]
  declared = p["body_jaxpr"].in_avals[p["body_nconsts"] :]

  def run(dtypes: list[Any], seen: list[list[Any]]) -> list[Any]:
    def step(carry: Sequence[Any]) -> list[Any]:
      new = body(carry)
      seen.append([interp.dtype_of(v) for v in new])
      return interp.cast_all(new, dtypes)

    if p["cond_jaxpr"].out_avals[0].shape:
      step = _batched_step(test, step)
    return list(lax.while_loop(lambda c: _predicate(test(c)), step, interp.cast_all(init, dtypes)))

  return _with_settled_carry(run, lambda: _carry_dtypes(body, init), init, declared)


def _predicate(pred: Any) -> Any:
  """A while loop's test as `lax.while_loop` wants it: a boolean scalar.

  A literal test is a NumPy bool; a batched one (below) loops while any
  element's test holds.
  """
  pred = jnp.asarray(pred, dtype=bool)
  return jnp.any(pred) if pred.ndim else pred


def _batched_step(
  test: Callable[[Sequence[Any]], Any], step: Callable[[Sequence[Any]], list[Any]]
) -> Callable[[Sequence[Any]], list[Any]]:
  """The body of a batched `while`, as JAX lowers it.

  The jaxpr of `jax.vmap` of a loop whose test depends on the mapped values
  holds one test per element (its shape a prefix of each carry's); JAX's
  lowering loops while any holds and steps only the elements whose test
  holds, keeping the others. `lax.while_loop` takes scalar tests only, so
  the selection is written out here.
  """

  def batched(carry: Sequence[Any]) -> list[Any]:
    pred = jnp.asarray(test(carry), dtype=bool)
    new = step(carry)
    keep = lambda n, c: lax.select(
      lax.broadcast_in_dim(pred, jnp.shape(c), tuple(range(pred.ndim))), n, c
    )
    return [keep(n, c) for n, c in zip(new, carry, strict=True)]

  return batched


def scan(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`lax.scan`, with the carry's dtypes at their fixed point."""
  p = eqn.params
  consts, init, xs = compat.scan_operands(p, invals)
  num_carry = len(init)
  kinds = _kinds(consts) + [Kind.ACT] * len(init) + _kinds(xs)

  def body(carry: Sequence[Any], x: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    out = loop.eval_closed(ctx, p["jaxpr"], [*consts, *carry, *x], kinds)
    return out[:num_carry], out[num_carry:]

  def first(carry: Sequence[Any]) -> list[Any]:  # one step, for the carry's types
    return body(carry, [x[0] for x in xs])[0]

  def run(dtypes: list[Any], seen: list[list[Any]]) -> list[Any]:
    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
      new, y = body(carry, x)
      seen.append([interp.dtype_of(v) for v in new])
      return interp.cast_all(new, dtypes), y

    carry, ys = lax.scan(
      step,
      interp.cast_all(init, dtypes),
      list(xs),
      length=p["length"],
      reverse=p["reverse"],
      unroll=p["unroll"],
    )
    return [*carry, *ys]

  declared = p["jaxpr"].in_avals[len(consts) : len(consts) + num_carry]
  settle = lambda: _carry_dtypes(first, init) if p["length"] else [interp.dtype_of(v) for v in init]
  with interp.repeated(p["length"]):
    return _with_settled_carry(run, settle, init, declared)


def custom_jvp(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`jax.custom_jvp`: the body interpreted, the rule kept (and interpreted alike)."""
  p = eqn.params
  consts, args = _split(invals, p["num_consts"])
  kinds = _kinds(invals)
  fun = lambda *a: loop.eval_closed(ctx, p["call_jaxpr"], [*consts, *a], kinds)
  dtypes = _out_dtypes(fun, args)
  new = jax.custom_jvp(fun)

  def rule(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
    # The rule's jaxpr for the tangents it is given, as JAX asks for it (`lift_jvp`): a
    # function with symbolic zeros (Equinox's `filter_custom_jvp`) is told which tangents
    # are zero, and its rule may refuse a tangent it is not meant to be given.
    zeros = [isinstance(t, jax.custom_derivatives.SymbolicZero) for t in tangents]
    jaxpr, rule_consts, out_zeros = compat.custom_jvp_rule_jaxpr(p, len(primals), zeros)
    nonzero = [t for t, z in zip(tangents, zeros, strict=True) if not z]
    arg_kinds = kinds[len(consts) :]
    tangent_kinds = [k for k, z in zip(arg_kinds, zeros, strict=True) if not z]
    with interp.tangents_scope(nonzero):
      outs = loop.eval_jaxpr(
        ctx, jaxpr, rule_consts, [*primals, *nonzero], [*arg_kinds, *tangent_kinds]
      )
    primals_out = interp.cast_all(outs[: len(out_zeros)], dtypes)
    nonzero_out = iter(outs[len(out_zeros) :])
    tangents_out = [
      _zeros(x) if zero else interp.cast(next(nonzero_out), interp.dtype_of(x))
      for x, zero in zip(primals_out, out_zeros, strict=True)
    ]
    return primals_out, tangents_out

  new.defjvp(rule, symbolic_zeros=p["symbolic_zeros"])
  return list(new(*args))


def custom_vjp(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`jax.custom_vjp` (and Equinox's `filter_custom_vjp`): body, forward and backward rules
  interpreted, the rules kept.

  The body runs when nothing is differentiated; under `grad`, the forward rule's jaxpr
  (JAX's, for the inputs that are perturbed) runs through the interpreter, and the
  backward rule is traced for the declared types (the residuals and cotangents of the
  float32 program) and runs through it too, on the residuals the forward rule kept. Its
  cotangents are cast to the inputs' dtypes; what a rule logs (`defvjp_with_logs`, jax >=
  0.11) is logged in the dtypes it declares. A release whose `custom_vjp_call` lacks these
  parameters runs it as written.
  """
  p = eqn.params
  if not all(k in p for k in ("call_jaxpr", "fwd_jaxpr_thunk", "bwd", "out_trees", "num_consts")):
    return interp.as_written(ctx, eqn, invals)
  consts, args = _split(invals, p["num_consts"])
  kinds = _kinds(invals)
  arg_kinds = kinds[len(consts) :]
  fun = lambda *a: loop.eval_closed(ctx, p["call_jaxpr"], [*consts, *a], kinds)
  dtypes = _out_dtypes(fun, args)
  declared = [v.aval for v in eqn.invars]
  res_avals: list[Any] = []

  def fwd(*primals: Any) -> tuple[list[Any], list[Any]]:
    values = [x.value for x in primals]
    perturbed = [bool(x.perturbed) for x in primals]
    jaxpr, fwd_consts = p["fwd_jaxpr_thunk"].call_wrapped(*perturbed)
    outs = loop.eval_jaxpr(ctx, jaxpr, fwd_consts, values, arg_kinds)
    # A literal residual as JAX's `eval_jaxpr` gives it (Equinox's rules read Python bools).
    outs = [
      getattr(v, "val", o) if _is_literal(v) else o
      for v, o in zip(jaxpr.outvars, outs, strict=True)
    ]
    _, res_tree, input_fwds = p["out_trees"]()
    n = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    computed, forwarded = iter(outs[:n]), [*consts, *values]
    out_avals = iter([v.aval for v in jaxpr.outvars[:n]])
    res, res_avals[:] = [], []
    for f in input_fwds:
      res.append(next(computed) if f is None else forwarded[f])
      res_avals.append(next(out_avals) if f is None else declared[f])
    return interp.cast_all(outs[n:], dtypes), res

  def bwd(res: list[Any], cts: list[Any]) -> tuple[Any, ...]:
    # A zero cotangent stays a symbolic zero, of the declared type (vmap's check on
    # outputs shared across the batch reads it).
    ct_avals = [v.aval.to_tangent_aval() for v in eqn.outvars]
    cts = [
      jax.custom_derivatives.SymbolicZero(a) if _is_symbolic_zero(ct) else ct
      for ct, a in zip(cts, ct_avals, strict=True)
    ]
    zero: list[bool] = []
    logs_tree: list[Any] = []  # the logs' treedef, once traced

    # A residual known at trace time stays known (a rule may branch on it, as diffrax's
    # does), in its declared dtype, and so does a symbolic zero; the others are traced
    # for their declared types.
    values = [*res, *cts]
    avals = [*res_avals, *ct_avals]
    known = [not isinstance(v, jax.core.Tracer) for v in values]
    traced = [v for v, k in zip(values, known, strict=True) if not k]

    def declared_bwd(*a: Any) -> list[Any]:
      rest = iter(a)
      full = [
        _declared(v, aval.dtype) if k else next(rest)
        for v, aval, k in zip(values, avals, known, strict=True)
      ]
      outs, logs = compat.custom_vjp_bwd(p, full[: len(res)], full[len(res) :])
      zero[:] = [not hasattr(o, "dtype") for o in outs]  # JAX's Zero: no cotangent
      logged, tree = jax.tree.flatten(logs)
      logs_tree[:] = [tree]
      return [*(o for o in outs if hasattr(o, "dtype")), *logged]

    structs = [
      jax.ShapeDtypeStruct(a.shape, a.dtype) for a, k in zip(avals, known, strict=True) if not k
    ]
    closed = jax.make_jaxpr(declared_bwd)(*structs)
    outs = loop.eval_closed(ctx, closed, traced)
    n = zero.count(False)
    logged = [interp.cast(o, a.dtype) for o, a in zip(outs[n:], closed.out_avals[n:], strict=True)]
    computed = iter(outs[:n])
    out = [None if z else next(computed) for z in zero]
    cts = tuple(
      interp.cast(o, interp.dtype_of(x)) if o is not None and interp.is_float(x) else None
      for o, x in zip(out, args, strict=True)
    )
    if not compat.CUSTOM_VJP_BWD_LOGS:
      return cts  # jax < 0.11
    return cts, jax.tree.unflatten(logs_tree[0], logged)

  new = jax.custom_vjp(fun)
  if compat.CUSTOM_VJP_BWD_LOGS:
    new.defvjp_with_logs(fwd, bwd, symbolic_zeros=True)
  else:
    new.defvjp(fwd, bwd, symbolic_zeros=True)  # jax < 0.11
  return list(new(*args))


def _is_literal(var: Any) -> bool:
  return isinstance(var, jex.core.Literal)


def _declared(value: Any, dtype: Any) -> Any:
  """A value known at trace time in its declared dtype (a Python scalar left as it is)."""
  if not hasattr(value, "dtype") or interp.dtype_of(value) == dtype:
    return value
  return np.asarray(value).astype(dtype)


def _is_symbolic_zero(ct: Any) -> bool:
  return isinstance(ct, jax.custom_derivatives.SymbolicZero)


def _zeros(x: Any) -> Any:
  if interp.is_float(x):
    return jnp.zeros_like(x)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def shard_map(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """`jax.shard_map`: the same mesh, specs and checks around the interpreted body."""
  p = eqn.params
  kinds = _kinds(invals)
  body = lambda *args: tuple(loop.eval_jaxpr(ctx, p["jaxpr"], (), args, kinds))
  mapped = jax.shard_map(
    body,
    mesh=p["mesh"],
    in_specs=p["in_specs"],
    out_specs=p["out_specs"],
    check_vma=compat.shard_map_check_vma(p),
    axis_names=compat.shard_map_manual_axes(p),
  )
  return list(mapped(*invals))


# -- helpers.


def _split(values: Sequence[Any], n: int) -> tuple[list[Any], list[Any]]:
  return list(values[:n]), list(values[n:])


def _out_dtypes(fun: Callable[..., Sequence[Any]], args: Sequence[Any]) -> list[Any]:
  """The dtypes `fun(*args)` returns, traced abstractly (trace time only)."""
  return [s.dtype for s in jax.eval_shape(lambda *a: list(fun(*a)), *args)]


def _promote(*dtypes: Any) -> Any:
  """The dtype several floating dtypes meet in; a non-floating one (a key) stays as it is."""
  if not all(interp.is_inexact_dtype(d) for d in dtypes):
    return dtypes[0]
  return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _with_settled_carry(
  run: Callable[[list[Any], list[list[Any]]], list[Any]],
  settle: Callable[[], list[Any]],
  init: Sequence[Any],
  declared: Sequence[Any],
) -> list[Any]:
  """`run(dtypes, seen)`, the loop traced once with its carry at the fixed point of its dtypes.

  Finding the fixed point (`settle`, `_carry_dtypes`) interprets the body
  once more than the loop itself; a scan-layered model's body is the whole
  model. It is not needed when every floating carry enters in its declared
  dtype and that dtype is at least 32 bits: no rule returns a value wider
  than its declared dtype then (only the float32 rule widens, and only
  16-bit values), so the carry's dtypes are already settled. `run` records
  the dtypes the body returns in `seen`; should one be wider all the same,
  the loop is traced again at the fixed point.
  """
  dtypes = [interp.dtype_of(v) for v in init]
  settled = all(
    not interp.is_inexact_dtype(d) or (d == np.dtype(a.dtype) and d.itemsize >= 4)
    for d, a in zip(dtypes, declared, strict=True)
  )
  if settled:
    seen: list[list[Any]] = []
    outs = run(dtypes, seen)
    if all(_promote(d, o) == d for row in seen for d, o in zip(dtypes, row, strict=True)):
      return outs
  return run(settle(), [])


def _carry_dtypes(body: Callable[[list[Any]], Sequence[Any]], init: Sequence[Any]) -> list[Any]:
  """The carry dtypes at which `body` returns what it receives: start as `init`, widen."""
  dtypes = [interp.dtype_of(v) for v in init]
  for _ in range(_MAX_ROUNDS):
    outs = _out_dtypes(lambda *c, d=dtypes: body(interp.cast_all(c, d)), init)
    wider = [_promote(d, o) for d, o in zip(dtypes, outs, strict=True)]
    if wider == dtypes:
      return dtypes
    dtypes = wider
  raise AssertionError(f"autocast: a loop carry's dtypes did not settle: {dtypes}")
