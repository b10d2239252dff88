"""Mixed precision with Equinox: float16 with loss scaling, bfloat16 with `skip_bad_steps`.

Trains an `eqx.nn.MLP` (64-128-10, Adam, minibatches of 64) on scikit-learn's
bundled digits, from the same initial parameters and the same batches, four
times. The parameters stay float32 (the master weights the optimizer updates);
the loss function casts the module's arrays and the inputs to the compute
dtype, and computes the softmax cross-entropy in float32:

* ``float32``: the reference, plain Adam;
* ``float16 + loss scaling``: float16 compute,
  ``ols.loss_scale_optimizer(optax.adam(...))`` with its dynamic loss scale,
  gradients from ``optax_lossscale.equinox.filter_value_and_grad``;
* ``bfloat16 + NaN batch``: bfloat16 compute, no loss scaling, plain Adam, and
  one batch (half-way through) holding a NaN pixel: the run ends in NaN;
* ``bfloat16 + NaN batch + skip_bad_steps``: the same with
  ``ols.skip_bad_steps(optax.adam(...))``, which skips that step.

The optimizer is given ``eqx.filter(model, eqx.is_inexact_array)`` as params:
the module's floating-point arrays, with ``None`` where it holds functions or
settings. Each run is one `lax.scan`. Run
``python examples/equinox_fp16.py --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import dataclasses
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from optax_lossscale.equinox import filter_value_and_grad

STEPS = 300
BATCH = 64
LEARNING_RATE = 3e-3
RUNS = (
  "float32",
  "float16 + loss scaling",
  "bfloat16 + NaN batch",
  "bfloat16 + NaN batch + skip_bad_steps",
)


@dataclasses.dataclass
class RunResult:
  """What one run produced; every number comes from the run."""

  name: str
  losses: list[float]  # minibatch loss (float32) at each step
  final_loss: float  # float32 cross-entropy over the whole training set
  test_accuracy: float
  skipped_steps: list[int]
  final_scale: float | None  # the loss scale after the last step (loss scaling only)


def nan_step(steps: int) -> int:
  """The step whose batch holds a NaN pixel in the bfloat16 runs: half-way."""
  return steps // 2


def load_batches(steps: int, seed: int) -> tuple[np.ndarray, ...]:
  """Digits scaled to [0, 1]; a quarter held out; `steps` minibatches of the rest."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  train_x, test_x, train_y, test_y = train_test_split(
    x, y, test_size=0.25, random_state=seed, stratify=y
  )
  rng = np.random.default_rng(seed)
  idx = np.stack([rng.choice(len(train_x), BATCH, replace=False) for _ in range(steps)])
  return train_x, train_y, test_x, test_y, train_x[idx], train_y[idx]


def make_model(seed: int) -> eqx.nn.MLP:
  return eqx.nn.MLP(64, 10, width_size=128, depth=1, key=jax.random.PRNGKey(seed))


def cast(model: Any, dtype: Any) -> Any:
  """The module with its floating-point arrays in `dtype`; functions and settings kept."""
  return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
  """Mean cross-entropy; the MLP runs in `dtype`, the softmax in float32."""
  logits = jax.vmap(cast(model, dtype))(x.astype(dtype)).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def accuracy(model: eqx.nn.MLP, x: np.ndarray, y: np.ndarray) -> float:
  logits = jax.vmap(model)(jnp.asarray(x))
  return float(np.mean(np.argmax(np.asarray(logits), axis=1) == y))


def make_optimizer(name: str) -> optax.GradientTransformation:
  adam = optax.adam(LEARNING_RATE)
  if name == "float16 + loss scaling":
    return ols.loss_scale_optimizer(adam)
  if name.endswith("skip_bad_steps"):
    return ols.skip_bad_steps(adam)
  return adam


