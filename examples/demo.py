"""A small float16 training run with dynamic loss scaling.

Fits a two-layer MLP in float16 compute with float32 master weights on a
synthetic regression task, starting from a deliberately huge loss scale so the
first steps overflow, and prints how the scale settles.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  key_x, key_w, key_p = jax.random.split(jax.random.PRNGKey(args.seed), 3)
  x = jax.random.normal(key_x, (512, 16))
  y = jnp.tanh(x @ jax.random.normal(key_w, (16, 1)))
  k1, k2 = jax.random.split(key_p)
  params = {
    "w1": jax.random.normal(k1, (16, 64)) * 0.25,
    "w2": jax.random.normal(k2, (64, 1)) * 0.1,
  }

  def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)  # float16 compute
    pred = jnp.tanh(x.astype(jnp.float16) @ half["w1"]) @ half["w2"]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), ols.DynamicLossScale(initial_loss_scale=2.0**24, increment_period=50)
  )
  state = tx.init(params)

  @jax.jit
  def train_step(
    params: dict[str, jax.Array], state: ols.LossScaleOptimizerState
  ) -> tuple[dict[str, jax.Array], ols.LossScaleOptimizerState, jax.Array]:
    loss, grads = jax.value_and_grad(lambda p: ols.get_scaled_loss(loss_fn(p), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss / ols.get_loss_scale(state)()

  print(f"{'step':>5} {'loss':>10} {'scale':>12} {'applied':>8} {'skipped':>8}")
  for step in range(args.steps):
    before = ols.get_loss_scale(state)()
    params, state, _ = train_step(params, state)
    m = ols.metrics(state)
    if step < 12 or step % 50 == 0 or step == args.steps - 1:
      print(
        f"{step:>5} {float(loss_fn(params)):>10.5f} {float(before):>12.0f}"
        f" {bool(m['last_step_applied'])!s:>8} {int(m['total_skips']):>8}"
      )
  final_scale = float(ols.get_loss_scale(state)())
  print(f"final loss scale {final_scale:.0f}, skipped steps {int(m['total_skips'])}")


if __name__ == "__main__":
  main()
