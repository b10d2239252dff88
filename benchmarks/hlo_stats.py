"""Deterministic properties of a compiled step, read from the executable.

* temporary memory: `compiled.memory_analysis().temp_size_in_bytes`;
* full-size copies: `copy` instructions in the optimized HLO whose shape is
  one of the large parameter shapes. A copy of a constant fill (the zeros a
  skip branch returns, which XLA deduplicates and then copies per output) is
  counted apart, as `fills`: it moves no data a step had to read;
* host transfers: send/recv, infeed/outfeed, host-transfer flags and Python
  callbacks, i.e. anything that makes the device wait on the host;
* donation: the number of input buffers the executable aliases to outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
import math
import re
from typing import Any

_COPY = re.compile(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\((?:[^%)]*)%([\w.\-]+)\)")
_HOST = re.compile(
  r"\b(send|recv|send-done|recv-done|infeed|outfeed)\(|is_host_transfer=true"
  r"|custom_call_target=\"[^\"]*(callback|host)[^\"]*\"",
  re.IGNORECASE,
)
_ALIAS = re.compile(r"\{[\d,\s]*\}: \(\d+, \{[\d,\s]*\}, (?:may|must)-alias\)")
# Shapes smaller than this are scalars and biases, not "full-size".
MIN_FULL_SIZE = 4096


def full_size_shapes(shapes: Iterable[tuple[int, ...]]) -> set[tuple[int, ...]]:
  return {tuple(s) for s in shapes if math.prod(s) >= MIN_FULL_SIZE}


def count_copies(hlo_text: str, shapes: set[tuple[int, ...]]) -> tuple[int, int]:
  """Returns (data copies, constant-fill copies) of the given shapes."""
  copies = fills = 0
  for match in _COPY.finditer(hlo_text):
    dims = tuple(int(d) for d in match[1].split(",") if d)
    if dims not in shapes:
      continue
    if "broadcast" in match[2]:
      fills += 1
    else:
      copies += 1
  return copies, fills


def has_host_transfer(hlo_text: str) -> bool:
  return _HOST.search(hlo_text) is not None


def aliased_inputs(hlo_text: str) -> int:
  header = hlo_text.split("\n", 1)[0]
  return len(_ALIAS.findall(header))


def compiled_stats(compiled: Any, param_shapes: Iterable[tuple[int, ...]]) -> dict[str, Any]:
  text = compiled.as_text()
  memory = compiled.memory_analysis()
  copies, fills = count_copies(text, full_size_shapes(param_shapes))
  return {
    "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
    "full_size_copies": copies,
    "fill_copies": fills,
    "host_transfer": has_host_transfer(text),
    "aliased_inputs": aliased_inputs(text),
    "conditional": " conditional(" in text,
  }
