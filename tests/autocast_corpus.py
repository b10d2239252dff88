"""A corpus of real JAX functions for `autocast`: jnp, jax.nn, jax.scipy, lax, jax.random, optax.

Each `Entry` is a function written in float32 and a generator of its inputs
(fixed seeds). Almost every function starts with a matrix product, `x @ w`,
whose result feeds the op under test: `autocast` changes dtypes downstream of
products only, so that is how 16-bit values reach the op.

Most entries take `w = I` and `x` on a grid exact in bfloat16 (and so in
float16): `x @ w` is then `x` exactly in any dtype, the op sees the values of
its domain the entry chose (positive for `log`, inside (-1, 1) for `arctanh`),
and an integer or boolean result of the op cannot move by a 16-bit rounding of
its input. The errors `tests/test_autocast_corpus.py` measures are then the
op's own under `autocast`, not its input's rounding. Entries modelled on
layers and losses take dense random weights instead.

`tests/test_autocast_corpus.py` runs every entry under `p=f32,c=f16,o=f32` and
`p=f32,c=bf16,o=f32`, eagerly, under `jit`, `grad` and `vmap`, and compares it
with the float32 function.
"""

# ruff: noqa: E501  (tables: one corpus entry per line reads better than wrapped)

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
from jax import lax
import jax.ad_checkpoint
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np

