"""What `autocast` did with each matrix product: `autocast_report`, and the record behind it.

Each product rule records one `ProductRow` when it runs (at trace time),
keyed by the path of equations that led to it, so that a loop body traced
several times (its carry's dtypes settling) or a cached `jit` body counts
once per place in the program::

  with recording() as rows:              # autocast's wrapper, on every trace
    eval_jaxpr(...)                      # each product: record(row)
  warn if fp8 was asked for and no row is fp8
  rows pass on to an enclosing recording (autocast_report's)

A product's name is its module path: the name stacks of the equations
enclosing it (a `jit`, a `scan` body) joined with its own, as a Flax module
or a `jax.named_scope` writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import contextvars
import itertools
from typing import Any, NamedTuple

import jax
import numpy as np


class ProductRow(NamedTuple):
  """One matrix product of a function run by `autocast`, and of its gradient.

  Attributes:
    name: its module path (the jaxpr's name stack: Flax module names,
      `jax.named_scope`s); '' where nothing names it.
    primitive: 'dot_general', 'conv_general_dilated' or 'ragged_dot_general'.
    dims: `(batch, m, n, k)` of a `dot_general`; () for the others.
    forward: the dtypes of its two operands, forward.
    backward: the dtypes of the incoming gradient and of the saved operand in
      each of its two backward products (under `jax.grad`).
    fp8: whether it runs in fp8.
    reason: why (or why not): 'cost model x1.04' (the model's predicted
      speedup, fp8 above 1), 'below 16' (a dimension too small), 'all',
      'chosen' or 'filtered out' (by `fp8_products`), 'fp8 off', ...
  """

  name: str
  primitive: str
  dims: tuple[int, ...]
  forward: tuple[str, str]
  backward: tuple[str, str]
  fp8: bool
  reason: str


class Report(tuple):
  """The rows of `autocast_report`; printed, a table."""

  def __str__(self) -> str:
    return format_table(self)


_COLUMNS = ("name", "dims (b, m, n, k)", "forward", "backward (g, saved)", "fp8", "reason")


def format_table(rows: Any) -> str:
  """The rows as a plain-text table, one line per product."""
  short = lambda ds: " x ".join(_SHORT.get(d, d) for d in ds)
  cells = [
    (
      r.name or "-",
      ", ".join(map(str, r.dims)) if r.dims else r.primitive,
      short(r.forward),
      short(r.backward),
      "yes" if r.fp8 else "no",
      r.reason,
    )
    for r in rows
  ]
  widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]
  line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)).rstrip()
  return "\n".join([line(_COLUMNS), *(line(c) for c in cells)])


_SHORT = {
  "float32": "f32",
  "float16": "f16",
  "bfloat16": "bf16",
  "float8_e4m3fn": "e4m3",
  "float8_e5m2": "e5m2",
}

# The path of (name stack, equation id) pairs of the equations being run.
_PATH: contextvars.ContextVar[tuple[tuple[str, int], ...]] = contextvars.ContextVar(
  "autocast_path", default=()
)
# The rows of the innermost recording, keyed by the path that made each.
_ROWS: contextvars.ContextVar[dict[tuple[int, ...], ProductRow] | None] = contextvars.ContextVar(
  "autocast_rows", default=None
)
# How many `autocast` functions ran under the innermost `autocast_report`.
_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
  "autocast_calls", default=None
)


@contextlib.contextmanager
def entering(eqn: Any) -> Iterator[None]:
  """Within it, products are named under `eqn`'s name stack (the loop runs each rule in it)."""
  token = _PATH.set((*_PATH.get(), (str(eqn.source_info.name_stack), id(eqn))))
  try:
    yield
  finally:
    _PATH.reset(token)


def current_name() -> str:
  """The module path of the equation being run."""
  return _join(*(n for n, _ in _PATH.get()))


def _join(*names: str) -> str:
  return "/".join(n for n in names if n)


def record(
  primitive: str,
  dims: tuple[int, ...],
  forward: tuple[Any, Any],
  backward: tuple[Any, Any],
  fp8: bool,
  reason: str,
) -> None:
  """Records the product being run (the last equation of the path), if anything records."""
  rows = _ROWS.get()
  if rows is None:
    return
  names = lambda ds: tuple(np.dtype(d).name for d in ds)
  row = ProductRow(current_name(), primitive, dims, names(forward), names(backward), fp8, reason)
  rows.setdefault(tuple(i for _, i in _PATH.get()), row)


