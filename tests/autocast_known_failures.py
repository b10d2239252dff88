"""The corpus cases `autocast` gets wrong today: issue 30's work queue, grouped by cause.

Each key is an (entry name, dtype, mode) pattern; `*` matches any run of
characters (brackets and dots are literal), dtype is "f16" or "bf16", mode one
of `tests/autocast_corpus_run.MODES`. A case that matches a key is a strict
xfail with the key's reason: once it passes it XPASSes, which fails the suite
until its key is deleted. The first matching key gives the reason. Recorded on
jax 0.10.2 with every case run (OLS_AUTOCAST_CORPUS=full); on another jax the
marks are not strict (a primitive jax 0.7.1 does not emit cannot fail there).
"""

from __future__ import annotations

import functools
import re

import jax

RECORDED_ON = "0.10.2"

# The causes, most cases first; the comment of each group names its part of issue 30.
LAX_COMPLEX = (
  "lax.complex re-bound on 16-bit operands raises inside JAX: complex does not accept dtype float16"
)
COMPLEX_CAST = (
  "complex values cast to a real dtype: complex outputs to float32, complex product "
  "operands to the compute dtype"
)
PLATFORM_INDEX = "no rule for the primitive 'platform_index'"
STACK = "no rule for the primitive 'stack'"
BATCHED_WHILE = (
  "a batched while loop (vmap of a data-dependent loop; jnp's vectorized special functions) "
  "re-bound by autocast: cond_fun must return a boolean scalar"
)
KEYS_IN_LOOPS = (
  "typed PRNG keys in a loop carry or a cond output: Cannot interpret 'key<fry>' as a data type"
)
NORM_SQUARES = (
  "jnp.linalg.norm squares with x * conj(x), a float16 mul: inf norms, zero normalised outputs"
)
NAME = "no rule for the primitive 'name'"
LU_PIVOTS = "no rule for the primitive 'lu_pivots_to_permutation'"
LOSS_DIFFERENCE = (
  "a loss's difference of two 16-bit activations 5e4 to 1e5 apart overflows float16: inf"
)
MUL_SQUARE = "a square written h * h runs in float16 and overflows (activations near 300 and 3e4)"
WINDOW_SUM = (
  "reduce_window_sum accumulates in 16 bits: inf at 3e4 in float16, 13 eps off over 512 values"
)
RANDOM_CLONE = "no rule for the primitive 'random_clone'"
UNSTACK = "no rule for the primitive 'unstack'"
GATHER_FILL = "a constant held in gather's parameters (fill_value=-1e9) is cast to float16: -inf"
LOG_SOFTMAX = (
  "log_softmax's x - max(x) runs in float16 and overflows for logits 5e4 to 1e5 apart: NaN"
)