Args = Callable[[np.random.Generator], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One function of the corpus.

  Attributes:
    name: unique, `family.function[variant]`, e.g. `jnp.sum[axis=0]`.
    fn: the function, written in float32, of the arrays `args` returns.
    args: `rng -> tuple of arrays` (float32, int32, bool, complex64, PRNG keys).
    grad: differentiable in its float32 inputs (checked under `jax.grad`).
    vmap: checked under `jax.vmap` over a leading axis of every input.
    tol: the error allowed, in units of the compute dtype's epsilon (float16
      2**-11, bfloat16 2**-8), of the largest magnitude of each output.
    grad_tol: the same for the gradients (default: 2 * tol).
    products: "compute" when every real floating matrix product of the function
      must take compute-dtype inputs under `autocast`; "any" when the function
      fixes a product's types itself (an explicit `preferred_element_type`).
    grad_products: the same for the products of its gradient (default:
      `products`); "any" where JAX's own derivative rules of a float32 kernel
      (cholesky, eigh, qr, svd, triangular_solve, a linear solve) emit float32
      products of their own.
    full_only: takes over a second to compile (the gamma samplers' rejection
      loops): checked in full runs only; a lighter sibling stands in the
      suite's sampled run.
    backends: the backends that run the function at all (None: every one),
      e.g. XLA lowers `schur` on the CPU only; elsewhere its cases skip.
  """

  name: str
  fn: Callable[..., Any]
  args: Args
  grad: bool = True
  vmap: bool = True
  tol: float = 16.0
  grad_tol: float | None = None
  products: str = "compute"
  full_only: bool = False
  backends: tuple[str, ...] | None = None
  grad_products: str | None = None

  @property
  def family(self) -> str:
    return self.name.split(".")[0]


ENTRIES: list[Entry] = []


def add(name: str, fn: Callable[..., Any], args: Args, **kw: Any) -> None:
  ENTRIES.append(Entry(name, fn, args, **kw))


def has(module: Any, *names: str) -> bool:
  """Whether the installed jax/optax has every name (the lowest supported versions lack some)."""
  return all(hasattr(module, n) for n in names)


# -- inputs.


def grid(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
  """Values in [lo, hi] on a grid of at most 8 significant bits: exact in bfloat16 and float16."""
  step = 2.0 ** (np.ceil(np.log2(max(abs(lo), abs(hi)))) - 7)
  k = rng.integers(int(np.ceil(lo / step)), int(np.floor(hi / step)), size=shape, endpoint=True)
  return (k * step).astype(np.float32)


def distinct(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
  """Grid values without repeats (no ties for sorts, arg-maxima and comparisons)."""
  step = 2.0 ** (np.ceil(np.log2(max(abs(lo), abs(hi)))) - 7)
  ks = np.arange(int(np.ceil(lo / step)), int(np.floor(hi / step)) + 1)
  k = rng.choice(ks, size=int(np.prod(shape)), replace=False).reshape(shape)
  return (k * step).astype(np.float32)


def eye(n: int) -> np.ndarray:
  return np.eye(n, dtype=np.float32)


def act(lo: float, hi: float, shape: tuple[int, ...] = (3, 4), *, unique: bool = False) -> Args:
  """`(x, w)` with `x @ w == x` exactly: the op sees values of [lo, hi]."""
  draw = distinct if unique else grid
  return lambda rng: (draw(rng, shape, lo, hi), eye(shape[-1]))


def act2(lo: float, hi: float, lo2: float, hi2: float, shape: tuple[int, ...] = (3, 4)) -> Args:
  """`(x, w)` with `x @ w` two side by side blocks: the first in [lo, hi], the second [lo2, hi2]."""

  def make(rng: np.random.Generator) -> tuple[Any, ...]:
    a, b = grid(rng, shape, lo, hi), grid(rng, shape, lo2, hi2)
    return np.concatenate([a, b], -1), eye(2 * shape[-1])

  return make


def halves(h: Any) -> tuple[Any, Any]:
  n = h.shape[-1] // 2
  return h[..., :n], h[..., n:]


def dense(*shapes: tuple[int, ...], scale: float = 1.0) -> Args:
  """Normal arrays, each divided by the square root of its first dimension (a layer's init)."""

  def make(rng: np.random.Generator) -> tuple[Any, ...]:
    out = []
    for s in shapes:
      a = rng.standard_normal(s).astype(np.float32)
      out.append(a * np.float32(scale / np.sqrt(s[0])) if len(s) > 1 else a * np.float32(scale))
    return tuple(out)

  return make


def with_extra(base: Args, *extra: Callable[[np.random.Generator], Any]) -> Args:
  return lambda rng: (*base(rng), *(e(rng) for e in extra))


def ints(lo: int, hi: int, shape: tuple[int, ...]) -> Callable[[np.random.Generator], Any]:
  return lambda rng: rng.integers(lo, hi, size=shape).astype(np.int32)


def key(rng: np.random.Generator) -> Any:
  return jax.random.key(int(rng.integers(0, 2**31)))


def spd(h: Any) -> Any:
  """A well-conditioned symmetric positive definite matrix made from `h` (n x n)."""
  n = h.shape[-1]
  return h @ jnp.swapaxes(h, -1, -2) / n + jnp.eye(n)


# -- jax.numpy: elementwise, one argument. (name, function, lo, hi, differentiable)

UNARY = [
  ("abs", jnp.abs, -4, 4, True), ("absolute", jnp.absolute, -4, 4, True),
  ("fabs", jnp.fabs, -4, 4, True), ("negative", jnp.negative, -4, 4, True),
  ("positive", jnp.positive, -4, 4, True), ("sign", jnp.sign, -4, 4, True),
  ("floor", jnp.floor, -4, 4, True), ("ceil", jnp.ceil, -4, 4, True),
  ("round", jnp.round, -4, 4, True), ("rint", jnp.rint, -4, 4, True),
  ("trunc", jnp.trunc, -4, 4, True),
  ("exp", jnp.exp, -4, 4, True), ("exp2", jnp.exp2, -4, 4, True),
  ("expm1", jnp.expm1, -2, 2, True), ("log", jnp.log, 0.25, 8, True),
  ("log2", jnp.log2, 0.25, 8, True), ("log10", jnp.log10, 0.25, 8, True),
  ("log1p", jnp.log1p, -0.5, 4, True), ("sqrt", jnp.sqrt, 0.25, 8, True),
  ("cbrt", jnp.cbrt, 0.25, 8, True), ("square", jnp.square, -4, 4, True),
  ("reciprocal", jnp.reciprocal, 0.25, 4, True), ("sin", jnp.sin, -3, 3, True),
  ("cos", jnp.cos, -3, 3, True), ("tan", jnp.tan, -1.2, 1.2, True),
  ("arcsin", jnp.arcsin, -0.875, 0.875, True), ("arccos", jnp.arccos, -0.875, 0.875, True),
  ("arctan", jnp.arctan, -4, 4, True), ("sinh", jnp.sinh, -3, 3, True),
  ("cosh", jnp.cosh, -3, 3, True), ("tanh", jnp.tanh, -4, 4, True),
  ("arcsinh", jnp.arcsinh, -4, 4, True), ("arccosh", jnp.arccosh, 1.25, 8, True),
  ("arctanh", jnp.arctanh, -0.875, 0.875, True), ("deg2rad", jnp.deg2rad, -4, 4, True),
  ("rad2deg", jnp.rad2deg, -4, 4, True), ("degrees", jnp.degrees, -4, 4, True),
  ("radians", jnp.radians, -4, 4, True), ("sinc", jnp.sinc, -3, 3, True),
  ("i0", jnp.i0, -3, 3, True), ("nan_to_num", jnp.nan_to_num, -4, 4, True),
  ("conj", jnp.conj, -4, 4, True), ("real", jnp.real, -4, 4, True),
  ("imag", jnp.imag, -4, 4, True), ("angle", jnp.angle, -4, 4, True),
  ("signbit", jnp.signbit, -4, 4, False), ("isfinite", jnp.isfinite, -4, 4, False),
  ("isinf", jnp.isinf, -4, 4, False), ("isnan", jnp.isnan, -4, 4, False),
  ("isposinf", jnp.isposinf, -4, 4, False), ("isneginf", jnp.isneginf, -4, 4, False),
  ("isreal", jnp.isreal, -4, 4, False), ("iscomplex", jnp.iscomplex, -4, 4, False),
  ("modf", jnp.modf, -4, 4, True), ("frexp", jnp.frexp, 0.25, 8, False),
  ("clip", lambda h: jnp.clip(h, -1.0, 1.5), -4, 4, True),
  ("sort_complex", jnp.sort_complex, -4, 4, False),
  ("logical_not", lambda h: jnp.logical_not(h > 0.5), -4, 4, False),
  ("invert", lambda h: jnp.invert(jnp.floor(h).astype(jnp.int32)), -4, 4, False),
  ("bitwise_count", lambda h: jnp.bitwise_count(jnp.floor(h * 8).astype(jnp.int32)), -4, 4, False),
  ("astype_int", lambda h: h.astype(jnp.int32), -4, 4, False),
  ("astype_bool", lambda h: h.astype(bool), -4, 4, False),
  ("astype_f16", lambda h: h.astype(jnp.float16), -4, 4, True),
  ("astype_bf16", lambda h: h.astype(jnp.bfloat16), -4, 4, True),
  ("unwrap", lambda h: jnp.unwrap(h * 2, axis=-1), -3, 3, True),
  ("gradient", lambda h: jnp.gradient(h, axis=-1), -4, 4, True),
  ("diff", lambda h: jnp.diff(h, axis=-1), -4, 4, True),
  ("ediff1d", jnp.ediff1d, -4, 4, True),
  ("trapezoid", lambda h: jnp.trapezoid(h, axis=-1), -4, 4, True),
  ("interp", lambda h: jnp.interp(h, jnp.linspace(-4, 4, 9), jnp.arange(9.0) ** 2), -3.9, 3.9,
   True),
  ("polyval", lambda h: jnp.polyval(jnp.array([0.5, -1.0, 2.0, 0.25]), h), -2, 2, True),
  ("piecewise", lambda h: jnp.piecewise(h, [h < 0, h >= 0], [lambda v: v * v, jnp.sin]), -3, 3,
   True),
  ("heaviside[0.5]", lambda h: jnp.heaviside(h, 0.5), -4, 4, True),
]  # fmt: skip
for _name, _op, _lo, _hi, _grad in UNARY:
  add(f"jnp.{_name}", lambda x, w, op=_op: op(x @ w), act(_lo, _hi), grad=_grad)

# -- jax.numpy: elementwise, two arguments, both 16-bit (the two halves of one product).

BINARY = [
  ("add", jnp.add, (-4, 4), (-4, 4), True), ("subtract", jnp.subtract, (-4, 4), (-4, 4), True),
  ("multiply", jnp.multiply, (-4, 4), (-4, 4), True),
  ("divide", jnp.divide, (-4, 4), (0.5, 4), True),
  ("true_divide", jnp.true_divide, (-4, 4), (-4, -0.5), True),
  ("floor_divide", jnp.floor_divide, (-4, 4), (1, 1), True),
  ("mod", jnp.mod, (-4, 4), (2, 2), True), ("remainder", jnp.remainder, (-4, 4), (0.5, 0.5), True),
  ("fmod", jnp.fmod, (-4, 4), (2, 2), True),
  ("power", jnp.power, (0.5, 2), (-2, 2), True),
  ("float_power", jnp.float_power, (0.5, 2), (-2, 2), True),
  ("pow", jnp.pow, (0.5, 2), (-2, 2), True),
  ("maximum", jnp.maximum, (-4, 4), (-4, 4), True), ("minimum", jnp.minimum, (-4, 4), (-4, 4), True),
  ("fmax", jnp.fmax, (-4, 4), (-4, 4), True), ("fmin", jnp.fmin, (-4, 4), (-4, 4), True),
  ("arctan2", jnp.arctan2, (-4, 4), (0.25, 4), True),
  ("hypot", jnp.hypot, (0.25, 4), (-4, -0.25), True),
  ("copysign", jnp.copysign, (-4, 4), (-4, 4), True),
  ("nextafter", jnp.nextafter, (-4, 4), (-4, 4), False),
  ("logaddexp", jnp.logaddexp, (-4, 4), (-4, 4), True),
  ("logaddexp2", jnp.logaddexp2, (-4, 4), (-4, 4), True),
  ("heaviside", jnp.heaviside, (-4, 4), (0, 1), True),
  ("equal", jnp.equal, (-1, 1), (-1, 1), False), ("not_equal", jnp.not_equal, (-1, 1), (-1, 1), False),
  ("less", jnp.less, (-4, 4), (-4, 4), False), ("less_equal", jnp.less_equal, (-1, 1), (-1, 1), False),
  ("greater", jnp.greater, (-4, 4), (-4, 4), False),
  ("greater_equal", jnp.greater_equal, (-1, 1), (-1, 1), False),
  ("isclose", jnp.isclose, (-1, 1), (-1, 1), False),
  ("logical_and", lambda a, b: jnp.logical_and(a > 0, b > 0), (-4, 4), (-4, 4), False),
  ("logical_or", lambda a, b: jnp.logical_or(a > 0, b > 0), (-4, 4), (-4, 4), False),
  ("logical_xor", lambda a, b: jnp.logical_xor(a > 0, b > 0), (-4, 4), (-4, 4), False),
  ("divmod", jnp.divmod, (-4, 4), (2, 2), True),
  ("where", lambda a, b: jnp.where(a > b, a, b * 2), (-4, 4), (-4, 4), True),
  ("select", lambda a, b: jnp.select([a > 1, b > 1], [a, b * b], -1.0), (-4, 4), (-4, 4), True),
  ("cross", lambda a, b: jnp.cross(a[..., :3], b[..., :3]), (-4, 4), (-4, 4), True),
  ("outer", lambda a, b: jnp.outer(a[0], b[1]), (-4, 4), (-4, 4), True),
  ("kron", lambda a, b: jnp.kron(a[:2, :2], b[:2, :2]), (-4, 4), (-4, 4), True),
  ("vdot", jnp.vdot, (-4, 4), (-4, 4), True), ("inner", jnp.inner, (-4, 4), (-4, 4), True),
  ("dot", lambda a, b: jnp.dot(a, b.T), (-4, 4), (-4, 4), True),
  ("matmul", lambda a, b: jnp.matmul(a, b.T), (-4, 4), (-4, 4), True),
  ("tensordot", lambda a, b: jnp.tensordot(a, b, axes=([1], [1])), (-4, 4), (-4, 4), True),
  ("einsum", lambda a, b: jnp.einsum("ij,kj->ik", a, b), (-4, 4), (-4, 4), True),
  ("einsum_trace", lambda a, b: jnp.einsum("ij,ij->", a, b), (-4, 4), (-4, 4), True),
  ("vecdot", lambda a, b: jnp.vecdot(a, b), (-4, 4), (-4, 4), True),
  ("convolve", lambda a, b: jnp.convolve(a[0], b[0]), (-4, 4), (-4, 4), True),
  ("correlate", lambda a, b: jnp.correlate(a[0], b[0], mode="full"), (-4, 4), (-4, 4), True),
  ("ldexp", lambda a, b: jnp.ldexp(a, jnp.floor(b).astype(jnp.int32)), (-4, 4), (-3, 3), False),
  ("stack", lambda a, b: jnp.stack([a, b]), (-4, 4), (-4, 4), True),
  ("stack_axis1", lambda a, b: jnp.stack([a, b], axis=1), (-4, 4), (-4, 4), True),
  ("vstack", lambda a, b: jnp.vstack([a, b]), (-4, 4), (-4, 4), True),
  ("hstack", lambda a, b: jnp.hstack([a, b]), (-4, 4), (-4, 4), True),
  ("dstack", lambda a, b: jnp.dstack([a, b]), (-4, 4), (-4, 4), True),
  ("column_stack", lambda a, b: jnp.column_stack([a[0], b[0]]), (-4, 4), (-4, 4), True),
  ("concatenate", lambda a, b: jnp.concatenate([a, b], 0), (-4, 4), (-4, 4), True),
  ("block", lambda a, b: jnp.block([[a, b], [b, a]]), (-4, 4), (-4, 4), True),
  ("append", lambda a, b: jnp.append(a, b, axis=1), (-4, 4), (-4, 4), True),
  ("polyadd", lambda a, b: jnp.polyadd(a[0], b[0, :2]), (-4, 4), (-4, 4), True),
  ("polymul", lambda a, b: jnp.polymul(a[0], b[0]), (-2, 2), (-2, 2), True),
  ("take_along_axis", lambda a, b: jnp.take_along_axis(a, jnp.argsort(b, axis=1), axis=1),
   (-4, 4), (-4, 4), True),
]  # fmt: skip
for _name, _op, _r1, _r2, _grad in BINARY:
  add(f"jnp.{_name}", lambda x, w, op=_op: op(*halves(x @ w)), act2(*_r1, *_r2), grad=_grad)
# One 16-bit operand and one float32 argument: the wider wins.
for _name, _op in (("add", jnp.add), ("multiply", jnp.multiply), ("maximum", jnp.maximum),
                   ("arctan2", jnp.arctan2), ("where", lambda a, b: jnp.where(a > 0, a, b))):  # fmt: skip
  add(
    f"jnp.{_name}[mixed]",
    lambda x, w, y, op=_op: op(x @ w, y),
    with_extra(act(-4, 4), lambda rng: grid(rng, (3, 4), 0.25, 4)),
  )

# -- jax.numpy: reductions, over every axis.

REDUCTIONS = [
  ("sum", jnp.sum, (-4, 4), True), ("prod", jnp.prod, (0.5, 1.5), True),
  ("mean", jnp.mean, (-4, 4), True), ("var", jnp.var, (-4, 4), True),
  ("std", jnp.std, (-4, 4), True), ("max", jnp.max, (-4, 4), True),
  ("min", jnp.min, (-4, 4), True), ("amax", jnp.amax, (-4, 4), True),
  ("ptp", jnp.ptp, (-4, 4), True), ("median", jnp.median, (-4, 4), True),
  ("nansum", jnp.nansum, (-4, 4), True), ("nanmean", jnp.nanmean, (-4, 4), True),
  ("nanmax", jnp.nanmax, (-4, 4), True), ("nanmin", jnp.nanmin, (-4, 4), True),
  ("nanstd", jnp.nanstd, (-4, 4), True), ("nanvar", jnp.nanvar, (-4, 4), True),
  ("nanprod", jnp.nanprod, (0.5, 1.5), True), ("nanmedian", jnp.nanmedian, (-4, 4), True),
  ("argmax", jnp.argmax, (-4, 4), False), ("argmin", jnp.argmin, (-4, 4), False),
  ("nanargmax", jnp.nanargmax, (-4, 4), False),
  ("all", lambda h, axis: jnp.all(h > 0, axis=axis), (-4, 4), False),
  ("any", lambda h, axis: jnp.any(h > 2, axis=axis), (-4, 4), False),
  ("count_nonzero", lambda h, axis: jnp.count_nonzero(h > 0, axis=axis), (-4, 4), False),
  ("logsumexp", jax.nn.logsumexp, (-4, 4), True),
  ("quantile", lambda h, axis: jnp.quantile(h, 0.3, axis=axis), (-4, 4), True),
  ("percentile", lambda h, axis: jnp.percentile(h, 70.0, axis=axis), (-4, 4), True),
  ("average", lambda h, axis: jnp.average(h, axis=axis, weights=jnp.abs(h) + 0.5), (-4, 4), True),
  ("vector_norm", lambda h, axis: jnp.linalg.vector_norm(h, axis=axis), (-4, 4), True),
]  # fmt: skip
for _name, _op, _range, _grad in REDUCTIONS:
  for _axis in (None, 0, 1):
    add(
      f"jnp.{_name}[axis={_axis}]",
      lambda x, w, op=_op, axis=_axis: op(x @ w, axis=axis),
      act(*_range, unique=not _grad),
      grad=_grad,
    )
for _name, _op in (("sum", jnp.sum), ("mean", jnp.mean), ("var", jnp.var), ("max", jnp.max)):
  add(f"jnp.{_name}[keepdims]", lambda x, w, op=_op: op(x @ w, axis=-1, keepdims=True), act(-4, 4))
# Sums over many elements: accumulated in float32, one rounding of the result (4 eps).
for _name, _op in (("sum", jnp.sum), ("mean", jnp.mean), ("var", jnp.var), ("std", jnp.std)):
  add(f"jnp.{_name}[512]", lambda x, w, op=_op: op(x @ w), act(0, 4, (128, 4)), tol=4)

CUMULATIVE = [
  ("cumsum", jnp.cumsum, (-4, 4)), ("cumprod", jnp.cumprod, (0.5, 1.5)),
  ("nancumsum", jnp.nancumsum, (-4, 4)), ("nancumprod", jnp.nancumprod, (0.5, 1.5)),
  ("cumulative_sum", jnp.cumulative_sum, (-4, 4)), ("cumulative_prod", jnp.cumulative_prod, (0.5, 1.5)),
]  # fmt: skip
for _name, _op, _range in CUMULATIVE:
  for _axis in (0, 1):
    add(f"jnp.{_name}[axis={_axis}]", lambda x, w, op=_op, a=_axis: op(x @ w, axis=a), act(*_range))

# -- jax.numpy: shapes, indexing, sorting.

SHAPES = [
  ("reshape", lambda h: h.reshape(2, 6)), ("ravel", jnp.ravel), ("transpose", jnp.transpose),
  ("swapaxes", lambda h: jnp.swapaxes(h, 0, 1)), ("moveaxis", lambda h: jnp.moveaxis(h, 0, 1)),
  ("expand_dims", lambda h: jnp.expand_dims(h, 1)), ("squeeze", lambda h: jnp.squeeze(h[:1])),
  ("broadcast_to", lambda h: jnp.broadcast_to(h, (2, 3, 4))), ("tile", lambda h: jnp.tile(h, (2, 1))),
  ("repeat", lambda h: jnp.repeat(h, 2, axis=0)), ("roll", lambda h: jnp.roll(h, 1, axis=1)),
  ("flip", jnp.flip), ("fliplr", jnp.fliplr), ("rot90", jnp.rot90),
  ("pad_constant", lambda h: jnp.pad(h, 1, constant_values=-2.5)),
  ("pad_edge", lambda h: jnp.pad(h, 1, mode="edge")),
  ("pad_reflect", lambda h: jnp.pad(h, 1, mode="reflect")),
  ("pad_wrap", lambda h: jnp.pad(h, 1, mode="wrap")),
  ("pad_linear_ramp", lambda h: jnp.pad(h, 1, mode="linear_ramp")),
  ("pad_mean", lambda h: jnp.pad(h, 1, mode="mean")),
  ("split", lambda h: jnp.split(h, 2, axis=1)), ("array_split", lambda h: jnp.array_split(h, 3, 1)),
  ("unstack", lambda h: jnp.unstack(h)), ("triu", jnp.triu), ("tril", lambda h: jnp.tril(h, -1)),
  ("diag", lambda h: jnp.diag(h[0])), ("diagonal", jnp.diagonal), ("trace", jnp.trace),
  ("diagflat", lambda h: jnp.diagflat(h[0])),
  ("fill_diagonal", lambda h: jnp.fill_diagonal(h, -1.0, inplace=False)),
  ("getitem_slice", lambda h: h[1:, ::2]), ("getitem_int", lambda h: h[jnp.array([2, 0])]),
  ("getitem_newaxis", lambda h: h[None, :, None]),
  ("take", lambda h: jnp.take(h, jnp.array([3, 0, 2]), axis=1)),
  ("take_clip", lambda h: jnp.take(h, jnp.array([5, 0, -1]), axis=1, mode="clip")),
  ("take_wrap", lambda h: jnp.take(h, jnp.array([5, 0, -1]), axis=1, mode="wrap")),
  ("take_fill", lambda h: jnp.take(h, jnp.array([5, 0, 2]), axis=1, mode="fill", fill_value=-1e9)),
  ("at_get_fill", lambda h: h.at[jnp.array([0, 7])].get(mode="fill", fill_value=-1e9)),
  ("at_set", lambda h: h.at[1].set(h[0] * 2)), ("at_add", lambda h: h.at[:, 1].add(h[:, 2])),
  ("at_add_dup", lambda h: h.at[jnp.array([0, 0, 2])].add(h)),
  ("at_multiply", lambda h: h.at[0].multiply(h[1])), ("at_divide", lambda h: h.at[0].divide(2.0)),
  ("at_min", lambda h: h.at[jnp.array([1, 1])].min(h[:2])),
  ("at_max", lambda h: h.at[jnp.array([1, 1])].max(h[:2])),
  ("at_power", lambda h: h.at[0].power(2)),
  ("put", lambda h: jnp.put(h, jnp.array([0, 5]), h[2, :2], inplace=False)),
  ("put_along_axis", lambda h: jnp.put_along_axis(h, jnp.array([[1], [0], [3]]), -h[:, :1], 1,
                                                  inplace=False)),
  ("insert", lambda h: jnp.insert(h, 1, -3.0, axis=1)), ("delete", lambda h: jnp.delete(h, 1, 1)),
  ("resize", lambda h: jnp.resize(h, (4, 4))),
  ("choose", lambda h: jnp.choose(np.array([0, 1, 2, 0]), h, mode="clip")),
  ("getitem_bool", lambda h: h[np.array([True, False, True])]),
  ("sort", lambda h: jnp.sort(h, axis=1)), ("sort_axis0", lambda h: jnp.sort(h, axis=0)),
  ("sort_descending", lambda h: jnp.sort(h, axis=1, descending=True)),
  ("argsort", lambda h: jnp.argsort(h, axis=1)),
  ("partition", lambda h: jnp.partition(h, 2, axis=1)),
  ("argpartition", lambda h: jnp.argpartition(h, 2, axis=1)),
  ("lexsort", lambda h: jnp.lexsort((h[0], h[1]))),
  ("searchsorted", lambda h: jnp.searchsorted(jnp.sort(h[0]), h[1:])),
  ("digitize", lambda h: jnp.digitize(h, jnp.array([-2.0, 0.0, 2.0]))),
  ("histogram", lambda h: jnp.histogram(h, bins=4, range=(-4, 4))),
  ("bincount", lambda h: jnp.bincount(jnp.argmax(h, 1), weights=h[:, 0], length=4)),
  ("unique_size", lambda h: jnp.unique(jnp.floor(h), size=6, fill_value=-9.0)),
  ("nonzero_size", lambda h: jnp.nonzero(h > 1, size=5)),
  ("argwhere_size", lambda h: jnp.argwhere(h > 1, size=5)),
  ("flatnonzero", lambda h: jnp.flatnonzero(h > 1, size=5)),
  ("extract", lambda h: jnp.extract(h > 1, h, size=5)),
  ("where_size", lambda h: jnp.where(h > 1, size=5)),
  ("isin", lambda h: jnp.isin(jnp.floor(h), jnp.array([-1.0, 2.0]))),
  ("clip_array", lambda h: jnp.clip(h, h[0], h[0] + 1)),
  ("corrcoef", lambda h: jnp.corrcoef(h)), ("cov", lambda h: jnp.cov(h)),
  ("meshgrid", lambda h: jnp.meshgrid(h[0], h[1])),
  ("apply_along_axis", lambda h: jnp.apply_along_axis(lambda r: r * r.sum(), 1, h)),
  ("vectorize", lambda h: jnp.vectorize(lambda r: jnp.sum(r * r), signature="(n)->()")(h)),
  ("vander", lambda h: jnp.vander(h[0], 3)), ("polyder", lambda h: jnp.polyder(h[0])),
  ("polyint", lambda h: jnp.polyint(h[0])),
  ("histogram_bin_edges", lambda h: jnp.histogram_bin_edges(h, bins=3, range=(-4, 4))),
]  # fmt: skip
_NO_GRAD = {
  "argsort", "argpartition", "lexsort", "searchsorted", "digitize", "histogram", "nonzero_size",
  "argwhere_size", "flatnonzero", "where_size", "isin", "histogram_bin_edges",
}
_DISTINCT = {"sort", "sort_axis0", "sort_descending", "argsort", "partition", "argpartition",
             "lexsort", "searchsorted", "bincount", "corrcoef"}  # fmt: skip
for _name, _op in SHAPES:
  add(
    f"jnp.{_name}",
    lambda x, w, op=_op: op(x @ w),
    act(-4, 4, unique=_name in _DISTINCT),
    grad=_name not in _NO_GRAD,
  )

# -- linear algebra. `dd` is diagonally dominant (well conditioned), `spd` positive definite.


def dd(h: Any) -> Any:
  return h + 4.0 * jnp.eye(h.shape[-1])


LINALG = [
  ("det", lambda h: jnp.linalg.det(dd(h)), 4), ("det[n=2]", lambda h: jnp.linalg.det(dd(h)), 2),
  ("det[n=5]", lambda h: jnp.linalg.det(dd(h)), 5),
  ("slogdet", lambda h: jnp.linalg.slogdet(dd(h)), 4),
  ("slogdet[n=6]", lambda h: jnp.linalg.slogdet(dd(h) - 8.0 * jnp.eye(6)), 6),
  ("inv", lambda h: jnp.linalg.inv(dd(h)), 4), ("pinv", lambda h: jnp.linalg.pinv(dd(h)), 4),
  ("solve", lambda h: jnp.linalg.solve(dd(h), h[:, :2]), 4),
  ("matrix_power", lambda h: jnp.linalg.matrix_power(h, 3), 4),
  ("matrix_rank", lambda h: jnp.linalg.matrix_rank(dd(h)), 4),
  ("cholesky", lambda h: jnp.linalg.cholesky(spd(h)), 4),
  ("eigh", lambda h: (lambda e: (e[0], jnp.abs(e[1])))(jnp.linalg.eigh(spd(h) + jnp.diag(jnp.arange(4.0)))), 4),
  ("eigvalsh", lambda h: jnp.linalg.eigvalsh(spd(h)), 4),
  ("eigvals", lambda h: jnp.linalg.eigvals(dd(h) + jnp.diag(jnp.arange(4.0) * 2)), 4),
  ("svd", lambda h: (lambda u, s, vt: (jnp.abs(u), s, (u * s) @ vt))(*jnp.linalg.svd(dd(h))), 4),
  ("svdvals", lambda h: jnp.linalg.svdvals(h), 4),
  ("qr", lambda h: (lambda q, r: (q @ r, jnp.abs(r)))(*jnp.linalg.qr(dd(h))), 4),
  ("lstsq", lambda h: jnp.linalg.lstsq(dd(h)[:, :3], h[:, 0])[0], 4),
  ("norm", lambda h: jnp.linalg.norm(h), 4), ("norm[fro]", lambda h: jnp.linalg.norm(h, "fro"), 4),
  ("norm[nuc]", lambda h: jnp.linalg.norm(h, "nuc"), 4), ("norm[2]", lambda h: jnp.linalg.norm(h, 2), 4),
  ("norm[-2]", lambda h: jnp.linalg.norm(dd(h), -2), 4), ("norm[1]", lambda h: jnp.linalg.norm(h, 1), 4),
  ("norm[inf]", lambda h: jnp.linalg.norm(h, jnp.inf), 4),
  ("norm[axis=-1]", lambda h: jnp.linalg.norm(h, axis=-1), 4),
  ("norm[ord=1,axis=-1]", lambda h: jnp.linalg.norm(h, 1, axis=-1), 4),
  ("norm[ord=3,axis=-1]", lambda h: jnp.linalg.norm(h, 3, axis=-1), 4),
  ("norm[ord=inf,axis=-1]", lambda h: jnp.linalg.norm(h, jnp.inf, axis=-1), 4),
  ("norm[ord=0,axis=-1]", lambda h: jnp.linalg.norm(h, 0, axis=-1), 4),
  ("matrix_norm", lambda h: jnp.linalg.matrix_norm(h), 4),
  ("cond", lambda h: jnp.linalg.cond(dd(h)), 4),
  ("multi_dot", lambda h: jnp.linalg.multi_dot([h, h.T, h]), 4),
  ("tensorsolve", lambda h: jnp.linalg.tensorsolve(dd(h), h[0]), 4),
  ("tensorinv", lambda h: jnp.linalg.tensorinv(dd(h), ind=1), 4),
  ("outer", lambda h: jnp.linalg.outer(h[0], h[1]), 4),
  ("cross", lambda h: jnp.linalg.cross(h[:, :3], h[::-1, 1:]), 4),
  ("diagonal", lambda h: jnp.linalg.diagonal(h), 4), ("trace", lambda h: jnp.linalg.trace(h), 4),
  ("matrix_transpose", lambda h: jnp.linalg.matrix_transpose(h), 4),
  ("vecdot", lambda h: jnp.linalg.vecdot(h, h[::-1]), 4),
]  # fmt: skip
_LINALG_NO_GRAD = {"matrix_rank", "eigvals", "cond"}
for _name, _op, _n in LINALG:
  add(
    f"linalg.{_name}", lambda x, w, op=_op: op(x @ w), act(-1, 1, (_n, _n)),
    grad=_name.split("[")[0] not in _LINALG_NO_GRAD,
  )  # fmt: skip

SCIPY_LINALG = [
  ("expm", lambda h: jsp.linalg.expm(h / 2)),
  ("lu_factor", lambda h: jsp.linalg.lu_factor(dd(h))),
  ("lu", lambda h: jsp.linalg.lu(dd(h))),
  ("lu_solve", lambda h: jsp.linalg.lu_solve(jsp.linalg.lu_factor(dd(h)), h[:, 0])),
  ("cho_solve", lambda h: jsp.linalg.cho_solve(jsp.linalg.cho_factor(spd(h)), h[:, 0])),
  ("solve_triangular", lambda h: jsp.linalg.solve_triangular(jnp.tril(dd(h)), h[:, :2], lower=True)),
  ("solve[assume_a=pos]", lambda h: jsp.linalg.solve(spd(h), h[:, 0], assume_a="pos")),
  ("block_diag", lambda h: jsp.linalg.block_diag(h[:2, :2], h[2:, 2:])),
  ("toeplitz", lambda h: jsp.linalg.toeplitz(h[0], h[1])),
  ("det", lambda h: jsp.linalg.det(dd(h))), ("inv", lambda h: jsp.linalg.inv(dd(h))),
  ("hessenberg", lambda h: jnp.abs(jsp.linalg.hessenberg(h))),
  ("schur", lambda h: jnp.abs(jnp.diagonal(jsp.linalg.schur(spd(h))[0]))),
  ("polar", lambda h: jsp.linalg.polar(dd(h))[1]),
  ("sqrtm", lambda h: jsp.linalg.sqrtm(spd(h))),
  ("eigh_tridiagonal", lambda h: jsp.linalg.eigh_tridiagonal(h[0] + 4, h[1, :3], eigvals_only=True)),
  ("expm_frechet", lambda h: jsp.linalg.expm_frechet(h / 2, h.T / 2, compute_expm=False)),
]  # fmt: skip
_SCIPY_LINALG_NO_GRAD = {"lu_factor", "lu", "hessenberg", "schur", "polar", "sqrtm",
                         "eigh_tridiagonal", "expm_frechet"}  # fmt: skip
for _name, _op in SCIPY_LINALG:
  add(
    f"scipy_linalg.{_name}", lambda x, w, op=_op: op(x @ w), act(-1, 1, (4, 4)),
    grad=_name not in _SCIPY_LINALG_NO_GRAD, full_only=_name == "expm_frechet",
  )  # fmt: skip

LAX_LINALG = [
  ("cholesky", lambda h: lax.linalg.cholesky(spd(h))),
  ("eigh", lambda h: lax.linalg.eigh(spd(h) + jnp.diag(jnp.arange(4.0)))[1]),
  ("lu", lambda h: lax.linalg.lu(dd(h))),
  ("lu_pivots_to_permutation", lambda h: lax.linalg.lu_pivots_to_permutation(
    lax.linalg.lu(h)[1], 4)),
  ("qr", lambda h: jnp.abs(lax.linalg.qr(dd(h))[1])),
  ("svd", lambda h: lax.linalg.svd(dd(h), compute_uv=False)),
  ("triangular_solve", lambda h: lax.linalg.triangular_solve(jnp.tril(dd(h)), h, left_side=True,
                                                             lower=True)),
  ("tridiagonal_solve", lambda h: lax.linalg.tridiagonal_solve(
    h[0].at[0].set(0.0), h[1] + 4.0, h[2].at[-1].set(0.0), h[:, :2])),
  ("householder_product", lambda h: lax.linalg.householder_product(h[:, :2], jnp.array([0.5, 1.0]))),
  ("tridiagonal", lambda h: jnp.abs(lax.linalg.tridiagonal(spd(h))[1])),
  ("schur", lambda h: jnp.abs(lax.linalg.schur(spd(h))[0])),
  ("hessenberg", lambda h: jnp.abs(lax.linalg.hessenberg(h)[0])),
]  # fmt: skip
_LAX_LINALG_NO_GRAD = {"lu", "lu_pivots_to_permutation", "tridiagonal_solve",
                       "householder_product", "tridiagonal", "schur", "hessenberg"}  # fmt: skip
for _name, _op in LAX_LINALG:
  add(
    f"lax_linalg.{_name}", lambda x, w, op=_op: op(x @ w), act(-1, 1, (4, 4)),
    grad=_name not in _LAX_LINALG_NO_GRAD,
  )  # fmt: skip

# -- FFT: complex outputs (and inputs) stay complex.

FFT = [
  ("fft", lambda h: jnp.fft.fft(h)), ("ifft", lambda h: jnp.fft.ifft(h)),
  ("fft2", lambda h: jnp.fft.fft2(h)), ("fftn", lambda h: jnp.fft.fftn(h)),
  ("rfft", lambda h: jnp.fft.rfft(h)), ("irfft", lambda h: jnp.fft.irfft(jnp.fft.rfft(h))),
  ("rfft2", lambda h: jnp.fft.rfft2(h)), ("irfftn", lambda h: jnp.fft.irfftn(h)),
  ("hfft", lambda h: jnp.fft.hfft(h)), ("ihfft", lambda h: jnp.fft.ihfft(h)),
  ("fft[n=8]", lambda h: jnp.fft.fft(h, n=8)), ("fft[norm=ortho]", lambda h: jnp.fft.fft(h, norm="ortho")),
  ("abs_fft", lambda h: jnp.abs(jnp.fft.fft(h))), ("fftshift", lambda h: jnp.fft.fftshift(h)),
  ("fft_complex_in", lambda h: jnp.fft.fft(lax.complex(h, h[::-1]))),
  ("fft_roundtrip", lambda h: jnp.real(jnp.fft.ifft(jnp.fft.fft(h) * 2))),
  ("dct", lambda h: jsp.fft.dct(h)), ("idct", lambda h: jsp.fft.idct(h, norm="ortho")),
  ("dctn", lambda h: jsp.fft.dctn(h)),
  ("signal.convolve", lambda h: jsp.signal.convolve(h, h[:2, :2])),
  ("signal.fftconvolve", lambda h: jsp.signal.fftconvolve(h, h[:2, :2])),
  ("signal.correlate", lambda h: jsp.signal.correlate(h, h[:2, :2], mode="same")),
  ("signal.convolve2d", lambda h: jsp.signal.convolve2d(h, h[:2, :2], mode="valid")),
]  # fmt: skip
for _name, _op in FFT:
  add(f"fft.{_name}", lambda x, w, op=_op: op(x @ w), act(-2, 2, (4, 4)))

# -- complex numbers.

COMPLEX = [
  ("complex", lambda a, b: lax.complex(a, b)), ("abs", lambda a, b: jnp.abs(lax.complex(a, b))),
  ("angle", lambda a, b: jnp.angle(lax.complex(a, b))),
  ("conj", lambda a, b: jnp.conj(lax.complex(a, b))),
  ("real_imag", lambda a, b: (lambda z: (jnp.real(z * z), jnp.imag(z * z)))(lax.complex(a, b))),
  ("exp", lambda a, b: jnp.exp(lax.complex(a, b))), ("log", lambda a, b: jnp.log(lax.complex(a, b))),
  ("sqrt", lambda a, b: jnp.sqrt(lax.complex(a, b))), ("sin", lambda a, b: jnp.sin(lax.complex(a, b))),
  ("tanh", lambda a, b: jnp.tanh(lax.complex(a, b))),
  ("matmul", lambda a, b: lax.complex(a, b) @ lax.complex(b, a).T),
  ("einsum", lambda a, b: jnp.einsum("ij,kj->ik", lax.complex(a, b), lax.complex(a, -b))),
  ("mul_1j", lambda a, b: a * 1j + b), ("astype", lambda a, b: (a + b).astype(jnp.complex64)),
  ("sum", lambda a, b: jnp.sum(lax.complex(a, b) ** 2)),
  ("mean", lambda a, b: jnp.mean(lax.complex(a, b), axis=0)),
  ("vdot", lambda a, b: jnp.vdot(lax.complex(a, b), lax.complex(b, a))),
  ("where", lambda a, b: jnp.where(a > 0, lax.complex(a, b), 0j)),
]  # fmt: skip
for _name, _op in COMPLEX:
  add(f"complex.{_name}", lambda x, w, op=_op: op(*halves(x @ w)), act2(-2, 2, 0.25, 2))
# A complex argument meeting a 16-bit activation.
add(
  "complex.mixed_arg",
  lambda x, w, z: z * (x @ w) + jnp.conj(z),
  with_extra(act(-2, 2), lambda rng: (grid(rng, (3, 4), -1, 1) + 1j * grid(rng, (3, 4), -1, 1)).astype(np.complex64)),
)
add(
  "complex.matmul_arg",
  lambda x, w, z: z @ (x @ w),
  with_extra(act(-2, 2, (4, 4)), lambda rng: (grid(rng, (3, 4), -1, 1) + 1j).astype(np.complex64)),
)

# -- jax.nn: activations on a dense layer's output, and the normalisations.

ACTIVATIONS = [
  "relu", "relu6", "sigmoid", "softplus", "soft_sign", "silu", "swish", "log_sigmoid",
  "leaky_relu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh", "elu", "celu", "selu",
  "gelu", "mish", "squareplus", "sparse_plus", "sparse_sigmoid", "tanh", "identity",
]
for _name in ACTIVATIONS:
  if has(jax.nn, _name):
    _op = getattr(jax.nn, _name)
    add(f"nn.{_name}", lambda x, w, op=_op: op(x @ w), act(-4, 4))
add("nn.gelu[exact]", lambda x, w: jax.nn.gelu(x @ w, approximate=False), act(-4, 4))
add("nn.glu", lambda x, w: jax.nn.glu(x @ w), act(-4, 4))
if has(jax.nn, "log1mexp"):
  add("nn.log1mexp", lambda x, w: jax.nn.log1mexp(x @ w), act(0.25, 4))
add("nn.relu[dense]", lambda x, w, b: jax.nn.relu(x @ w + b), dense((4, 8), (8, 16), (16,)))
add("nn.gelu[dense]", lambda x, w, b: jax.nn.gelu(x @ w + b), dense((4, 8), (8, 16), (16,)))
for _axis in (-1, 0, None):
  add(f"nn.softmax[axis={_axis}]", lambda x, w, a=_axis: jax.nn.softmax(x @ w, axis=a), act(-4, 4))
  add(f"nn.log_softmax[axis={_axis}]", lambda x, w, a=_axis: jax.nn.log_softmax(x @ w, axis=a), act(-4, 4))
  add(f"nn.logsumexp[axis={_axis}]", lambda x, w, a=_axis: jax.nn.logsumexp(x @ w, axis=a), act(-4, 4))
  add(f"nn.standardize[axis={_axis}]", lambda x, w, a=_axis: jax.nn.standardize(x @ w, axis=a), act(-4, 4))
add("nn.softmax[where]", lambda x, w: jax.nn.softmax(x @ w, where=jnp.arange(4) < 3), act(-4, 4))
add("nn.logsumexp[b]", lambda x, w: jax.nn.logsumexp(x @ w, axis=-1, b=jnp.array([1.0, 2.0, 0.5, 1.0])), act(-4, 4))
add("nn.logsumexp[sign]", lambda x, w: jax.nn.logsumexp(x @ w, axis=-1, b=jnp.array([1.0, -0.5, 1.0, 1.0]), return_sign=True), act(-4, 4))
if has(jax.nn, "logmeanexp"):
  add("nn.logmeanexp", lambda x, w: jax.nn.logmeanexp(x @ w, axis=-1), act(-4, 4))
add("nn.one_hot", lambda x, w: jax.nn.one_hot(jnp.argmax(x @ w, -1), 4) * (x @ w), act(-4, 4, unique=True))
add("nn.one_hot_int", lambda x, w, n: jax.nn.one_hot(n, 5), with_extra(act(-4, 4), ints(0, 5, (3,))), grad=False)
add("nn.standardize[variance]", lambda x, w: jax.nn.standardize(x @ w, variance=jnp.ones(4) * 2.0), act(-4, 4))
add("nn.l2_normalize", lambda x, w: (lambda h: h / jnp.linalg.norm(h, axis=-1, keepdims=True))(x @ w), act(-4, 4))


def _attention_inputs(b: int = 2, t: int = 5, heads: int = 2, d: int = 8) -> Args:
  """Token embeddings and the query, key and value projections."""
  return dense((b, t, d), (d, heads * d // 2), (d, heads * d // 2), (d, heads * d // 2))


def _qkv(x: Any, wq: Any, wk: Any, wv: Any, heads: int = 2) -> tuple[Any, Any, Any]:
  split = lambda h: h.reshape(*h.shape[:-1], heads, h.shape[-1] // heads)
  return split(x @ wq), split(x @ wk), split(x @ wv)


ATTENTION = [
  ("", {}), ("[causal]", {"is_causal": True}), ("[scale]", {"scale": 0.5}),
  ("[mask]", {"mask": jnp.tril(jnp.ones((5, 5), bool))[None, None]}),
  ("[bias]", {"bias": jnp.linspace(-1.0, 1.0, 25).reshape(1, 1, 5, 5)}),
  ("[key_value_seq_lengths]", {"key_value_seq_lengths": jnp.array([3, 5])}),
]  # fmt: skip
for _name, _kw in ATTENTION:
  add(
    f"nn.dot_product_attention{_name}",
    lambda x, wq, wk, wv, kw=_kw: jax.nn.dot_product_attention(*_qkv(x, wq, wk, wv), **kw),
    _attention_inputs(), products="any",
  )  # fmt: skip


def _attention_by_hand(x: Any, wq: Any, wk: Any, wv: Any) -> Any:
  q, k, v = _qkv(x, wq, wk, wv)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
  logits = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), logits, -1e9)  # a mask constant
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)


add("nn.attention_by_hand", _attention_by_hand, _attention_inputs())

# -- jax.scipy.special and jax.scipy.stats. (name, function of the 16-bit activation(s), ranges)

SPECIAL = [
  ("erf", lambda h: jsp.special.erf(h), (-3, 3)), ("erfc", lambda h: jsp.special.erfc(h), (-3, 3)),
  ("erfinv", lambda h: jsp.special.erfinv(h), (-0.875, 0.875)),
  ("erfcx", lambda h: jsp.special.erfcx(h), (-2, 4)),
  ("gammaln", lambda h: jsp.special.gammaln(h), (0.25, 8)),
  ("gamma", lambda h: jsp.special.gamma(h), (0.25, 5)),
  ("loggamma", lambda h: jsp.special.loggamma(h), (0.25, 8)),
  ("gammasgn", lambda h: jsp.special.gammasgn(h), (-3.75, 4)),
  ("digamma", lambda h: jsp.special.digamma(h), (0.25, 8)),
  ("polygamma", lambda h: jsp.special.polygamma(1, h), (0.5, 8)),
  ("expit", lambda h: jsp.special.expit(h), (-4, 4)),
  ("logit", lambda h: jsp.special.logit(h), (0.0625, 0.9375)),
  ("entr", lambda h: jsp.special.entr(h), (0.0625, 4)),
  ("log_ndtr", lambda h: jsp.special.log_ndtr(h), (-4, 4)),
  ("ndtr", lambda h: jsp.special.ndtr(h), (-4, 4)),
  ("ndtri", lambda h: jsp.special.ndtri(h), (0.0625, 0.9375)),
  ("i0", lambda h: jsp.special.i0(h), (-3, 3)), ("i0e", lambda h: jsp.special.i0e(h), (-3, 3)),
  ("i1", lambda h: jsp.special.i1(h), (-3, 3)), ("i1e", lambda h: jsp.special.i1e(h), (-3, 3)),
  ("expi", lambda h: jsp.special.expi(h), (0.25, 4)),
  ("expi[neg]", lambda h: jsp.special.expi(h), (-4, -0.25)),
  ("exp1", lambda h: jsp.special.exp1(h), (0.25, 4)),
  ("expn", lambda h: jsp.special.expn(2, h), (0.25, 4)),
  ("hyp1f1", lambda h: jsp.special.hyp1f1(0.5, 1.5, h), (-2, 2)),
  ("factorial", lambda h: jsp.special.factorial(h), (0, 5)),
  ("multigammaln", lambda h: jsp.special.multigammaln(h, 2), (1.5, 6)),
  ("spence", lambda h: jsp.special.spence(h), (0.25, 4)),
  ("dawsn", lambda h: jsp.special.dawsn(h), (-3, 3)),
  ("fresnel", lambda h: jsp.special.fresnel(h), (-2, 2)),
  ("sici", lambda h: jsp.special.sici(h), (0.25, 4)),
  ("wofz", lambda h: jsp.special.wofz(lax.complex(h, jnp.ones_like(h))), (-2, 2)),
  ("sph_harm_y", lambda h: jsp.special.sph_harm_y(jnp.full(4, 2), jnp.full(4, 1), h[0], h[1] * 0.5,
                                                       n_max=2),
   (0.25, 3)),
  ("boxcox", lambda h: jsp.special.boxcox(h, 0.5), (0.25, 4)),
  ("boxcox1p", lambda h: jsp.special.boxcox1p(h, 0.5), (0.25, 4)),
  ("softmax", lambda h: jsp.special.softmax(h), (-4, 4)),
  ("log_softmax", lambda h: jsp.special.log_softmax(h), (-4, 4)),
  ("logsumexp", lambda h: jsp.special.logsumexp(h, axis=-1), (-4, 4)),
  ("zeta", lambda h: jsp.special.zeta(h, 1.0), (1.5, 6)),
]  # fmt: skip
_SPECIAL_NO_GRAD = {"gammasgn", "erfcx", "expi[neg]", "spence", "dawsn", "fresnel", "sici",
                    "wofz", "sph_harm_y", "zeta", "expn"}  # fmt: skip
for _name, _op, _range in SPECIAL:
  if has(jsp.special, _name.split("[")[0]):
    add(f"special.{_name}", lambda x, w, op=_op: op(x @ w), act(*_range),
        grad=_name not in _SPECIAL_NO_GRAD, full_only=_name == "expi[neg]")  # fmt: skip

SPECIAL2 = [
  ("xlogy", lambda a, b: jsp.special.xlogy(a, b), (-2, 2), (0.25, 4)),
  ("xlog1py", lambda a, b: jsp.special.xlog1py(a, b), (-2, 2), (0.25, 4)),
  ("kl_div", lambda a, b: jsp.special.kl_div(a, b), (0.25, 2), (0.25, 2)),
  ("rel_entr", lambda a, b: jsp.special.rel_entr(a, b), (0.25, 2), (0.25, 2)),
  ("betaln", lambda a, b: jsp.special.betaln(a, b), (0.5, 4), (0.5, 4)),
  ("beta", lambda a, b: jsp.special.beta(a, b), (0.5, 4), (0.5, 4)),
  ("betainc", lambda a, b: jsp.special.betainc(a, b, 0.375), (0.5, 4), (0.5, 4)),
  ("betainc[x]", lambda a, b: jsp.special.betainc(1.5, 2.5, b), (0.5, 4), (0.125, 0.875)),
  ("gammainc", lambda a, b: jsp.special.gammainc(a, b), (0.5, 4), (0.25, 4)),
  ("gammaincc", lambda a, b: jsp.special.gammaincc(a, b), (0.5, 4), (0.25, 4)),
  ("zeta[q]", lambda a, b: jsp.special.zeta(a, b), (1.5, 4), (0.5, 2)),
  ("poch", lambda a, b: jsp.special.poch(a, b), (0.5, 3), (0.5, 2)),
  ("owens_t", lambda a, b: jsp.special.owens_t(a, b), (-2, 2), (0.25, 2)),
  ("hyp2f1", lambda a, b: jsp.special.hyp2f1(0.5, 1.0, 1.5, b), (0, 1), (-0.75, 0.75)),
  ("hyp1f1[ab]", lambda a, b: jsp.special.hyp1f1(a, a + 1.0, b), (0.5, 2), (-1, 1)),
  ("comb", lambda a, b: jsp.special.comb(jnp.floor(a) + 4, jnp.floor(b)), (0, 4), (0, 3)),
]  # fmt: skip
_SPECIAL2_NO_GRAD = {"zeta[q]", "poch", "owens_t", "hyp2f1", "hyp1f1[ab]", "comb", "betainc"}
for _name, _op, _r1, _r2 in SPECIAL2:
  if has(jsp.special, _name.split("[")[0]):
    add(f"special.{_name}", lambda x, w, op=_op: op(*halves(x @ w)), act2(*_r1, *_r2),
        grad=_name not in _SPECIAL2_NO_GRAD, full_only=_name == "hyp2f1")  # fmt: skip

_st = jsp.stats
STATS = [
  ("norm.pdf", lambda h: _st.norm.pdf(h, 0.5, 2.0), (-4, 4)),
  ("norm.logpdf", lambda h: _st.norm.logpdf(h), (-4, 4)),
  ("norm.cdf", lambda h: _st.norm.cdf(h), (-4, 4)),
  ("norm.logcdf", lambda h: _st.norm.logcdf(h), (-4, 4)),
  ("norm.ppf", lambda h: _st.norm.ppf(h), (0.0625, 0.9375)),
  ("norm.sf", lambda h: _st.norm.sf(h), (-4, 4)),
  ("t.logpdf", lambda h: _st.t.logpdf(h, 3.0), (-4, 4)),
  ("cauchy.logpdf", lambda h: _st.cauchy.logpdf(h), (-4, 4)),
  ("laplace.logpdf", lambda h: _st.laplace.logpdf(h), (-4, 4)),
  ("logistic.cdf", lambda h: _st.logistic.cdf(h), (-4, 4)),
  ("logistic.logpdf", lambda h: _st.logistic.logpdf(h), (-4, 4)),
  ("expon.logpdf", lambda h: _st.expon.logpdf(h), (0.25, 4)),
  ("gamma.logpdf", lambda h: _st.gamma.logpdf(h, 2.5), (0.25, 4)),
  ("gamma.cdf", lambda h: _st.gamma.cdf(h, 2.5), (0.25, 4)),
  ("beta.logpdf", lambda h: _st.beta.logpdf(h, 2.0, 3.0), (0.0625, 0.9375)),
  ("beta.cdf", lambda h: _st.beta.cdf(h, 2.0, 3.0), (0.0625, 0.9375)),
  ("chi2.logpdf", lambda h: _st.chi2.logpdf(h, 3.0), (0.25, 4)),
  ("uniform.logpdf", lambda h: _st.uniform.logpdf(h, -4.5, 9.0), (-4, 4)),
  ("truncnorm.logpdf", lambda h: _st.truncnorm.logpdf(h, -4.5, 4.5), (-4, 4)),
  ("vonmises.logpdf", lambda h: _st.vonmises.logpdf(h, 2.0), (-3, 3)),
  ("gennorm.logpdf", lambda h: _st.gennorm.logpdf(h, 1.5), (-4, 4)),
  ("pareto.logpdf", lambda h: _st.pareto.logpdf(h, 2.0), (1.25, 4)),
  ("poisson.logpmf", lambda h: _st.poisson.logpmf(jnp.arange(4.0), h), (0.25, 4)),
  ("binom.logpmf", lambda h: _st.binom.logpmf(jnp.arange(4.0), 5, jax.nn.sigmoid(h)), (-2, 2)),
  ("bernoulli.logpmf", lambda h: _st.bernoulli.logpmf(jnp.array([0, 1, 1, 0]), jax.nn.sigmoid(h)),
   (-2, 2)),
  ("geom.logpmf", lambda h: _st.geom.logpmf(jnp.arange(1.0, 5.0), jax.nn.sigmoid(h)), (-2, 2)),
  ("nbinom.logpmf", lambda h: _st.nbinom.logpmf(jnp.arange(4.0), 3.0, jax.nn.sigmoid(h)), (-2, 2)),
  ("multivariate_normal.logpdf", lambda h: _st.multivariate_normal.logpdf(h, jnp.zeros(4), spd(
    jnp.eye(4) * 0.5)), (-2, 2)),
  ("dirichlet.logpdf", lambda h: _st.dirichlet.logpdf(jax.nn.softmax(h[0]), jnp.arange(1.0, 5.0)),
   (-2, 2)),
  ("multinomial.logpmf", lambda h: _st.multinomial.logpmf(jnp.array([1, 0, 2, 1]), 4,
                                                          jax.nn.softmax(h[0])), (-2, 2)),
  ("rankdata", lambda h: _st.rankdata(h[0]), (-4, 4)),
  ("mode", lambda h: _st.mode(jnp.floor(h), axis=1)[0], (-4, 4)),
  ("sem", lambda h: _st.sem(h, axis=1), (-4, 4)),
]  # fmt: skip
for _name, _op, _range in STATS:
  add(f"stats.{_name}", lambda x, w, op=_op: op(x @ w), act(*_range, unique=_name == "rankdata"),
      grad=_name not in {"rankdata", "mode"})  # fmt: skip

# -- lax: elementwise primitives, windows, convolutions, sorts, scans.

LAX_UNARY = [
  ("rsqrt", lax.rsqrt, (0.25, 8)), ("logistic", lax.logistic, (-4, 4)), ("erf", lax.erf, (-3, 3)),
  ("erfc", lax.erfc, (-3, 3)), ("erf_inv", lax.erf_inv, (-0.875, 0.875)),
  ("lgamma", lax.lgamma, (0.25, 8)), ("digamma", lax.digamma, (0.25, 8)),
  ("integer_pow[3]", lambda h: lax.integer_pow(h, 3), (-4, 4)),
  ("integer_pow[-2]", lambda h: lax.integer_pow(h, -2), (0.5, 4)),
  ("square", lax.square, (-4, 4)), ("cbrt", lax.cbrt, (0.25, 8)), ("exp2", lax.exp2, (-4, 4)),
  ("tan", lax.tan, (-1.2, 1.2)), ("sign", lax.sign, (-4, 4)), ("neg", lax.neg, (-4, 4)),
  ("round[away]", lambda h: lax.round(h, lax.RoundingMethod.AWAY_FROM_ZERO), (-4, 4)),
  ("round[even]", lambda h: lax.round(h, lax.RoundingMethod.TO_NEAREST_EVEN), (-4, 4)),
  ("is_finite", lax.is_finite, (-4, 4)), ("bessel_i0e", lax.bessel_i0e, (-3, 3)),
  ("bessel_i1e", lax.bessel_i1e, (-3, 3)),
  ("reduce_precision", lambda h: lax.reduce_precision(h, 5, 10), (-4, 4)),
  ("bitcast_convert_type", lambda h: lax.bitcast_convert_type(h, jnp.int32), (-4, 4)),
  ("convert_element_type", lambda h: lax.convert_element_type(h, jnp.int32), (-4, 4)),
  ("population_count", lambda h: lax.population_count(jnp.floor(h * 8).astype(jnp.int32)), (-4, 4)),
  ("clz", lambda h: lax.clz(jnp.floor(h * 8).astype(jnp.int32)), (-4, 4)),
  ("clamp", lambda h: lax.clamp(-1.0, h, 2.0), (-4, 4)),
  ("stop_gradient", lambda h: lax.stop_gradient(h) * h, (-4, 4)),
  ("optimization_barrier", lambda h: lax.optimization_barrier((h, h * 2))[1], (-4, 4)),
  ("rev", lambda h: lax.rev(h, (0, 1)), (-4, 4)),
  ("pad[interior]", lambda h: lax.pad(h, -1.5, ((1, 0, 1), (0, -1, 0))), (-4, 4)),
  ("dynamic_slice", lambda h: lax.dynamic_slice(h, (jnp.argmax(h[:, 0]) % 2, 1), (2, 2)), (-4, 4)),
  ("dynamic_update_slice", lambda h: lax.dynamic_update_slice(h, h[:1, :2] * 3, (1, 1)), (-4, 4)),
  ("gather", lambda h: h[jnp.argsort(h[:, 0])], (-4, 4)),
  ("scatter_add", lambda h: jnp.zeros(5).at[jnp.array([0, 2, 2, 4])].add(h[0]), (-4, 4)),
  ("select_n", lambda h: lax.select_n(jnp.argmax(h, 1) % 3, h[:, 0], h[:, 1], h[:, 2]), (-4, 4)),
  ("cummax", lambda h: lax.cummax(h, axis=1), (-4, 4)),
  ("cummin", lambda h: lax.cummin(h, axis=0, reverse=True), (-4, 4)),
  ("cumlogsumexp", lambda h: lax.cumlogsumexp(h, axis=1), (-4, 4)),
  ("cumsum", lambda h: lax.cumsum(h, axis=1), (-4, 4)),
  ("cumprod", lambda h: lax.cumprod(h, axis=1), (0.5, 1.5)),
  ("reduce_max", lambda h: lax.reduce_max(h, (1,)), (-4, 4)),
  ("argmax", lambda h: lax.argmax(h, 1, jnp.int32), (-4, 4)),
  ("top_k", lambda h: lax.top_k(h, 2), (-4, 4)),
  ("approx_max_k", lambda h: lax.approx_max_k(h, 2), (-4, 4)),
  ("sort_multi", lambda h: lax.sort((h[0], h[1], h[2]), num_keys=1), (-4, 4)),
  ("sort_key_val", lambda h: lax.sort_key_val(h[0], h[1]), (-4, 4)),
  ("reduce_tuple", lambda h: lax.reduce((h, -h), (0.0, 0.0), lambda a, b: (a[0] + b[0], a[1] + b[1]),
                                        (1,)), (-4, 4)),
  ("reduce_custom", lambda h: lax.reduce(h, -jnp.inf, lax.max, (0,)), (-4, 4)),
  ("associative_scan", lambda h: lax.associative_scan(jnp.add, h, axis=1), (-4, 4)),
  ("associative_scan_mul", lambda h: lax.associative_scan(jnp.multiply, h, axis=1), (0.5, 1.5)),
  ("nextafter", lambda h: lax.nextafter(h, h[::-1]), (-4, 4)),
  ("rem", lambda h: lax.rem(h, 2.0), (-4, 4)),
  ("pow", lambda h: lax.pow(h, h[::-1] / 4), (0.5, 2)),
  ("atan2", lambda h: lax.atan2(h, h[::-1]), (0.25, 4)),
  ("expand_dims", lambda h: lax.expand_dims(h, (0,)), (-4, 4)),
  ("broadcast_in_dim", lambda h: lax.broadcast_in_dim(h, (2, 3, 4), (1, 2)), (-4, 4)),
  ("concatenate", lambda h: lax.concatenate([h, h * 2], 1), (-4, 4)),
  ("split", lambda h: lax.split(h, (1, 3), axis=1), (-4, 4)),
  ("squeeze", lambda h: lax.squeeze(h[:1], (0,)), (-4, 4)),
  ("full_like", lambda h: lax.full_like(h, 2.0) * h, (-4, 4)),
  ("iota_mul", lambda h: h * lax.broadcasted_iota(jnp.float32, (3, 4), 1), (-4, 4)),
  ("platform_dependent", lambda h: lax.platform_dependent(h, cpu=jnp.sin, default=jnp.cos), (-3, 3)),
  ("psum_vmap", lambda h: jax.vmap(lambda r: lax.psum(r, "i"), axis_name="i")(h), (-4, 4)),
  ("pmean_vmap", lambda h: jax.vmap(lambda r: lax.pmean(r, "i"), axis_name="i")(h), (-4, 4)),
  ("pmax_vmap", lambda h: jax.vmap(lambda r: lax.pmax(r, "i"), axis_name="i")(h), (-4, 4)),
  ("all_gather_vmap", lambda h: jax.vmap(lambda r: lax.all_gather(r, "i"), axis_name="i")(h), (-4, 4)),
  ("axis_index_vmap", lambda h: jax.vmap(lambda r: r * lax.axis_index("i"), axis_name="i")(h), (-4, 4)),
]  # fmt: skip
_LAX_NO_GRAD = {"is_finite", "bitcast_convert_type", "convert_element_type", "population_count",
                "clz", "argmax", "approx_max_k", "reduce_custom", "nextafter", "reduce_precision",
                "all_gather_vmap", "pmax_vmap"}  # fmt: skip
_LAX_DISTINCT = {"top_k", "approx_max_k", "sort_multi", "sort_key_val", "gather", "argmax",
                 "select_n", "dynamic_slice", "cummax", "cummin", "reduce_max"}  # fmt: skip
for _name, _op, _range in LAX_UNARY:
  add(f"lax.{_name}", lambda x, w, op=_op: op(x @ w), act(*_range, unique=_name in _LAX_DISTINCT),
      grad=_name not in _LAX_NO_GRAD)  # fmt: skip


def _window(h: Any, op: Any, init: float, size: int = 2, stride: int = 2, pad: str = "VALID") -> Any:
  return lax.reduce_window(h, init, op, (1, size, size, 1), (1, stride, stride, 1), pad)


WINDOWS = [
  ("avg_pool", lambda h: _window(h, lax.add, 0.0) / 4),
  ("avg_pool[same]", lambda h: _window(h, lax.add, 0.0, 3, 1, "SAME") / 9),
  ("max_pool", lambda h: _window(h, lax.max, -jnp.inf)),
  ("max_pool[same]", lambda h: _window(h, lax.max, -jnp.inf, 3, 2, "SAME")),
  ("min_pool", lambda h: _window(h, lax.min, jnp.inf)),
  ("sum_pool[1d]", lambda h: lax.reduce_window(h, 0.0, lax.add, (1, 4, 1, 1), (1, 1, 1, 1), "VALID")),
  ("mul_window", lambda h: lax.reduce_window(h, 1.0, lax.mul, (1, 2, 1, 1), (1, 1, 1, 1), "VALID")),
  ("window_dilation", lambda h: lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1),
                                                  "VALID", window_dilation=(1, 2, 2, 1))),
]  # fmt: skip
for _name, _op in WINDOWS:
  add(f"lax.reduce_window.{_name}", lambda x, w, op=_op: op((x @ w).reshape(1, 6, 6, 2)),
      act(-4, 4, (36, 2), unique=True), grad=_name != "mul_window")  # fmt: skip


