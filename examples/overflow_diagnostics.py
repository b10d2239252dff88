"""A float16 model that loss scaling cannot save, and what the diagnostics say about it.

The bug: raw pixel-like features (0..255) and a loss *summed* over a batch of
4096 instead of averaged. Some float16 gradients then exceed 65504 even
unscaled, so the dynamic loss scale backs off step after step down to its
minimum and every step is skipped. The guard stops the run, names the leaves
and prints their gradient report; averaging the loss fixes it, and
`suggest_loss_scale` picks a starting scale for the fixed model.

Run: python examples/overflow_diagnostics.py
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols


def init_params(key: jax.Array) -> dict:
  k1, k2 = jax.random.split(key)
  return {
    "encoder": {"kernel": jax.random.normal(k1, (16, 32)) / 16, "bias": jnp.zeros(32)},
    "head": {"kernel": jax.random.normal(k2, (32, 4)) / 6, "bias": jnp.zeros(4)},
  }


def loss_fn(params: dict, x: jax.Array, y: jax.Array, reduce: Any, dtype: Any) -> jax.Array:
  """A two-layer classifier computed in `dtype`; `reduce` is jnp.sum (the bug) or jnp.mean."""
  p = jax.tree.map(lambda a: a.astype(dtype), params)
  h = jax.nn.relu(x.astype(dtype) @ p["encoder"]["kernel"] + p["encoder"]["bias"])
  logits = (h @ p["head"]["kernel"] + p["head"]["bias"]).astype(jnp.float32)
  return reduce(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def train(
  tx: optax.GradientTransformation, params: dict, data: tuple, reduce: Any, steps: int
) -> tuple[dict, Any]:
  @jax.jit
  def step(params: dict, opt_state: Any) -> tuple[dict, Any]:
    scaled = lambda p: ols.get_scaled_loss(loss_fn(p, *data, reduce, jnp.float16), opt_state)
    updates, opt_state = tx.update(jax.grad(scaled)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for i in range(steps):
    params, opt_state = step(params, opt_state)
    m = ols.metrics(opt_state)
    if i % 4 == 0 and "nonfinite_leaves" in m:
      bad = [path for path, flag in m["nonfinite_leaves"].items() if flag]
      print(
        f"step {i:2d}: scale {float(m['loss_scale']):>5g}, skipped {int(m['total_skips'])}, {bad}"
      )
  return params, opt_state


def main() -> None:
  key_p, key_x, key_y = jax.random.split(jax.random.key(0), 3)
  params = init_params(key_p)
  x = jax.random.uniform(key_x, (4096, 16), maxval=255.0)  # raw pixel values, not normalised
  y = jnp.argmax((x - 127.5) @ jax.random.normal(key_y, (16, 4)), axis=-1)  # learnable labels

  print("== 1. Training with the guard on ==")
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-3), record_nonfinite_leaves=True, raise_at_min_loss_scale=True
  )
  try:
    train(tx, params, (x, y), jnp.sum, steps=100)
  except (jax.errors.JaxRuntimeError, ValueError) as e:  # jax's wrappers of a callback error
    message = str(e)
    print(message[message.index("OverflowGuardError") :])

  print("\n== 2. Averaged loss, and a starting scale from a float32 sample ==")
  advice = ols.suggest_loss_scale(jax.grad(loss_fn)(params, x, y, jnp.mean, jnp.float32))
  print(advice)
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale(advice.scale))
  before = float(loss_fn(params, x, y, jnp.mean, jnp.float32))
  params, opt_state = train(tx, params, (x, y), jnp.mean, steps=50)
  m = ols.metrics(opt_state)
  after = float(loss_fn(params, x, y, jnp.mean, jnp.float32))
  print(
    f"50 steps: loss {before:.4f} -> {after:.4f}, scale {float(m['loss_scale']):g},"
    f" skipped {int(m['total_skips'])}"
  )


if __name__ == "__main__":
  main()
