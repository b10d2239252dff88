"""The cost of `skip_bad_steps` on the Adam update, against bare optax and `apply_if_finite`.

Standalone (it does not go through `benchmarks.run`): one process, every step
jitted with its params and state donated, warmed up, then timed in interleaved
rounds (each round runs every variant for the same number of steps, so a slow
moment of the machine hits all alike). A variant's time is the median over
rounds of its per-step time; its ratio is the median over rounds of its time
over bare optax's in the same round. Gradients are finite and spike-free, so
every step is applied: the cost measured is the check, not the skip.

  python -m benchmarks.skip_bad_steps_bench [--sizes 1M 4M] [--rounds 9] [--steps 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

SIZES = {"1M": 2**20, "4M": 2**22}


def _params(size: int) -> dict[str, jax.Array]:
  """Four leaves of `size` float32 parameters in all, as in a small MLP."""
  quarter = size // 4
  return {f"w{i}": jnp.linspace(-1.0, 1.0, quarter, dtype=jnp.float32) for i in range(4)}


def _update_then_apply(tx: optax.GradientTransformation) -> Callable[..., Any]:
  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _fused(tx: optax.GradientTransformation) -> Callable[..., Any]:
  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    return ols.apply_gradients(tx, grads, state, params)

  return step


def variants() -> dict[str, tuple[optax.GradientTransformation, Callable[..., Any]]]:
  adam = optax.adam(1e-3)
  guard = ols.skip_bad_steps(adam)
  spikes = ols.skip_bad_steps(adam, spike_threshold=6.0, warmup_steps=1)
  return {
    "bare optax": (adam, _update_then_apply(adam)),
    "optax.apply_if_finite": (
      optax.apply_if_finite(adam, max_consecutive_errors=10),
      None,
    ),
    "skip_bad_steps, update + apply_updates": (guard, None),
    "skip_bad_steps (fused apply_gradients)": (guard, _fused(guard)),
    "skip_bad_steps + spike (fused)": (spikes, _fused(spikes)),
  }


def measure(size: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
  params = _params(size)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  runs = {}
  for name, (tx, step) in variants().items():
    step = step or _update_then_apply(tx)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    s = jax.jit(tx.init)(p)
    for _ in range(3):  # compile and warm up
      p, s = jitted(p, s, grads)
    jax.block_until_ready((p, s))
    runs[name] = [jitted, p, s]
  times = {name: [] for name in runs}
  for _ in range(rounds):
    for name, run in runs.items():
      jitted, p, s = run
      start = time.perf_counter()
      for _ in range(steps):
        p, s = jitted(p, s, grads)
      jax.block_until_ready((p, s))
      times[name].append((time.perf_counter() - start) / steps)
      run[1], run[2] = p, s
  bare = np.asarray(times["bare optax"])
  return {
    name: {
      "median_ms": float(np.median(t) * 1e3),
      "ratio": float(np.median(np.asarray(t) / bare)),
    }
    for name, t in times.items()
  }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; Adam, params and state donated")
  results = {}
  for label in args.sizes:
    results[label] = measure(SIZES[label], args.rounds, args.steps)
    print(f"\n{label} parameters ({args.rounds} interleaved rounds of {args.steps} steps)")
    print(f"{'variant':<42} {'median ms':>10} {'x bare':>7}")
    for name, r in results[label].items():
      print(f"{name:<42} {r['median_ms']:>10.3f} {r['ratio']:>7.2f}")
  return results


if __name__ == "__main__":
  main()