def _conv(x: Any, k: Any, **kw: Any) -> Any:
  return lax.conv_general_dilated(x, k, **{"window_strides": (1, 1), "padding": "SAME", **kw},
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip


CONVS = [
  ("conv2d", lambda x, k: _conv(x, k)),
  ("conv2d[stride]", lambda x, k: _conv(x, k, window_strides=(2, 2), padding="VALID")),
  ("conv2d[dilated]", lambda x, k: _conv(x, k, rhs_dilation=(2, 2))),
  ("conv2d[lhs_dilated]", lambda x, k: _conv(x, k, lhs_dilation=(2, 2), padding=((1, 1), (1, 1)))),
  ("conv_transpose", lambda x, k: lax.conv_transpose(x, k, (2, 2), "SAME",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))),
  ("conv1d", lambda x, k: lax.conv_general_dilated(x[:, 0], k[0], (1,), "SAME",
                                                   dimension_numbers=("NWC", "WIO", "NWC"))),
  ("conv_relu_pool", lambda x, k: _window(jax.nn.relu(_conv(x, k)), lax.max, -jnp.inf)),
]  # fmt: skip
for _name, _op in CONVS:
  add(f"lax.{_name}", _op, dense((2, 6, 6, 2), (3, 3, 2, 3), scale=0.5))
