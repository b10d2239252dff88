"""fp8 training with Flax: a NaN batch, the fp8 scales, and loss scaling.

A Flax Linen MLP (64-128-128-10) whose dense layers run their matrix products
in fp8 (`flax.linen.fp8_ops.Fp8Einsum`: e4m3 inputs and kernels, e5m2 output
gradients, accumulated in float32 as fp8 matrix units do; each tensor has a
scale and a 1024-step amax history in the `_overwrite_with_gradient`
collection) learns scikit-learn's bundled digits in minibatches of 64, from
the same initial variables and the same batches, in four runs (XLA emulates
the fp8 types on CPU). Batches ``SHIFT_STEPS`` have their features scaled by
``SHIFT``, a change of input range the fp8 scales must follow:

* ``clean``: bfloat16 compute, `optax_lossscale.flax.TrainState` with
  `ols.skip_bad_steps(adam)`, no bad batch (the reference);
* ``flax + apply_if_finite``: the same with batch ``NAN_STEP`` holding one NaN
  pixel, on Flax's own `TrainState` with `optax.apply_if_finite(adam)`: the
  step is skipped, but Flax's `TrainState` writes the fp8 metadata anyway;
* ``ols skip_bad_steps``: the same NaN batch on our `TrainState` with
  `ols.skip_bad_steps(adam)`: the step is skipped and the metadata untouched;
* ``float16 + loss scaling``: float16 compute and `ols.loss_scale_optimizer`
  (a dynamic scale), the same NaN batch, on our `TrainState`.

For each it reports the final float32 loss over the training set, the test
accuracy, the skipped steps, whether a NaN reached an amax history, and how
many steps after the NaN batch quantized the first layer's input beyond the
e4m3 range of its scale (values that `quantize` clips silently). Flax computes a
step's scale from the maximum of the history, and keeps the old one while
that maximum is not finite: a NaN in the history freezes the scales until it
leaves the 1024-step window, and the shifted batches are clipped one after
another. Run ``python examples/fp8_flax.py --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import time
from typing import Any

import flax.linen as nn
from flax.linen import fp8_ops
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from optax_lossscale.flax import TrainState

STEPS = 300
BATCH = 64
NAN_STEP = 120
SHIFT_STEPS = range(200, 210)
SHIFT = 4.0
LEARNING_RATE = 3e-3
LAYERS = (128, 128, 10)
RUNS = ("clean", "flax + apply_if_finite", "ols skip_bad_steps", "float16 + loss scaling")
OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)


class Fp8Dense(nn.Module):
  """A dense layer whose product runs in fp8, accumulated in float32, output in `dtype`."""

  features: int
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.lecun_normal()
    kernel = self.param("kernel", init, (x.shape[-1], self.features), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
    y = fp8_ops.Fp8Einsum()(
      "bi,io->bo",
      x.astype(self.dtype),
      kernel.astype(self.dtype),
      preferred_element_type=jnp.float32,
    )
    return (y + bias).astype(self.dtype)


class Fp8MLP(nn.Module):
  """fp8 dense layers with ReLU between, computing in `dtype`, with float32 params."""

  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate(LAYERS):
      x = Fp8Dense(width, self.dtype)(x)
      if i < len(LAYERS) - 1:
        x = nn.relu(x)
    return x


@dataclasses.dataclass
class RunResult:
  """What one run produced; every number comes from the run."""

  name: str
  final_loss: float
  test_accuracy: float
  skipped: list[int]
  nan_in_history: bool  # a NaN in any amax history at the end
  clipped_steps: list[int]  # steps after the NaN batch that clipped an input in fp8
  loss_scales: list[float]
  input_ratio: list[float]  # per step, layer 0's input amax / (e4m3 max * scale)
  grad_ratio: list[float]  # per step, the same for the output gradients (e5m2)


def load_batches(steps: int, seed: int) -> tuple[np.ndarray, ...]:
  """Standardised digits, `steps` minibatches of `BATCH`, a NaN pixel at `NAN_STEP`."""
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = digits.data.astype(np.float32) / 16.0
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  split = len(x) * 4 // 5
  train_x, train_y, test_x, test_y = x[:split], y[:split], x[split:], y[split:]
  mean, std = train_x.mean(0), train_x.std(0) + 1e-3
  train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
  rng = np.random.default_rng(seed + 1)
  index = rng.integers(0, len(train_x), size=(steps, BATCH))
  batch_x, batch_y = train_x[index], train_y[index]
  for step in SHIFT_STEPS:
    if step < steps:
      batch_x[step] *= SHIFT
  bad_x = batch_x.copy()
  if NAN_STEP < steps:
    bad_x[NAN_STEP, 0, 0] = np.nan
  return train_x, train_y, test_x, test_y, batch_x, bad_x, batch_y


def _loss(apply_fn: Callable[..., Any], variables: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  logits = apply_fn(variables, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def range_ratios(grads: Any) -> dict[str, jax.Array]:
  """How far this step's amax went past the fp8 range of the scale it was quantized with.

  The fp8 "gradients" hold, at index 0 of each history, this step's amax, and
  the scale this step used; a ratio above 1 means `quantize` clipped values.
  For the first layer's input (e4m3), which the shifted batches scale, and
  the maximum over the layers' output gradients (e5m2).
  """
  metas = list(grads[OWG].values())
  metas = [next(iter(m.values())) for m in metas]  # the Fp8Einsum of each layer
  ratio = lambda m, kind, top: m[f"{kind}_amax_history"][0] / (top * m[f"{kind}_scale"][0])
  return {
    "input_ratio": ratio(metas[0], "input", E4M3_MAX),
    "grad_ratio": jnp.max(jnp.stack([ratio(m, "output_grad", E5M2_MAX) for m in metas])),
  }


def _step_fn(name: str, model: Fp8MLP) -> Callable[..., Any]:
  """One training step of run `name`, returning the new state and what to record."""

  def step(state: Any, xy: tuple[jax.Array, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
    x, y = xy
    loss_fn = lambda v: _loss(model.apply, v, x, y)
    if name.startswith("float16"):
      _, grads = ols.value_and_grad(loss_fn)(state, state.params)
    else:
      grads = jax.grad(loss_fn)(state.params)
    ratios = range_ratios(grads)
    state = state.apply_gradients(grads=grads)
    if name == "flax + apply_if_finite":
      applied = state.opt_state.last_finite
      scale = jnp.float32(1.0)
    else:
      applied = ols.metrics(state)["last_step_applied"]
      scale = ols.metrics(state).get("loss_scale", jnp.float32(1.0))
    return state, {"applied": applied, "loss_scale": scale, **ratios}

  return step


def run(
  name: str,
  steps: int = STEPS,
  seed: int = 0,
  loss_scale: ols.LossScale | None = None,
) -> RunResult:
  """Trains run `name` for `steps` minibatches (one `lax.scan`).

  `loss_scale` replaces the float16 run's (a `DynamicLossScale(2**15,
  increment_period=50)`).
  """
  train_x, train_y, test_x, test_y, batch_x, bad_x, batch_y = load_batches(steps, seed)
  dtype = jnp.float16 if name.startswith("float16") else jnp.bfloat16
  model = Fp8MLP(dtype=dtype)
  variables = model.init(jax.random.key(seed), jnp.zeros((1, 64)))
  adam = optax.adam(LEARNING_RATE)
  if name == "flax + apply_if_finite":
    state = train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.apply_if_finite(adam, 10)
    )
  elif name.startswith("float16"):
    loss_scale = loss_scale or ols.DynamicLossScale(2.0**15, increment_period=50)
    tx = ols.loss_scale_optimizer(adam, loss_scale)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  else:
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=ols.skip_bad_steps(adam))
  xs = batch_x if name == "clean" else bad_x
  data = (jnp.asarray(xs), jnp.asarray(batch_y))
  state, record = jax.jit(lambda s, d: jax.lax.scan(_step_fn(name, model), s, d))(state, data)
  record = jax.device_get(record)

  histories = [
    v for p, v in jax.tree_util.tree_leaves_with_path(state.params) if "amax_history" in str(p)
  ]
  float32_model = Fp8MLP(dtype=jnp.float32)
  train_loss = _loss(float32_model.apply, state.params, jnp.asarray(train_x), jnp.asarray(train_y))
  logits = float32_model.apply(state.params, jnp.asarray(test_x))
  return RunResult(
    name=name,
    final_loss=float(train_loss),
    test_accuracy=float(np.mean(np.argmax(logits, -1) == test_y)),
    skipped=[int(i) for i in np.flatnonzero(~record["applied"])],
    nan_in_history=any(bool(np.isnan(np.asarray(h)).any()) for h in histories),
    clipped_steps=[
      int(i) for i in np.flatnonzero(record["input_ratio"] > 1) if NAN_STEP < i < steps
    ],
    loss_scales=[float(s) for s in record["loss_scale"]],
    input_ratio=[float(r) for r in record["input_ratio"]],
    grad_ratio=[float(r) for r in record["grad_ratio"]],
  )


def run_all(steps: int = STEPS, seed: int = 0) -> dict[str, RunResult]:
  return {name: run(name, steps, seed) for name in RUNS}


def format_table(results: dict[str, RunResult]) -> str:
  header = (
    f"{'run':<24}{'final loss':>11}{'test acc':>9}  {'skipped':<14}"
    f"{'NaN in history':>15}  {'inputs clipped after the NaN batch'}"
  )
  lines = [header, "-" * len(header)]
  for r in results.values():
    skipped = ", ".join(map(str, r.skipped[:3])) + (" ..." if len(r.skipped) > 3 else "")
    clipped = _spans(r.clipped_steps)
    lines.append(
      f"{r.name:<24}{r.final_loss:>11.4f}{r.test_accuracy:>9.1%}  {skipped or 'none':<14}"
      f"{'yes' if r.nan_in_history else 'no':>15}  {clipped}"
    )
  return "\n".join(lines)


def _spans(steps: list[int]) -> str:
  """'200-209 (10 steps)' for consecutive steps, 'none' for none."""
  if not steps:
    return "none"
  spans, start = [], steps[0]
  for a, b in zip(steps, [*steps[1:], None], strict=True):
    if b != a + 1:
      spans.append(f"{start}" if start == a else f"{start}-{a}")
      start = b
  return f"{', '.join(spans)} ({len(steps)} step{'s' * (len(steps) > 1)})"


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=STEPS, help="minibatches per run")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data order")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  results = run_all(args.steps, args.seed)
  print(format_table(results))
  shifted = f"{SHIFT_STEPS.start}-{SHIFT_STEPS.stop - 1}"
  print(
    f"\n{args.steps} steps per run, NaN batch at step {NAN_STEP}, features x{SHIFT:g} at"
    f" steps {shifted}, seed {args.seed};"
  )
  print(f"jax {jax.__version__} on {jax.default_backend()}, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
