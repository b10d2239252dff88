"""autocast against hand casts on the transformer LM train step: FLOPs, memory, converts, loss.

The GPT-style LM of `workloads.py`, written in float32 (its Flax modules'
`dtype=None`), trained on Python's own standard-library sources as bytes
(vocabulary 256) with Adam, float32 parameters, from the same initial
parameters and the same batches, in:

* `float32`: no casts, bare optax;
* `hand-cast float16` (jmp style): `policy.cast_to_compute` on the params
  inside the loss, so every op of the model runs in float16, with
  `loss_scale_optimizer`;
* `autocast float16`: `ols.autocast(loss_fn, "p=f32,c=f16,o=f32")`, with
  `loss_scale_optimizer`;
* `hand-cast bfloat16` and `autocast bfloat16`: the same in bfloat16, with
  `skip_bad_steps` (bfloat16 needs no loss scale);
* `model-dtype float16`, `model-dtype bfloat16`: the model's own Flax
  `dtype=` (every module computes in it, float32 parameters), the peer a Flax
  user has today.

For each: the share of the step's matrix FLOPs (every `dot_general` of the
jaxpr of the whole train step, forward and backward) whose inputs are 16-bit,
the compiled step's temporary memory (`memory_analysis`), the `convert`
instructions of the optimized HLO, the step time relative to float32 (medians
of interleaved rounds; on CPU float16 arithmetic is emulated, so time belongs
to a GPU run), and the float32 loss on held-out text after the same steps.

  python -m benchmarks.autocast_bench [--steps N] [--quick] [--gpu-size] [--out F.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import math
import os
import pathlib
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import workloads
import optax_lossscale as ols

CPU_LM = {"vocab": 256, "d_model": 256, "heads": 4, "layers": 4, "seq": 64, "batch": 8}
QUICK_LM = {"vocab": 256, "d_model": 32, "heads": 2, "layers": 1, "seq": 16, "batch": 2}
GPU_LM = {**workloads.GPU_LM, "vocab": 256}
VARIANTS = (
  "float32",
  "hand-cast float16",
  "model-dtype float16",
  "autocast float16",
  "hand-cast bfloat16",
  "model-dtype bfloat16",
  "autocast bfloat16",
)
LEARNING_RATE = 1e-3


def stdlib_bytes(limit: int = 2_000_000) -> np.ndarray:
  """Python's own standard-library sources, concatenated, as bytes (no download)."""
  root = pathlib.Path(os.__file__).parent
  chunks, size = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    size += len(data)
    if size >= limit:
      break
  return np.frombuffer(b"".join(chunks), np.uint8)