add("lax.conv2d[groups]", lambda x, k: _conv(x, k, feature_group_count=2),
    dense((2, 6, 6, 2), (3, 3, 1, 4), scale=0.5))
add("lax.conv_int", lambda x, k: lax.conv_general_dilated(
  jnp.floor(x * 4).astype(jnp.int32), jnp.floor(k * 4).astype(jnp.int32), (1, 1), "SAME",
  dimension_numbers=("NHWC", "HWIO", "NHWC")), dense((2, 6, 6, 2), (3, 3, 2, 3)), grad=False)
add("lax.dot_int", lambda x, w: jnp.floor(x * 4).astype(jnp.int32) @ jnp.floor(w * 4).astype(jnp.int32),
    dense((3, 4), (4, 5)), grad=False)  # fmt: skip
add("lax.dot_general[batch]", lambda x, w: lax.dot_general(x, w, (((2,), (1,)), ((0,), (0,)))),
    dense((2, 3, 4), (2, 4, 5)))  # fmt: skip
add("lax.dot[preferred=f32]", lambda x, w: lax.dot(x, w, preferred_element_type=jnp.float32),
    dense((3, 4), (4, 5)), products="any")  # fmt: skip
add("lax.dot[precision=highest]", lambda x, w: lax.dot(x, w, precision=lax.Precision.HIGHEST),
    dense((3, 4), (4, 5)))  # fmt: skip
