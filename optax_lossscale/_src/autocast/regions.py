"""Regions: the elementwise work between two products, float32 inside, 16 bits at its edges.

A fused kernel computes in float32 and reads and writes 16-bit arrays; what
its backward pass keeps are its 16-bit inputs. `autocast` does the same on a
jaxpr: each maximal run of consecutive equations whose rule is `float32` or
`widest` (arithmetic, data movement, reductions: no product, no control
flow, no kernel) becomes one region::

  forward    outputs = region(inputs)                 # every op in float32
  saved      each input that is an activation, in the compute dtype
             (the copy a product makes of it anyway, when there is one)
  backward   region's derivative at the saved inputs   # recomputed, as remat

so reverse mode keeps 16-bit activations where it would keep float32 ones,
while the forward values are the float32 computation's. Parameters (the
function's arguments) are kept as they are: the caller holds them anyway.
Statistics (sums, means, maxima and what follows from them alone) and small
values (under `MIN_SAVED_SIZE` elements: counters, scalars) are kept exact.

A region is a `custom_jvp` whose tangent is a `jax.checkpoint` of the
region's JVP at the restored 16-bit inputs, built once per structure (cached
by it). Where an evaluation meets a structure first, the region runs inline;
where it meets it again (the identical blocks of an unrolled model), it calls
the region under a `jax.jit`, so that the 24 blocks are interpreted,
differentiated and lowered once (JAX caches by jaxpr identity). A `scan`ned
block meets each of its regions once: a `jit` there would only add its own
linearization and transposition to the first trace. Its tangent is one
function object per structure, so that a re-trace finds the checkpoint's
trace, partial evaluation and transposition in JAX's caches.

Which equations form a region, and each value's kind, the plan decides
(`plan`); this module only runs a planned region.
"""

from __future__ import annotations

from collections import OrderedDict
import threading
from typing import Any

import jax
from jax import lax
import numpy as np

from optax_lossscale._src.autocast import interpreter as interp
from optax_lossscale._src.autocast import plan as plan_lib
from optax_lossscale._src.utils import compat

Kind = interp.Kind

# Values smaller than this stay as computed in the backward pass: a 16-bit
# copy would save nothing that matters, and they are typically counters,
# scalars and per-example statistics whose precision does matter.
MIN_SAVED_SIZE = 1024

_CACHE_SIZE = 4096
_lock = threading.RLock()


def saved_in_compute_dtype(value: Any, kind: Kind, compute_dtype: np.dtype) -> bool:
  """Whether the backward pass keeps `value` as its compute-dtype copy.

  An activation (kind ACT), real, wider than the compute dtype, and not
  small: counted over a scan's steps, whose residuals the backward pass keeps
  stacked.
  """
  return (
    kind is Kind.ACT
    and interp.is_real_float(value)
    and interp.dtype_of(value).itemsize > compute_dtype.itemsize
    and int(np.prod(np.shape(value))) * interp.repeats() >= MIN_SAVED_SIZE
  )


def run(
  ctx: interp.Context, region: plan_lib.Region, invals: list[Any], kinds: list[Kind]
) -> list[Any]:
  """Evaluates a region: its equations inline when it keeps nothing, else its cached
  fused call (under its `jit` where this evaluation met its structure before)."""
  if not region.wrap:
    return interp.eval_flat(ctx, region.eqns, region.invars, region.outvars, invals)
  c = ctx.compute_dtype
  saved = tuple(saved_in_compute_dtype(v, k, c) for v, k in zip(invals, kinds, strict=True))
  copies = [interp.compute_copy(v, c) for v, s in zip(invals, saved, strict=True) if s]
  fused = _fused(ctx, region, saved)
  # The first of its structure in this evaluation runs inline; a repeat (an unrolled
  # model's next block) calls it under its cached `jit`, traced and differentiated once.
  repeat = region.key is not None and interp.met_before((ctx, region.key, saved))
  fn = fused.jitted() if repeat else fused.inline
  with compat.name_stack(region.name_stack):
    return list(fn(*invals, *copies))


class _Fused:
  """A region's `custom_jvp` function, and its `jit` once a repeat asks for it (built
  then: a scanned block's first trace builds none, 1k Python calls fewer on the GPT)."""

  def __init__(self, inline: Any) -> None:
    self.inline = inline
    self._jitted: Any = None

  def jitted(self) -> Any:
    with _lock:
      if self._jitted is None:
        self._jitted = jax.jit(self.inline)
      return self._jitted


_fused_cache: OrderedDict[Any, _Fused] = OrderedDict()


def _fused(ctx: interp.Context, region: plan_lib.Region, saved: tuple[bool, ...]) -> _Fused:
  if region.key is None:
    return _build(ctx, region, saved)
  key = (ctx, region.key, saved)
  with _lock:
    fn = _fused_cache.get(key)
    if fn is not None:
      _fused_cache.move_to_end(key)
      return fn
  fn = _build(ctx, region, saved)
  with _lock:
    _fused_cache[key] = fn
    while len(_fused_cache) > _CACHE_SIZE:
      _fused_cache.popitem(last=False)
  return fn


