"""8-bit Adam state and bfloat16 stochastic rounding against PyTorch's, on one CPU.

bitsandbytes' and torchao's 8-bit optimizers are what a PyTorch user switches
to in order to save optimizer memory; what they cost per step against their
own framework's float32 Adam is the mark for ours against optax's. One
process, one machine, the update alone (as `low_precision_params.update_cost`:
4 matrices of 1024 x 1024 unless `--side`, a fixed gradient), every variant
run `--steps` steps a round in a shuffled order, `--rounds` rounds after one
of warm-up (PyTorch compiles torchao's update with `torch.compile` then);
median ms a step and the median over rounds of the ratio to the framework's
own float32 Adam; and, as every variant has then taken the same steps from the
same start, how far its parameters are from optax's float32 Adam's (largest
absolute difference, against the largest distance optax's moved them):

  JAX      optax.adam, float32                          (the JAX baseline)
           ols.state_dtypes(adam, q8 / fp8 moments)     float32 params
           ols.stochastic_rounding(adam)                bfloat16 params
  PyTorch  torch.optim.Adam(fused=True), float32        (the PyTorch baseline)
           torch.optim.Adam (foreach, the default)
           torchao.optim.Adam8bit / AdamFp8             float32 params
           torchao.optim._AdamW(bf16_stochastic_round)  bfloat16 params
           bitsandbytes.optim.Adam8bit                  float32 params (if installed)

The JAX updates are `ols.apply_gradients` compiled with the params and the
state donated (`low_precision_params.compiled_update`); the PyTorch ones
`optimizer.step()` with the gradients set once. Both frameworks use both
cores (XLA:CPU splits each loop; PyTorch's intra-op threads, `--threads`).
bitsandbytes runs where it is installed (0.50 steps its 8-bit Adam on the CPU).

Not part of `make test` (PyTorch is no dependency of this project). Run it
from a virtual environment holding both (torchao 0.18 wants torch >= 2.10):

  python -m venv /tmp/tv && /tmp/tv/bin/pip install torch torchao bitsandbytes
  /tmp/tv/bin/pip install -c constraints.txt -e .
  /tmp/tv/bin/python -m benchmarks.lowbit_optim_vs_torch [--side 2048] [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import pathlib
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import low_precision_params as lp
import optax_lossscale as ols

JAX_BASE = "optax.adam, float32"
TORCH_BASE = "torch.optim.Adam(fused=True), float32"
LR = 1e-3


def _jax_variants(seed: int = 0) -> dict[str, lp.Variant]:
  adam = lambda: optax.adam(LR)
  return {
    JAX_BASE: lp._optax(adam(), jnp.float32),
    "ols q8 moments, float32": lp._optax(
      ols.state_dtypes(adam(), {"mu": "q8", "nu": "q8"}), jnp.float32
    ),
    "ols fp8 moments, float32": lp._optax(
      ols.state_dtypes(adam(), {"mu": "fp8", "nu": "fp8"}), jnp.float32
    ),
    "ols stochastic_rounding, bfloat16": lp._optax(
      ols.stochastic_rounding(adam(), key=seed), lp.BF16
    ),
  }


def _torch_variants() -> dict[str, tuple[Any, Callable[[list[Any]], Any]]]:
  """name -> (parameter dtype, optimizer of a parameter list)."""
  import torch
  import torchao.optim as tao

  return {
    TORCH_BASE: (torch.float32, lambda ps: torch.optim.Adam(ps, lr=LR, fused=True)),
    "torch.optim.Adam (foreach), float32": (
      torch.float32,
      lambda ps: torch.optim.Adam(ps, lr=LR, foreach=True),
    ),
    "torchao Adam8bit, float32": (torch.float32, lambda ps: tao.Adam8bit(ps, lr=LR)),
    "torchao AdamFp8, float32": (torch.float32, lambda ps: tao.AdamFp8(ps, lr=LR)),
    "torchao _AdamW(bf16_stochastic_round), bfloat16": (
      torch.bfloat16,
      lambda ps: tao._AdamW(ps, lr=LR, weight_decay=0.0, bf16_stochastic_round=True),
    ),
    **_bitsandbytes_variants(),
  }


def _bitsandbytes_variants() -> dict[str, tuple[Any, Callable[[list[Any]], Any]]]:
  """bitsandbytes' 8-bit Adam (blockwise, its CPU backend), where it is installed."""
  try:
    import bitsandbytes as bnb
    import torch
  except ImportError:
    return {}
  return {
    "bitsandbytes Adam8bit, float32": (torch.float32, lambda ps: bnb.optim.Adam8bit(ps, lr=LR))
  }


