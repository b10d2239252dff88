"""Flax mixed precision: float16 compute, float32 master params, dynamic loss scaling.

Trains a small MLP on a synthetic regression task twice, with the same data and
optimizer: once as a Linen model in `optax_lossscale.flax.TrainState`, once as
an NNX model with `nnx.Optimizer`. Layers compute in float16
(`dtype=jnp.float16`) while their parameters stay float32
(`param_dtype=jnp.float32`). The loss scale starts at 2**24 so that the first
float16 backward passes overflow: those steps are skipped and the scale backs
off until it fits, then grows again every `--period` finite steps.

  python examples/flax_mixed_precision.py --steps 200
"""

from __future__ import annotations

import argparse
from typing import Any

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols
from optax_lossscale.flax import TrainState, nnx_value_and_grad

HALF = {"dtype": jnp.float16, "param_dtype": jnp.float32}


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.tanh(nn.Dense(64, **HALF)(x))
    return nn.Dense(1, **HALF)(x)


class NNXMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.hidden = nnx.Linear(16, 64, rngs=rngs, **HALF)
    self.out = nnx.Linear(64, 1, rngs=rngs, **HALF)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jnp.tanh(self.hidden(x)))


def _data(seed: int) -> tuple[jax.Array, jax.Array]:
  key_x, key_w = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(key_x, (512, 16))
  return x, jnp.tanh(x @ jax.random.normal(key_w, (16, 1)))


def _tx(period: int) -> optax.GradientTransformation:
  scale = ols.DynamicLossScale(initial_loss_scale=2.0**24, increment_period=period)
  return ols.loss_scale_optimizer(optax.adam(1e-2), scale)


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  # The loss in float32: float16 compute stops at the model's output.
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def train_linen(steps: int, period: int = 50, seed: int = 0) -> dict[str, Any]:
  """Trains the Linen model; returns the first and last loss and the metrics."""
  x, y = _data(seed)
  model = LinenMLP()
  params = model.init(jax.random.PRNGKey(seed + 1), x[:1])["params"]
  state = TrainState.create(apply_fn=model.apply, params=params, tx=_tx(period))

  @jax.jit
  def train_step(state: TrainState) -> tuple[TrainState, jax.Array]:
    loss_fn = lambda p: _mse(state.apply_fn({"params": p}, x), y)
    loss, grads = ols.value_and_grad(loss_fn)(state, state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(steps):
    state, loss = train_step(state)
    losses.append(float(loss))
  return {"first_loss": losses[0], "last_loss": losses[-1], "step": int(state.step)} | {
    k: v.item() for k, v in ols.metrics(state).items()
  }


def train_nnx(steps: int, period: int = 50, seed: int = 0) -> dict[str, Any]:
  """Trains the NNX model; returns the first and last loss and the metrics."""
  x, y = _data(seed)
  model = NNXMLP(nnx.Rngs(seed + 1))
  optimizer = nnx.Optimizer(model, _tx(period), wrt=nnx.Param)

  @nnx.jit
  def train_step(model: NNXMLP, optimizer: nnx.Optimizer) -> jax.Array:
    loss, grads = nnx_value_and_grad(lambda m: _mse(m(x), y))(optimizer, model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(steps)]
  return {"first_loss": losses[0], "last_loss": losses[-1], "step": int(optimizer.step[...])} | {
    k: v.item() for k, v in ols.metrics(optimizer).items()
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--period", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  for name, train in (("linen TrainState", train_linen), ("nnx Optimizer", train_nnx)):
    result = train(args.steps, args.period, args.seed)
    print(
      f"{name:17s} loss {result['first_loss']:.4f} -> {result['last_loss']:.4f};"
      f" loss scale {result['loss_scale']:g}, {result['total_skips']} of {args.steps}"
      f" steps skipped, step counter {result['step']}"
    )


if __name__ == "__main__":
  main()