def _build(ctx: interp.Context, region: plan_lib.Region, saved: tuple[bool, ...]) -> _Fused:
  """`custom_jvp(region)`, its tangent a checkpoint at the saved 16-bit inputs."""
  eqns, invars, outvars = region.eqns, region.invars, region.outvars
  n = len(invars)

  def body(*xs: Any) -> list[Any]:
    return interp.eval_flat(ctx, eqns, invars, outvars, xs)

  # The forward values (the function's and its JVP rule's primal), their constants apart
  # from the backward's: under a `jit`, traced once for both and found in its cache by a
  # re-trace (it is never differentiated: the rule gives the derivative).
  forward = jax.jit(_apart(body))

  @jax.custom_jvp
  def fused(*args: Any) -> list[Any]:
    return forward(*args[:n])

  tangents: dict[Any, Any] = {}

  def tangent_of(diff: tuple[int, ...], dtypes: tuple[Any, ...]) -> Any:
    """The checkpointed tangent for these differentiated inputs and dtypes: one function
    object per kind of call, so that JAX's caches of its trace, partial evaluation and
    transposition (keyed by the function and the jaxpr) serve every later trace."""
    fn = tangents.get((diff, dtypes))
    if fn is not None:
      return fn

    def tangent(kept: list[Any], dxs: list[Any]) -> list[Any]:
      restored = [
        interp.cast(k, d) if s else k for k, d, s in zip(kept, dtypes, saved, strict=True)
      ]

      def partial(*d: Any) -> list[Any]:
        full = list(restored)
        for i, v in zip(diff, d, strict=True):
          full[i] = v
        return body(*full)

      return jax.jvp(partial, [restored[i] for i in diff], dxs)[1]

    # prevent_cse: without the barrier XLA merges what the backward recomputes with the
    # forward's identical subexpressions (a BatchNorm's parameters broadcast to the
    # activations' shape), materialised once and alive from the forward to the backward:
    # the benchmark CNN's compiled temp memory is 25.1 MiB without, 18.6 with (CPU).
    fn = tangents[(diff, dtypes)] = jax.checkpoint(tangent, prevent_cse=True)
    return fn

  def fused_jvp(primals: tuple[Any, ...], tangents_in: tuple[Any, ...]) -> tuple[Any, Any]:
    xs, copies = primals[:n], iter(primals[n:])
    out = forward(*xs)
    diff = tuple(
      i for i in range(n)
      if interp.is_float(xs[i])
      and not isinstance(tangents_in[i], jax.custom_derivatives.SymbolicZero)
    )  # fmt: skip
    if not diff:
      return out, [_zero_tangent(o) for o in out]
    kept = [next(copies) if s else x for x, s in zip(xs, saved, strict=True)]
    kept = _pinned(kept, saved)
    dtypes = tuple(interp.dtype_of(x) for x in xs)
    dxs = [tangents_in[i] for i in diff]
    return out, tangent_of(diff, dtypes)(kept, dxs)

  fused.defjvp(fused_jvp, symbolic_zeros=True)

  def autocast_region(*args: Any) -> list[Any]:
    return fused(*args)

  return _Fused(autocast_region)


def _apart(body: Any) -> Any:
  """`body` with its floating scalar constants its own (`interp.constants_apart`).

  XLA merges equal constants and their broadcasts program-wide (CSE): the
  forward's `max(x, 0)` and the backward's recomputed `x > 0` then share one
  broadcast zero, and XLA's CPU backend materialises a broadcast that two
  fusions read (its YNNPACK fusions take no shared broadcast): a float32
  activation of zeros, alive in the forward pass. An optimization barrier on
  each constant stops that CSE (XLA drops the barrier right after): the
  benchmark CNN's compiled temp memory is 18.6 MiB with the merge, 14.4
  without (CPU, jax 0.10.2).
  """

  def autocast_region_forward(*xs: Any) -> list[Any]:
    with interp.constants_apart():
      return body(*xs)

  return autocast_region_forward


def _zero_tangent(x: Any) -> Any:
  if interp.is_float(x):
    return jax.numpy.zeros_like(x)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _pinned(kept: list[Any], saved: tuple[bool, ...]) -> list[Any]:
  """The saved 16-bit copies behind an optimization barrier.

  With excess precision allowed (XLA's default), XLA removes a float32 ->
  16-bit -> float32 chain of converts (`simplify-fp-conversions`): it would
  read the float32 value in the backward pass and keep it alive instead of
  its 16-bit copy. The barrier keeps the copy what is stored.
  """
  idx = [i for i, s in enumerate(saved) if s]
  if not idx:
    return kept
  pinned = lax.optimization_barrier([kept[i] for i in idx])
  out = list(kept)
  for i, v in zip(idx, pinned, strict=True):
    out[i] = v
  return out
