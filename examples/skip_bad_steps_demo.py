"""One bad batch can ruin a bfloat16 run; `skip_bad_steps` skips it.

Trains a small MLP (64-128-10, Adam) on scikit-learn's bundled digits with
bfloat16 compute (float32 master parameters, no loss scaling), in minibatches
of 64, four times from the same initial parameters and the same batches:

* ``clean``: no bad batch (the reference);
* ``no guard``: two injected bad batches, a spike (one batch whose features
  are scaled by 100, as a preprocessing bug would) and a NaN batch (one NaN
  pixel);
* ``apply_if_finite``: the same bad batches with ``optax.apply_if_finite``,
  which skips the NaN step but applies the spike;
* ``skip_bad_steps``: the same bad batches with
  ``ols.skip_bad_steps(adam, spike_threshold=6, monitor=('grad_norm', 'loss'))``;
* ``skip_bad_steps (clip)``: the same with ``on_spike='clip'``, watching the
  gradient norm only: the spike step is applied with its gradients scaled
  down to the threshold norm instead of skipped.

Each run is one `lax.scan` over the steps. It prints the final training loss
(float32, full training set) and test accuracy of each run, and which steps
the guard skipped and why; with ``--plot`` it saves the loss curves with the
skipped steps marked. Run ``python examples/skip_bad_steps_demo.py --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import dataclasses
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

STEPS = 300
BATCH = 64
SPIKE_STEP = 150
NAN_STEP = 220
SPIKE_FACTOR = 100.0
LEARNING_RATE = 3e-3
GUARD = {"spike_threshold": 6.0, "monitor": ("grad_norm", "loss"), "warmup_steps": 50}
CLIP_GUARD = {"spike_threshold": 6.0, "warmup_steps": 50, "on_spike": "clip"}
RUNS = ("clean", "no guard", "apply_if_finite", "skip_bad_steps", "skip_bad_steps (clip)")


@dataclasses.dataclass
class RunResult:
  """What one run produced; every number comes from the run."""

  name: str
  losses: list[float]  # minibatch loss (float32) at each step
  final_loss: float  # float32 cross-entropy over the whole training set
  test_accuracy: float
  nonfinite_skips: list[int]  # steps skipped for NaN/Inf (by apply_if_finite or the guard)
  spike_skips: list[int]  # steps skipped as spikes (the guard only)
  spike_clips: list[int] = dataclasses.field(default_factory=list)  # steps clipped (clip run)


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


def corrupt(batch_x: np.ndarray) -> np.ndarray:
  """The injected bad batches: a feature-scale spike and a NaN pixel."""
  batch_x = batch_x.copy()
  if SPIKE_STEP < len(batch_x):
    batch_x[SPIKE_STEP] *= SPIKE_FACTOR
  if NAN_STEP < len(batch_x):
    batch_x[NAN_STEP, 0, 10] = np.nan
  return batch_x


def init_mlp(seed: int) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {
    "w1": jax.random.normal(k1, (64, 128)) * np.sqrt(2.0 / 64),
    "b1": jnp.zeros(128),
    "w2": jax.random.normal(k2, (128, 10)) * np.sqrt(1.0 / 128),
    "b2": jnp.zeros(10),
  }


def loss_fn(params: Any, x: jax.Array, y: jax.Array, dtype: Any = jnp.bfloat16) -> jax.Array:
  """Mean cross-entropy; the MLP runs in `dtype`, the softmax in float32."""
  p = jax.tree.map(lambda a: a.astype(dtype), params)
  h = jax.nn.relu(x.astype(dtype) @ p["w1"] + p["b1"])
  logits = (h @ p["w2"] + p["b2"]).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def make_optimizer(name: str) -> optax.GradientTransformation:
  adam = optax.adam(LEARNING_RATE)
  if name == "apply_if_finite":
    return optax.apply_if_finite(adam, max_consecutive_errors=10)
  if name == "skip_bad_steps":
    return ols.skip_bad_steps(adam, **GUARD)
  if name == "skip_bad_steps (clip)":
    return ols.skip_bad_steps(adam, **CLIP_GUARD)
  return adam


def train(
  name: str,
  params: Any,
  batch_x: np.ndarray,
  batch_y: np.ndarray,
  tx: optax.GradientTransformation | None = None,
) -> tuple[Any, ...]:
  """The whole run as one scan: final params, per-step losses, skip and clip counters.

  `tx` replaces the run's optimizer (`make_optimizer(name)`).
  """
  tx = tx or make_optimizer(name)
  zero = jnp.zeros((), jnp.int32)

  def step(carry: Any, batch: Any) -> tuple[Any, Any]:
    params, state = carry
    x, y = batch
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params, state = ols.apply_gradients(tx, grads, state, params, loss=loss)
    if isinstance(state, ols.SkipBadStepsState):
      m = ols.metrics(state)
      flags = (m["nonfinite_skips"], m["spike_skips"], m["spike_clips"])
    elif name == "apply_if_finite":
      flags = (state.total_notfinite, zero, zero)
    else:
      flags = (zero, zero, zero)
    return (params, state), (loss, *flags)

  run = jax.jit(lambda p, bx, by: jax.lax.scan(step, (p, tx.init(p)), (bx, by)))
  (params, _), out = run(params, jnp.asarray(batch_x), jnp.asarray(batch_y))
  return (params, *(np.asarray(o) for o in out))


def _steps_where_counter_grew(counter: np.ndarray) -> list[int]:
  return [int(i) for i in np.flatnonzero(np.diff(counter, prepend=0) > 0)]


def run_all(steps: int = STEPS, seed: int = 0) -> dict[str, RunResult]:
  """The four runs of the module docstring, by name."""
  train_x, train_y, test_x, test_y, batch_x, batch_y = load_batches(steps, seed)
  params0 = init_mlp(seed)
  results = {}
  for name in RUNS:
    bx = batch_x if name == "clean" else corrupt(batch_x)
    params, losses, nonfinite, spikes, clips = train(name, params0, bx, batch_y)
    final = float(loss_fn(params, jnp.asarray(train_x), jnp.asarray(train_y), jnp.float32))
    logits = jax.nn.relu(test_x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    results[name] = RunResult(
      name=name,
      losses=[float(v) for v in losses],
      final_loss=final,
      test_accuracy=float(np.mean(np.argmax(np.asarray(logits), axis=1) == test_y)),
      nonfinite_skips=_steps_where_counter_grew(nonfinite),
      spike_skips=_steps_where_counter_grew(spikes),
      spike_clips=_steps_where_counter_grew(clips),
    )
  return results


def format_table(results: dict[str, RunResult]) -> str:
  clean = results["clean"].final_loss
  lines = [
    f"{'run':<22} {'final loss':>10} {'vs clean':>9} {'test acc':>8}"
    "  skipped or clipped (step: reason)",
    "-" * 88,
  ]
  for r in results.values():
    rel = r.final_loss / clean - 1 if np.isfinite(r.final_loss) else float("nan")
    skipped = sorted(
      [(s, "nan/inf") for s in r.nonfinite_skips]
      + [(s, "spike") for s in r.spike_skips]
      + [(s, "spike clipped") for s in r.spike_clips]
    )
    skips = ", ".join(f"{s}: {why}" for s, why in skipped) or "none"
    lines.append(
      f"{r.name:<22} {r.final_loss:>10.4f} {rel:>+9.1%} {r.test_accuracy:>8.1%}  {skips}"
    )
  return "\n".join(lines)


def plot(results: dict[str, RunResult], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 4.5))
  styles = {
    "no guard": "C3-",
    "apply_if_finite": "C1-",
    "clean": "k-",
    "skip_bad_steps": "C0-",
    "skip_bad_steps (clip)": "C4-",
  }
  for name, style in styles.items():
    ax.plot(results[name].losses, style, lw=1.0, alpha=0.85, label=name)
  unguarded = np.asarray(results["no guard"].losses)
  if not np.all(np.isfinite(unguarded)):
    first = int(np.flatnonzero(~np.isfinite(unguarded))[0])
    ax.plot(first - 1, unguarded[first - 1], "C3x", ms=9)
    ax.annotate(
      f"no guard: NaN from step {first} on",
      (first, unguarded[first - 1]),
      xytext=(6, 14),
      textcoords="offset points",
      fontsize=8,
      color="C3",
    )
  guarded = results["skip_bad_steps"]
  top = np.nanmax([v for r in results.values() for v in r.losses if np.isfinite(v)])
  for s in guarded.spike_skips:
    ax.axvline(s, color="C0", ls="--", lw=0.8)
    ax.annotate("skipped: spike", (s, top), fontsize=8, color="C0", rotation=90, va="top")
  for s in guarded.nonfinite_skips:
    ax.axvline(s, color="C2", ls="--", lw=0.8)
    ax.annotate("skipped: NaN", (s, top), fontsize=8, color="C2", rotation=90, va="top")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("minibatch loss (bfloat16 MLP)")
  ax.set_title("digits, Adam, bfloat16: one spike batch and one NaN batch")
  ax.legend(loc="lower left")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (> {NAN_STEP})")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data split")
  parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("out/skip_bad_steps.png"))
  args = parser.parse_args(argv)
  if args.steps <= NAN_STEP:
    parser.error(f"--steps must be more than {NAN_STEP}, the NaN batch's step; got {args.steps}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, RunResult]:
  args = parse_args(argv)
  start = time.perf_counter()
  results = run_all(args.steps, args.seed)
  print(
    f"bfloat16 MLP on digits, {args.steps} steps of {BATCH}; spike batch at step"
    f" {SPIKE_STEP} (features x{SPIKE_FACTOR:g}), NaN batch at step {NAN_STEP}"
  )
  print(format_table(results))
  plot(results, args.plot)
  print(f"plot: {args.plot}  ({time.perf_counter() - start:.1f} s)")
  return results


if __name__ == "__main__":
  main()
