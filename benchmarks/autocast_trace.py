"""How long a train step takes to trace under autocast, against float32.

A GPT-style LM of `--layers` Flax Linen blocks (the residual-memory
benchmark's GPT block), its train step (`value_and_grad` of the loss, Adam)
traced with `jax.jit(step).trace(...)`, in two forms:

* `unrolled`: the blocks inlined into one jaxpr (every equation interpreted);
* `jitted blocks`: each block under `nn.jit`, as models that jit their layers
  do (JAX caches a jitted block's jaxpr; autocast caches its interpreted one);
* `nn.scan`: the blocks' parameters stacked and the block run by Flax's
  `nn.scan` (one `lax.scan` over the layers, as large models are written);
* `lax.scan`: the same by hand, a `lax.scan` over a stacked parameter tree
  (the block applied with `GPTBlock.apply`).

And two moments:

* `first`: the first trace in a fresh process (one subprocess per variant
  and round);
* `re-trace`: a new step function around the same model traced again in the
  same process, with JAX's caches warm (what a second `jit` wrapper, a new
  static argument or a re-run notebook cell costs).

And a reference: `autocast` reads the function as a jaxpr, so its first trace
includes tracing the loss once more (`jax.make_jaxpr`, in a fresh process);
`vs f32 + jaxpr` is autocast's first trace against float32's plus that one
(per round). It is no floor: autocast runs the jaxpr under the derivative
instead of the model's Python, which can cost less (`--parts`).

`--calls` counts instead the Python function calls each trace makes
(`cProfile`, one fresh process per variant): the same on every run, where
times on a shared machine vary by a tenth from round to round. `--parts`
counts them with autocast's regions, and its products' custom JVP rules,
taken out (patched, in a fresh process each).

Times are the tracing process's CPU seconds (`time.process_time`): tracing is
single-threaded Python, and on a shared machine wall time also counts the
neighbours. Variants interleaved per round, medians of per-round ratios. Run:
`python -m benchmarks.autocast_trace` (`--quick` for a smoke test).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import cProfile
import gc
import json
import pstats
import statistics
import subprocess
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.autocast_memory import GPTBlock
import optax_lossscale as ols

POLICIES = {"float32": None, "autocast bf16": "p=f32,c=bf16,o=f32"}
FORMS = ("unrolled", "jitted blocks", "nn.scan", "lax.scan")
FLOOR = "loss jaxpr"  # the loss traced to a jaxpr alone (first trace only)


class _ScannedBlock(nn.Module):
  """A `GPTBlock` in the signature `nn.scan` wants: (carry, x) -> (carry, y)."""

  width: int

  @nn.compact
  def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
    return GPTBlock(self.width, 4)(x), None


class _HandScan(nn.Module):
  """The blocks' parameters stacked on a leading axis, run by a hand-written `lax.scan`."""

  layers: int
  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    block = GPTBlock(self.width, 4)
    init = lambda key: jax.vmap(lambda k: block.init(k, x)["params"])(
      jax.random.split(key, self.layers)
    )
    stacked = self.param("blocks", init)
    step = lambda h, p: (block.apply({"params": p}, h), None)
    return jax.lax.scan(step, x, stacked)[0]


class LM(nn.Module):
  layers: int
  form: str
  vocab: int = 1024
  width: int = 256

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(self.vocab, self.width)
    x = embed(tokens)
    if self.form == "nn.scan":
      scanned = nn.scan(
        _ScannedBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=self.layers,
      )
      x, _ = scanned(self.width)(x, None)
    elif self.form == "lax.scan":
      x = _HandScan(self.layers, self.width)(x)
    else:
      block = nn.jit(GPTBlock) if self.form == "jitted blocks" else GPTBlock
      for _ in range(self.layers):
        x = block(self.width, 4)(x)
    return embed.attend(nn.LayerNorm()(x))


def make_loss(model: LM) -> Callable[..., Any]:
  def loss(params: Any, tokens: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens))

  return loss


def make_step(model: LM, policy: str | None) -> Callable[..., Any]:
  loss = make_loss(model)
  loss_fn = loss if policy is None else ols.autocast(loss, policy)
  tx = optax.adam(1e-3)

  def step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
    value, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def _setup(layers: int, form: str) -> tuple[LM, tuple[Any, ...]]:
  model = LM(layers, form)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (2, 128)), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
  opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
  return model, (params, opt_state, tokens)


