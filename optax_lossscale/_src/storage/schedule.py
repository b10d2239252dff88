"""Hints to XLA:CPU, so that a parameter write moves the bytes it must and no more.

XLA:CPU fuses elementwise work into one loop per output and never several
outputs into one loop: each full-size output is its own fusion, which
recomputes from the program's inputs whatever cheap work it needs. Two ways
that costs bytes, met by the parameter writers:

* Two outputs of one value (the bfloat16 parameter and the 16-bit remainder
  of one float32 master) each recompute it from the old parameter and
  remainder, so whichever is written first destroys what the other still
  reads, and XLA copies both donated buffers first. `materialized(x)` makes
  XLA compute `x` once into a buffer of its own, which both outputs read: a
  reduction (which XLA never duplicates into its consumers) that is the
  identity, an OR with zeros.
* An output computed from a donated buffer that another output overwrites
  in place (stochastic rounding's new parameter reads the old moments, which
  the moments' own loops overwrite) needs the reads before the writes; with
  nothing ordering them, XLA copies the buffer. `after(tree, dep)` is
  `tree`, ORed with zero bits read from one element of each array of `dep`:
  a data dependency XLA's copy removal sees (an optimization barrier is not:
  XLA:CPU expands it into nothing before its copy removal), also how
  `quantize.codes_after` writes 8-bit state after the new parameters. It
  orders the loop that writes `dep` only if XLA will not duplicate that loop
  into the one-element read:
  one holding an expensive operation (the division and square root of an
  Adam step, before `rounding.round_with_bits`'s final select); a cheap loop,
  even one ending in a select (the remainder's split, tried), is recomputed
  for that element on its own, and nothing is ordered.

And a third, for loops that XLA would recompute in the one-element read:
`after_whole(tree, dep, token)` reads that element through a conditional,
which XLA fuses nothing into (`state_dtypes`' fused step orders each
parameter's loops after the codes of the one before, so that its gradient is
read while it is still cached: at 16M parameters, x1.92 of float32 Adam's
time instead of x2.15).

They are the identity, bit for bit, and act only when the program is
compiled for a CPU (`jax.lax.platform_dependent`): XLA:GPU fuses several
outputs into one kernel, where a materialized value would be a round trip
through memory.

What they leave (jax 0.10's XLA:CPU, one Adam step on 4 bfloat16 matrices):
the remainder moves 48 B/param, the least with one loop per output, since
both halves read the old parameter and remainder: 32 bits per parameter held
in between, written and read twice. Left to XLA:CPU's scheduler, every leaf's
buffer is live at once, and from 8M parameters on the allocator hands them
back and faults them in afresh every step (at 16M, x1.96 of
`master_weights()`'s time); ordered one leaf after another (`after` the
previous leaf's remainder, which `materialized` writes in a loop of its own:
an OR-reduction, which XLA never duplicates into the one-element read), one
leaf's buffer is reused: x1.13 of that time at 4M, x1.23 at 16M. Leaves
smaller than `WINDOW` wait instead for the leaf a window of elements before
(`waits`): XLA:CPU runs a small loop on one core, and a chain of them kept
the other idle (on 64 leaves of 256 x 256, x1.38 of that time; x1.08 to x1.14
with the window). A variadic reduce
computes both halves in one loop, but XLA writes neither output in place
(copies: 44 B/param, no faster). Stochastic rounding's one-element reads
count in XLA's cost analysis as reads of the whole parameter (a bfloat16
array is converted to float32 before it is sliced): 24 B/param, of which 22
are moved (jax 0.12's XLA:CPU slices the bfloat16 array as it is, and counts
22); compiled with `xla_cpu_copy_insertion_use_region_analysis` (a
compiler option of the caller's `jit`), XLA orders the loops without `after`
at 22.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _unsigned(dtype: Any) -> Any:
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]


def _on_cpu(x: Any, on_cpu: Any) -> Any:
  return jax.lax.platform_dependent(x, cpu=on_cpu, default=lambda x: x)


def _materialize_bits(x: jax.Array) -> jax.Array:
  # On the bits: XLA:CPU computes some 16-bit floating operations in float32, which
  # would make a NaN's payload canonical. An integer array is ORed as it is: a
  # conversion of the result, were it an output, would be a loop of its own.
  integer = jnp.issubdtype(x.dtype, jnp.integer)
  bits = x if integer else jax.lax.bitcast_convert_type(x, _unsigned(x.dtype))
  stacked = jnp.stack([bits, jnp.zeros_like(bits)])
  out = jax.lax.reduce(stacked, np.zeros((), bits.dtype), jax.lax.bitwise_or, (0,))
  return out if integer else jax.lax.bitcast_convert_type(out, x.dtype)


def materialized(x: jax.Array) -> jax.Array:
  """`x`, which XLA:CPU computes once into its own buffer (the identity elsewhere).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale._src.storage import schedule
    >>> x = jnp.array([1.5, -0.0, jnp.nan])
    >>> y = jax.jit(schedule.materialized)(x)
    >>> bool(jnp.all(jax.lax.bitcast_convert_type(y, jnp.uint32)
    ...               == jax.lax.bitcast_convert_type(x, jnp.uint32)))
    True
  """
  x = jnp.asarray(x)
  if x.size <= 1 or x.dtype == np.bool_ or np.dtype(x.dtype).itemsize not in (1, 2, 4):
    return x
  return _on_cpu(x, _materialize_bits)


def _explicitly_sharded(x: Any) -> bool:
  sharding = getattr(jax.typeof(x), "sharding", None)
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  mesh = getattr(sharding, "mesh", None)
  return explicit is not None and explicit in getattr(mesh, "axis_types", ())


def _zero_bits_of(dep: list[jax.Array]) -> jax.Array:
  """A uint32 zero that XLA cannot compute before every array of `dep` is written."""
  zero = jnp.zeros((), jnp.uint32)
  for d in dep:
    first = jax.lax.slice(d, (0,) * d.ndim, (1,) * d.ndim).reshape(())
    bits = jax.lax.bitcast_convert_type(first, _unsigned(d.dtype)).astype(jnp.uint32)
    # Shifted out in two steps: zero, which XLA's simplifier does not know.
    zero = zero | ((bits >> np.uint32(16)) >> np.uint32(16))
  return zero


def _orderable(dep: list[Any]) -> list[jax.Array]:
  """The arrays of `dep` that can order a loop: nonempty, of up to 32 bits, and not
  sharded over Explicit mesh axes (which cannot be sliced to one element: left out,
  their loops keep XLA's copies)."""
  return [
    jnp.asarray(d)
    for d in dep
    if jnp.size(d) and np.dtype(jnp.result_type(d)).itemsize <= 4 and not _explicitly_sharded(d)
  ]


def after(tree: Any, dep: list[jax.Array]) -> Any:
  """`tree`, each array leaf of which XLA:CPU computes after every array of `dep`.

  `dep` are arrays of up to 32 bits whose loop ends in an operation XLA does
  not duplicate into a read of one element (see the module's docstring). The
  identity elsewhere than on a CPU.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale._src.storage import schedule
    >>> state = {'mu': jnp.array([1.0, -0.0]), 'count': jnp.int32(3)}
    >>> out = jax.jit(schedule.after)(state, [jnp.ones(2, jnp.bfloat16)])
    >>> out['mu'].tolist(), int(out['count'])
    ([1.0, -0.0], 3)
  """
  dep = _orderable(dep)
  if not dep:
    return tree

  return _on_cpu(tree, lambda tree: _with_zero(tree, _zero_bits_of(dep)))


def _with_zero(tree: Any, zero: jax.Array) -> Any:
  """`tree`, each array leaf of up to 32 bits ORed with `zero` (a uint32 zero)."""

  def one(x: Any) -> Any:
    if not isinstance(x, jax.Array) or np.dtype(x.dtype).itemsize not in (1, 2, 4):
      return x
    if np.dtype(x.dtype) == np.bool_:
      return x | zero.astype(jnp.bool_)
    kind = _unsigned(x.dtype)
    bits = jax.lax.bitcast_convert_type(x, kind) | zero.astype(kind)
    return jax.lax.bitcast_convert_type(bits, x.dtype)

  return jax.tree.map(one, tree)


#: Elements of the leaves a parameter writer lets XLA:CPU step at once (`waits`): 1 MiB
#: of float32. On 64 leaves of 256 x 256 (one Adam step, 2 cores), waiting for the
#: leaf before took x1.38 of `master_weights`' time with the remainder, and the 8-bit
#: update x2.38 of float32 Adam's; with a window of 2**17 to 2**19 elements, x1.08 to
#: x1.14 and x2.05 to x2.16; of 2**22, as slow as the chain.
WINDOW = 2**18


def waits(sizes: list[int], window: int | None = None) -> list[int | None]:
  """For each of a run of leaves (their sizes), the earlier one it waits for: the
  latest `j` whose leaves `j` to `i - 1` hold at least `window` elements together
  (None where the earlier leaves hold fewer).

  A writer that steps its leaves one after another, so that one leaf's temporaries
  are reused by the next or its arrays are read while still cached, waits so for a
  leaf as large as the window, and lets smaller ones run together: XLA:CPU runs a
  small loop on one core, and a chain of them would keep the other idle.

  Example:
    >>> from optax_lossscale._src.storage import schedule
    >>> schedule.waits([4, 4, 4, 4], window=4)
    [None, 0, 1, 2]
    >>> schedule.waits([1, 1, 1, 1, 1], window=2)
    [None, None, 0, 1, 2]
  """
  window = WINDOW if window is None else window
  if window < 1:
    raise ValueError(f"waits' window must be a positive number of elements; got {window}.")
  out: list[int | None] = []
  j, total = 0, 0  # total: the elements of leaves j to i - 1
  for i, size in enumerate(sizes):
    while j < i and total - sizes[j] >= window:
      total -= sizes[j]
      j += 1
    out.append(j if total >= window else None)
    total += size
  return out


def after_whole(tree: Any, dep: list[jax.Array], token: Any) -> Any:
  """`tree`, each array leaf of which XLA:CPU computes after the whole loops that
  write `dep`, whatever those loops hold (the identity elsewhere than on a CPU).

  `after` reads one element of each array of `dep`, which orders nothing when
  XLA recomputes that element on its own (a cheap loop, such as one writing
  8-bit codes): it then reads the arrays the loop reads, and where the loop
  overwrites them in place, XLA copies them first. Here the element is read
  inside a conditional, whose branches XLA fuses nothing into: the read waits
  for the array as written. `token` is a scalar the step computes (a count,
  not read from a buffer that the step overwrites: that read would wait too,
  and XLA would copy the buffer): the conditional's predicate, false on every
  value, which XLA cannot know. Both branches read the same element, so the
  result is `tree` whatever it is. (XLA's cost analysis counts the read of an
  8-bit float array, fp8 codes, as a read of the whole array, which XLA:CPU
  converts to float32 before slicing: 1 byte an element, counted, not moved.)

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_lossscale._src.storage import schedule
    >>> codes = jnp.arange(6, dtype=jnp.uint8)
    >>> out = jax.jit(schedule.after_whole)({'u': jnp.array([0.5, -0.0])}, [codes], jnp.uint32(3))
    >>> out['u'].tolist()
    [0.5, -0.0]
  """
  dep = _orderable(dep)
  if not dep:
    return tree

  def order(tree: Any) -> Any:
    def first(arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
      return tuple(jax.lax.slice(d, (0,) * d.ndim, (1,) * d.ndim) for d in arrays)

    bits = jnp.asarray(token).astype(jnp.uint32)
    never = ((bits >> np.uint32(16)) >> np.uint32(16)) != 0  # unknown to XLA's simplifier
    return _with_zero(tree, _zero_bits_of(list(jax.lax.cond(never, first, first, tuple(dep)))))

  return _on_cpu(tree, order)
