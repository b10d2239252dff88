"""fp8 autocast: training against float32 and bfloat16 (CPU), and its speed (GPU, `--gpu`).

**Training** (default; CPU). Three problems, each trained with Adam from the
same initial parameters on the same batches, in four variants: `float32`
(bare optax), `bfloat16` (`ols.autocast(loss, "p=f32,c=bf16,o=f32")`), and
the same with `fp8="tensorwise"` and `fp8="rowwise"` (`skip_bad_steps`
around Adam for the three autocast rows). The fp8 rows use
`fp8_products="all"`: at these CPU sizes the cost model would leave every
product in bfloat16, and what is measured here is fp8's numerics on every
product with dimensions >= 16 (the worst case), not its speed.

* `regression`: y = x @ W_true, no noise (256 inputs, 32 outputs, batch 64,
  W from 0; ten times `--steps`): the loss can reach 0, so a format's
  rounding sets its floor;
* `digits MLP`: scikit-learn's digits, 64-256-256-10, cross-entropy
  (`low_precision_params.digits_mlp`; its 256x10 head stays bfloat16: a
  dimension under 16);
* `LM`: the benchmarks' transformer LM (`workloads._lm_model`, written in
  float32) on a 4-successor Markov-chain language: its best loss is
  log 4 = 1.386.

Reported per variant: the final float32 loss on held-out data (mean over
seeds, and the spread), its mean distance from the float32 run of the same
seed, the share of the train step's matrix FLOPs (forward and backward) on
fp8 operands, skipped steps and whether anything was NaN.

**Speed** (`--gpu`, for `benchmarks/run_gpu.sh`; runs anywhere, but only an
fp8-capable GPU (sm89+) answers the question): step time of the 186M LM of
the H100 measurements (`workloads.GPU_LM`) in bare bfloat16 (the model's own
`dtype=bfloat16`), autocast bfloat16, and autocast with each fp8 recipe (and
tensorwise on every product, cost model lifted), as medians of interleaved
rounds; and single products, forward and forward + backward, bfloat16 against
fp8, for 4096x8192x16384 (torchao's example) and a sweep, beside the cost
model's prediction (`fp8_choice.predicted_speedup`). Each compiled program's
cuBLASLt fp8 GEMMs (`__cublas$lt$matmul$f8` custom calls) are counted: the
proof that XLA's rewriter turned the fp8 products into fp8 GEMMs.

  python -m benchmarks.fp8_autocast_bench [--quick] [--seeds K] [--steps N] [--out F.json]
  python -m benchmarks.fp8_autocast_bench --gpu [--quick] [--out F.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import math
import pathlib
import re
import statistics
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import low_precision_params as lpp
from benchmarks import workloads
import optax_lossscale as ols
from optax_lossscale._src.autocast import fp8 as fp8_product
from optax_lossscale._src.autocast import fp8_choice

BF16 = "p=f32,c=bf16,o=f32"
VARIANTS = ("float32", "bfloat16", "fp8 tensorwise", "fp8 rowwise")
LEARNING_RATE = 1e-3


class Problem(NamedTuple):
  name: str
  description: str
  params: Any
  loss_fn: Callable[[Any, Any], jax.Array]
  batch: Callable[[int], Any]
  eval_batches: list[Any]


def regression(seed: int, quick: bool = False) -> Problem:
  """y = x @ W_true without noise; W_true ~ N(0, 1/256), W starts at 0."""
  d_in, d_out, batch = (32, 16, 16) if quick else (256, 32, 64)
  rng = np.random.default_rng(seed)
  w_true = jnp.asarray(rng.standard_normal((d_in, d_out)).astype(np.float32) / np.sqrt(d_in))

  def make(i: int) -> Any:
    x = np.random.default_rng([seed, i]).standard_normal((batch, d_in)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(x) @ w_true

  def loss_fn(params: Any, data: Any) -> jax.Array:
    x, y = data
    return jnp.mean((x @ params["w"] - y) ** 2)

  desc = f"regression {d_in}->{d_out}, batch {batch}, no noise, W from 0"
  params = {"w": jnp.zeros((d_in, d_out))}
  return Problem("regression", desc, params, loss_fn, make, [make(10**6 + i) for i in range(4)])


def digits(seed: int, quick: bool = False) -> Problem:
  del quick
  p = lpp.digits_mlp(seed, 0)
  return Problem("digits MLP", p.description, p.params, p.loss_fn, p.batch, p.eval_batches)


def markov_lm(seed: int, quick: bool = False) -> Problem:
  """The benchmarks' LM, float32 as written, on a language whose best loss is log 4."""
  size = dict(vocab=256, d_model=128, heads=4, layers=2, seq=64)
  batch = 8
  if quick:
    size, batch = dict(vocab=64, d_model=32, heads=2, layers=1, seq=16), 2
  model = workloads._lm_model(**size, dtype=None)
  vocab, seq = size["vocab"], size["seq"]

  def make(i: int) -> jax.Array:
    return workloads.markov_tokens(seed, i, vocab=vocab, seq=seq, batch=batch)

  params = model.init(jax.random.key(seed), make(0)[:, :-1])["params"]
  loss_fn = workloads._lm_loss(model)
  n = workloads.num_params(params)
  desc = (
    f"transformer LM {size['layers']}x{size['d_model']}, {n / 1e6:.2f}M params, {batch}x{seq}"
    " tokens of a 4-successor Markov chain (best loss log 4 = 1.386)"
  )
  return Problem("LM", desc, params, loss_fn, make, [make(10**6 + i) for i in range(4)])