def _trace_seconds(model: LM, policy: str | None, args: tuple[Any, ...]) -> float:
  step = make_step(model, policy)  # a new function: no jit cache hit on the step itself
  # A full collection pending from earlier work (70 ms on this heap, half a scan-form
  # trace) would land in whichever trace comes next: start each from a collected heap.
  gc.collect()
  start = time.process_time()
  jax.jit(step).trace(*args)
  return time.process_time() - start


def _jaxpr_seconds(model: LM, args: tuple[Any, ...]) -> float:
  """The loss (no derivative, no optimizer) traced to a jaxpr, as `autocast` reads it."""
  params, _, tokens = args
  loss = make_loss(model)
  start = time.process_time()
  jax.make_jaxpr(loss)(params, tokens)
  return time.process_time() - start


def _in_fresh_process(function: str, *args: Any) -> float:
  """`function` of this module called on `args` in a new Python process: its number."""
  code = f"from benchmarks.autocast_trace import {function}; print({function}(*{args!r}))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return float(out.stdout.strip().splitlines()[-1])


def _first_in_fresh_process(
  layers: int, form: str, variant: str, calls: bool = False, again: bool = False
) -> float:
  return _in_fresh_process("_one", layers, form, variant, calls, again)


def _one(layers: int, form: str, variant: str, calls: bool = False, again: bool = False) -> float:
  """The first trace's CPU seconds, or with `calls` its Python function calls; with
  `again`, those of the re-trace that follows it (a new step around the same model)."""
  model, args = _setup(layers, form)
  trace = lambda: (
    _jaxpr_seconds(model, args)
    if variant == FLOOR
    else _trace_seconds(model, POLICIES[variant], args)
  )
  if again:
    trace()
  if not calls:
    return trace()
  profile = cProfile.Profile()
  profile.runcall(trace)
  return float(sum(row[1] for row in pstats.Stats(profile).stats.values()))


AGAIN = ", re-trace"


def call_counts(layers: int, forms: tuple[str, ...]) -> dict[str, dict[str, float]]:
  """Python function calls of each first trace (fresh processes), by form and variant,
  and of each variant's re-trace (`"<variant>, re-trace"`, after a first in its process)."""
  out: dict[str, dict[str, float]] = {}
  for form in forms:
    row = {v: _first_in_fresh_process(layers, form, v, calls=True) for v in [*POLICIES, FLOOR]}
    for v in POLICIES:
      row[v + AGAIN] = _first_in_fresh_process(layers, form, v, calls=True, again=True)
    out[form] = row
  return out


# What a first trace costs, part by part (`--parts`): autocast with its two costliest
# features taken out, counterfactuals that patch its internals (in a fresh process each,
# never shipped), against float32 alone and float32 after the loss traced to a jaxpr.
PARTS = (
  "float32",
  "loss jaxpr, then float32",
  "autocast, plain products, no regions",
  "autocast, no regions",
  "autocast bf16",
)


def _without(part: str) -> None:
  """Patches autocast for `part`: no regions (each plan flat), and plain products (bound
  on 16-bit operands, no custom JVP rule making the backward products 16-bit)."""
  from optax_lossscale._src.autocast import plan, products

  if "no regions" in part:
    planned = plan._plan
    plan._plan = lambda ctx, jaxpr, kinds, flat: planned(ctx, jaxpr, kinds, True)
  if "plain products" in part:

    def plain(primitive: Any, items: Any, c: Any, result: Any) -> Callable[..., Any]:
      params = dict(items)
      return lambda *ops: primitive.bind(*ops, **{**params, "preferred_element_type": result})

    plain.__wrapped__ = plain  # as the cached original's, for unhashable parameters
    products._product = plain


def _part_calls(layers: int, form: str, part: str) -> float:
  """The Python function calls of `part`'s first trace. It patches autocast for the rest
  of the process: run it in a fresh one (`part_counts`)."""
  _without(part)
  model, args = _setup(layers, form)

  def trace() -> None:
    if part == "loss jaxpr, then float32":
      _jaxpr_seconds(model, args)
    _trace_seconds(
      model, None if part.startswith(("float32", "loss")) else POLICIES["autocast bf16"], args
    )

  profile = cProfile.Profile()
  profile.runcall(trace)
  return float(sum(row[1] for row in pstats.Stats(profile).stats.values()))