@contextlib.contextmanager
def recording() -> Iterator[dict[tuple[int, ...], ProductRow]]:
  """Records the products run within it; then passes them on to an enclosing recording."""
  outer = _ROWS.get()
  rows: dict[tuple[int, ...], ProductRow] = {}
  token = _ROWS.set(rows)
  try:
    yield rows
  finally:
    _ROWS.reset(token)
  if outer is not None:  # (equation ids are unique while a trace lives: tell traces apart)
    run = next(_RUNS)
    for key, row in rows.items():
      outer.setdefault((run, *key), row)


_RUNS = itertools.count()


@contextlib.contextmanager
def detached() -> Iterator[dict[tuple[int, ...], ProductRow]]:
  """Records relative to an empty path, passing nothing on: a cached `jit` body's rows."""
  path = _PATH.set(())
  rows: dict[tuple[int, ...], ProductRow] = {}
  token = _ROWS.set(rows)
  try:
    yield rows
  finally:
    _ROWS.reset(token)
    _PATH.reset(path)


def replay(rows: dict[tuple[int, ...], ProductRow]) -> None:
  """Records a cached body's rows at the current path (a `jit` called here)."""
  current = _ROWS.get()
  if current is None:
    return
  prefix = current_name()
  ids = tuple(i for _, i in _PATH.get())
  for key, row in rows.items():
    current.setdefault((*ids, *key), row._replace(name=_join(prefix, row.name)))


def reporting() -> bool:
  """Whether an `autocast_report` is tracing (its table says what a warning would)."""
  return _CALLS.get() is not None


def called() -> None:
  """Counts an `autocast` function run under `autocast_report`."""
  calls = _CALLS.get()
  if calls is not None:
    calls[0] += 1


def autocast_report(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
  r"""Each matrix product of `fun` and of its gradient: its dtypes, whether it is fp8, and why.

  `fun` is (or calls) a function returned by `ols.autocast`; it is traced
  abstractly on `args` (arrays or `jax.ShapeDtypeStruct`\ s: nothing is
  computed, nothing allocated), and each product of its jaxpr gives one row:
  its module path (Flax module names, `jax.named_scope`), its dimensions,
  the operand dtypes of its forward product and of its two backward products
  (under `jax.grad`), whether it runs in fp8, and the reason. A `jit`,
  `scan` or `checkpoint` body counts once, wherever it runs.

  Args:
    fun: a function that calls an `ols.autocast` function.
    *args: its arguments (arrays, `jax.ShapeDtypeStruct`\ s; other leaves are
      static).
    **kwargs: its keyword arguments, alike.

  Returns:
    A tuple of `ProductRow`\ s (`name`, `primitive`, `dims`, `forward`,
    `backward`, `fp8`, `reason`), in the order `fun` runs them, which prints
    as a table.

  Raises:
    ValueError: if no `ols.autocast` function ran (a plain function, or a
      `jax.jit` whose trace was cached before: report the function inside).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   with jax.named_scope("head"):
    ...     return jnp.mean((x @ w) ** 2)
    >>> fp8_loss = ols.autocast(loss, "p=f32,c=bf16,o=f32", fp8="tensorwise",
    ...                         fp8_products="all")
    >>> w, x = jnp.ones((64, 32)), jnp.ones((128, 64))
    >>> print(ols.autocast_report(fp8_loss, w, x))
    name  dims (b, m, n, k)  forward      backward (g, saved)  fp8  reason
    head  1, 128, 32, 64     e4m3 x e4m3  e5m2 x e4m3          yes  all
  """
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  arrays = [i for i, x in enumerate(leaves) if _is_abstract_array(x)]

  def flat(*values: Any) -> Any:
    local = list(leaves)
    for i, v in zip(arrays, values, strict=True):
      local[i] = v
    inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, local)
    return fun(*inner_args, **inner_kwargs)

  calls = [0]
  token = _CALLS.set(calls)
  try:
    with recording() as rows:
      jax.make_jaxpr(flat)(*[leaves[i] for i in arrays])
  finally:
    _CALLS.reset(token)
  if not calls[0]:
    raise ValueError(
      "autocast_report: no ols.autocast function ran in fun. Pass the function"
      " ols.autocast returned (or one calling it); a jax.jit traced before on these"
      " shapes reuses its trace: report the function it wraps."
    )
  return Report(rows.values())


def _is_abstract_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))
