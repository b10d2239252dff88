"""The corpus cases `autocast` gets wrong: a work queue, empty on jax 0.10.2 (every case passes).

Issue 30 recorded 848 failing cases of 8160 here, grouped by cause; each
group was deleted with its fix.

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

KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


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
  # ... and in the vmap modes, where vmap makes a product batched.
  ("*", "bf16", "autocast_vmap"): _BF16_DOT,
  ("*", "bf16", "vmap"): _BF16_DOT,
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