def part_counts(layers: int, forms: tuple[str, ...]) -> dict[str, dict[str, float]]:
  """`_part_calls` of every part, by form, each in a fresh process."""
  out: dict[str, dict[str, float]] = {}
  for form in forms:
    out[form] = {}
    for part in PARTS:
      out[form][part] = _in_fresh_process("_part_calls", layers, form, part)
  return out


def measure(layers: int, rounds: int, forms: tuple[str, ...] = FORMS) -> dict[str, Any]:
  out: dict[str, Any] = {"layers": layers, "rounds": rounds}
  for form in forms:
    model, args = _setup(layers, form)
    first: dict[str, list[float]] = {k: [] for k in POLICIES}
    again: dict[str, list[float]] = {k: [] for k in POLICIES}
    for name in POLICIES:  # warm JAX's caches of the model's helpers once
      _trace_seconds(model, POLICIES[name], args)
    jaxpr: list[float] = []
    for _ in range(rounds):
      for name, policy in POLICIES.items():
        first[name].append(_first_in_fresh_process(layers, form, name))
        again[name].append(_trace_seconds(model, policy, args))
      jaxpr.append(_first_in_fresh_process(layers, form, FLOOR))
    per_round = lambda d, k: [a / b for a, b in zip(d[k], d["float32"], strict=True)]
    floor = [f + j for f, j in zip(first["float32"], jaxpr, strict=True)]
    out[form] = {
      name: {
        "first s": statistics.median(first[name]),
        "first x": statistics.median(per_round(first, name)),
        "re-trace s": statistics.median(again[name]),
        "re-trace x": statistics.median(per_round(again, name)),
        "first vs floor": statistics.median(a / b for a, b in zip(first[name], floor, strict=True)),
      }
      for name in POLICIES
    }
    out[form][FLOOR] = {
      "first s": statistics.median(jaxpr),
      "floor x": statistics.median(
        b / f for b, f in zip(floor, first["float32"], strict=True)
      ),  # float32's first trace plus the jaxpr, against float32's
    }
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 layers, 1 round (a smoke test)")
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument(
    "--forms", nargs="+", choices=FORMS, default=list(FORMS), help="the model forms to trace"
  )
  parser.add_argument("--json", help="write the results to this file")
  parser.add_argument(
    "--calls", action="store_true", help="count the first traces' Python function calls"
  )
  parser.add_argument(
    "--parts",
    action="store_true",
    help="count the calls of autocast's first trace without regions and 16-bit backward products",
  )
  args = parser.parse_args()
  layers, rounds = (2, 1) if args.quick else (args.layers, args.rounds)
  if args.parts:
    parts = part_counts(layers, tuple(args.forms))
    print(f"first trace, Python function calls, GPT LM with {layers} layers, part by part")
    for form, row in parts.items():
      for part, n in row.items():
        print(f"{form:15}{part:40}{n:10.0f}  x{n / row['float32']:.2f} of float32")
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"layers": layers, "calls": parts}, f, indent=2)
    return
  if args.calls:
    counts = call_counts(layers, tuple(args.forms))
    print(f"first trace, Python function calls, GPT LM with {layers} layers")
    for form, row in counts.items():
      f32, floor = row["float32"], row["float32"] + row[FLOOR]
      for variant, n in row.items():
        base = row["float32" + AGAIN] if variant.endswith(AGAIN) else f32
        print(f"{form:15}{variant:25}{n:10.0f}  x{n / base:.2f} of float32's")
      print(f"{form:15}{'f32 + jaxpr':25}{floor:10.0f}  x{floor / f32:.2f} of float32's")
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"layers": layers, "calls": counts}, f, indent=2)
    return
  out = measure(layers, rounds, tuple(args.forms))
  print(f"train step trace, GPT LM with {layers} layers ({rounds} rounds, medians)")
  print(
    f"{'form':15}{'variant':15}{'first (s)':>11}{'vs f32':>8}{'vs f32+jaxpr':>14}"
    f"{'re-trace (s)':>14}{'vs f32':>8}"
  )
  for form in args.forms:
    for name in POLICIES:
      r = out[form][name]
      print(
        f"{form:15}{name:15}{r['first s']:11.2f}{r['first x']:8.2f}{r['first vs floor']:14.2f}"
        f"{r['re-trace s']:14.2f}{r['re-trace x']:8.2f}"
      )
    r = out[form][FLOOR]
    print(f"{form:15}{FLOOR:15}{r['first s']:11.2f}   (float32 + it: x{r['floor x']:.2f})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
