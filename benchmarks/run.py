"""Runs the loss-scaling benchmark: `python -m benchmarks.run [--quick]`.

For each workload every recipe of `benchmarks.recipes` is compiled (params
and state donated), its executable inspected (`benchmarks.hlo_stats`), warmed
up, then timed in interleaved rounds: each round runs every variant for the
same number of steps, in a freshly shuffled order, so that load from other
processes hits all variants alike. A variant's ratio is the median over rounds
of its time divided by the bare optax step's time in the *same* round.

Writes `<out>/<backend>.json` and `<out>/<backend>.png` and, unless told
otherwise, refreshes this backend's tables in `BENCHMARKS.md`.

`--gpu-size` (for `run_gpu.sh`) adds the GPU-size workload, a 186M-parameter
LM (`workloads.GPU_LM`, kind `large`), and the recipes of
`recipes.GPU_VARIANTS` to every workload; CPU runs keep their small sizes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import hlo_stats, recipes, workloads
from optax_lossscale._src.utils import tree_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRE_CHANGE = "ols cond (jnp.all check)"
PLOT_OMITS = frozenset(
  {
    "ols auto",
    "ols cond + guard",
    "ols cond + record leaves",
    "jmp (object carried through jit)",
    PRE_CHANGE,
  }
)
# Left out of the GPU-size LM, where every variant costs a compile of a
# 186M-parameter model and 3 GB of params and state: the diagnostics, the
# ablation and the variants that repeat another's executable.
LARGE_OMITS = frozenset(
  {
    "ols auto",
    "ols apply_gradients (select)",
    "ols cond + guard",
    "ols cond + record leaves",
    PRE_CHANGE,
  }
)
TITLES = {
  "optimizer": "Optimizer update",
  "train": "Full train step",
  "large": "Full train step, GPU size",
  "skip": "Skipped step",
}


@contextlib.contextmanager
def _jnp_all_check() -> Iterator[None]:
  """Traces with `jnp.all(jnp.isfinite(x))`, the first per-leaf check, instead."""
  saved = tree_utils.leaf_all_finite
  tree_utils.leaf_all_finite = lambda x: jnp.all(jnp.isfinite(x))
  try:
    yield
  finally:
    tree_utils.leaf_all_finite = saved


def _copy_tree(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _compile(recipe: recipes.Recipe, params: Any, batch: Any) -> tuple[Any, Any, Any]:
  """`(callable step, compiled executable to inspect, initial state)`."""
  state = recipe.init(params)
  step = jax.jit(recipe.step, donate_argnums=(0, 1))
  if not recipe.lowers_flat:
    compiled = step.lower(params, state, batch).compile()
    return compiled, compiled, state
  # The same computation over the state's leaves, for the executable's
  # statistics; the step itself is timed as users call it, through `jit`.
  leaves, treedef = jax.tree.flatten(state)

  def flat_step(params, leaves, batch):
    params, new_state = recipe.step(params, jax.tree.unflatten(treedef, leaves), batch)
    return params, jax.tree.leaves(new_state)

  flat = jax.jit(flat_step, donate_argnums=(0, 1)).lower(params, leaves, batch).compile()
  return step, flat, state


def measure(
  workload: workloads.Workload,
  *,
  rounds: int,
  kind: str,
  skip_batch: Any = None,
  min_chunk_s: float = 0.03,
  seed: int = 0,
  gpu_variants: bool = False,
  omit: frozenset[str] = frozenset(),
) -> dict[str, Any]:
  """Compiles, inspects and times every variant on one workload.

  `gpu_variants` adds `recipes.GPU_VARIANTS`; `omit` names variants to leave out.
  """
  tx = optax.adam(1e-3)
  shapes = [x.shape for x in jax.tree.leaves(workload.params)]
  runs: dict[str, dict[str, Any]] = {}
  builders = {**recipes.VARIANTS, **(recipes.GPU_VARIANTS if gpu_variants else {})}
  names = [name for name in [*builders, PRE_CHANGE] if name not in omit]
  for name in names:
    if name == PRE_CHANGE:
      recipe = recipes.optax_lossscale(tx, workload.loss_fn, skip_mode="cond")
      with _jnp_all_check():
        step, compiled, state = _compile(recipe, workload.params, workload.batch)
    else:
      try:
        recipe = builders[name](tx, workload.loss_fn)
        step, compiled, state = _compile(recipe, workload.params, workload.batch)
      except ImportError as e:  # jmp or flax missing where the benchmark runs
        print(f"skipping {name}: {e}", flush=True)
        continue
      except recipes.NotApplicable:  # e.g. retry on given gradients
        continue
    # In the skipped-step workload every variant but the two references gets
    # the poisoned gradients; they run the taken step it is compared to.
    batch = workload.batch
    if skip_batch is not None and name not in (recipes.BASELINE, recipes.ONE_READ):
      batch = skip_batch
    runs[name] = {
      "step": step,
      "params": _copy_tree(workload.params),
      "state": state,
      "batch": batch,
      "stats": hlo_stats.compiled_stats(compiled, shapes),
      "times": [],
      "cpu_times": [],
      "faults": [],
    }

  def run_steps(run: dict[str, Any], steps: int) -> float:
    params, state = run["params"], run["state"]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
      params, state = run["step"](params, state, run["batch"])
    jax.block_until_ready((params, state))
    elapsed = time.perf_counter() - start
    run["cpu_times"].append((time.process_time() - cpu_start) / steps)
    run["faults"].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps)
    run["params"], run["state"] = params, state
    return elapsed / steps

  # Warm-up: two steps each, then size the chunks from the slowest variant.
  for run in runs.values():
    run_steps(run, 2)
  slowest = max(run_steps(run, 1) for run in runs.values())
  fastest = min(run_steps(run, 1) for run in runs.values())
  steps = max(1, min(20, math.ceil(min_chunk_s / max(fastest, 1e-6))))
  if slowest * steps * len(runs) > 1.0:  # keep one round near 1 s at most
    steps = max(1, int(1.0 / (slowest * len(runs))))
  rng = np.random.default_rng(seed)
  order = list(runs)
  for run in runs.values():
    run["cpu_times"].clear()
    run["faults"].clear()
  for _ in range(rounds):
    rng.shuffle(order)
    for name in order:
      runs[name]["times"].append(run_steps(runs[name], steps))

  base = np.asarray(runs[recipes.BASELINE]["times"])
  cpu_base = np.asarray(runs[recipes.BASELINE]["cpu_times"])
  one_read = runs.get(recipes.ONE_READ)
  results = {}
  for name, run in runs.items():
    times = np.asarray(run["times"])
    ratios = times / base
    # Paired per round, like `ratio`: the target "within one extra read of
    # the gradients" holds where this is at most 1.
    to_one_read = times / np.asarray(one_read["times"]) if one_read else None
    cpu_ratios = np.asarray(run["cpu_times"]) / cpu_base
    results[name] = {
      "median_ms": float(np.median(times) * 1e3),
      "ratio": float(np.median(ratios)),
      "ratio_p25": float(np.percentile(ratios, 25)),
      "ratio_p75": float(np.percentile(ratios, 75)),
      # Other processes only ever add time, so the fastest round of each
      # variant is the least disturbed estimate of its own cost.
      "best_ratio": float(times.min() / base.min()),
      # Process CPU time (all of XLA's threads): not inflated by other
      # processes' load, unlike wall time, so a second opinion on a busy host.
      "cpu_ratio": float(np.median(cpu_ratios)),
      # Minor page faults: XLA:CPU allocates temporaries per step, and glibc
      # maps buffers over 32 MiB afresh each time, so every page faults.
      "page_faults_per_step": float(np.median(run["faults"])),
      "ratio_to_one_read": None if to_one_read is None else float(np.median(to_one_read)),
      "round_ms": [float(t * 1e3) for t in times],
      **run["stats"],
    }
  finite = {
    name: bool(all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(run["params"])))
    for name, run in runs.items()
  }
  # Whether a variant's params still equal the workload's: a skipped-step
  # workload must leave every loss-scaling recipe's params where they were.
  unchanged = {
    name: bool(
      all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
          jax.tree.leaves(run["params"]), jax.tree.leaves(workload.params), strict=True
        )
      )
    )
    for name, run in runs.items()
  }
  return {
    "name": workload.name,
    "kind": kind,
    "description": workload.description,
    "num_params": workloads.num_params(workload.params),
    "param_mib": workloads.num_params(workload.params) * 4 / 2**20,
    "rounds": rounds,
    "steps_per_round": steps,
    "params_finite_after": finite,
    "params_unchanged_after": unchanged,
    "results": results,
  }


def plan(quick: bool, gpu_size: bool = False) -> list[dict[str, Any]]:
  """The workloads to run, with their rounds (fewer where a step is slow)."""
  large = []
  if gpu_size:
    large = [
      {
        "kind": "large",
        "make": lambda: workloads.transformer_lm(**workloads.GPU_LM),
        "rounds": 7,
        "omit": LARGE_OMITS,
      }
    ]
  if quick:
    return [
      {"kind": "optimizer", "make": lambda: workloads.optimizer_only(2**18), "rounds": 5},
      {"kind": "optimizer", "make": lambda: workloads.optimizer_only(2**20), "rounds": 5},
      {"kind": "train", "make": lambda: workloads.mlp(width=256, batch=32), "rounds": 5},
      {
        "kind": "train",
        "make": lambda: workloads.transformer_lm(d_model=64, layers=2, seq=32, batch=4),
        "rounds": 5,
      },
      {"kind": "skip", "size": 2**18, "rounds": 5},
      *large,
    ]
  return [
    {"kind": "optimizer", "make": lambda: workloads.optimizer_only(2**20), "rounds": 15},
    {"kind": "optimizer", "make": lambda: workloads.optimizer_only(2**22), "rounds": 11},
    {"kind": "optimizer", "make": lambda: workloads.optimizer_only(2**24), "rounds": 7},
    {"kind": "optimizer", "make": lambda: workloads.optimizer_only(2**26), "rounds": 5},
    {"kind": "train", "make": lambda: workloads.mlp(), "rounds": 11},
    {"kind": "train", "make": lambda: workloads.transformer_lm(), "rounds": 7},
    {"kind": "skip", "size": 2**22, "rounds": 11},
    {"kind": "skip", "size": 2**24, "rounds": 5},
    *large,
  ]


def _version(package: str) -> str | None:
  """The installed version of `package`, or None (its variants are skipped)."""
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def machine_info() -> dict[str, Any]:
  cpu = platform.processor() or platform.machine()
  with contextlib.suppress(OSError):
    text = pathlib.Path("/proc/cpuinfo").read_text()
    found = re.search(r"model name\s*:\s*(.+)", text)
    cpu = found[1].strip() if found else cpu
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "backend": jax.default_backend(),
    "device": getattr(device, "device_kind", str(device)),
    "cpu": cpu,
    "cpu_count": os.cpu_count(),
    "load_average": [round(x, 2) for x in os.getloadavg()],
    "python": platform.python_version(),
    "versions": {
      "jax": jax.__version__,
      "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
      "optax": optax.__version__,
      "flax": _version("flax"),
      "jmp": _version("jmp"),
      "numpy": np.__version__,
    },
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def _mib(n: int | None) -> str:
  return "?" if n is None else f"{n / 2**20:.1f}"


def _kernels(result: dict[str, Any]) -> str:
  """Launches of the compiled step, the copies among them named (memcpys on a GPU)."""
  if "kernels" not in result:  # a report written before the column existed
    return "?"
  copies = result["kernel_kinds"]["copy"]
  if not copies:
    return str(result["kernels"])
  return f"{result['kernels']} ({copies} cop{'y' if copies == 1 else 'ies'})"


def markdown(report: dict[str, Any]) -> str:
  meta = report["meta"]
  v = meta["versions"]
  lines = [
    f"Measured {meta['date']} on {meta['backend']} ({meta['device']}; {meta['cpu']},"
    f" {meta['cpu_count']} cores; load average at start {meta['load_average']});"
    f" jax {v['jax']}, optax {v['optax']}, flax {v['flax']}, jmp {v['jmp']}."
    + (f" XLA_FLAGS=`{meta['xla_flags']}`." if meta["xla_flags"] else ""),
    "",
  ]
  for w in report["workloads"]:
    title = TITLES[w["kind"]]
    lines += [
      f"#### {title}: {w['description']}, {w['num_params'] / 1e6:.2f}M params (`{w['name']}`)",
      "",
      f"{w['rounds']} interleaved rounds of {w['steps_per_round']} steps.",
      "",
      "| variant | ms/step | ratio to bare (IQR) | best-round ratio | CPU-time ratio"
      " | ratio to bare + one read | page faults/step | temp MiB | kernels"
      " | full-size copies (+fills) | host transfer | donated inputs aliased |",
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, r in w["results"].items():
      to_one_read = r.get("ratio_to_one_read")
      lines.append(
        f"| {name} | {r['median_ms']:.2f} | x{r['ratio']:.3f} ({r['ratio_p25']:.2f}-"
        f"{r['ratio_p75']:.2f}) | x{r['best_ratio']:.3f} | x{r['cpu_ratio']:.3f}"
        f" | {'-' if to_one_read is None else f'x{to_one_read:.3f}'}"
        f" | {r['page_faults_per_step']:.0f}"
        f" | {_mib(r['temp_bytes'])} | {_kernels(r)}"
        f" | {r['full_size_copies']} (+{r['fill_copies']})"
        f" | {'yes' if r['host_transfer'] else 'no'} | {r['aliased_inputs']} |"
      )
    lines.append("")
  return "\n".join(lines)


def update_markdown(path: pathlib.Path, backend: str, body: str) -> None:
  start, end = f"<!-- results:{backend}:start -->", f"<!-- results:{backend}:end -->"
  block = f"{start}\n{body}\n{end}"
  text = path.read_text() if path.exists() else "# Benchmarks\n"
  if start in text and end in text:
    text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
  else:
    text = text.rstrip("\n") + f"\n\n## Results: {backend}\n\n{block}\n"
  path.write_text(text)


def plot(report: dict[str, Any], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sized = [w for w in report["workloads"] if w["kind"] == "optimizer"]
  if not sized:
    return
  fig, ax = plt.subplots(figsize=(9, 4.8))
  sizes = [w["num_params"] for w in sized]
  # The recipes compared; `ols auto` (the same executable as `ols cond`), the
  # diagnostics and the ablation stay in the tables.
  shown = [name for name in sized[0]["results"] if name not in PLOT_OMITS]
  for i, name in enumerate(shown):
    ratios = [w["results"][name]["ratio"] for w in sized]
    ours = name.startswith("ols")
    ax.plot(
      sizes,
      ratios,
      marker="o" if ours else "s",
      linestyle="-" if ours or name in (recipes.BASELINE, recipes.ONE_READ) else "--",
      linewidth=2.2 if name == "ols apply_gradients" else 1.4,
      color=plt.get_cmap("tab10")(i % 10),
      label=name,
    )
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("parameters")
  ax.set_ylabel("step time / bare optax step (median)")
  meta = report["meta"]
  ax.set_title(f"Adam update + loss scaling, {meta['backend']} ({meta['cpu_count']} cores)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="CI-size run (small models)")
  parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
  parser.add_argument(
    "--markdown",
    default=None,
    help="file whose results block to refresh (default BENCHMARKS.md; 'none' to skip;"
    " --quick skips unless given)",
  )
  parser.add_argument("--tag", default=None, help="suffix of the output names, e.g. 'cmdbuf'")
  parser.add_argument(
    "--only", default=None, help="comma-separated kinds to run: optimizer, train, skip, large"
  )
  parser.add_argument(
    "--gpu-size",
    action="store_true",
    help="add the 186M-parameter LM (kind 'large') and the GPU-only recipes",
  )
  args = parser.parse_args(argv)

  out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results"
  out.mkdir(parents=True, exist_ok=True)
  backend = jax.default_backend()
  label = backend + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
  md = args.markdown or ("none" if args.quick else str(ROOT / "BENCHMARKS.md"))

  report: dict[str, Any] = {"meta": machine_info(), "workloads": []}
  report["meta"]["quick"] = args.quick
  started = time.perf_counter()
  report["meta"]["gpu_size"] = args.gpu_size
  kinds = set(args.only.split(",")) if args.only else set(TITLES)
  for item in (i for i in plan(args.quick, args.gpu_size) if i["kind"] in kinds):
    t0 = time.perf_counter()
    skip_batch = None
    if item["kind"] == "skip":
      poisoned = workloads.optimizer_only(item["size"], inject_nan=True)
      workload = poisoned._replace(batch=workloads.optimizer_only(item["size"]).batch)
      skip_batch = poisoned.batch
    else:
      workload = item["make"]()
    result = measure(
      workload,
      rounds=item["rounds"],
      kind=item["kind"],
      skip_batch=skip_batch,
      gpu_variants=args.gpu_size,
      omit=item.get("omit", frozenset()),
    )
    report["workloads"].append(result)
    summary = ", ".join(f"{k} x{r['ratio']:.2f}" for k, r in result["results"].items())
    print(f"[{time.perf_counter() - t0:5.1f}s] {result['name']}: {summary}", flush=True)
  report["meta"]["total_seconds"] = round(time.perf_counter() - started, 1)
  report["meta"]["process_cpu_seconds"] = round(time.process_time(), 1)
  report["meta"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]

  json_path = out / f"{label}.json"
  json_path.write_text(json.dumps(report, indent=1))
  plot(report, out / f"{label}.png")
  if md != "none":
    update_markdown(pathlib.Path(md), label, markdown(report))
  print(f"wrote {json_path} in {report['meta']['total_seconds']} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
