"""The table of `autocast`: which dtype each JAX primitive runs in.

The float32 list starts from `torch.amp`'s ("CUDA ops that can autocast to
float32"), mapped to the JAX primitives those ops lower to, and differs from
it where JAX's primitives are not PyTorch's ops (docs/guides/mixed_precision.md,
"Which ops run in which dtype", explains every difference):

- torch lists composite ops (`layer_norm`, `softmax`, `cross_entropy`, the
  losses); JAX decomposes them, so their parts are listed: the sums
  (`reduce_sum`), `exp`, `log`, `rsqrt`, `square` and `integer_pow` (a
  variance's squares overflow float16 above 256). Their statistics therefore
  run in float32 whatever function computes them.
- `logistic` (sigmoid) is here, torch keeps it in float16; `sqrt` is not,
  torch has no entry for it either; `1 / x` (a `div` whose numerator is a
  Python number) is, as torch's `__rdiv__`.
- special functions (`lgamma`, `digamma`, `erf_inv`, ...) and linear algebra
  (`cholesky`, `triangular_solve`, ...): float32, as torch runs them (they
  have no float16 kernels there).

A primitive missing from the table raises `UnknownPrimitiveError` naming it;
`autocast(..., rules={name: kind})` adds or overrides entries per call.
"""

from __future__ import annotations

from collections.abc import Mapping

from optax_lossscale._src.precision import autocast_control as control
from optax_lossscale._src.precision import autocast_interpreter as interp

# Matrix products and convolutions: inputs in the compute dtype, float32 accumulation.
COMPUTE = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# Overflow- and precision-prone: inputs promoted to at least float32.
FLOAT32 = (
  # exponentials, logarithms and powers (torch: exp, expm1, log, log1p, log2, log10, pow)
  "exp", "exp2", "expm1", "log", "log1p", "logistic", "pow", "integer_pow", "square",
  # reciprocals and the functions that overflow (torch: rsqrt, reciprocal, tan, cosh, sinh, ...)
  "rsqrt", "tan", "acos", "asin", "acosh", "asinh", "atanh", "cosh", "sinh",
  # sums and products over many elements (torch: sum, prod, cumsum, cumprod, logsumexp)
  "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
  # special functions (torch: erfinv)
  "erf_inv", "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a",
  "random_gamma_grad", "zeta", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
  # linear algebra and the FFT: no float16 kernels on any backend
  "fft", "cholesky", "cholesky_update", "eig", "eigh", "svd", "qr", "lu", "schur",
  "hessenberg", "tridiagonal", "tridiagonal_solve", "triangular_solve", "householder_product",
  "geqrf", "geqp3", "ormqr", "symmetric_product",
)  # fmt: skip

# Everything else that computes or moves floats: inputs meet in their widest dtype.
WIDEST = (
  "add", "add_any", "sub", "mul", "max", "min", "neg", "abs", "sign", "floor", "ceil",
  "round", "rem", "nextafter", "atan", "atan2", "sin", "cos", "tanh", "sqrt", "cbrt", "erf",
  "erfc", "is_finite", "eq", "ne", "lt", "gt", "le", "ge", "eq_to", "le_to", "lt_to",
  "select_n", "clamp", "complex", "conj", "real", "imag", "convert_element_type", "copy",
  "copy_p", "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "rev",
  "slice", "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "split",
  "tile", "select_and_gather_add", "select_and_scatter_add", "reduce_max", "reduce_min",
  "argmax", "argmin", "cummax", "cummin", "top_k", "approx_top_k", "reduce_window_max",
  "reduce_window_min", "reduce_window_sum", "stop_gradient", "ragged_all_to_all",
  "sharding_constraint", "reshard", "mesh_cast", "layout_constraint",
  "with_memory_space_constraint", "zeros_like", "empty", "empty2",
  # integer, boolean and key work: nothing floating to cast
  "iota", "and", "or", "not", "xor", "shift_left", "shift_right_arithmetic",
  "shift_right_logical", "population_count", "clz", "mulhi", "reduce_and", "reduce_or",
  "reduce_xor", "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap",
  "random_unwrap", "threefry2x32", "rng_bit_generator", "axis_index",
)  # fmt: skip

# Operands that never meet: each keeps its dtype.
INDEPENDENT = (
  "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all", "reduce_scatter",
  "pbroadcast", "psum_invariant", "all_gather_invariant", "pvary", "device_put",
  "optimization_barrier", "sort",
)  # fmt: skip

# Dtypes fixed by the function: bitcasts, typed kernels and callbacks, custom_vjp.
AS_WRITTEN = (
  "bitcast_convert_type", "reduce_precision", "rng_uniform", "random_gamma",
  "custom_vjp_call", "custom_vjp_call_jaxpr", "pure_callback", "io_callback",
  "debug_callback", "debug_print", "ffi_call", "pallas_call", "custom_linear_solve",
  "reduce", "reduce_window", "select_and_scatter", "scatter", "scatter-add", "scatter-sub",
  "scatter-mul", "scatter-min", "scatter-max", "scatter_add", "scatter_mul", "scatter_min",
  "scatter_max",
)  # fmt: skip

# Primitives holding jaxprs.
CONTROL: Mapping[str, interp.Rule] = {
  "jit": control.inline,
  "pjit": control.inline,
  "closed_call": control.inline,
  "core_call": control.inline,
  "remat2": control.remat,
  "checkpoint": control.remat,
  "cond": control.cond,
  "while": control.while_loop,
  "scan": control.scan,
  "custom_jvp_call": control.custom_jvp,
  "shard_map": control.shard_map,
}

KIND_OF: dict[str, str] = {
  **dict.fromkeys(COMPUTE, "compute"),
  **dict.fromkeys(FLOAT32, "float32"),
  **dict.fromkeys(WIDEST, "widest"),
  **dict.fromkeys(INDEPENDENT, "independent"),
  **dict.fromkeys(AS_WRITTEN, "as_written"),
}

RULES: dict[str, interp.Rule] = {
  **{name: interp.KINDS[kind] for name, kind in KIND_OF.items()},
  "div": interp.reciprocal_in_float32,
  **CONTROL,
}
