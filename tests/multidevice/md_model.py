"""A tiny MLP, its data and a reference loss-scale trajectory for the multi-device tests.

Everything here is deterministic numpy so that every device layout, every
process and the single-device reference see exactly the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

BATCH = 16  # two rows per device on 8 devices
FEATURES = 4
HIDDEN = 8
INITIAL_SCALE = 2.0**8
PERIOD = 2


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "w1": (rng.standard_normal((FEATURES, HIDDEN)) * 0.5).astype(np.float32),
    "b1": np.zeros((HIDDEN,), np.float32),
    "w2": (rng.standard_normal((HIDDEN, 1)) * 0.5).astype(np.float32),
  }


def make_batch(step: int, nan_row: int | None = None) -> dict[str, np.ndarray]:
  """The global batch of `step`; `nan_row` puts a NaN into one row's inputs."""
  rng = np.random.default_rng(1000 + step)
  x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
  y = np.tanh(x.sum(axis=1, keepdims=True)).astype(np.float32)
  if nan_row is not None:
    x[nan_row, 0] = np.nan
  return {"x": x, "y": y}


def loss_fn(params: Any, batch: Any) -> jax.Array:
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def make_tx(skip_mode: str = "auto", axis_name: Any = None) -> ols.LossScaleOptimizer:
  return ols.loss_scale_optimizer(
    optax.adam(1e-2),
    ols.DynamicLossScale(initial_loss_scale=INITIAL_SCALE, increment_period=PERIOD),
    skip_mode=skip_mode,
    axis_name=axis_name,
  )


def make_train_step(
  tx: ols.LossScaleOptimizer, gather: Callable[[Any], Any] = lambda p: p, fused: bool = False
) -> Callable[..., Any]:
  """A train step; `gather` all-gathers FSDP-sharded parameters for the forward pass.

  With `fused`, it steps with `ols.apply_gradients` instead of `update` and
  `optax.apply_updates`.
  """

  def train_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any]:
    scaled = lambda p: ols.get_scaled_loss(loss_fn(gather(p), batch), opt_state)
    grads = jax.grad(scaled)(params)
    if fused:
      return ols.apply_gradients(tx, grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return train_step


def expected_scales(steps: int, nan_steps: Iterable[int]) -> list[tuple[float, int, bool]]:
  """(scale, counter, applied) after each step, from the documented rules in plain Python."""
  nan_steps = set(nan_steps)
  scale, counter, out = INITIAL_SCALE, 0, []
  for step in range(steps):
    if step in nan_steps:
      scale, counter = max(scale / 2.0, 1.0), 0
    else:
      counter += 1
      if counter >= PERIOD:
        scale, counter = scale * 2.0, 0
    out.append((scale, counter, step not in nan_steps))
  return out
