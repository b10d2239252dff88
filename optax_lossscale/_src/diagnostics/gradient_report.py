"""A per-leaf census of a gradient tree: what is non-finite, what a low-precision cast loses.

`gradient_report` is pure and jit-compatible: it returns one `LeafStats` per
floating leaf, keyed by the leaf's pytree path. `format_gradient_report` turns
the (fetched) report into a table with the offending leaves first.

Definitions, for each floating leaf `g` and a target dtype `T` (float16 by
default)::

  nan        values that are NaN
  posinf     values equal to +Inf
  neginf     values equal to -Inf
  zero       values that are exactly zero (+0 or -0) in g's own dtype
  underflow  finite, nonzero values whose cast to T is zero
  subnormal  finite values whose cast to T is nonzero but subnormal in T
  overflow   finite values whose cast to T is +-Inf
  max_abs    the largest |value| over the finite values (0 if there are none)

"Cast to T" is the device's own `astype(T)` (round to nearest even), so the
counts say exactly what storing these gradients in T would do on this backend.
Zeros, subnormals and `max_abs` are read from the bit patterns rather than
from float comparisons: XLA on CPU compares float32 subnormals as if they were
zero (denormals-are-zero), which would otherwise count a tiny gradient as an
exact zero. Complex leaves are counted component-wise (real and imaginary
parts as separate values); `None`, integer, bool and `float0` leaves are not
reported. Counts are int32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.utils import dtypes, tree_utils

_TARGET_DTYPES = ("float16", "bfloat16", "float32")
_COUNT_FIELDS = ("nan", "posinf", "neginf", "zero", "underflow", "subnormal", "overflow")


@dataclasses.dataclass(frozen=True)
class LeafStats:
  """The statistics of one gradient leaf; see the module docstring.

  The counts and `max_abs` are arrays (scalars), so a `LeafStats` can be
  returned from `jit`; `dtype` and `shape` describe the leaf and are static.

  Attributes:
    nan: NaN values.
    posinf: +Inf values.
    neginf: -Inf values.
    zero: exact zeros.
    underflow: finite nonzero values that become zero in the target dtype.
    subnormal: finite values that become subnormal in the target dtype.
    overflow: finite values that become +-Inf in the target dtype.
    max_abs: the largest finite magnitude (float32, or the leaf's dtype if wider).
    dtype: the leaf's dtype name.
    shape: the leaf's shape.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> stats = ols.gradient_report([jnp.array([-jnp.inf, 1e-9, 3.0])]).leaves['[0]']
    >>> int(stats.neginf), int(stats.underflow), float(stats.max_abs), stats.shape
    (1, 1, 3.0, (3,))
  """

  nan: jax.Array
  posinf: jax.Array
  neginf: jax.Array
  zero: jax.Array
  underflow: jax.Array
  subnormal: jax.Array
  overflow: jax.Array
  max_abs: jax.Array
  dtype: str
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    """The number of values counted (twice the elements for complex leaves)."""
    n = int(np.prod(self.shape, dtype=np.int64))
    return 2 * n if self.dtype.startswith("complex") else n

  @property
  def nonfinite(self) -> jax.Array:
    """NaN plus +Inf plus -Inf."""
    return self.nan + self.posinf + self.neginf


jax.tree_util.register_dataclass(
  LeafStats, data_fields=[*_COUNT_FIELDS, "max_abs"], meta_fields=["dtype", "shape"]
)


@dataclasses.dataclass(frozen=True)
class GradientReport:
  """The result of `gradient_report`: per-leaf stats and the target dtype.

  Attributes:
    leaves: `LeafStats` by pytree path (`jax.tree_util.keystr`). A dict that
      has been through `jit` has its keys sorted, so iterate `paths` (or
      `items()`) for tree order.
    target_dtype: the dtype name the underflow/subnormal/overflow counts refer to.
    paths: the keys of `leaves` in tree order (static).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> report = jax.jit(ols.gradient_report)({'w': jnp.array([jnp.nan, 1.0])})
    >>> report.target_dtype, list(report.leaves), report.nonfinite_paths()
    ('float16', ["['w']"], ["['w']"])
  """

  leaves: dict[str, LeafStats]
  target_dtype: str
  paths: tuple[str, ...] = ()

  def items(self) -> list[tuple[str, LeafStats]]:
    """`(path, stats)` pairs in tree order."""
    return [(path, self.leaves[path]) for path in self.paths]

  def nonfinite_paths(self) -> list[str]:
    """The paths of the leaves holding any NaN or Inf, in tree order (reads values)."""
    return [path for path, s in self.items() if int(s.nonfinite) > 0]

  def __str__(self) -> str:
    return format_gradient_report(self)


jax.tree_util.register_dataclass(
  GradientReport, data_fields=["leaves"], meta_fields=["target_dtype", "paths"]
)


def _target_dtype(dtype: Any) -> np.dtype:
  return dtypes.read_dtype(dtype, "dtype", among=[np.dtype(name) for name in _TARGET_DTYPES])


def narrowest_float_dtype(tree: Any) -> str:
  """The report target for `tree`: its narrowest real float dtype among those reported on.

  float16 or bfloat16 when a leaf has it (float16 first: the narrower range),
  else float32.
  """
  names = {np.dtype(x.dtype).name for x in jax.tree.leaves(tree) if tree_utils.is_inexact(x)}
  return next((n for n in ("float16", "bfloat16") if n in names), "float32")


def _magnitude_bits(x: jax.Array) -> jax.Array:
  """|x| as an unsigned integer: ordered like |x| for every non-NaN value."""
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  sign = np.array(1 << (8 * x.dtype.itemsize - 1), bits.dtype)
  return bits & ~sign


def _real_components(x: jax.Array) -> jax.Array:
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.stack([jnp.real(x), jnp.imag(x)])
  return x


def _leaf_stats(leaf: Any, target: np.dtype) -> LeafStats:
  leaf = jnp.asarray(leaf)
  x = _real_components(leaf)
  count = lambda mask: jnp.sum(mask, dtype=jnp.int32)
  finite = jnp.isfinite(x)
  mag = _magnitude_bits(x)
  cast_mag = _magnitude_bits(x.astype(target))
  # In IEEE formats the smallest normal number has the bit pattern 1 << nmant.
  smallest_normal_bits = np.array(1 << jnp.finfo(target).nmant, cast_mag.dtype)
  finite_mag = jnp.where(finite, mag, jnp.zeros_like(mag))
  max_abs = jax.lax.bitcast_convert_type(jnp.max(finite_mag, initial=0), x.dtype)
  return LeafStats(
    nan=count(jnp.isnan(x)),
    posinf=count(x == jnp.inf),
    neginf=count(x == -jnp.inf),
    zero=count(mag == 0),
    underflow=count(finite & (mag != 0) & (cast_mag == 0)),
    subnormal=count(finite & (cast_mag != 0) & (cast_mag < smallest_normal_bits)),
    overflow=count(finite & jnp.isinf(x.astype(target))),
    max_abs=max_abs.astype(jnp.promote_types(x.dtype, jnp.float32)),
    dtype=leaf.dtype.name,
    shape=tuple(leaf.shape),
  )


def gradient_report(grads: Any, dtype: Any = jnp.float16) -> GradientReport:
  """Counts, per leaf, the NaNs, Infs, zeros and values `dtype` would lose.

  Pure and jit-compatible; read the result on the host, e.g. with
  `print(report)` or `format_gradient_report`. Each floating leaf gets a
  `LeafStats` keyed by its path; see the module docstring for the exact
  definitions. Pass the gradients whose precision you worry about: the
  unscaled float32 gradients to see what float16 storage would lose, or the
  scaled ones to see what the loss scale rescues.

  Args:
    grads: any pytree of arrays.
    dtype: the target dtype of the underflow, subnormal and overflow counts:
      `'float16'` (default), `'bfloat16'` or `'float32'`.

  Returns:
    A `GradientReport`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> grads = {'w': jnp.array([1.0, jnp.inf, 1e-9, 0.0]), 'b': jnp.ones(2)}
    >>> report = ols.gradient_report(grads)
    >>> s = report.leaves["['w']"]
    >>> int(s.posinf), int(s.zero), int(s.underflow), float(s.max_abs)
    (1, 1, 1, 1.0)
    >>> report.nonfinite_paths()
    ["['w']"]
  """
  target = _target_dtype(dtype)
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  leaves = {
    jax.tree_util.keystr(path) or "<root>": _leaf_stats(leaf, target)
    for path, leaf in flat
    if tree_utils.is_inexact(leaf)
  }
  return GradientReport(leaves=leaves, target_dtype=target.name, paths=tuple(leaves))


def _problem_rank(s: LeafStats) -> tuple[int, float]:
  """Sort key: non-finite leaves first, then overflow, then by underflow share."""
  if int(s.nonfinite):
    return (0, -int(s.nonfinite))
  if int(s.overflow):
    return (1, -int(s.overflow))
  if int(s.underflow):
    return (2, -int(s.underflow) / max(s.size, 1))
  return (3, 0.0)


def _status(s: LeafStats) -> str:
  return ("NONFINITE", "OVERFLOW", "UNDERFLOW", "ok")[_problem_rank(s)[0]]


def format_gradient_report(report: GradientReport, max_rows: int | None = None) -> str:
  """Renders a report as a table, offending leaves first (host side).

  Rows are sorted by status: `NONFINITE` (NaN or Inf; most first), then
  `OVERFLOW` (finite values that become Inf in the target dtype), then
  `UNDERFLOW` (nonzero values that become zero; largest share first), then
  `ok` leaves in tree order.

  Args:
    report: a `GradientReport` (its arrays are fetched to the host).
    max_rows: show at most this many rows (a positive int), or all if None.

  Returns:
    The table as a string, headed by a one-line summary.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> grads = {'a': jnp.ones(3), 'b': jnp.array([jnp.nan, 1e-9])}
    >>> print(ols.format_gradient_report(ols.gradient_report(grads)))
    Gradient report (target float16): 1 of 2 leaves non-finite, 1 with values lost to underflow.
    status     leaf   dtype    shape  NaN  +Inf  -Inf  zero  underflow  subnormal  overflow  max|g|
    NONFINITE  ['b']  float32  (2,)     1     0     0     0          1          0         0   1e-09
    ok         ['a']  float32  (3,)     0     0     0     0          0          0         0       1
  """
  if max_rows is not None and (
    isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1
  ):
    raise ValueError(f"max_rows must be None or a positive int; got {max_rows!r}.")
  stats = dict(jax.device_get(report.items()))  # a dict keeps the tree order here
  order = sorted(stats.items(), key=lambda kv: _problem_rank(kv[1]))  # stable
  n_bad = sum(int(s.nonfinite) > 0 for s in stats.values())
  n_under = sum(int(s.underflow) > 0 for s in stats.values())
  n_over = sum(int(s.overflow) > 0 for s in stats.values())
  summary = (
    f"Gradient report (target {report.target_dtype}): {n_bad} of {len(stats)} leaves"
    f" non-finite, {n_under} with values lost to underflow"
    + (f", {n_over} overflow in {report.target_dtype}" if n_over else "")
    + "."
  )
  header = ["status", "leaf", "dtype", "shape", "NaN", "+Inf", "-Inf", "zero"]
  header += ["underflow", "subnormal", "overflow", "max|g|"]
  rows = [
    [_status(s), path, s.dtype, str(s.shape)]
    + [str(int(getattr(s, f))) for f in _COUNT_FIELDS]
    + [f"{float(s.max_abs):.4g}"]
    for path, s in order
  ]
  hidden = 0
  if max_rows is not None and len(rows) > max_rows:
    hidden, rows = len(rows) - max_rows, rows[:max_rows]
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  # Text columns align left, numbers right.
  align = lambda i, cell: cell.ljust(widths[i]) if i < 4 else cell.rjust(widths[i])
  lines = [summary] + ["  ".join(align(i, c) for i, c in enumerate(r)) for r in [header, *rows]]
  if hidden:
    lines.append(f"... {hidden} more leaves not shown.")
  return "\n".join(line.rstrip() for line in lines)