add("lax.einsum[preferred=f32]", lambda x, w: jnp.einsum("ij,jk->ik", x, w,
    preferred_element_type=jnp.float32), dense((3, 4), (4, 5)), products="any")  # fmt: skip
add("lax.dot[fp8]", lambda x, w, v: lax.dot((x @ w).astype(jnp.float8_e4m3fn), v.astype(
    jnp.float8_e4m3fn), preferred_element_type=jnp.float32), with_extra(act(-2, 2), lambda rng: grid(
    rng, (4, 3), -1, 1)), grad=False)  # fmt: skip  (an fp8 layer's own product: run as written)
add("lax.ragged_dot", lambda x, w: lax.ragged_dot(x, w, jnp.array([2, 4], jnp.int32)),
    dense((6, 4), (2, 4, 3)), vmap=False)  # fmt: skip

# -- control flow, remat and custom rules.


def _while_data(x: Any, w: Any) -> Any:
  """A data-dependent loop: halve until every value is below 1 (int counter, float carry)."""
  h = x @ w
  cond = lambda c: (jnp.max(jnp.abs(c[1])) > 1.0) & (c[0] < 20)
  return lax.while_loop(cond, lambda c: (c[0] + 1, c[1] * 0.5), (0, h))


def _scan_rnn(x: Any, w: Any, u: Any) -> Any:
  def step(c: Any, xt: Any) -> Any:
    c = jnp.tanh(c @ u + xt @ w)
    return c, c.sum()

  return lax.scan(step, jnp.zeros((2, 4)), x)


