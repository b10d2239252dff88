"""Why float16 training needs loss scaling, shown on handwritten digits.

Trains the same small MLP on scikit-learn's bundled digits (8x8 images, no
download) in five settings, all from the same initial parameters:

* ``float32``: float32 parameters, activations and gradients (the reference).
* ``float16``: float32 master parameters, cast to float16 inside the loss, so
  the forward pass and the whole backward pass run in float16; the gradients
  reach Adam with whatever float16 could represent. No loss scaling.
* ``float16 + loss scaling``: the same float16 compute, with the optimizer
  wrapped in ``optax_lossscale.loss_scale_optimizer`` (a dynamic loss scale):
  the loss is multiplied by the scale before differentiation and the
  gradients are divided by it (in float32) before Adam sees them; steps whose
  gradients overflow are skipped and the scale backs off.
* ``float16 + scaling + retry``: the same, with ``ols.retry_on_overflow``:
  an overflowing step is recomputed on the same batch at a backed-off scale
  instead of skipped, so no batch is lost.
* ``float16 autocast + scaling``: the float32 model, no hand cast, run through
  ``ols.autocast(..., "p=f32,c=f16,o=f32")``: the products (forward and
  backward) take float16 inputs, the softmax and the sums run in float32,
  with the same loss scaling.

The objective is the summed cross-entropy divided by ``LOSS_NORMALIZER = 2**20``,
about a million: the number of tokens a language-model batch averages over.
That normalisation is what makes per-example gradients small, as they are in
large models, so small that float16 (smallest subnormal 6e-8) flushes many of
them to zero. Every step the demo also computes float32 gradients at the same
parameters and counts the gradient entries that are non-zero in float32 but
zero in the run's float16 gradients: the fraction of gradient signal lost.

Run ``python examples/demo.py --help`` for the options; it prints a table and
writes ``demo.png`` (loss curves, loss-scale trajectory with skipped steps,
underflow fraction) and ``demo.json`` (every number in the table and plot).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import itertools
import json
import pathlib
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

Params = list[dict[str, jax.Array]]

LOSS_NORMALIZER = 2.0**20
LAYER_SIZES = (64, 128, 128, 10)
LEARNING_RATE = 1e-3
INITIAL_LOSS_SCALE = 2.0**15  # Keras's default
GROWTH_PERIOD = 20  # finite steps between doublings; Keras uses 2000, too slow for a short run


class Data(NamedTuple):
  """The digits, split into train and test, pixels scaled to [0, 1]."""

  train_x: jax.Array
  train_y: jax.Array
  test_x: jax.Array
  test_y: jax.Array


@dataclasses.dataclass(frozen=True)
class Setting:
  """One of the training settings."""

  name: str
  compute_dtype: Any
  loss_scaling: bool
  retry: bool = False  # retry an overflow on the same batch (ols.retry_on_overflow)
  autocast: bool = False  # the float32 model through ols.autocast(..., POLICY), no hand cast


SETTINGS = (
  Setting("float32", jnp.float32, loss_scaling=False),
  Setting("float16", jnp.float16, loss_scaling=False),
  Setting("float16 + loss scaling", jnp.float16, loss_scaling=True),
  Setting("float16 + scaling + retry", jnp.float16, loss_scaling=True, retry=True),
  Setting("float16 autocast + scaling", jnp.float16, loss_scaling=True, autocast=True),
)
POLICY = "p=f32,c=f16,o=f32"  # the autocast row's: float32 params, float16 compute


@dataclasses.dataclass
class RunResult:
  """What one setting's run produced; every number comes from the run."""

  name: str
  losses: list[float]  # mean train cross-entropy (float32) before each step
  loss_scales: list[float]  # loss scale used at each step (1 without scaling)
  skipped_steps: list[int]  # steps whose update was skipped (overflow): batches lost
  retries: int  # backward passes redone at a lower scale (retry_on_overflow)
  underflow: list[float] | None  # per-step fraction of gradient values lost
  final_loss: float
  test_accuracy: float
  final_loss_scale: float

  @property
  def mean_underflow(self) -> float | None:
    return None if self.underflow is None else float(np.mean(self.underflow))