PROBLEMS = {"regression": regression, "digits": digits, "lm": markov_lm}
# Steps per problem, a multiple of --steps: the regression is cheap and needs
# long enough for float32 to go well below where fp8's rounding stops it.
STEPS_FACTOR = {"regression": 10, "digits": 1, "lm": 1}


def fp8_flop_share(closed: Any) -> float:
  """The share of the matrix FLOPs of a jaxpr (every `dot_general`) on fp8 operands."""
  total = fp8 = 0.0
  for eqn in workloads.equations(closed.jaxpr):
    if eqn.primitive.name != "dot_general":
      continue
    lhs, rhs = (v.aval for v in eqn.invars)
    (contract, _), _ = eqn.params["dimension_numbers"]
    flops = 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contract)
    total += flops
    fp8 += flops if min(lhs.dtype.itemsize, rhs.dtype.itemsize) == 1 else 0
  return fp8 / total if total else 0.0


def _loss_of(name: str, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  if name == "float32":
    return loss_fn
  if not name.startswith("fp8"):
    return ols.autocast(loss_fn, BF16)
  return ols.autocast(loss_fn, BF16, fp8=name.split()[1], fp8_products="all")


def train(problem: Problem, name: str, steps: int) -> dict[str, Any]:
  loss = _loss_of(name, problem.loss_fn)
  tx = (
    optax.adam(LEARNING_RATE)
    if name == "float32"
    else ols.skip_bad_steps(optax.adam(LEARNING_RATE))
  )

  def step(params: Any, state: Any, data: Any) -> tuple[Any, Any, jax.Array]:
    value, grads = jax.value_and_grad(loss)(params, data)
    if name == "float32":
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value
    params, state = ols.apply_gradients(tx, grads, state, params)
    return params, state, value

  params, state = problem.params, tx.init(problem.params)
  share = fp8_flop_share(jax.make_jaxpr(step)(params, state, problem.batch(0)))
  compiled = jax.jit(step).lower(params, state, problem.batch(0)).compile()
  finite = True
  for i in range(steps):
    params, state, value = compiled(params, state, problem.batch(i))
    finite &= bool(jnp.isfinite(value))
  evaluate = jax.jit(problem.loss_fn)
  final = float(np.mean([evaluate(params, b) for b in problem.eval_batches]))
  skipped = 0 if name == "float32" else int(ols.metrics(state)["total_skips"])
  return {"loss": final, "fp8_flop_share": share, "skipped": skipped, "finite": finite}


def measure_training(
  quick: bool, seeds: int, steps: int, only: tuple[str, ...] = tuple(PROBLEMS)
) -> dict[str, Any]:
  report = []
  for key in only:
    make = PROBLEMS[key]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for seed in range(seeds):
      problem = make(seed, quick)
      for name in VARIANTS:
        start = time.perf_counter()
        runs[name].append(train(problem, name, steps * STEPS_FACTOR[key]))
        print(
          f"{problem.name:11s} seed {seed} {name:15s} loss {runs[name][-1]['loss']:.5g}"
          f" ({time.perf_counter() - start:.0f} s)",
          flush=True,
        )
    reference = [r["loss"] for r in runs["float32"]]
    results = {}
    for name, rs in runs.items():
      losses = [r["loss"] for r in rs]
      results[name] = {
        "losses": losses,
        "distance": float(np.mean([abs(a - b) for a, b in zip(losses, reference, strict=True)])),
        "fp8_flop_share": rs[0]["fp8_flop_share"],
        "skipped": sum(r["skipped"] for r in rs),
        "finite": all(r["finite"] and np.isfinite(r["loss"]) for r in rs),
      }
    report.append(
      {"problem": key, "description": problem.description, "steps": steps * STEPS_FACTOR[key],
       "seeds": seeds,
       "results": results}
    )  # fmt: skip
  return {"kind": "training", "meta": _meta(), "workloads": report}


# -- speed (GPU).

GEMM = (4096, 8192, 16384)  # M, K, N: torchao's "large shapes" example (x1.39 on an H100)
SWEEP = (
  (1024, 2048, 1024),
  (2048, 2048, 2048),
  (8192, 1024, 1024),
  (8192, 1024, 4096),
  (4096, 4096, 4096),
)
F8_GEMM = re.compile(r"__cublas\$lt\$matmul\$f8")


def f8_gemms(compiled: Any) -> int:
  return len(F8_GEMM.findall(compiled.as_text()))


def _timed(fns: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, float]:
  """Median ms per call over interleaved rounds."""
  times: dict[str, list[float]] = {name: [] for name in fns}
  for fn in fns.values():
    jax.block_until_ready(fn())
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(calls):
        out = fn()
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - start) / calls * 1e3)
  return {name: statistics.median(t) for name, t in times.items()}