def _policy_remat(x: Any, w: Any) -> Any:
  def block(h: Any) -> Any:
    a = jax.ad_checkpoint.checkpoint_name(jnp.tanh(h @ w), "act")
    return jnp.sin(a @ w)

  policy = jax.checkpoint_policies.save_only_these_names("act")
  return jax.checkpoint(block, policy=policy)(x @ w)


CONTROL = [
  ("while_loop", _while_data, act(-8, 8), {"grad": False}),
  ("while_loop[float_carry]", lambda x, w: lax.while_loop(
    lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5 + 0.5), (0, x @ w)), act(-1, 1),
   {"grad": False}),
  ("fori_loop", lambda x, w: lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + i, x @ w),
   dense((3, 4), (4, 4))),
  ("fori_loop[dynamic]", lambda x, w: lax.fori_loop(0, jnp.argmax(x[0]) + 1, lambda i, h: h * 0.5,
                                                    x @ w), act(-4, 4, unique=True),
   {"grad": False}),
  ("scan", _scan_rnn, dense((3, 2, 4), (4, 4), (4, 4))),
  ("scan[reverse]", lambda x, w: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), x @ w,
                                          reverse=True), act(-2, 2, (5, 4))),
  ("scan[unroll]", lambda x, w: lax.scan(lambda c, r: (jnp.sin(c) + r, None), (x @ w)[0], x @ w,
                                         unroll=2)[0], act(-2, 2, (5, 4))),
  ("map", lambda x, w: lax.map(lambda r: jnp.sum(r * r), x @ w), act(-4, 4)),
  ("cond", lambda x, w: lax.cond(jnp.sum(x) > 0, lambda h: h @ w, lambda h: jnp.exp(h), x @ w),
   dense((4, 4), (4, 4))),
  ("cond[int_out]", lambda x, w: lax.cond(jnp.sum(x) > 0, lambda h: (jnp.argmax(h), h * 2),
                                          lambda h: (jnp.argmin(h), h - 1), x @ w), act(-4, 4, unique=True)),
  ("switch", lambda x, w: lax.switch(jnp.argmax(x[0]) % 3, [jnp.sin, jnp.exp, lambda h: h * h],
                                     x @ w), act(-2, 2, unique=True)),
  ("select_branches", lambda x, w: jnp.where(x @ w > 0, jnp.log1p(jnp.abs(x @ w)), jnp.expm1(x @ w)),
   act(-4, 4)),
  ("jit_inner", lambda x, w: jax.jit(lambda h: jnp.tanh(h) * 2)(x @ w), act(-4, 4)),
  ("jit_static", lambda x, w: jax.jit(lambda h, n: h**n, static_argnums=1)(x @ w, 3), act(-2, 2)),
  ("checkpoint", lambda x, w: jax.checkpoint(lambda h: jnp.sin(h @ w))(x @ w), dense((3, 4), (4, 4))),
  ("checkpoint[dots_saveable]", lambda x, w: jax.checkpoint(
    lambda h: jnp.sin(h @ w), policy=jax.checkpoint_policies.dots_saveable)(x @ w),
   dense((3, 4), (4, 4))),
  ("checkpoint[save_only_these_names]", _policy_remat, dense((3, 4), (4, 4))),
  ("checkpoint_name", lambda x, w: jax.ad_checkpoint.checkpoint_name(x @ w, "h") * 2, act(-4, 4)),
  ("remat", lambda x, w: jax.remat(lambda h: jnp.exp(h) * h)(x @ w), act(-2, 2)),
  ("named_call", lambda x, w: jax.named_call(lambda h: h * h, name="sq")(x @ w), act(-4, 4)),
  ("named_scope", lambda x, w: (lambda h: jnp.tanh(h))(x @ w), act(-4, 4)),
  ("vmap_inner", lambda x, w: jax.vmap(lambda r: jnp.outer(r, r).sum(0))(x @ w), act(-2, 2)),
  ("grad_inner", lambda x, w: jax.grad(lambda h: jnp.sum(jnp.sin(h) ** 2))(x @ w), act(-2, 2)),
  ("jvp_inner", lambda x, w: jax.jvp(jnp.tanh, (x @ w,), (jnp.ones((3, 4)),)), act(-2, 2)),
  ("linearize_inner", lambda x, w: jax.linearize(jnp.sin, x @ w)[1](x @ w), act(-2, 2)),
  ("custom_linear_solve", lambda x, w: jnp.linalg.solve(dd(x @ w), jnp.ones(4)),
   act(-1, 1, (4, 4))),
  ("pure_callback", lambda x, w: jax.pure_callback(
    lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct((3, 4), jnp.float32), x @ w,
    vmap_method="sequential"), act(-4, 4), {"grad": False}),
]  # fmt: skip
for _name, _fn, _args, *_kw in CONTROL:
  add(f"control.{_name}", _fn, _args, **(_kw[0] if _kw else {}))