def _data(shapes: list[tuple[int, int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """The parameters and gradient of `low_precision_params.update_cost`, as NumPy arrays."""
  params, grads = lp.update_problem(shapes)
  return [np.asarray(p) for p in params.values()], [np.asarray(g) for g in grads.values()]


def measure(side: int = 1024, rounds: int = 15, steps: int = 5, threads: int = 2) -> dict[str, Any]:
  import torch

  torch.set_num_threads(threads)
  shapes = [(side, side)] * 4
  n = 4 * side * side
  params_np, grads_np = _data(shapes)

  # Each runner does `steps` updates and returns once they are done; `read` gives the
  # parameters as one float32 NumPy vector.
  runners: dict[str, Callable[[], None]] = {}
  read: dict[str, Callable[[], np.ndarray]] = {}
  jax_variants = _jax_variants()
  for name, variant in jax_variants.items():
    params = {f"w{i}": jnp.asarray(p) for i, p in enumerate(params_np)}
    grads = {f"w{i}": jnp.asarray(g) for i, g in enumerate(grads_np)}
    step, p, state = lp.compiled_update(variant, params, grads)
    g = jax.tree.map(lambda x, d=variant.dtype: jnp.array(x, d, copy=True), grads)
    held = {"p": p, "s": state}

    def run(step: Any = step, g: Any = g, held: dict[str, Any] = held) -> None:
      p, s = held["p"], held["s"]
      for _ in range(steps):
        p, s = step(p, s, g)
      jax.block_until_ready(p)
      held["p"], held["s"] = p, s

    runners[name] = run
    read[name] = lambda held=held: np.concatenate(
      [np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(held["p"])]
    )
  for name, (dtype, make) in _torch_variants().items():
    ps = [torch.nn.Parameter(torch.from_numpy(p.copy()).to(dtype)) for p in params_np]
    for p, g in zip(ps, grads_np, strict=True):
      p.grad = torch.from_numpy(g.copy()).to(dtype)
    opt = make(ps)

    def run(opt: Any = opt) -> None:
      for _ in range(steps):
        opt.step()

    runners[name] = run
    read[name] = lambda ps=ps: np.concatenate([p.detach().float().numpy().ravel() for p in ps])

  order = list(runners)
  times: dict[str, list[float]] = {name: [] for name in runners}
  rng = np.random.default_rng(0)
  for _ in range(rounds + 1):  # the first round warms up (and compiles torchao's step): dropped
    rng.shuffle(order)
    for name in order:
      start = time.perf_counter()
      runners[name]()
      times[name].append((time.perf_counter() - start) / steps)
  arrays = {name: np.asarray(t[1:] if len(t) > 1 else t) for name, t in times.items()}
  origin = np.concatenate([p.ravel() for p in params_np])
  reference = read[JAX_BASE]()
  moved = float(np.abs(reference - origin).max())
  results = {}
  for name, t in arrays.items():
    base = arrays[JAX_BASE if name in jax_variants else TORCH_BASE]
    results[name] = {
      "ms": float(np.median(t) * 1e3),
      "vs_own_adam": float(np.median(t / base)),
      "max_abs_from_optax_adam": float(np.abs(read[name]() - reference).max()),
    }
  return {
    "params": n,
    "rounds": rounds,
    "steps": steps,
    "updates": (rounds + 1) * steps,
    "optax_adam_moved": moved,
    "threads": threads,
    "torch": torch.__version__,
    "torchao": _version("torchao"),
    "jax": jax.__version__,
    "machine": platform.processor() or platform.machine(),
    "results": results,
  }


def _version(package: str) -> str:
  from importlib import metadata

  return metadata.version(package)


def markdown(out: dict[str, Any]) -> str:
  lines = [
    f"{out['params']:,} parameters, {out['rounds']} rounds of {out['steps']} steps,"
    f" torch {out['torch']}, torchao {out['torchao']}, jax {out['jax']}; after"
    f" {out['updates']} updates, optax's float32 Adam moved the parameters up to"
    f" {out['optax_adam_moved']:.3g}",
    "",
    "| framework | update | ms a step | vs its framework's float32 Adam |"
    " max distance from optax's float32 Adam |",
    "| --- | --- | --- | --- | --- |",
  ]
  for name, r in out["results"].items():
    framework = "PyTorch" if name.startswith(("torch", "bitsandbytes")) else "JAX"
    lines.append(
      f"| {framework} | {name} | {r['ms']:.2f} | x{r['vs_own_adam']:.2f} |"
      f" {r['max_abs_from_optax_adam']:.2g} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--side", type=int, default=1024, help="the matrices' side (4 of them)")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
  parser.add_argument("--quick", action="store_true", help="a 64 x 64 smoke test, 1 round")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
  args = parser.parse_args(argv)
  if args.quick:
    args.side, args.rounds, args.steps = 64, 1, 1
  out = measure(args.side, args.rounds, args.steps, args.threads)
  print(markdown(out))
  if args.out is not None:
    args.out.write_text(json.dumps(out, indent=1) + "\n")
  return out


if __name__ == "__main__":
  main()