def train(name: str, model: eqx.nn.MLP, batch_x: np.ndarray, batch_y: np.ndarray) -> tuple:
  """The whole run as one scan; returns the final model, losses, skip flags and scales."""
  dtype = {"float32": jnp.float32, "float16": jnp.float16}.get(name.split()[0], jnp.bfloat16)
  tx = make_optimizer(name)
  scaled = name == "float16 + loss scaling"
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def step(carry: Any, batch: Any) -> tuple[Any, Any]:
    params, opt_state = carry
    x, y = batch
    model = eqx.combine(params, static)
    if scaled:
      # The unscaled loss, and the gradients of the scaled loss; None at non-arrays.
      loss, grads = filter_value_and_grad(loss_fn)(opt_state, model, x, y, dtype)
    else:
      loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, dtype)
    params, opt_state = ols.apply_gradients(tx, grads, opt_state, params)
    if scaled or name.endswith("skip_bad_steps"):
      m = ols.metrics(opt_state)
      skipped = ~m["last_step_applied"]
      scale = m.get("loss_scale", jnp.float32(1.0))
    else:
      skipped, scale = jnp.asarray(False), jnp.float32(1.0)
    return (params, opt_state), (loss, skipped, scale)

  @jax.jit
  def run(params: Any, bx: jax.Array, by: jax.Array) -> Any:
    return jax.lax.scan(step, (params, tx.init(params)), (bx, by))

  (params, _), (losses, skipped, scales) = run(params, jnp.asarray(batch_x), jnp.asarray(batch_y))
  return eqx.combine(params, static), np.asarray(losses), np.asarray(skipped), np.asarray(scales)


def run_all(steps: int = STEPS, seed: int = 0) -> dict[str, RunResult]:
  """The four runs of the module docstring, by name."""
  train_x, train_y, test_x, test_y, batch_x, batch_y = load_batches(steps, seed)
  bad_x = batch_x.copy()
  bad_x[nan_step(steps), 0, 10] = np.nan
  model0 = make_model(seed)
  results = {}
  for name in RUNS:
    bx = bad_x if "NaN batch" in name else batch_x
    model, losses, skipped, scales = train(name, model0, bx, batch_y)
    final = float(loss_fn(model, jnp.asarray(train_x), jnp.asarray(train_y), jnp.float32))
    results[name] = RunResult(
      name=name,
      losses=[float(v) for v in losses],
      final_loss=final,
      test_accuracy=accuracy(model, test_x, test_y),
      skipped_steps=[int(i) for i in np.flatnonzero(skipped)],
      final_scale=float(scales[-1]) if name == "float16 + loss scaling" else None,
    )
  return results


def format_table(results: dict[str, RunResult]) -> str:
  lines = [
    f"{'run':<38} {'final loss':>10}  {'test acc':>8}  {'scale':>6}  skipped steps",
    "-" * 80,
  ]
  for r in results.values():
    scale = f"2^{int(np.log2(r.final_scale))}" if r.final_scale else "-"
    skipped = ", ".join(map(str, r.skipped_steps[:6])) or "none"
    if len(r.skipped_steps) > 6:
      skipped += f", ... ({len(r.skipped_steps)})"
    lines.append(
      f"{r.name:<38} {r.final_loss:>10.4f}  {r.test_accuracy:>8.1%}  {scale:>6}  {skipped}"
    )
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=STEPS, help="steps per run (at least 2)")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data split")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(
      f"--steps must be at least 2, so that a step follows the NaN batch; got {args.steps}"
    )
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, RunResult]:
  args = parse_args(argv)
  start = time.perf_counter()
  results = run_all(args.steps, args.seed)
  print(
    f"eqx.nn.MLP on digits, {args.steps} steps of {BATCH}, float32 master parameters;"
    f" NaN batch at step {nan_step(args.steps)} in the bfloat16 runs"
  )
  print(format_table(results))
  print(f"({time.perf_counter() - start:.1f} s)")
  return results


if __name__ == "__main__":
  main()