@jax.custom_jvp
def _softclip(h: Any) -> Any:
  return jnp.tanh(h) * 3


_softclip.defjvp(lambda p, t: (_softclip(p[0]), t[0] * 3 / jnp.cosh(p[0]) ** 2))


@jax.custom_vjp
def _scale_grad(h: Any) -> Any:
  return h * 1.0


_scale_grad.defvjp(lambda h: (h * 1.0, None), lambda _, g: (g * 0.5,))

add("control.custom_jvp", lambda x, w: _softclip(x @ w), act(-4, 4))
add("control.custom_vjp", lambda x, w: jnp.sin(_scale_grad(x @ w)), act(-4, 4))


def _shard_map(x: Any, w: Any) -> Any:
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  spec = jax.sharding.PartitionSpec("d")
  body = lambda h: jnp.tanh(h) * lax.psum(jnp.sum(h), "d")
  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x @ w)


if has(jax, "shard_map"):
  add("control.shard_map", _shard_map, act(-1, 1), vmap=False)

# -- jax.random: typed keys passed in, split in loops, samples shaped by activations.


def _keyed(fn: Callable[..., Any], lo: float = -2, hi: float = 2, shape: tuple[int, ...] = (3, 4),
           **kw: Any) -> dict[str, Any]:  # fmt: skip
  return {"fn": fn, "args": with_extra(act(lo, hi, shape), key), **kw}


_r = jax.random
RANDOM = [
  ("normal", _keyed(lambda x, w, k: _r.normal(k, (3, 4)) * (x @ w))),
  ("uniform", _keyed(lambda x, w, k: _r.uniform(k, (3, 4), minval=-1.0, maxval=1.0) + x @ w)),
  ("uniform[maxval]", _keyed(lambda x, w, k: _r.uniform(k, (3, 4), maxval=x @ w), 0.5, 2)),
  ("truncated_normal", _keyed(lambda x, w, k: _r.truncated_normal(k, -1.0, 1.0, (3, 4)) * (x @ w))),
  ("bernoulli", _keyed(lambda x, w, k: _r.bernoulli(k, jax.nn.sigmoid(x @ w)), grad=False)),
  ("categorical", _keyed(lambda x, w, k: _r.categorical(k, x @ w), grad=False)),
  ("gumbel", _keyed(lambda x, w, k: _r.gumbel(k, (3, 4)) + x @ w)),
  ("exponential", _keyed(lambda x, w, k: _r.exponential(k, (3, 4)) * (x @ w))),
  ("laplace", _keyed(lambda x, w, k: _r.laplace(k, (3, 4)) * (x @ w))),
  ("logistic", _keyed(lambda x, w, k: _r.logistic(k, (3, 4)) + x @ w)),
  ("cauchy", _keyed(lambda x, w, k: jnp.tanh(_r.cauchy(k, (3, 4))) * (x @ w))),
  ("rademacher", _keyed(lambda x, w, k: _r.rademacher(k, (3, 4)) * (x @ w))),
  ("randint", _keyed(lambda x, w, k: _r.randint(k, (3, 4), 0, 10) + jnp.argmax(x @ w, -1)[:, None],
                     grad=False)),
  ("permutation", _keyed(lambda x, w, k: _r.permutation(k, x @ w))),
  ("permutation[independent]", _keyed(lambda x, w, k: _r.permutation(k, x @ w, axis=1,
                                                                      independent=True))),
  ("choice", _keyed(lambda x, w, k: _r.choice(k, x @ w, (2,), replace=False))),
  ("choice[p]", _keyed(lambda x, w, k: _r.choice(k, 4, (3,), p=jax.nn.softmax((x @ w)[0])),
                       grad=False)),
  ("poisson", _keyed(lambda x, w, k: _r.poisson(k, x @ w), 0.5, 6, grad=False)),
  ("poisson[large]", _keyed(lambda x, w, k: _r.poisson(k, x @ w), 12, 40, grad=False)),
  ("binomial", _keyed(lambda x, w, k: _r.binomial(k, 8.0, jax.nn.sigmoid(x @ w)), grad=False)),
  ("multinomial", _keyed(lambda x, w, k: _r.multinomial(k, 8.0, jax.nn.softmax(x @ w)), grad=False)),
  ("gamma", _keyed(lambda x, w, k: _r.gamma(k, x @ w), 0.5, 4)),
  ("beta", _keyed(lambda x, w, k: _r.beta(k, *halves(x @ w)), 0.5, 4, (3, 8))),
  ("dirichlet", _keyed(lambda x, w, k: _r.dirichlet(k, x @ w), 0.5, 4)),
  ("chisquare", _keyed(lambda x, w, k: _r.chisquare(k, x @ w), 1, 4)),
  ("t", _keyed(lambda x, w, k: jnp.tanh(_r.t(k, x @ w)), 2, 6)),
  ("loggamma", _keyed(lambda x, w, k: _r.loggamma(k, x @ w), 0.5, 4)),
  ("lognormal", _keyed(lambda x, w, k: _r.lognormal(k, 0.5, (3, 4)) * (x @ w))),
  ("pareto", _keyed(lambda x, w, k: _r.pareto(k, x @ w), 1, 4)),
  ("weibull_min", _keyed(lambda x, w, k: _r.weibull_min(k, 1.0, x @ w), 0.5, 4)),
  ("geometric", _keyed(lambda x, w, k: _r.geometric(k, jax.nn.sigmoid(x @ w)), grad=False)),
  ("generalized_normal", _keyed(lambda x, w, k: _r.generalized_normal(k, 2.0, (3, 4)) * (x @ w))),
  ("triangular", _keyed(lambda x, w, k: _r.triangular(k, -1.0, 0.0, 1.0, (3, 4)) * (x @ w))),
  ("rayleigh", _keyed(lambda x, w, k: _r.rayleigh(k, x @ w), 0.5, 4)),
  ("wald", _keyed(lambda x, w, k: _r.wald(k, x @ w), 0.5, 4)),
  ("maxwell", _keyed(lambda x, w, k: _r.maxwell(k, (3, 4)) * (x @ w))),
  ("double_sided_maxwell", _keyed(lambda x, w, k: _r.double_sided_maxwell(k, 0.0, 1.0, (3, 4)) * (x @ w))),
  ("orthogonal", _keyed(lambda x, w, k: _r.orthogonal(k, 4) @ (x @ w).T)),
  ("ball", _keyed(lambda x, w, k: _r.ball(k, 4, shape=(3,)) * (x @ w))),
  ("multivariate_normal", _keyed(lambda x, w, k: _r.multivariate_normal(k, x @ w, spd(
    jnp.eye(4) * 0.5)))),
  ("bits", _keyed(lambda x, w, k: _r.bits(k, (3, 4)) % 7 + jnp.argmax(x @ w, -1)[:, None].astype(
    jnp.uint32), grad=False)),
  ("dropout", _keyed(lambda x, w, k: jnp.where(_r.bernoulli(k, 0.75, (3, 4)), (x @ w) / 0.75, 0.0))),
  ("split_fold_in", _keyed(lambda x, w, k: _r.normal(_r.fold_in(_r.split(k)[1], 3), (3, 4)) * (x @ w))),
  ("fold_in_data", _keyed(lambda x, w, k: _r.uniform(_r.fold_in(k, jnp.argmax(x @ w)), (3, 4)),
                          grad=False)),
  ("key_data", _keyed(lambda x, w, k: (_r.key_data(k), _r.wrap_key_data(_r.key_data(k)), x @ w))),
  ("clone", _keyed(lambda x, w, k: _r.normal(_r.clone(k), (3, 4)) * (x @ w))),
  ("split_in_fori", _keyed(lambda x, w, k: lax.fori_loop(
    0, 3, lambda i, c: (_r.split(c[0])[0], c[1] + _r.normal(_r.split(c[0])[1], (3, 4)) * 0.1),
    (k, x @ w)))),
  ("split_in_scan", _keyed(lambda x, w, k: lax.scan(
    lambda c, r: ((_r.split(c[0])[0], c[1] * 0.5), _r.uniform(c[0], (4,)) * r), (k, (x @ w)[0]),
    x @ w))),
  ("key_in_while", _keyed(lambda x, w, k: lax.while_loop(
    lambda c: c[2] < 3, lambda c: (_r.split(c[0])[1], c[1] + _r.normal(c[0], (3, 4)), c[2] + 1),
    (k, x @ w, 0)), grad=False)),
  ("key_out_of_cond", _keyed(lambda x, w, k: lax.cond(
    jnp.sum(x @ w) > 0, lambda k: (_r.split(k)[0], 1.0), lambda k: (k, 2.0), k))),
  ("split_vmap", _keyed(lambda x, w, k: jax.vmap(lambda kk, r: _r.normal(kk, (4,)) * r)(
    _r.split(k, 3), x @ w))),
]  # fmt: skip
# Built on the gamma sampler (random.gamma stands for them in the sampled run), or named in issue
# 30 and run on their own by tests/test_autocast_ops.py (binomial, multinomial).
_HEAVY_RANDOM = {"t", "generalized_normal", "dirichlet", "loggamma", "ball", "beta", "chisquare",
                 "poisson[large]", "binomial", "multinomial"}  # fmt: skip
for _name, _kw in RANDOM:
  add(f"random.{_name}", **_kw, full_only=_name in _HEAVY_RANDOM)

# -- optax's losses, on logits or predictions from a dense layer.

import optax  # noqa: E402  (after jax: the losses are the corpus's last family but two)

_L = optax.losses


def _logits(shape: tuple[int, ...] = (4, 5)) -> Args:
  return dense((shape[0], 6), (6, shape[1]), scale=2.0)


def _probs(rng: np.random.Generator, shape: tuple[int, ...] = (4, 5)) -> Any:
  p = rng.uniform(0.1, 1.0, shape).astype(np.float32)
  return p / p.sum(-1, keepdims=True)


def _binary(rng: np.random.Generator, shape: tuple[int, ...] = (4, 5)) -> Any:
  return rng.integers(0, 2, shape).astype(np.float32)


def _targets(rng: np.random.Generator, shape: tuple[int, ...] = (4, 5)) -> Any:
  return rng.standard_normal(shape).astype(np.float32)


LOSSES = [
  ("softmax_cross_entropy", lambda h, t: _L.softmax_cross_entropy(h, t), _probs),
  ("softmax_cross_entropy_with_integer_labels",
   lambda h, t: _L.softmax_cross_entropy_with_integer_labels(h, t), ints(0, 5, (4,))),
  ("safe_softmax_cross_entropy", lambda h, t: _L.safe_softmax_cross_entropy(h, t), _probs),
  ("sigmoid_binary_cross_entropy", lambda h, t: _L.sigmoid_binary_cross_entropy(h, t), _binary),
  ("sigmoid_focal_loss", lambda h, t: _L.sigmoid_focal_loss(h, t, alpha=0.25, gamma=2.0), _binary),
  ("sigmoid_focal_loss[gamma=0]", lambda h, t: _L.sigmoid_focal_loss(h, t), _binary),
  ("l2_loss", lambda h, t: _L.l2_loss(h, t), _targets),
  ("squared_error", lambda h, t: _L.squared_error(h, t), _targets),
  ("huber_loss", lambda h, t: _L.huber_loss(h, t, delta=1.0), _targets),
  ("log_cosh", lambda h, t: _L.log_cosh(h, t), _targets),
  ("cosine_distance", lambda h, t: _L.cosine_distance(h, t), _targets),
  ("cosine_similarity", lambda h, t: _L.cosine_similarity(h, t), _targets),
  ("kl_divergence", lambda h, t: _L.kl_divergence(jax.nn.log_softmax(h), t), _probs),
  ("kl_divergence_with_log_targets",
   lambda h, t: _L.kl_divergence_with_log_targets(jax.nn.log_softmax(h), jnp.log(t)), _probs),
  ("convex_kl_divergence", lambda h, t: _L.convex_kl_divergence(jax.nn.log_softmax(h), t), _probs),
  ("hinge_loss", lambda h, t: _L.hinge_loss(h, t * 2 - 1), _binary),
  ("perceptron_loss", lambda h, t: _L.perceptron_loss(h, t * 2 - 1), _binary),
  ("multiclass_hinge_loss", lambda h, t: _L.multiclass_hinge_loss(h, t), ints(0, 5, (4,))),
  ("multiclass_perceptron_loss", lambda h, t: _L.multiclass_perceptron_loss(h, t), ints(0, 5, (4,))),
  ("poly_loss_cross_entropy", lambda h, t: _L.poly_loss_cross_entropy(h, t), _probs),
  ("sparsemax_loss", lambda h, t: _L.sparsemax_loss(h, t), _binary),
  ("multiclass_sparsemax_loss", lambda h, t: _L.multiclass_sparsemax_loss(h, t), ints(0, 5, (4,))),
  ("smooth_labels", lambda h, t: _L.smooth_labels(jax.nn.softmax(h), 0.1), _probs),
  ("ranking_softmax_loss", lambda h, t: _L.ranking_softmax_loss(h, t), _binary),
  ("triplet_margin_loss", lambda h, t: _L.triplet_margin_loss(h, t, h[::-1]), _targets),
  ("ntxent", lambda h, t: _L.ntxent(h, jnp.array([0, 0, 1, 1])), _targets),
  ("dice_loss", lambda h, t: _L.dice_loss(h, t), _probs),
  ("binary_dice_loss", lambda h, t: _L.binary_dice_loss(h, t), _binary),
  ("generalized_kl_divergence", lambda h, t: _L.generalized_kl_divergence(
    jax.nn.log_softmax(h), t), _probs),
  ("fenchel_young[logsumexp]", lambda h, t: _L.make_fenchel_young_loss(jax.nn.logsumexp)(h, t), _probs),
]  # fmt: skip
for _name, _loss, _target in LOSSES:
  if has(_L, _name.split("[")[0]) and not (
    _name.startswith("fenchel") and not has(_L, "make_fenchel_young_loss")
  ):
    add(f"optax.{_name}", lambda x, w, t, loss=_loss: loss(x @ w, t), with_extra(_logits(), _target),
        grad=_name not in {"sparsemax_loss", "multiclass_sparsemax_loss"})  # fmt: skip