KNOWN_FAILURES: dict[tuple[str, str, str], str] = {
  # LAX_COMPLEX (part 1, complex): 170 cases
  ("complex.abs", "*", "*"): LAX_COMPLEX,
  ("complex.angle", "*", "*"): LAX_COMPLEX,
  ("complex.complex", "*", "*"): LAX_COMPLEX,
  ("complex.conj", "*", "*"): LAX_COMPLEX,
  ("complex.einsum", "*", "*"): LAX_COMPLEX,
  ("complex.exp", "*", "*"): LAX_COMPLEX,
  ("complex.log", "*", "*"): LAX_COMPLEX,
  ("complex.matmul", "*", "*"): LAX_COMPLEX,
  ("complex.mean", "*", "*"): LAX_COMPLEX,
  ("complex.real_imag", "*", "*"): LAX_COMPLEX,
  ("complex.sin", "*", "*"): LAX_COMPLEX,
  ("complex.sqrt", "*", "*"): LAX_COMPLEX,
  ("complex.sum", "*", "*"): LAX_COMPLEX,
  ("complex.tanh", "*", "*"): LAX_COMPLEX,
  ("complex.vdot", "*", "*"): LAX_COMPLEX,
  ("complex.where", "*", "*"): LAX_COMPLEX,
  ("fft.fft_complex_in", "*", "*"): LAX_COMPLEX,
  # COMPLEX_CAST (part 1, complex): 160 cases
  ("complex.astype", "*", "autocast_vmap"): COMPLEX_CAST,
  ("complex.astype", "*", "eager"): COMPLEX_CAST,
  ("complex.astype", "*", "jit"): COMPLEX_CAST,
  ("complex.astype", "*", "vmap"): COMPLEX_CAST,
  ("complex.matmul_arg", "*", "*"): COMPLEX_CAST,
  ("complex.mixed_arg", "*", "*"): COMPLEX_CAST,
  ("complex.mul_1j", "*", "*"): COMPLEX_CAST,
  ("fft.fft", "*", "*"): COMPLEX_CAST,
  ("fft.fft2", "*", "*"): COMPLEX_CAST,
  ("fft.fft[n=8]", "*", "*"): COMPLEX_CAST,
  ("fft.fft[norm=ortho]", "*", "*"): COMPLEX_CAST,
  ("fft.fftn", "*", "*"): COMPLEX_CAST,
  ("fft.ifft", "*", "*"): COMPLEX_CAST,
  ("fft.ihfft", "*", "*"): COMPLEX_CAST,
  ("fft.rfft", "*", "*"): COMPLEX_CAST,
  ("fft.rfft2", "*", "*"): COMPLEX_CAST,
  ("jnp.sort_complex", "*", "*"): COMPLEX_CAST,
  ("linalg.eigvals", "*", "*"): COMPLEX_CAST,
  ("special.sph_harm_y", "*", "*"): COMPLEX_CAST,
  ("special.wofz", "*", "*"): COMPLEX_CAST,
  # PLATFORM_INDEX (part 2): 132 cases
  ("extreme.corrcoef[300]", "*", "*"): PLATFORM_INDEX,
  ("extreme.corrcoef[3e4]", "*", "*"): PLATFORM_INDEX,
  ("jnp.corrcoef", "*", "*"): PLATFORM_INDEX,
  ("lax.platform_dependent", "*", "*"): PLATFORM_INDEX,
  ("linalg.det", "*", "*"): PLATFORM_INDEX,
  ("linalg.det[n=5]", "*", "*"): PLATFORM_INDEX,
  ("linalg.diagonal", "*", "*"): PLATFORM_INDEX,
  ("linalg.slogdet", "*", "*"): PLATFORM_INDEX,
  ("linalg.slogdet[n=6]", "*", "*"): PLATFORM_INDEX,
  ("random.orthogonal", "*", "*"): PLATFORM_INDEX,
  ("scipy_linalg.det", "*", "*"): PLATFORM_INDEX,
  ("scipy_linalg.schur", "*", "*"): PLATFORM_INDEX,
  ("scipy_linalg.sqrtm", "*", "*"): PLATFORM_INDEX,
  ("stats.multivariate_normal.logpdf", "*", "*"): PLATFORM_INDEX,
  # STACK (part 2): 94 cases
  ("jnp.select", "*", "*"): STACK,
  ("jnp.stack", "*", "*"): STACK,
  ("jnp.stack_axis1", "*", "*"): STACK,
  ("optax.sigmoid_focal_loss", "*", "*"): STACK,
  ("optax.sigmoid_focal_loss[gamma=0]", "*", "*"): STACK,
  ("special.beta", "*", "*"): STACK,
  ("special.gamma", "*", "*"): STACK,
  ("special.gammasgn", "*", "*"): STACK,
  ("special.poch", "*", "*"): STACK,
  ("special.sici", "*", "*"): STACK,
  # BATCHED_WHILE (part 2): 70 cases
  ("control.fori_loop[dynamic]", "*", "autocast_vmap"): BATCHED_WHILE,
  ("control.while_loop", "*", "autocast_vmap"): BATCHED_WHILE,
  ("scipy_linalg.eigh_tridiagonal", "*", "autocast_vmap"): BATCHED_WHILE,
  ("scipy_linalg.polar", "*", "autocast_vmap"): BATCHED_WHILE,
  ("special.exp1", "*", "*"): BATCHED_WHILE,
  ("special.expi", "*", "*"): BATCHED_WHILE,
  ("special.expi[neg]", "*", "*"): BATCHED_WHILE,
  ("special.expn", "*", "*"): BATCHED_WHILE,
  ("special.hyp1f1", "*", "*"): BATCHED_WHILE,
  ("special.hyp1f1[ab]", "*", "*"): BATCHED_WHILE,
  ("special.hyp2f1", "*", "*"): BATCHED_WHILE,
  # KEYS_IN_LOOPS (part 2): 68 cases
  ("random.binomial", "*", "*"): KEYS_IN_LOOPS,
  ("random.key_in_while", "*", "*"): KEYS_IN_LOOPS,
  ("random.key_out_of_cond", "*", "eager"): KEYS_IN_LOOPS,
  ("random.key_out_of_cond", "*", "grad"): KEYS_IN_LOOPS,
  ("random.key_out_of_cond", "*", "jit"): KEYS_IN_LOOPS,
  ("random.key_out_of_cond", "*", "vmap"): KEYS_IN_LOOPS,
  ("random.multinomial", "*", "*"): KEYS_IN_LOOPS,
  ("random.poisson", "*", "*"): KEYS_IN_LOOPS,
  ("random.poisson[large]", "*", "*"): KEYS_IN_LOOPS,
  ("random.split_in_fori", "*", "*"): KEYS_IN_LOOPS,
  ("random.split_in_scan", "*", "*"): KEYS_IN_LOOPS,
  # NORM_SQUARES (part 1, squares): 32 cases
  ("extreme.l2_normalize[300]", "f16", "*"): NORM_SQUARES,
  ("extreme.l2_normalize[3e4]", "f16", "*"): NORM_SQUARES,
  ("extreme.norm[300]", "f16", "*"): NORM_SQUARES,
  ("extreme.norm[3e4]", "f16", "*"): NORM_SQUARES,
  ("extreme.norm[axis=-1][300]", "f16", "*"): NORM_SQUARES,
  ("extreme.norm[axis=-1][3e4]", "f16", "*"): NORM_SQUARES,
  ("extreme.vector_norm[300]", "f16", "*"): NORM_SQUARES,
  ("extreme.vector_norm[3e4]", "f16", "*"): NORM_SQUARES,
  # NAME (part 2): 20 cases
  ("control.checkpoint[save_only_these_names]", "*", "*"): NAME,
  ("control.checkpoint_name", "*", "*"): NAME,
  # LU_PIVOTS (part 2): 18 cases
  ("lax_linalg.lu_pivots_to_permutation", "*", "*"): LU_PIVOTS,
  ("scipy_linalg.lu_solve", "*", "*"): LU_PIVOTS,
  # LOSS_DIFFERENCE (part 1, losses): 16 cases
  ("extreme.huber_loss[+-4e4]", "f16", "*"): LOSS_DIFFERENCE,
  ("extreme.l2_loss[+-4e4]", "f16", "*"): LOSS_DIFFERENCE,
  ("extreme.mse[+-4e4]", "f16", "*"): LOSS_DIFFERENCE,
  ("extreme.squared_error[+-4e4]", "f16", "*"): LOSS_DIFFERENCE,
  # MUL_SQUARE (part 1, squares): 16 cases
  ("extreme.mul_self[300]", "f16", "*"): MUL_SQUARE,
  ("extreme.mul_self[3e4]", "f16", "*"): MUL_SQUARE,
  ("extreme.rms_norm[300]", "f16", "*"): MUL_SQUARE,
  ("extreme.rms_norm[3e4]", "f16", "*"): MUL_SQUARE,
  # WINDOW_SUM (part 1, window sums): 16 cases
  ("extreme.avg_pool[3e4]", "f16", "*"): WINDOW_SUM,
  ("extreme.avg_pool[512]", "*", "*"): WINDOW_SUM,
  ("extreme.avg_pool[same][3e4]", "f16", "*"): WINDOW_SUM,
  # RANDOM_CLONE (part 2): 10 cases
  ("random.clone", "*", "*"): RANDOM_CLONE,
  # UNSTACK (part 2): 10 cases
  ("jnp.unstack", "*", "*"): UNSTACK,
  # GATHER_FILL (part 1, constants): 8 cases
  ("jnp.at_get_fill", "f16", "autocast_vmap"): GATHER_FILL,
  ("jnp.at_get_fill", "f16", "eager"): GATHER_FILL,
  ("jnp.at_get_fill", "f16", "jit"): GATHER_FILL,
  ("jnp.at_get_fill", "f16", "vmap"): GATHER_FILL,
  ("jnp.take_fill", "f16", "autocast_vmap"): GATHER_FILL,
  ("jnp.take_fill", "f16", "eager"): GATHER_FILL,
  ("jnp.take_fill", "f16", "jit"): GATHER_FILL,
  ("jnp.take_fill", "f16", "vmap"): GATHER_FILL,
  # LOG_SOFTMAX (part 1, losses): 8 cases
  ("extreme.log_softmax[+-4e4]", "f16", "*"): LOG_SOFTMAX,
  ("extreme.softmax_cross_entropy[+-4e4]", "f16", "*"): LOG_SOFTMAX,
}


