"""The table of `autocast`: which dtype each JAX primitive runs in.

Every primitive the supported jax releases define has an entry
(`tests/test_autocast_primitives.py` walks the installed jax and fails on one
without), so a new release's primitive is caught by CI, not by a user.

- compute: the matrix products (16-bit operands, float32 accumulation).
- float32: arithmetic, every op that rounds: a fused kernel computes in
  float32 whatever it stores, and so does autocast (torch.amp's float32
  list, `exp`, `log`, `pow`, the sums and norms, the losses, is a subset;
  docs/guides/mixed_precision.md lists the differences). Their results are
  float32; what the backward pass keeps of them is 16-bit (`regions`).
- widest: the exact ops (data movement, comparisons, max and min, select,
  random bits): a 16-bit value moves in 16 bits.
- kernels: linear algebra and the FFT, float32 (no 16-bit kernels anywhere),
  and, being costly, never recomputed in a region's backward pass.
- independent: operands that never meet (collectives, sort, sharding hints).
- as_written: dtypes the function fixed (bitcasts, typed kernels, callbacks,
  scatters, references, sparse arrays).

Libraries that define primitives (Equinox, Lineax) have entries by name in
`LIBRARIES`: the core never imports them.

The primitives that only live inside a Pallas, Mosaic or Triton kernel's own
jaxpr have no entry: `pallas_call` runs as written and autocast never enters
its kernel (`tests/test_autocast_primitives.py` lists them).

The float32 and widest primitives join regions; everything else is a region
boundary (`name`, `checkpoint_name`'s primitive, too: it marks what a remat
policy may save).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optax_lossscale._src.autocast import control, products
from optax_lossscale._src.autocast import interpreter as interp

# Matrix products and convolutions: compute-dtype operands, float32 accumulation.
COMPUTE = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# Arithmetic: inputs promoted to at least float32.
FLOAT32 = (
  "add", "add_any", "sub", "mul", "div", "rem", "pow", "integer_pow", "square", "sqrt",
  "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh",
  "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
  "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "igamma", "igammac",
  "igamma_grad_a", "random_gamma_grad", "zeta", "bessel_i0e", "bessel_i1e",
  "regularized_incomplete_beta", "nextafter", "complex",
  # jax >= 0.11: `log2`; `1 - x**2` (tanh's gradient); a polynomial by Horner (polyval, sinc)
  "log2", "one_minus_square", "polynomial",
  # sums and products over many elements: accumulated in float32
  "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
  "select_and_scatter_add",
)  # fmt: skip

# Exact ops: inputs meet in their widest floating dtype.
WIDEST = (
  "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "max", "min", "clamp", "eq",
  "ne", "lt", "gt", "le", "ge", "eq_to", "le_to", "lt_to", "select_n", "real", "imag", "conj",
  "convert_element_type", "copy", "copy_p", "broadcast_in_dim", "reshape", "transpose",
  "squeeze", "expand_dims", "rev", "slice", "dynamic_slice", "dynamic_update_slice", "gather",
  "concatenate", "pad", "split", "tile", "stack", "unstack", "reduce_max", "reduce_min",
  "argmax", "argmin", "cummax", "cummin", "top_k", "approx_top_k", "reduce_window_max",
  "reduce_window_min", "select_and_gather_add", "stop_gradient", "zeros_like", "empty",
  "empty2",
  # integer, boolean and key work: nothing floating to cast
  "iota", "and", "or", "not", "xor", "shift_left", "shift_right_arithmetic",
  "shift_right_logical", "population_count", "clz", "mulhi", "reduce_and", "reduce_or",
  "reduce_xor", "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap",
  "random_unwrap", "random_clone", "threefry2x32", "threefry4x32", "philox2x32",
  "philox4x32", "iota_2x32_shape", "rng_bit_generator",
)  # fmt: skip


# Linear algebra and the FFT: float32 (no 16-bit kernels), never recomputed.
KERNELS = (
  "fft", "cholesky", "cholesky_update", "eig", "eigh", "svd", "qr", "lu", "schur",
  "hessenberg", "tridiagonal", "tridiagonal_solve", "triangular_solve", "householder_product",
  "geqrf", "geqp3", "ormqr", "symmetric_product", "eigh_jacobi",
)  # fmt: skip

# Operands that never meet: each keeps its dtype.
INDEPENDENT = (
  "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all", "reduce_scatter",
  "pbroadcast", "psum_invariant", "all_gather_invariant", "all_gather_reduced", "pvary",
  "preduced", "unreduced_psum", "unreduced_reduce_scatter", "vary_unreduced_cast_p",
  "reduced_vary_cast_p", "psend", "precv", "ragged_all_to_all",
  # jax >= 0.11: the casts renamed without `_p`, unreduced max and min, a broadcast from a
  # dynamic source
  "reduced_vary_cast", "vary_unreduced_cast", "unreduced_pmax", "unreduced_pmin",
  "pbroadcast_dynamic",
  # the asynchronous halves of the collectives
  "psum_start", "psum_done", "psum_invariant_start", "all_gather_start", "all_gather_done",
  "all_gather_reduced_start", "all_to_all_start", "all_to_all_done", "ppermute_start",
  "ppermute_done", "pbroadcast_start", "pbroadcast_done", "reduce_scatter_start",
  "reduce_scatter_done", "unreduced_psum_start", "unreduced_reduce_scatter_start",
  # placement, sharding and ordering: the values pass through
  "device_put", "optimization_barrier", "sort", "sharding_constraint", "reshard", "mesh_cast",
  "layout_constraint", "with_memory_space_constraint", "shard_alike", "inspect_sharding",
  "axis_index", "platform_index", "create_token", "after_all", "dce_sink", "tie", "pin",
  "unpin", "dimension_size", "dim_as_value", "shape_assertion", "lu_pivots_to_permutation",
  "full_to_shard", "shard_to_full", "pgather", "global_array_to_host_local_array",
  "host_local_array_to_global_array", "relayout",
)  # fmt: skip

# Dtypes fixed by the function: bitcasts, typed kernels and callbacks, refs.
AS_WRITTEN = (
  "bitcast_convert_type", "reduce_precision", "rng_uniform", "random_gamma",
  "custom_vjp_call_jaxpr", "custom_jvp_call_jaxpr", "pure_callback",
  "io_callback", "debug_callback", "debug_print", "buffer_callback", "ffi_call",
  "pallas_call", "tpu_custom_call", "cudnn_fusion", "custom_partitioning",
  "custom_linear_solve", "custom_vmap_call", "linear_call", "custom_lin", "remat_opt",
  "composite", "compute_on", "call_exported", "check", "xla_metadata_value", "eval_jaxpr",
  # jax >= 0.12: a call whose equations run in program order (a jaxpr bound as written)
  "program_order",
  "xla_metadata_call", "fused_call", "scheduling_group", "custom_transpose_call",
  "custom_dce_call", "dce_sential", "for", "assert_consumed_value", "consume", "array_ref",
  # jax < 0.8 only: pmap's own primitive (later releases build pmap from jit and shard_map)
  "xla_pmap",
  "reduce", "reduce_window", "select_and_scatter", "scatter", "scatter-add", "scatter-sub",
  "scatter-mul", "scatter-min", "scatter-max", "scatter_add", "scatter_mul", "scatter_min",
  "scatter_max", "to_edtype", "from_edtype", "unreachable",
  # typed fused kernels (cuDNN attention, scaled and fp8 matmuls)
  "dot_product_attention_fwd", "dot_product_attention_bwd",
  "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
  "dot_product_attention_fp8_fwd", "dot_product_attention_fp8_bwd",
  "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper",
  "scaled_matmul", "scaled_matmul_wrapper", "scaled_dot", "rnn_fwd", "rnn_bwd", "bias_fwd",
  "bias_bwd", "mosaic_gpu_p",
  # sparse arrays (jax.experimental.sparse): typed kernels
  "bcoo_dot_general", "bcoo_dot_general_sampled", "bcoo_extract", "bcoo_fromdense",
  "bcoo_sort_indices", "bcoo_spdot_general", "bcoo_sum_duplicates", "bcoo_todense",
  "bcoo_transpose", "bcsr_dot_general", "bcsr_extract", "bcsr_fromdense", "bcsr_todense",
  "coo_fromdense", "coo_matmat", "coo_matvec", "coo_spmm", "coo_spmv", "coo_todense",
  "csr_fromdense", "csr_matmat", "csr_matvec", "csr_spmm", "csr_spmv", "csr_todense", "todense",
  "spsolve", "sparse_dense_matmul", "sparse_pack_nm",
  # references (mutable arrays) and hijax boxes: a write takes the reference's dtype
  "get", "swap", "addupdate", "new_ref", "empty_ref", "free_ref", "freeze",
  "accum_grad_in_ref", "create_linear", "broadcast_to", "run_state", "new_box", "box_get",
  "box_set", "new_log", "log_extend", "log_read", "call_hi_primitive",
  "call_hi_primitive_linearized", "stage",
  # whole kernels and fusions built by hand (Pallas core_map, fusers)
  "core_map", "mpmd_map", "fusible", "pack_dtype", "unpack_dtype", "custom_fusion",
  # jax.experimental.thunky (jax >= 0.12): XLA:GPU thunks on typed device buffers
  "thunky.all_gather", "thunky.all_reduce", "thunky.all_to_all", "thunky.async_done",
  "thunky.async_start", "thunky.call_jax", "thunky.call_thunky_nested",
  "thunky.collective_group", "thunky.collective_permute", "thunky.cond", "thunky.copy",
  "thunky.custom_call", "thunky.inline_constant", "thunky.memset", "thunky.memzero",
  "thunky.ptx_kernel", "thunky.reduce_scatter", "thunky.while",
)  # fmt: skip

# Primitives that libraries define (named here, never imported: the core imports neither).
# None joins a region: a region is differentiated and compiled whole, and some of these
# refuse a transformation on purpose (`nontraceable`, `nondifferentiable_backward`).
LIBRARIES: Mapping[str, str] = {
  # Equinox 0.13 (equinox.internal): reductions over the batch that ignore vmap, on booleans
  # and integers; identities that refuse a transformation; a select and a buffer write of
  # its while loops, whose operands must agree (widest, so a 16-bit value stays 16-bit);
  # `noinline` calls a function traced for the declared dtypes.
  "unvmap_all": "independent", "unvmap_any": "independent", "unvmap_max": "independent",
  "nontraceable": "independent", "nondifferentiable_backward": "independent",
  "nonbatchable": "independent", "announce_jaxpr": "independent",
  "select_if_vmap": "widest", "maybe_set": "widest", "noinline": "as_written",
  # Lineax (diffrax's and optimistix's linear solves): the operator's declared dtypes.
  "linear_solve": "as_written",
}  # fmt: skip


def _batched(ctx: interp.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  """Equinox's `vprim`: a primitive under `vmap`, run by the rule of its kind.

  Equinox batches its primitives (`maybe_set`, Lineax's `linear_solve`) by
  binding `vprim` with the primitive as a parameter; the batched one runs in
  the dtypes the unbatched one would. A primitive without a first-order kind
  runs as written.
  """
  rule = ctx.rules.get(eqn.params["prim"].name)
  if rule not in KINDS.values():
    rule = interp.as_written
  return rule(ctx, eqn, invals)


# Primitives holding jaxprs.
CONTROL: Mapping[str, interp.Rule] = {
  "jit": control.jit,
  "pjit": control.jit,
  "closed_call": control.inline,
  "core_call": control.inline,
  "call": control.inline,
  "remat2": control.remat,
  "checkpoint": control.remat,
  "cond": control.cond,
  "while": control.while_loop,
  "scan": control.scan,
  "custom_jvp_call": control.custom_jvp,
  "custom_vjp_call": control.custom_vjp,
  "shard_map": control.shard_map,
  # exact, but a region boundary: `checkpoint_name` marks what a remat policy saves
  "name": control.name,
}

KIND_OF: dict[str, str] = {
  **dict.fromkeys(COMPUTE, "compute"),
  **dict.fromkeys(FLOAT32 + KERNELS, "float32"),
  **dict.fromkeys(WIDEST, "widest"),
  **dict.fromkeys(INDEPENDENT, "independent"),
  **dict.fromkeys(AS_WRITTEN, "as_written"),
  **LIBRARIES,
}

KINDS: dict[str, interp.Rule] = {
  "compute": products.compute,
  "float32": interp.float32,
  "widest": interp.widest,
  "as_written": interp.as_written,
  "independent": interp.independent,
}

RULES: dict[str, interp.Rule] = {
  **{name: KINDS[kind] for name, kind in KIND_OF.items()},
  **CONTROL,
  "vprim": _batched,
}

# What may join a region (see the module docstring).
FUSIBLE = frozenset(FLOAT32 + WIDEST)