def _ctc(x: Any, w: Any, labels: Any) -> Any:
  logits = (x @ w).reshape(2, 6, 5)
  logit_pad = jnp.zeros((2, 6)).at[1, 5:].set(1.0)
  label_pad = jnp.zeros((2, 3)).at[1, 2:].set(1.0)
  return _L.ctc_loss(logits, logit_pad, labels, label_pad)


add("optax.ctc_loss", _ctc, with_extra(dense((12, 6), (6, 5), scale=2.0), ints(1, 5, (2, 3))))
add("optax.mean_cross_entropy", lambda x, w, t: jnp.mean(
  _L.softmax_cross_entropy_with_integer_labels(x @ w, t)), with_extra(_logits(), ints(0, 5, (4,))))

# -- layers and models written by hand, as a framework writes them.


def _layer_norm(h: Any, scale: Any, bias: Any) -> Any:
  mean = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
  return (h - mean) * lax.rsqrt(var + 1e-6) * scale + bias


def _rms_norm(h: Any, scale: Any) -> Any:
  return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * scale


def _mlp_block(x: Any, w1: Any, b1: Any, w2: Any, s: Any) -> Any:
  h = _layer_norm(x, s, 0.0)
  return x + jax.nn.gelu(h @ w1 + b1) @ w2


def _gpt_block(x: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
  h = _rms_norm(x, 1.0)
  att = jax.nn.dot_product_attention(*_qkv(h, wq, wk, wv), is_causal=True)
  return x + att.reshape(*x.shape) @ wo


def _rotary(x: Any, w: Any) -> Any:
  h = x @ w  # (t, d)
  half = h.shape[-1] // 2
  freq = 1.0 / (10000 ** (jnp.arange(half) / half))
  angle = jnp.arange(h.shape[0])[:, None] * freq
  a, b = h[..., :half], h[..., half:]
  return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle),
                          a * jnp.sin(angle) + b * jnp.cos(angle)], -1)  # fmt: skip


def _batch_norm(x: Any, k: Any) -> Any:
  h = _conv(x, k)
  mean = jnp.mean(h, (0, 1, 2))
  var = jnp.var(h, (0, 1, 2))
  return jax.nn.relu((h - mean) / jnp.sqrt(var + 1e-5))


MODELS = [
  ("layer_norm", lambda x, w, s, b: _layer_norm(x @ w, s, b), dense((4, 8), (8, 8), (8,), (8,))),
  ("rms_norm", lambda x, w, s: _rms_norm(x @ w, s), dense((4, 8), (8, 8), (8,))),
  ("group_norm", lambda x, w: (lambda h: (h - h.mean(-1, keepdims=True)) / jnp.sqrt(
    h.var(-1, keepdims=True) + 1e-5))((x @ w).reshape(4, 2, 4)), dense((4, 8), (8, 8))),
  ("mlp_block", _mlp_block, dense((4, 8), (8, 16), (16,), (16, 8), (8,))),
  ("gpt_block", _gpt_block, dense((1, 5, 8), (8, 8), (8, 8), (8, 8), (8, 8))),
  ("rotary", _rotary, dense((6, 8), (8, 8))),
  ("batch_norm_conv", _batch_norm, dense((2, 6, 6, 2), (3, 3, 2, 4))),
  ("residual_tanh", lambda x, w: x + jnp.tanh(x @ w), dense((4, 8), (8, 8))),
  ("swiglu", lambda x, w, v: jax.nn.silu(x @ w) * (x @ v), dense((4, 8), (8, 16), (8, 16))),
  ("mixture_gate", lambda x, w, e: jnp.einsum("te,ted->td", jax.nn.softmax(x @ w), jnp.einsum(
    "td,edk->tek", x, e)), dense((4, 8), (8, 3), (3, 8, 8))),
  ("embedding", lambda x, w, t: jnp.take(x @ w, t, axis=0), with_extra(dense((6, 8), (8, 8)),
                                                                       ints(0, 6, (4,)))),
  ("l2_normalize_rows", lambda x, w: (lambda h: h * lax.rsqrt(jnp.sum(h * h, -1, keepdims=True)))(
    x @ w), dense((4, 8), (8, 8))),
  ("mse", lambda x, w, y: jnp.mean((x @ w - y) ** 2), dense((4, 8), (8, 3), (4, 3))),
  ("mae", lambda x, w, y: jnp.mean(jnp.abs(x @ w - y)), dense((4, 8), (8, 3), (4, 3))),
  ("logits_accuracy", lambda x, w, y: (jnp.mean(jnp.argmax(x @ w, -1) == y),
                                       jnp.sum(jnp.argmax(x @ w, -1) == y)),
   with_extra(act(-4, 4, unique=True), ints(0, 4, (3,))), {"grad": False}),
  ("int_counter", lambda x, w, n: (n + 1, jnp.sum(x @ w)), with_extra(act(-4, 4), ints(0, 9, ()))),
]  # fmt: skip
for _name, _fn, _args, *_kw in MODELS:
  add(f"model.{_name}", _fn, _args, **(_kw[0] if _kw else {}))

# -- extreme magnitudes: activations near 300 (their squares overflow float16: 65504) and near
# 3e4 (their sums and differences do). Exact in bfloat16 and float16. bfloat16 has float32's range:
# there these check precision only. Not under grad: at these magnitudes the gradients of O(1)
# weights overflow or underflow float16 in any mixed-precision scheme (what loss scaling is for);
# tests/test_autocast_ops.py checks the gradients of norms of activations of 300 on their own.

BIG = {"300": (256, 384), "3e4": (16384, 32768)}
EXTREME = [
  ("sum", lambda h: jnp.sum(h, -1)), ("mean", lambda h: jnp.mean(h, -1)),
  ("var", lambda h: jnp.var(h, -1)), ("std", lambda h: jnp.std(h)),
  ("square", lambda h: jnp.square(h)), ("mul_self", lambda h: h * h),
  ("norm", lambda h: jnp.linalg.norm(h)), ("norm[axis=-1]", lambda h: jnp.linalg.norm(h, axis=-1)),
  ("vector_norm", lambda h: jnp.linalg.vector_norm(h, axis=0)),
  ("l2_normalize", lambda h: h / jnp.linalg.norm(h, axis=-1, keepdims=True)),
  ("rms_norm", lambda h: h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)),
  ("layer_norm", lambda h: _layer_norm(h, 1.0, 0.0)),
  ("standardize", lambda h: jax.nn.standardize(h, axis=-1)),
  ("softmax", lambda h: jax.nn.softmax(h / 64, axis=-1)),
  ("logsumexp", lambda h: jax.nn.logsumexp(h / 64, axis=-1)),
  ("cosine_similarity", lambda h: _L.cosine_similarity(h, h[::-1])),
  ("hypot", lambda h: jnp.hypot(h, h[::-1])),
  ("avg_pool", lambda h: _window(h.reshape(1, 3, 4, 1), lax.add, 0.0) / 4),
  ("avg_pool[same]", lambda h: _window(h.reshape(1, 3, 4, 1), lax.add, 0.0, 3, 1, "SAME") / 9),
  ("cumsum", lambda h: jnp.cumsum(h, -1)), ("mean_of_squares", lambda h: jnp.mean(h**2)),
  ("corrcoef", lambda h: jnp.corrcoef(h)),
]  # fmt: skip
for _size, _range in BIG.items():
  for _name, _op in EXTREME:
    add(f"extreme.{_name}[{_size}]", lambda x, w, op=_op: op(x @ w), act(*_range, unique=True),
        grad=False)  # fmt: skip
# Differences of two activations of opposite signs, 2.5e4 to 5e4: 5e4 to 1e5 apart.
EXTREME2 = [
  ("squared_error", lambda a, b: _L.squared_error(a, b)), ("l2_loss", lambda a, b: _L.l2_loss(a, b)),
  ("huber_loss", lambda a, b: _L.huber_loss(a, b)), ("mse", lambda a, b: jnp.mean((a - b) ** 2)),
  ("softmax_cross_entropy", lambda a, b: _L.softmax_cross_entropy(
    jnp.concatenate([a, b], -1), jnp.full((3, 8), 0.125))),
  ("log_softmax", lambda a, b: jax.nn.log_softmax(jnp.concatenate([a, b], -1))),
]  # fmt: skip
for _name, _op in EXTREME2:
  add(f"extreme.{_name}[+-4e4]", lambda x, w, op=_op: op(*halves(x @ w)),
      act2(24576, 49152, -49152, -24576), grad=False)  # fmt: skip
# A mean of many 16-bit values (a window sum accumulated in float32 leaves one rounding): 512 wide.
add("extreme.avg_pool[512]", lambda x, w: lax.reduce_window((x @ w).reshape(1, 1024), 0.0, lax.add,
    (1, 512), (1, 256), "VALID") / 512, act(0.5, 1.5, (256, 4)), tol=4,
    grad=False)  # fmt: skip  (XLA constant-folds its transpose for seconds)

# What XLA lowers on the CPU only: `schur` and `hessenberg` (no GPU kernels; `sqrtm` is a
# Schur decomposition), integer convolutions (cuDNN has none).
_CPU_ONLY = ("scipy_linalg.hessenberg", "scipy_linalg.schur", "scipy_linalg.sqrtm",
             "lax_linalg.schur", "lax_linalg.hessenberg", "lax.conv_int")  # fmt: skip
# Whose gradients go through the derivative rules of float32 kernels (every case, full run).
_KERNEL_GRADS = (
  "control.custom_linear_solve", "lax_linalg.cholesky", "lax_linalg.eigh", "lax_linalg.qr",
  "lax_linalg.svd", "lax_linalg.triangular_solve", "linalg.cholesky", "linalg.eigh",
  "linalg.eigvalsh", "linalg.inv", "linalg.lstsq", "linalg.norm[-2]", "linalg.norm[2]",
  "linalg.norm[nuc]", "linalg.qr", "linalg.solve", "linalg.svd", "linalg.svdvals",
  "linalg.tensorinv", "linalg.tensorsolve", "scipy_linalg.cho_solve", "scipy_linalg.expm",
  "scipy_linalg.inv", "scipy_linalg.lu_solve", "scipy_linalg.solve[assume_a=pos]",
  "scipy_linalg.solve_triangular",
)  # fmt: skip
for _i, _entry in enumerate(ENTRIES):
  if _entry.name in _CPU_ONLY:
    _entry = ENTRIES[_i] = dataclasses.replace(_entry, backends=("cpu",))
  if _entry.name in _KERNEL_GRADS:
    ENTRIES[_i] = dataclasses.replace(_entry, grad_products="any")

NAMES = [e.name for e in ENTRIES]
assert len(NAMES) == len(set(NAMES)), sorted(n for n in NAMES if NAMES.count(n) > 1)
BY_NAME = {e.name: e for e in ENTRIES}
assert set(_CPU_ONLY + _KERNEL_GRADS) <= set(BY_NAME), set(_CPU_ONLY + _KERNEL_GRADS) - set(BY_NAME)
