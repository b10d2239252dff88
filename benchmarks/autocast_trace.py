"""How long a train step takes to trace under autocast, against float32.

A GPT-style LM of `--layers` unrolled Flax Linen blocks (the residual-memory
benchmark's GPT block), its train step (`value_and_grad` of the loss, Adam)
traced with `jax.jit(step).trace(...)`:

* first trace: a fresh `jax.jit` of a fresh step function, each variant in
  turn (JAX's caches of the model's inner jitted helpers warm up in the first
  round, which is discarded);
* re-trace: a fresh `jax.jit` of the *same* step function with the same
  shapes, as a second `jit` wrapper or an evicted cache would trace it.

Variants interleaved per round, medians of per-round ratios. Run:
`python -m benchmarks.autocast_trace` (`--quick` for a smoke test).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.autocast_memory import GPT
import optax_lossscale as ols

POLICIES = {"float32": None, "autocast bf16": "p=f32,c=bf16,o=f32"}


def make_step(model: GPT, policy: str | None) -> Callable[..., Any]:
  def loss(params: Any, tokens: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens))

  loss_fn = loss if policy is None else ols.autocast(loss, policy)
  tx = optax.adam(1e-3)

  def step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
    value, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def _trace_seconds(step: Callable[..., Any], *args: Any) -> float:
  start = time.perf_counter()
  jax.jit(step).trace(*args)
  return time.perf_counter() - start


def measure(layers: int, rounds: int, width: int = 256, seq: int = 128) -> dict[str, Any]:
  model = GPT(vocab=1024, width=width, heads=4, depth=layers)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (2, seq)), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
  opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
  first: dict[str, list[float]] = {k: [] for k in POLICIES}
  again: dict[str, list[float]] = {k: [] for k in POLICIES}
  for r in range(rounds + 1):
    for name, policy in POLICIES.items():
      step = make_step(model, policy)
      t1 = _trace_seconds(step, params, opt_state, tokens)
      t2 = _trace_seconds(step, params, opt_state, tokens)
      if r:  # the first round warms JAX's own caches
        first[name].append(t1)
        again[name].append(t2)
  ratio = lambda d, k: statistics.median(a / b for a, b in zip(d[k], d["float32"], strict=True))
  out: dict[str, Any] = {"layers": layers}
  for name in POLICIES:
    out[name] = {
      "first s": statistics.median(first[name]),
      "re-trace s": statistics.median(again[name]),
      "first x": ratio(first, name),
      "re-trace x": ratio(again, name),
    }
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 layers, 1 round (a smoke test)")
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  layers, rounds = (2, 1) if args.quick else (args.layers, args.rounds)
  out = measure(layers, rounds)
  print(f"train step trace, GPT with {layers} unrolled layers ({rounds} rounds, medians)")
  print(f"{'variant':16}{'first (s)':>11}{'vs f32':>8}{'re-trace (s)':>14}{'vs f32':>8}")
  for name in POLICIES:
    r = out[name]
    print(
      f"{name:16}{r['first s']:11.2f}{r['first x']:8.2f}{r['re-trace s']:14.2f}"
      f"{r['re-trace x']:8.2f}"
    )


if __name__ == "__main__":
  main()
