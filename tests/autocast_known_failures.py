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

KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


@functools.cache
def _pattern(text: str) -> re.Pattern[str]:
  return re.compile(".*".join(re.escape(part) for part in text.split("*")) + r"\Z")


def known_failure(name: str, dtype: str, mode: str) -> str | None:
  """The reason a case is known to fail, or None."""
  for key, reason in KNOWN_FAILURES.items():
    if all(_pattern(k).match(v) for k, v in zip(key, (name, dtype, mode), strict=True)):
      return reason
  return None


def strict() -> bool:
  return jax.__version__ == RECORDED_ON
