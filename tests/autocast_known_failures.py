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

KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


# On the lowest supported jax (0.7.1) only: XLA's own failures there, each seen in a run of the
# bfloat16 eager and vmap cases on 0.7.1 (full or sampled; a case run after one that corrupted
# XLA's heap may crash or pass instead, so these marks are never strict).
OLD_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10)
_BF16_DOT = "XLA 0.7.1 CPU: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"
_BATCHED_BY_VMAP = (
  "nn.attention_by_hand", "jnp.moveaxis", "jnp.swapaxes", "jnp.transpose",
  "linalg.matrix_transpose", "scipy_linalg.expm_frechet", "random.orthogonal",
)  # fmt: skip
_VMAP_MODES = ("vmap", "autocast_vmap")
OLD_JAX_FAILURES: dict[tuple[str, str, str], str] = {
  # Batched bfloat16 products accumulating in float32, run eagerly ...
  ("nn.attention_by_hand", "bf16", "eager"): _BF16_DOT,
  # ... and where vmap makes a product batched.
  **{(name, "bf16", mode): _BF16_DOT for name in _BATCHED_BY_VMAP for mode in _VMAP_MODES},
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