def gemm_variants(m: int, k: int, n: int) -> dict[str, tuple[Callable[..., Any], Any]]:
  """`name -> (fn(x, w, g), None)`: a product of x (m, k) and w (k, n), forward or with its vjp."""
  dims = (((1,), (0,)), ((), ()))

  def fp8(recipe: str) -> Callable[..., Any]:
    return lambda x, w: fp8_product.fp8_dot_general(
      x, w, dimension_numbers=dims, recipe=recipe, compute_dtype=jnp.bfloat16,
      out_dtype=jnp.bfloat16,
    )  # fmt: skip

  products = {
    "bfloat16": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
    "fp8 tensorwise": fp8("tensorwise"),
    "fp8 rowwise": fp8("rowwise"),
  }
  out = {}
  for name, f in products.items():
    out[f"{name} forward"] = lambda x, w, g, f=f: f(x, w)
    out[f"{name} forward+backward"] = lambda x, w, g, f=f: jax.vjp(f, x, w)[1](g)
  return out


def measure_gemms(
  shapes: tuple[tuple[int, int, int], ...], rounds: int, calls: int
) -> list[dict[str, Any]]:
  rows = []
  for m, k, n in shapes:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
    g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    compiled = {
      name: jax.jit(fn).lower(x, w, g).compile() for name, fn in gemm_variants(m, k, n).items()
    }
    calls_of = {name: (lambda c=c, x=x, w=w, g=g: c(x, w, g)) for name, c in compiled.items()}
    ms = _timed(calls_of, rounds, calls)
    rows.append(
      {
        "m": m, "k": k, "n": n, "ms": ms,
        "f8_gemms": {name: f8_gemms(c) for name, c in compiled.items()},
        "model_speedup": {r: fp8_choice.predicted_speedup(m, n, k, r) for r in RECIPES},
      }
    )  # fmt: skip
  return rows


RECIPES = fp8_product.RECIPES
QUICK_LM = {"vocab": 64, "d_model": 32, "heads": 2, "layers": 1, "seq": 16, "batch": 2}
LM_VARIANTS = (
  "bare bfloat16",
  "autocast bfloat16",
  "fp8 tensorwise",
  "fp8 rowwise",
  "fp8 tensorwise, every product",
)


def measure_lm(
  lm: dict[str, int], rounds: int, calls: int, variants: tuple[str, ...] = LM_VARIANTS
) -> dict[str, Any]:
  model_kw = {k: v for k, v in lm.items() if k != "batch"}
  tokens = workloads._lm_tokens(vocab=lm["vocab"], seq=lm["seq"], batch=lm["batch"])
  float32_model = workloads._lm_model(**model_kw, dtype=None)
  bf16_model = workloads._lm_model(**model_kw, dtype=jnp.bfloat16)
  params = jax.jit(float32_model.init)(jax.random.key(0), tokens[:, :-1])["params"]
  tx = optax.adam(LEARNING_RATE)
  state = tx.init(params)
  results = {}
  steps = {}
  for name in variants:
    if name == "bare bfloat16":
      loss = workloads._lm_loss(bf16_model)  # the model's own dtype: params cast in its modules
    else:
      recipe = None if name == "autocast bfloat16" else name.split()[1].rstrip(",")
      products = "all" if name.endswith("every product") else "auto"
      loss = ols.autocast(
        workloads._lm_loss(float32_model), BF16, fp8=recipe, fp8_products=products
      )

    def step(params: Any, state: Any, tokens: jax.Array, loss: Any = loss) -> Any:
      value, grads = jax.value_and_grad(loss)(params, tokens)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value

    share = fp8_flop_share(jax.make_jaxpr(step)(params, state, tokens))
    compiled = jax.jit(step).lower(params, state, tokens).compile()
    steps[name] = compiled
    results[name] = {"fp8_flop_share": share, "f8_gemms": f8_gemms(compiled)}
  ms = _timed(
    {name: (lambda c=c: c(params, state, tokens)) for name, c in steps.items()}, rounds, calls
  )
  for name in variants:
    results[name]["ms"] = ms[name]
    results[name]["ratio"] = ms[name] / ms["bare bfloat16"]
  return {"lm": lm, "params": workloads.num_params(params), "variants": results}


