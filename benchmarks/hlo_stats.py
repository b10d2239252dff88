"""Deterministic properties of a compiled step, read from the executable.

* temporary memory: `compiled.memory_analysis().temp_size_in_bytes`;
* full-size copies: `copy` instructions in the optimized HLO whose shape is
  one of the large parameter shapes. A copy of a constant fill (the zeros a
  skip branch returns, which XLA deduplicates and then copies per output) is
  counted apart, as `fills`: it moves no data a step had to read;
* host transfers: send/recv, infeed/outfeed, host-transfer flags and Python
  callbacks, i.e. anything that makes the device wait on the host;
* donation: the number of input buffers the executable aliases to outputs;
* kernel launches: `count_launches`, see its docstring.
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


# Instructions that launch nothing: they name buffers (parameter, constant,
# get-tuple-element, bitcast, tuple), order work (after-all, add-dependency,
# opt-barrier, domain) or hand control to other computations, whose own
# instructions are counted instead (call, conditional, while).
_NO_LAUNCH = frozenset(
  {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "call",
    "conditional",
    "while",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "domain",
  }
)
_COLLECTIVES = frozenset(
  {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
  }
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(
  r"\b(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)"
  r"|false_computation=%?([\w.\-]+))"
)
LAUNCH_KINDS = ("fusion", "custom-call", "copy", "collective", "other")


def output_positions(hlo_text: str) -> list[int]:
  """Where each output of a scheduled program (`compiled.as_text()`) is computed: for
  each operand of the entry computation's ROOT tuple, in order, the line of the entry
  computation that defines it (XLA runs a scheduled program's lines in that order).

  >>> text = "HloModule m, is_scheduled=true\\n\\nENTRY %main {\\n  %a = f32[] parameter(0)\\n"
  >>> text += "  %b = f32[] negate(%a)\\n  ROOT %t = (f32[], f32[]) tuple(%b, %a)\\n}"
  >>> output_positions(text)
  [2, 1]
  """
  entry = hlo_text.split("\nENTRY", 1)[1].splitlines()
  defined = {}
  for i, line in enumerate(entry):
    found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if found:
      defined[found[1]] = i
  root = next(line for line in entry if line.lstrip().startswith("ROOT"))
  return [defined[name] for name in re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1])]


def _opcode(rest: str) -> str | None:
  """The opcode of an instruction, given the text after its `=`: shape, then opcode."""
  if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
    depth = 0
    for i, char in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        rest = rest[i + 1 :]
        break
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else ""
  match = _OPCODE.match(rest)
  return match[1] if match else None


def _computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str]]], str | None]:
  """Each computation's `(opcode, line)` pairs, and the entry computation's name."""
  computations: dict[str, list[tuple[str, str]]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header:
        current = computations.setdefault(header[2], [])
        entry = header[2] if header[1] else entry
    elif line.strip() == "}":
      current = None
    else:
      instruction = _INSTRUCTION.match(line)
      opcode = instruction and _opcode(instruction[1])
      if opcode:
        current.append((opcode, line))
  return computations, entry


def _kind(opcode: str) -> str | None:
  """The launch kind of an instruction left at the top level of a computation."""
  if opcode in _NO_LAUNCH or opcode.endswith(("-done", "-update")):
    return None
  base = opcode.removesuffix("-start")
  if base in _COLLECTIVES:
    return "collective"
  if base in ("fusion", "custom-call", "copy"):
    return base
  return "other"  # an unfused op: a reduce, a sort, a scatter, a dot, ...


def count_launches(hlo_text: str) -> dict[str, int]:
  """Counts the work items one run of an optimized HLO module launches, by kind.

  Reads `compiled.as_text()` (HLO after optimization, so fusions are formed)
  and counts, in the entry computation, every top-level instruction that does
  work on the device: each `fusion` (one kernel), `custom-call` (a cuBLAS or
  cuDNN call, a Triton kernel), `copy`, collective (`all-reduce`, ... or its
  `-start`) and any op left unfused (`reduce`, `sort`, `scatter`, `dot`,
  an elementwise op, ...). Parameters, constants, tuples, get-tuple-element,
  bitcasts and the `-done` halves of async pairs launch nothing. `call`,
  `conditional` and `while` launch nothing themselves: their computations'
  instructions are counted in their place, a conditional by its largest
  branch (the work of the step that is not skipped, usually), a while loop's
  condition and body once (one iteration).

  Returns the counts by kind (`LAUNCH_KINDS`) and their sum under `total`.

  On XLA:GPU, whose executable is a sequence of thunks, this matches the
  kernel count of that sequence only approximately:

  * it reads the HLO it is given: XLA:CPU forms other fusions than XLA:GPU
    (and keeps, e.g., `reduce-window` and `dot` ops apart), so a count from a
    CPU compile says nothing exact about the GPU executable of the same step;
  * on the GPU a `copy` that keeps its layout runs as a device-to-device
    memcpy, not a kernel, and a fusion that only moves data (an in-place
    dynamic-update-slice, a copy) may also become a memcpy or nothing; the
    `copy` kind is reported apart so that the kernels proper are
    `total - copy` there;
  * a cuBLAS or cuDNN `custom-call` may launch more than one kernel (split-K
    gemm and its reduction), counted here as one;
  * a `conditional` costs, with XLA's default flags, a copy of its predicate
    to the host and a wait for it, which is no kernel and is not counted;
    with command buffers (CUDA graphs) kernels are launched as one graph, so
    the count stays but the launch cost per kernel changes.

  Example:
    >>> count_launches('''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   %c = f32[8]{0} copy(%p)
    ...   ROOT %f = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused
    ... }''')
    {'fusion': 1, 'custom-call': 0, 'copy': 1, 'collective': 0, 'other': 0, 'total': 2}
  """
  computations, entry = _computations(hlo_text)
  if entry is None:
    raise ValueError("hlo_text holds no ENTRY computation; pass compiled.as_text().")
  counted: dict[str, dict[str, int]] = {}

  def count(name: str, active: frozenset[str]) -> dict[str, int]:
    if name in counted:
      return counted[name]
    if name in active or name not in computations:  # recursion, or not printed
      return dict.fromkeys(LAUNCH_KINDS, 0)
    active = active | {name}
    totals = dict.fromkeys(LAUNCH_KINDS, 0)
    for opcode, line in computations[name]:
      kind = _kind(opcode)
      if kind is not None:
        totals[kind] += 1
        continue
      called: list[dict[str, int]] = []
      if opcode in ("call", "while"):
        called = [count(callee, active) for callee in _CALLED.findall(line)]
      elif opcode == "conditional":
        branches = []
        for listed, true_branch, false_branch in _BRANCHES.findall(line):
          names = [n.strip().lstrip("%") for n in listed.split(",")] if listed else []
          branches += [count(n, active) for n in [*names, true_branch, false_branch] if n]
        if branches:
          called = [max(branches, key=lambda c: sum(c.values()))]
      for callee in called:
        for kind_ in LAUNCH_KINDS:
          totals[kind_] += callee[kind_]
    counted[name] = totals
    return totals

  totals = dict(count(entry, frozenset()))
  totals["total"] = sum(totals.values())
  return totals


def compiled_stats(compiled: Any, param_shapes: Iterable[tuple[int, ...]]) -> dict[str, Any]:
  text = compiled.as_text()
  memory = compiled.memory_analysis()
  copies, fills = count_copies(text, full_size_shapes(param_shapes))
  launches = count_launches(text)
  return {
    "kernels": launches["total"],
    "kernel_kinds": {k: v for k, v in launches.items() if k != "total"},
    "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
    "full_size_copies": copies,
    "fill_copies": fills,
    "host_transfer": has_host_transfer(text),
    "aliased_inputs": aliased_inputs(text),
    "conditional": " conditional(" in text,
  }