def batches(text: np.ndarray, steps: int, batch: int, seq: int, seed: int) -> list[jax.Array]:
  """`steps` batches of `batch` random windows of `seq + 1` bytes (the same for every variant)."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(text) - seq - 1, size=(steps, batch))
  windows = text[starts[..., None] + np.arange(seq + 1)]
  return [jnp.asarray(w, jnp.int32) for w in windows]


def _compute_dtype(name: str) -> str:
  return name.rpartition(" ")[2]  # "autocast bfloat16" -> "bfloat16"


def make_variant(
  name: str, loss_fn: Callable[..., Any], model_dtype_loss: Callable[..., Any] | None = None
) -> tuple[Any, Callable[..., Any]]:
  """`(tx, step)` of one variant; `step(params, state, tokens) -> (params, state, loss)`.

  `model_dtype_loss` is the loss of the same model built with `dtype=` the
  variant's compute dtype (the `model-dtype` variants).
  """
  half = jnp.dtype(_compute_dtype(name))
  policy = ols.Policy(jnp.float32, half, jnp.float32)
  if name == "float32":
    tx = optax.adam(LEARNING_RATE)

    def step(params, state, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    return tx, step
  if name.startswith("hand-cast"):
    loss = lambda p, tokens: loss_fn(policy.cast_to_compute(p), tokens)  # jmp's recipe
  elif name.startswith("model-dtype"):
    assert model_dtype_loss is not None
    loss = model_dtype_loss
  else:
    loss = ols.autocast(loss_fn, policy)
  if half == jnp.float16:
    tx = ols.loss_scale_optimizer(optax.adam(LEARNING_RATE))

    def step(params, state, tokens):
      value, grads = ols.value_and_grad(loss)(state, params, tokens)
      params, state = ols.apply_gradients(tx, grads, state, params)
      return params, state, value

    return tx, step
  tx = ols.skip_bad_steps(optax.adam(LEARNING_RATE))

  def step(params, state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    params, state = ols.apply_gradients(tx, grads, state, params)
    return params, state, value

  return tx, step


def matmul_flops(jaxpr: Any) -> dict[str, float]:
  """FLOPs of every `dot_general`, by the dtype of its inputs ('16-bit' when both are)."""
  flops: dict[str, float] = {}
  for eqn in workloads.equations(jaxpr.jaxpr):
    if eqn.primitive.name != "dot_general":
      continue
    lhs, rhs = (v.aval for v in eqn.invars)
    (contract, _), _ = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval
    n = 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)
    key = "16-bit" if lhs.dtype.itemsize == rhs.dtype.itemsize == 2 else str(lhs.dtype)
    flops[key] = flops.get(key, 0.0) + n
  return flops


def converts(hlo_text: str) -> int:
  return len(re.findall(r"\bconvert\(", hlo_text))


def measure(lm: dict[str, int], steps: int, rounds: int, seed: int) -> dict[str, Any]:
  model_kw = {k: v for k, v in lm.items() if k != "batch"}
  model = workloads._lm_model(**model_kw, dtype=None)  # the float32 model
  loss_fn = workloads._lm_loss(model)
  text = stdlib_bytes()
  train = batches(text[: int(0.9 * len(text))], steps, lm["batch"], lm["seq"], seed)
  held_out = batches(text[int(0.9 * len(text)) :], 4, lm["batch"], lm["seq"], seed + 1)
  params0 = jax.jit(model.init)(jax.random.key(seed), train[0][:, :-1])["params"]
  evaluate = jax.jit(lambda p: jnp.mean(jnp.stack([loss_fn(p, t) for t in held_out])))
  results: dict[str, dict[str, Any]] = {}
  steppers = {}
  model_dtype_losses = {
    dtype: workloads._lm_loss(workloads._lm_model(**model_kw, dtype=jnp.dtype(dtype)))
    for dtype in ("float16", "bfloat16")
  }
  for name in VARIANTS:
    tx, step = make_variant(name, loss_fn, model_dtype_losses.get(_compute_dtype(name)))
    state = tx.init(params0)
    jaxpr = jax.make_jaxpr(step)(params0, state, train[0])
    flops = matmul_flops(jaxpr)
    compiled = jax.jit(step).lower(params0, state, train[0]).compile()
    memory = compiled.memory_analysis()
    params = params0
    for tokens in train:
      params, state, _ = compiled(params, state, tokens)
    skips = int(ols.metrics(state)["total_skips"]) if name != "float32" else 0
    results[name] = {
      "half_flop_share": flops.get("16-bit", 0.0) / sum(flops.values()),
      "matmul_gflops": sum(flops.values()) / 1e9,
      "temp_mib": None if memory is None else memory.temp_size_in_bytes / 2**20,
      "converts": converts(compiled.as_text()),
      "final_loss": float(evaluate(params)),
      "skipped": skips,
    }
    steppers[name] = (compiled, state)
  # Step time: interleaved rounds of 5 steps, medians of the ratios to float32.
  ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
  for _ in range(rounds):
    times = {}
    for name, (compiled, state) in steppers.items():
      params = params0
      jax.block_until_ready(compiled(params, state, train[0]))
      start = time.perf_counter()
      for tokens in train[:5]:
        params, state, loss = compiled(params, state, tokens)
      jax.block_until_ready(loss)
      times[name] = (time.perf_counter() - start) / 5
    for name in VARIANTS:
      ratios[name].append(times[name] / times["float32"])
  for name in VARIANTS:
    results[name]["time_vs_float32"] = statistics.median(ratios[name]) if rounds else None
  return {
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0].device_kind),
    "lm": lm,
    "params": workloads.num_params(params0),
    "steps": steps,
    "rounds": rounds,
    "seed": seed,
    "jax": jax.__version__,
    "variants": results,
    "compute_dtypes": {name: _compute_dtype(name) for name in VARIANTS},
  }


def markdown(report: dict[str, Any]) -> str:
  lm = report["lm"]
  lines = [
    f"LM {lm['layers']}x{lm['d_model']}, {report['params'] / 1e6:.1f}M params, batch"
    f" {lm['batch']}x{lm['seq']} bytes of Python's standard library, Adam {LEARNING_RATE},"
    f" {report['steps']} steps; {report['backend']} ({report['device']}), jax {report['jax']}.",
    "",
    "| variant | matmul FLOPs in 16-bit | temp memory | converts | step time vs float32"
    " | held-out loss | skipped |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for name, r in report["variants"].items():
    temp = "n/a" if r["temp_mib"] is None else f"{r['temp_mib']:.1f} MiB"
    ratio = "n/a" if r["time_vs_float32"] is None else f"x{r['time_vs_float32']:.2f}"
    lines.append(
      f"| {name} | {100 * r['half_flop_share']:.0f}% | {temp} | {r['converts']} |"
      f" {ratio} | {r['final_loss']:.4f} | {r['skipped']} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300, help="training steps per variant")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
  parser.add_argument(
    "--quick", action="store_true", help="a tiny LM, 5 steps, no timing: a smoke test"
  )
  parser.add_argument("--gpu-size", action="store_true", help="the 186M-parameter LM (GPU)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report as JSON")
  args = parser.parse_args(argv)
  lm = QUICK_LM if args.quick else GPU_LM if args.gpu_size else CPU_LM
  steps = 5 if args.quick else args.steps
  rounds = 0 if args.quick else args.rounds
  report = measure(lm, steps, rounds, args.seed)
  print(markdown(report))
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
  return report


if __name__ == "__main__":
  main()
