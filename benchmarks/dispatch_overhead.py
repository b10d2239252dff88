"""Python run per dispatched call: `python -m benchmarks.dispatch_overhead`.

On a GPU a small step is host-bound: its time is the time to dispatch it, so
the Python that runs per call decides the ratio. For every recipe of
`benchmarks.recipes`, on a tiny optimizer-only problem, this prints:

* `identity`: a jitted identity over the recipe's state, i.e. the cost of
  flattening the state in and unflattening it out of a `jit` call;
* `step`: the recipe's jitted step (params and state donated), called the
  way users call it;

each as the median microseconds per call over interleaved rounds, its ratio
to bare optax's, and the Python function calls per dispatch counted by
cProfile: all of them, and those whose code lives in `optax_lossscale` (the
pytree flatten/unflatten functions of its loss scales, if any run per call).
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import time
from typing import Any

import jax
import numpy as np
import optax

from benchmarks import recipes, workloads
import optax_lossscale

PACKAGE_DIR = str(pathlib.Path(optax_lossscale.__file__).resolve().parent)


def _callables(name: str, workload: workloads.Workload) -> dict[str, tuple[Any, tuple[Any, ...]]]:
  """`{'identity': (fn, args), 'step': (fn, args)}`; a step's args are updated as it runs."""
  recipe = recipes.VARIANTS[name](optax.adam(1e-3), workload.loss_fn)
  params = jax.tree.map(lambda x: x.copy(), workload.params)
  state = recipe.init(params)
  return {
    "identity": (jax.jit(lambda s: s), (state,)),
    "step": (jax.jit(recipe.step, donate_argnums=(0, 1)), (params, state, workload.batch)),
  }


def _call(fn: Any, args: tuple[Any, ...], kind: str) -> tuple[Any, ...]:
  out = fn(*args)
  return (*out, args[2]) if kind == "step" else (out,)


def python_calls(fn: Any, args: tuple[Any, ...], kind: str, calls: int = 50) -> tuple[Any, ...]:
  """`(all Python calls, those in optax_lossscale)` per dispatch, and the updated args."""
  profile = cProfile.Profile()
  profile.enable()
  for _ in range(calls):
    args = _call(fn, args, kind)
  profile.disable()
  jax.block_until_ready(args)
  stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
  total = sum(nc for _, nc, *_ in stats.values())
  ours = sum(nc for (file, *_), (_, nc, *_) in stats.items() if file.startswith(PACKAGE_DIR))
  return total / calls, ours / calls, args


def measure(
  names: list[str] | None = None, *, size: int = 2**12, rounds: int = 7, calls: int = 200
) -> dict[str, dict[str, dict[str, float]]]:
  """`{recipe: {'identity' | 'step': {us, ratio, python_calls, package_calls}}}`."""
  workload = workloads.optimizer_only(size)
  names = names or list(recipes.VARIANTS)
  if recipes.BASELINE not in names:
    names = [recipes.BASELINE, *names]
  runs: dict[tuple[str, str], list[Any]] = {}
  for name in names:
    try:
      built = _callables(name, workload)
    except ImportError as e:  # jmp or flax missing
      print(f"skipping {name}: {e}", flush=True)
      continue
    for kind, (fn, args) in built.items():
      for _ in range(3):  # compile and warm up
        args = _call(fn, args, kind)
      jax.block_until_ready(args)
      runs[(name, kind)] = [fn, args, []]
  order = list(runs)
  rng = np.random.default_rng(0)
  for _ in range(rounds):
    rng.shuffle(order)
    for key in order:
      fn, args, times = runs[key]
      start = time.perf_counter()
      for _ in range(calls):
        args = _call(fn, args, key[1])
      jax.block_until_ready(args)
      times.append((time.perf_counter() - start) / calls)
      runs[key][1] = args
  results: dict[str, dict[str, dict[str, float]]] = {}
  for (name, kind), (fn, args, times) in runs.items():
    base = np.asarray(runs[(recipes.BASELINE, kind)][2])
    total, ours, runs[(name, kind)][1] = python_calls(fn, args, kind)
    results.setdefault(name, {})[kind] = {
      "us": float(np.median(times) * 1e6),
      "ratio": float(np.median(np.asarray(times) / base)),
      "python_calls": total,
      "package_calls": ours,
    }
  return results


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--calls", type=int, default=200, help="dispatches per round")
  parser.add_argument("--size", type=int, default=2**12, help="parameters of the tiny problem")
  args = parser.parse_args(argv)
  results = measure(size=args.size, rounds=args.rounds, calls=args.calls)
  print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}), {args.size} params")
  print(
    f"{'recipe':34s} {'kind':8s} {'us/call':>9s} {'ratio':>7s} {'py calls':>9s} {'ols calls':>9s}"
  )
  for name, kinds in results.items():
    for kind, r in kinds.items():
      print(
        f"{name:34s} {kind:8s} {r['us']:9.1f} x{r['ratio']:6.2f}"
        f" {r['python_calls']:9.1f} {r['package_calls']:9.1f}"
      )


if __name__ == "__main__":
  main()
