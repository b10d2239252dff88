"""Where a compiled optimizer update spends its time, loop by loop, from JAX's profiler.

XLA's cost analysis counts the bytes a program moves, and a step's time on a
shared machine says little about which of its loops spends it. This runs a
compiled update under `jax.profiler.trace` and reads the trace back
(`jax.profiler.ProfileData`): each event named for an instruction of the
program's entry computation is one of its loops or small ops (XLA:CPU runs a
fusion as one task, whose event lasts until its partitions on the other
threads are done), grouped by kind, the name without its `.N` suffix
(`multiply_add_fusion`, `convert_or_fusion`, ...). Per kind: the loops a
step runs, the median loop's milliseconds and the milliseconds a step spends
in them; and the span of a step, from its first loop's start to its last
one's end. Loops that run at the same time each count in full, so the kinds
can add up to more than the span.

What it showed (2026-12-07, XLA:CPU, jax 0.10.2, 2 cores, 4M and 16M run
one after the other, twice): the q8 Adam update of `low_precision_params`
at 16M parameters (4 matrices of 2048 x 2048) spends the most in the 8 loops
that write the codes, 4.1 to 6.0 ms each (median) for 4M elements, where at
4M parameters they take 0.58 to 0.67 ms for 1M: x1.8 to x2.2 per element,
when the parameters' loops take the same per element at both sizes (5.9
against 1.44-1.47 ms) and the block extremes' x1.3 (4.6-5.1 against
0.89-0.91). A step spans 64-69 ms against 12-15 (x4.7-5.3 for x4 the
parameters). One codes loop taken alone, in plain `jax.numpy`, takes about
the same per element at both sizes; taking away the order that writes the
codes after the parameters makes them slower (6.6 ms, and copies). XLA:CPU
ran every parameter's new value, then every code, and each codes loop
re-read a gradient that had left the caches; with each parameter's loops
run back to back (`state_dtypes`' fused step since), the codes loops at 16M
take 2.2-2.7 ms.

Run: `python -m benchmarks.loop_profile --side 2048` (`--quick` for a smoke
test).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import low_precision_params as lpp

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", re.MULTILINE)


def entry_instructions(hlo_text: str) -> set[str]:
  """The names of the instructions of a compiled program's entry computation (the
  whole text, if it holds no line starting with `ENTRY`)."""
  return set(_INSTRUCTION.findall(hlo_text[max(hlo_text.find("\nENTRY"), 0) :]))


def _kind(name: str) -> str:
  return re.sub(r"\.\d+$", "", name)


def loop_times(compiled: Any, params: Any, state: Any, grads: Any, steps: int = 10) -> dict:
  """`steps` updates of `compiled` (`(params, state, grads) -> (params, state)`, as
  `low_precision_params.compiled_update` builds it), traced: per kind of loop, the
  loops a step runs, the median one's ms and a step's ms in them; and a step's span.

  Returns `{"kinds": {kind: {"per_step", "median_ms", "ms_per_step"}}, "span_ms",
  "params", "state"}`, the last two what the steps left (the inputs were donated).
  """
  names = entry_instructions(compiled.as_text())
  params, state = compiled(params, state, grads)  # warm: the first call is not traced
  jax.block_until_ready(params)
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      for _ in range(steps):
        params, state = compiled(params, state, grads)
      jax.block_until_ready(params)
    (path,) = pathlib.Path(directory).rglob("*.xplane.pb")
    profile = jax.profiler.ProfileData.from_file(str(path))
    events = [
      (event.start_ns, event.duration_ns, event.name)
      for plane in profile.planes
      for line in plane.lines
      for event in line.events
      if event.name in names
    ]
  if not events:
    raise RuntimeError("the trace holds no event named for an instruction of the program")
  durations: dict[str, list[float]] = collections.defaultdict(list)
  for _, duration, name in events:
    durations[_kind(name)].append(duration / 1e6)
  start = min(s for s, _, _ in events)
  end = max(s + d for s, d, _ in events)
  kinds = {
    kind: {
      "per_step": len(ms) / steps,
      "median_ms": float(np.median(ms)),
      "ms_per_step": float(np.sum(ms)) / steps,
    }
    for kind, ms in sorted(durations.items(), key=lambda item: -sum(item[1]))
  }
  return {"kinds": kinds, "span_ms": (end - start) / 1e6 / steps, "params": params, "state": state}


def profile(variant: str, side: int, leaves: int = 4, steps: int = 10) -> dict:
  """`loop_times` of `low_precision_params.update_variants()[variant]` on `leaves`
  matrices of `side` x `side` (the update part's parameters and gradient)."""
  chosen = lpp.update_variants()[variant]
  params, grads = lpp.update_problem([(side, side)] * leaves)
  compiled, p, state = lpp.compiled_update(chosen, params, grads)
  g = jax.tree.map(lambda x: jnp.array(x, chosen.dtype, copy=True), grads)
  out = loop_times(compiled, p, state, g, steps)
  return {"kinds": out["kinds"], "span_ms": out["span_ms"], "params": leaves * side * side}


def markdown(variant: str, report: dict, top: int = 6) -> str:
  lines = [
    f"**{variant}**, {report['params'] / 1e6:.2f}M parameters: a step spans"
    f" {report['span_ms']:.2f} ms",
    "",
    "| loop kind | per step | median ms | ms a step |",
    "| --- | --- | --- | --- |",
  ]
  for kind, row in list(report["kinds"].items())[:top]:
    lines.append(
      f"| {kind} | {row['per_step']:g} | {row['median_ms']:.3f} | {row['ms_per_step']:.2f} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--side", type=int, default=1024, help="4 matrices of side x side")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument(
    "--variants",
    default="Adam, float32 parameters;Adam, float32 parameters, q8 moments",
    help="';'-separated names of low_precision_params.update_variants()",
  )
  parser.add_argument("--quick", action="store_true", help="side 64, 2 steps (a smoke test)")
  args = parser.parse_args(argv)
  side, steps = (64, 2) if args.quick else (args.side, args.steps)
  for variant in args.variants.split(";"):
    print(markdown(variant, profile(variant, side, steps=steps)))
    print()


if __name__ == "__main__":
  main()
