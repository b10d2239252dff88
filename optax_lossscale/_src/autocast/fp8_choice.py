"""Which matrix products run in fp8 under `autocast(..., fp8=recipe, fp8_products=...)`, and why.

`decide` gives each `dot_general` a verdict and a reason (the report's):
operands that can be quantized (16- or 32-bit floats), every dimension at
least 16, then the user's choice: 'auto', a cost model of an H100
(`predicted_speedup`, from the bytes the fp8 program moves, `traffic`);
'all'; or a callable given the product's `Product` description.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._src.autocast import fp8

# Below 16 a dimension is padded to 16 by cuBLASLt's fp8 GEMM (XLA's rewriter
# pads it), and such a product is too small to profit anyway.
MIN_DIMENSION = 16

# The cost model of `predicted_speedup`, an H100's: achieved (not peak) GEMM
# rates and memory bandwidth, and the bytes the fp8 program moves (`traffic`).
# Checked against torchao's two published H100 measurements of a float8
# linear against bfloat16, forward and backward (M, K, N = 1024, 2048, 1024:
# x0.80; 4096, 8192, 16384: x1.39). Unmeasured with XLA:
# `benchmarks/fp8_autocast_bench.py --gpu` prints it beside the timings.
BF16_FLOPS = 700e12
FP8_FLOPS = 1150e12
MEMORY_BYTES_PER_S = 3.0e12

# What `autocast(..., fp8_products=...)` accepts besides a callable.
PRODUCTS = ("auto", "all")


class Product(NamedTuple):
  """A matrix product as `autocast(..., fp8_products=fn)` shows it to `fn`.

  Attributes:
    name: the module path of the equation, from the jaxpr's name stack (a Flax
      module's path such as 'Transformer/block_0/mlp/up', a `jax.named_scope`);
      '' where the function names nothing.
    dims: `(batch, m, n, k)`, the sizes of one matrix product and the batch size.
    dtypes: the operands' dtype names, as the function wrote them.
    speedup: the cost model's prediction for it (`predicted_speedup`), forward
      and backward.
  """

  name: str
  dims: tuple[int, int, int, int]
  dtypes: tuple[str, str]
  speedup: float


def check_products(products: Any) -> None:
  """Raises unless `products` is 'auto', 'all' or a callable."""
  if callable(products) or (isinstance(products, str) and products in PRODUCTS):
    return
  raise ValueError(
    "fp8_products must be 'auto' (the cost model), 'all' (every product whose dimensions"
    " allow it) or a callable taking an ols fp8 Product (name, dims, dtypes, speedup) and"
    f" returning whether it runs in fp8; got {products!r}."
  )


class Traffic(NamedTuple):
  """Bytes one fp8 product moves in a training step (forward and both backward products).

  Attributes:
    quantize: the amax passes and the quantize passes (read the source twice,
      write the fp8 copy) of each quantized tensor.
    gemms: the three GEMMs' reads of their fp8 operands and writes of their
      outputs.
    rescale: the passes that rescale an output by vectors (rowwise), where the
      GEMM cannot fold a scalar.
    gradient: the rowwise gradient with a saved operand's scales moved onto it,
      written and read back where the amax reduction cannot fuse its producer.
    transpose: fp8 copies laid out for a GEMM that takes only K-major fp8
      operands (cuBLASLt's fp8 GEMMs on Hopper): each tensor serves one of its
      two products transposed.
  """

  quantize: float
  gemms: float
  rescale: float
  gradient: float
  transpose: float

  @property
  def total(self) -> float:
    return self.quantize + self.gemms + self.rescale + self.gradient + self.transpose

  @property
  def scaling(self) -> float:
    """What current scaling adds to the GEMMs' own traffic."""
    return self.total - self.gemms


def traffic(
  m: int,
  n: int,
  k: int,
  recipe: str = "tensorwise",
  *,
  source_bytes: int | tuple[int, int, int] = 4,
  out_bytes: int = 4,
  stored_bytes: int = 1,
  folds_scalar: bool = True,
  fuses_producers: bool = True,
  k_major_fp8: bool = True,
) -> Traffic:
  """The bytes the program of one fp8 product and its two backward products moves.

  Each operand is quantized once (an amax pass and a quantize pass over its
  source, `source_bytes` wide: one width, or the lhs's, the rhs's and the
  gradient's; an fp8 write of `stored_bytes`), the gradient
  once ('tensorwise') or once per backward product ('rowwise'); each of the
  three GEMMs reads its two fp8 operands and writes an `out_bytes`-wide
  result; a rescale by vectors (rowwise, or any rescale where the backend
  does not fold a scalar into the GEMM: `folds_scalar=False`) reads and
  writes each float32 output again; and where an amax reduction does not
  fuse the multiply producing its input (`fuses_producers=False`), rowwise's
  scaled gradients are written and read back; where fp8 GEMMs take K-major
  operands only (`k_major_fp8`), each tensor is copied once transposed in fp8.
  The defaults are an H100's (XLA's rewriter folds a scalar, reductions fuse
  their producers, cuBLASLt's fp8 GEMMs are "TN"); XLA:CPU upcasts fp8
  (`stored_bytes=4`), folds nothing, does not fuse producers into its
  reductions and takes any layout: `tests/test_fp8_control.py` compares this
  count with its compiled programs' `cost_analysis()`.
  """
  a, b, c = m * k, k * n, m * n
  tensors = a + b + c
  sa, sb, sc = source_bytes if isinstance(source_bytes, tuple) else (source_bytes,) * 3
  gradients = c if recipe == "tensorwise" else 2 * c
  rescaled = 0 if recipe == "tensorwise" and folds_scalar else tensors
  return Traffic(
    quantize=a * (2 * sa + stored_bytes)
    + b * (2 * sb + stored_bytes)
    + gradients * (2 * sc + stored_bytes),
    gemms=2 * tensors * stored_bytes + tensors * out_bytes,
    rescale=rescaled * 8,
    gradient=0 if recipe == "tensorwise" or fuses_producers else 2 * c * 8,
    transpose=2 * tensors * stored_bytes if k_major_fp8 else 0,
  )


def predicted_speedup(
  m: int,
  n: int,
  k: int,
  recipe: str = "tensorwise",
  *,
  source_bytes: int | tuple[int, int, int] = 4,
  out_bytes: int = 4,
) -> float:
  """Time of the three bfloat16 products of a training step over their fp8 time (the model).

  Each GEMM is bound by its arithmetic or its memory traffic, whichever is
  slower (fp8 doubles the rate and halves the operand bytes), and the fp8
  step adds the scaling passes `traffic` counts, at memory speed. Operands
  are `source_bytes` wide (autocast's: float32 parameters and activations;
  `decide` passes the operands' own widths and a float32 gradient) and
  outputs `out_bytes` (autocast's: the declared float32). The batch size
  cancels.
  """
  flops = 2.0 * m * n * k
  products = ((m * k, k * n, m * n), (m * n, k * n, m * k), (m * k, m * n, k * n))
  bw = MEMORY_BYTES_PER_S
  bf16 = sum(max(flops / BF16_FLOPS, (2 * (x + y) + out_bytes * z) / bw) for x, y, z in products)
  fp8 = sum(max(flops / FP8_FLOPS, (x + y + out_bytes * z) / bw) for x, y, z in products)
  t = traffic(m, n, k, recipe, source_bytes=source_bytes, out_bytes=out_bytes)
  return bf16 / (fp8 + t.scaling / bw)


def _is_eligible_dtype(dtype: Any) -> bool:
  dtype = np.dtype(dtype)
  return dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def decide(
  lhs_aval: Any,
  rhs_aval: Any,
  dimension_numbers: Any,
  recipe: str = "tensorwise",
  products: Any = "auto",
  name: str = "",
) -> tuple[bool, str]:
  """Whether `dot_general(lhs, rhs)` runs in fp8, and why (the report's reason).

  Both operands 16- or 32-bit floating (an fp8 operand is the function's own
  quantization, a complex or integer one is never fp8) and every dimension of
  the matrix product (m, n, k; batch dimensions are allowed) at least 16;
  then `products` decides: 'auto', `predicted_speedup` above 1; 'all', yes;
  a callable, what it returns for the product's `Product`. Convolutions are
  never fp8: they stay in the compute dtype.
  """
  for aval in (lhs_aval, rhs_aval):
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      return False, "not an array"
    if not _is_eligible_dtype(dtype):
      return False, f"{np.dtype(dtype).name} operand"
  dims = fp8.product_dims(lhs_aval.shape, rhs_aval.shape, dimension_numbers)
  _, m, n, k = dims
  if min(m, n, k) < MIN_DIMENSION:
    return False, f"below {MIN_DIMENSION}"
  widths = (np.dtype(lhs_aval.dtype).itemsize, np.dtype(rhs_aval.dtype).itemsize, 4)
  speedup = predicted_speedup(m, n, k, recipe, source_bytes=widths)
  if products == "all":
    return True, "all"
  if products == "auto":
    return speedup > 1.0, f"cost model x{speedup:.2f}"
  dtypes = (np.dtype(lhs_aval.dtype).name, np.dtype(rhs_aval.dtype).name)
  chosen = bool(products(Product(name, dims, dtypes, speedup)))
  return chosen, "chosen" if chosen else "filtered out"


def eligible(
  lhs_aval: Any,
  rhs_aval: Any,
  dimension_numbers: Any,
  recipe: str = "tensorwise",
  products: Any = "auto",
) -> bool:
  """Whether `dot_general(lhs, rhs)` runs in fp8 (`decide`'s verdict)."""
  return decide(lhs_aval, rhs_aval, dimension_numbers, recipe, products)[0]