def load_data(seed: int) -> Data:
  """Loads the bundled digits and splits off a stratified quarter for testing."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  train_x, test_x, train_y, test_y = train_test_split(
    x, y, test_size=0.25, random_state=seed, stratify=y
  )
  return Data(*map(jnp.asarray, (train_x, train_y, test_x, test_y)))


def init_mlp(key: jax.Array, sizes: Sequence[int] = LAYER_SIZES) -> Params:
  """He-initialised float32 dense layers."""
  params = []
  for fan_in, fan_out in itertools.pairwise(sizes):
    key, subkey = jax.random.split(key)
    w = jax.random.normal(subkey, (fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
    params.append({"w": w, "b": jnp.zeros(fan_out)})
  return params


def mlp(params: Params, x: jax.Array, dtype: Any) -> jax.Array:
  """Runs the MLP in `dtype`; returns float32 logits.

  Casting the float32 parameters here puts the cast in the graph, so the
  backward pass runs in `dtype` too and only the final parameter gradients
  are cast back to float32 (the master weights' dtype).
  """
  h = x.astype(dtype)
  for i, layer in enumerate(params):
    h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  # The softmax runs in float32, as mixed-precision recipes prescribe.
  return h.astype(jnp.float32)


def cross_entropy(params: Params, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
  """Mean cross-entropy in nats: what we report."""
  logits = mlp(params, x, dtype)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def objective(params: Params, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
  """Summed cross-entropy over LOSS_NORMALIZER: what we differentiate."""
  return cross_entropy(params, x, y, dtype) * (x.shape[0] / LOSS_NORMALIZER)


def underflow_fraction(reference: Params, grads: Params) -> jax.Array:
  """Fraction of the non-zero `reference` gradient entries that are zero in `grads`."""
  pairs = zip(jax.tree.leaves(reference), jax.tree.leaves(grads), strict=True)
  lost, nonzero = 0, 0
  for ref, grad in pairs:
    lost += jnp.sum((ref != 0) & (grad == 0))
    nonzero += jnp.sum(ref != 0)
  return lost / jnp.maximum(nonzero, 1)


def make_optimizer(setting: Setting) -> optax.GradientTransformation:
  """Adam, wrapped with a dynamic loss scale where the setting asks for one."""
  adam = optax.adam(LEARNING_RATE)
  if not setting.loss_scaling:
    return adam
  return ols.loss_scale_optimizer(
    adam, ols.DynamicLossScale(INITIAL_LOSS_SCALE, increment_period=GROWTH_PERIOD)
  )


StepFn = Callable[[Params, Any], tuple[Params, Any, dict[str, jax.Array]]]


def make_train_step(setting: Setting, tx: optax.GradientTransformation, data: Data) -> StepFn:
  """Builds the jitted full-batch training step of one setting."""
  x, y, dtype = data.train_x, data.train_y, setting.compute_dtype
  loss = objective
  if setting.autocast:  # the float32 model; autocast decides each op's dtype
    loss, dtype = ols.autocast(objective, POLICY), jnp.float32

  @jax.jit
  def train_step(params: Params, opt_state: Any) -> tuple[Params, Any, dict[str, jax.Array]]:
    if setting.retry:
      retrying = ols.retry_on_overflow(ols.value_and_grad(loss), max_retries=8)
      _, grads, opt_state = retrying(opt_state, params, x, y, dtype)
      scale = ols.get_loss_scale(opt_state)()  # the scale the gradients were computed at
    elif setting.loss_scaling:
      scale = ols.get_loss_scale(opt_state)()
      grads = jax.grad(lambda p: ols.get_scaled_loss(loss(p, x, y, dtype), opt_state))(params)
    else:
      scale = jnp.float32(1)
      grads = jax.grad(objective)(params, x, y, dtype)
    reference = jax.grad(objective)(params, x, y, jnp.float32)
    updates, opt_state = tx.update(grads, opt_state, params)
    applied = ols.metrics(opt_state)["last_step_applied"] if setting.loss_scaling else True
    retries = ols.metrics(opt_state)["retries"] if setting.loss_scaling else 0
    record = {
      "retries": jnp.asarray(retries),
      "loss": cross_entropy(params, x, y, jnp.float32),
      "loss_scale": scale,
      "applied": jnp.asarray(applied),
      "underflow": underflow_fraction(reference, grads),
    }
    return optax.apply_updates(params, updates), opt_state, record

  return train_step


def accuracy(params: Params, x: jax.Array, y: jax.Array, setting: Setting) -> float:
  """Fraction of `x` classified correctly, with the forward pass of `setting`."""
  if setting.autocast:
    logits = ols.autocast(mlp, POLICY)(params, x, jnp.float32)
  else:
    logits = mlp(params, x, setting.compute_dtype)
  return float(jnp.mean(jnp.argmax(logits, axis=-1) == y))


def train(setting: Setting, data: Data, steps: int, seed: int, progress: Any) -> RunResult:
  """Trains one setting for `steps` full-batch steps and collects its history."""
  params = init_mlp(jax.random.PRNGKey(seed))
  tx = make_optimizer(setting)
  opt_state = tx.init(params)
  train_step = make_train_step(setting, tx, data)
  records = []
  for _ in range(steps):
    params, opt_state, record = train_step(params, opt_state)
    records.append(record)  # device arrays: no sync per step
    progress.update(1)
  history = jax.device_get(jax.tree.map(lambda *r: jnp.stack(r), *records))
  final_scale = ols.get_loss_scale(opt_state)() if setting.loss_scaling else 1.0
  has_fp16 = setting.compute_dtype == jnp.float16
  return RunResult(
    name=setting.name,
    losses=history["loss"].tolist(),
    loss_scales=history["loss_scale"].tolist(),
    skipped_steps=np.flatnonzero(~history["applied"]).tolist(),
    retries=int(np.sum(history["retries"])),
    underflow=history["underflow"].tolist() if has_fp16 else None,
    final_loss=float(cross_entropy(params, data.train_x, data.train_y, jnp.float32)),
    test_accuracy=accuracy(params, data.test_x, data.test_y, setting),
    final_loss_scale=float(final_scale),
  )


def format_scale(scale: float) -> str:
  """Writes a power-of-two loss scale as 2^k, which is how it moves."""
  exponent = np.log2(scale)
  if scale > 1 and exponent == int(exponent):
    return f"2^{int(exponent)}"
  return f"{scale:.4g}"


def format_table(results: Sequence[RunResult]) -> str:
  """The summary table, one row per setting."""
  header = (
    f"{'setting':<26} {'final loss':>10} {'test acc':>9} {'skipped':>8} {'retries':>8}"
    f" {'final scale':>12} {'underflow':>10}"
  )
  lines = [header, "-" * len(header)]
  for r in results:
    underflow = "n/a" if r.mean_underflow is None else f"{100 * r.mean_underflow:.1f}%"
    lines.append(
      f"{r.name:<26} {r.final_loss:>10.5f} {100 * r.test_accuracy:>8.1f}%"
      f" {len(r.skipped_steps):>8d} {r.retries:>8d} {format_scale(r.final_loss_scale):>12}"
      f" {underflow:>10}"
    )
  return "\n".join(lines)


def plot(results: Sequence[RunResult], path: pathlib.Path) -> None:
  """Writes the loss curves, the loss-scale trajectory and the underflow fraction."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_scale, ax_under) = plt.subplots(1, 3, figsize=(15, 4.2))
  styles = {
    "float32": "-",
    "float16": "-",
    "float16 + loss scaling": "--",
    "float16 + scaling + retry": ":",
    "float16 autocast + scaling": "-.",
  }
  for r in results:
    ax_loss.plot(r.losses, styles[r.name], label=r.name)
  ax_loss.set(yscale="log", xlabel="step", ylabel="train cross-entropy", title="Loss")
  ax_loss.legend()

  scaled = next(r for r in results if r.name == "float16 + loss scaling")
  ax_scale.plot(scaled.loss_scales, color="C2", label="loss scale")
  skipped = scaled.skipped_steps
  ax_scale.plot(
    skipped, [scaled.loss_scales[s] for s in skipped], "rx", label=f"skipped ({len(skipped)})"
  )
  retried = next((r for r in results if r.name == "float16 + scaling + retry"), None)
  if retried is not None:
    ax_scale.plot(
      retried.loss_scales, ":", color="C3", label=f"with retry ({retried.retries} retries)"
    )
  ax_scale.set(yscale="log", xlabel="step", ylabel="scale", title="Dynamic loss scale")
  ax_scale.set_yscale("log", base=2)
  ax_scale.legend()

  for r in results:
    if r.underflow is not None:
      ax_under.plot(100 * np.asarray(r.underflow), styles[r.name], label=r.name)
  ax_under.set(
    xlabel="step", ylabel="% of gradient entries", title="Gradients flushed to zero in float16"
  )
  ax_under.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110, metadata={"Software": None})
  plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=1000, help="training steps per setting")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/demo"))
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data split")
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f"--steps must be a positive integer; got {args.steps}")
  return args


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
  """Runs the settings, prints the table and writes demo.png and demo.json."""
  from tqdm import tqdm

  args = parse_args(argv)
  data = load_data(args.seed)
  start = time.perf_counter()
  results = []
  with tqdm(total=args.steps * len(SETTINGS), unit="step", mininterval=0.5) as progress:
    for setting in SETTINGS:
      progress.set_description(setting.name)
      results.append(train(setting, data, args.steps, args.seed, progress))
  seconds = time.perf_counter() - start

  print()
  print(format_table(results))
  print("underflow: share of gradient entries non-zero in float32 but zero in float16 (mean)")
  print(f"{args.steps} steps per setting in {seconds:.1f} s")
  args.out.mkdir(parents=True, exist_ok=True)
  plot(results, args.out / "demo.png")
  summary = {
    "steps": args.steps,
    "seed": args.seed,
    "loss_normalizer": LOSS_NORMALIZER,
    "runs": [dataclasses.asdict(r) | {"mean_underflow": r.mean_underflow} for r in results],
  }
  (args.out / "demo.json").write_text(json.dumps(summary, indent=1))
  print(f"wrote {args.out / 'demo.png'} and {args.out / 'demo.json'}")
  return results


if __name__ == "__main__":
  main()