# On the lowest supported jax (0.7.1) only: XLA's own failures there, seen in the sampled run.
OLD_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10)
_BF16_DOT = "XLA 0.7.1 CPU: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"
OLD_JAX_FAILURES: dict[tuple[str, str, str], str] = {
  # Batched bfloat16 products accumulating in float32, run eagerly.
  ("nn.attention_by_hand", "bf16", "eager"): _BF16_DOT,
  ("nn.dot_product_attention*", "bf16", "eager"): _BF16_DOT,
  ("model.gpt_block", "bf16", "eager"): _BF16_DOT,
  ("model.mixture_gate", "bf16", "eager"): _BF16_DOT,
  ("lax.dot_general[batch]", "bf16", "eager"): _BF16_DOT,
}
# Cases that crash XLA 0.7.1's CPU compiler, or leave it broken for the next program (the process
# dies): skipped, not run.
OLD_JAX_CRASHES: dict[tuple[str, str, str], str] = {
  ("scipy_linalg.expm", "bf16", "*"): "XLA 0.7.1's CPU compiler: double free or corruption",
  ("control.fori_loop", "bf16", "autocast_vmap"): (
    "XLA 0.7.1's CPU compiler: unsupported operand type BF16 in op dot, then a corrupted heap"
  ),
}


@functools.cache
def _pattern(text: str) -> re.Pattern[str]:
  return re.compile(".*".join(re.escape(part) for part in text.split("*")) + r"\Z")


def _lookup(table: dict[tuple[str, str, str], str], case: tuple[str, str, str]) -> str | None:
  for key, reason in table.items():
    if all(_pattern(k).match(v) for k, v in zip(key, case, strict=True)):
      return reason
  return None


def known_failure(name: str, dtype: str, mode: str) -> str | None:
  """The reason a case is known to fail, or None."""
  case = (name, dtype, mode)
  return _lookup(KNOWN_FAILURES, case) or (_lookup(OLD_JAX_FAILURES, case) if OLD_JAX else None)


def crashes(name: str, dtype: str, mode: str) -> str | None:
  """Why a case cannot run on this jax (it would crash the process), or None."""
  return _lookup(OLD_JAX_CRASHES, (name, dtype, mode)) if OLD_JAX else None


def strict() -> bool:
  return jax.__version__ == RECORDED_ON