def measure_speed(quick: bool) -> dict[str, Any]:
  if quick:  # the code paths only: tiny shapes, each kind of LM variant once
    shapes, lm, rounds, calls = ((64, 32, 48),), QUICK_LM, 1, 1
    variants = ("bare bfloat16", "fp8 rowwise", "fp8 tensorwise, every product")
  else:
    shapes, lm, rounds, calls = (GEMM, *SWEEP), workloads.GPU_LM, 7, 10
    variants = LM_VARIANTS
  gemms = measure_gemms(shapes, rounds, calls)
  lm_report = measure_lm(lm, rounds, calls, variants)
  return {"kind": "speed", "meta": _meta(), "gemms": gemms, "lm": lm_report}


def _meta() -> dict[str, Any]:
  return {
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0].device_kind),
    "jax": jax.__version__,
  }


def markdown(report: dict[str, Any]) -> str:
  meta = report["meta"]
  lines = [f"{meta['backend']} ({meta['device']}), jax {meta['jax']}.", ""]
  if report["kind"] == "training":
    for w in report["workloads"]:
      lines += [
        f"**{w['problem']}**: {w['description']}; {w['steps']} Adam steps (lr {LEARNING_RATE}),"
        f" seeds 0-{w['seeds'] - 1}.",
        "",
        "| variant | final loss | distance from float32 | matmul FLOPs in fp8 | skipped | NaN |",
        "| --- | --- | --- | --- | --- | --- |",
      ]
      for name, r in w["results"].items():
        losses = np.asarray(r["losses"])
        spread = f" ({losses.min():.4g} to {losses.max():.4g})" if len(losses) > 1 else ""
        lines.append(
          f"| {name} | {losses.mean():.4g}{spread} | {r['distance']:.2g} |"
          f" {100 * r['fp8_flop_share']:.0f}% | {r['skipped']} | {'no' if r['finite'] else 'yes'} |"
        )
      lines.append("")
    return "\n".join(lines)
  lines += [
    "| product (M, K, N) | variant | ms | vs bfloat16 | fp8 GEMMs | model |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for row in report["gemms"]:
    for name, ms in row["ms"].items():
      base = row["ms"]["bfloat16 " + name.rpartition(" ")[2]]
      recipe = name.split()[1] if name.startswith("fp8") else None
      model = f"x{row['model_speedup'][recipe]:.2f}" if recipe and "backward" in name else ""
      lines.append(
        f"| {row['m']}x{row['k']}x{row['n']} | {name} | {ms:.3f} | x{base / ms:.2f} |"
        f" {row['f8_gemms'][name]} | {model} |"
      )
  lm = report["lm"]
  lines += [
    "",
    f"LM {lm['lm']['layers']}x{lm['lm']['d_model']}, {lm['params'] / 1e6:.0f}M params, batch"
    f" {lm['lm']['batch']}x{lm['lm']['seq']}, Adam:",
    "",
    "| variant | ms / step | vs bare bfloat16 | matmul FLOPs in fp8 | fp8 GEMMs |",
    "| --- | --- | --- | --- | --- |",
  ]
  for name, r in lm["variants"].items():
    lines.append(
      f"| {name} | {r['ms']:.2f} | x{r['ratio']:.3f} | {100 * r['fp8_flop_share']:.0f}% |"
      f" {r['f8_gemms']} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes and steps: a smoke test")
  parser.add_argument("--gpu", action="store_true", help="the speed part (GEMMs and the 186M LM)")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report as JSON")
  parser.add_argument(
    "--only", default=",".join(PROBLEMS), help="training problems, of " + ", ".join(PROBLEMS)
  )
  args = parser.parse_args(argv)
  only = tuple(args.only.split(","))
  if not set(only) <= set(PROBLEMS):
    parser.error(f"--only takes some of {', '.join(PROBLEMS)}; got {args.only}")
  start = time.perf_counter()
  if args.gpu:
    report = measure_speed(args.quick)
  else:
    seeds, steps = (1, 5) if args.quick else (args.seeds, args.steps)
    report = measure_training(args.quick, seeds, steps, only)
  print(markdown(report))
  print(f"total {time.perf_counter() - start:.0f} s")
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
  return report


if __name__ == "__main__":
  main()
