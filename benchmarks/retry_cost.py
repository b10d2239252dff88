"""What `retry_on_overflow` saves and costs at the start of a float16 LM run.

The benchmark's transformer LM (float16 compute, float32 params, Adam) starts
from a loss scale far too high, `initial_scale=2**32` (DeepSpeed's default),
and trains `--steps` steps on the same batches two ways:

* ``skip``: `ols.apply_gradients` on the gradients of the scaled loss, as
  every loss scaler does: an overflowing step is skipped, its batch lost,
  and the scale halves;
* ``retry``: the same step fed by `ols.retry_on_overflow(ols.value_and_grad(loss),
  max_retries=32)`: an overflowing step is recomputed on the same batch at
  the halved scale, inside the compiled step.

It reports the batches lost (skipped steps), the backward passes redone,
the scale reached, and, with both steps compiled and warm, the median time
of a finite step of each (interleaved rounds; the ratio is the cost of the
retry loop on a step that does not overflow) and of a step that retries
`k` times (its cost over a finite step, per retry: about one backward pass).
`python -m benchmarks.retry_cost [--steps N] [--rounds R] [--quick]`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import workloads
import optax_lossscale as ols

START = 2.0**32


def _steps(workload: workloads.Workload) -> dict[str, tuple]:
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale(START))
  loss_fn = workload.loss_fn

  def skip(params, state, batch):
    grads = jax.grad(lambda p: ols.get_scaled_loss(loss_fn(p, batch), state))(params)
    return ols.apply_gradients(tx, grads, state, params)

  def retry(params, state, batch):
    retrying = ols.retry_on_overflow(ols.value_and_grad(loss_fn), max_retries=32)
    _, grads, state = retrying(state, params, batch)
    return ols.apply_gradients(tx, grads, state, params)

  return {
    name: (tx, jax.jit(f, donate_argnums=(0, 1))) for name, f in (("skip", skip), ("retry", retry))
  }


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--quick", action="store_true", help="a small LM (a smoke test)")
  args = parser.parse_args(argv)
  small = {"d_model": 64, "layers": 2, "seq": 32, "batch": 4}
  workload = workloads.transformer_lm(**(small if args.quick else {}))
  steps = _steps(workload)
  start = time.perf_counter()
  print(f"{workload.description}; {workloads.num_params(workload.params) / 1e6:.1f}M params")
  settled = {}
  for name, (tx, step) in steps.items():
    params, state = _copy(workload.params), tx.init(workload.params)
    for _ in range(args.steps):
      params, state = step(params, state, workload.batch)
    m = jax.device_get(ols.metrics(state))
    settled[name] = (params, state)
    print(
      f"{name:>5}: {int(m['total_skips'])} batches lost, {int(m['total_retries'])} backward"
      f" passes redone, scale 2^{int(np.log2(m['loss_scale']))} after {args.steps} steps"
    )
  # Finite steps, both warm, interleaved.
  times = {name: [] for name in steps}
  for _ in range(args.rounds):
    for name, (_, step) in steps.items():
      params, state = settled[name]
      jax.block_until_ready(params)
      t = time.perf_counter()
      for _ in range(5):
        params, state = step(params, state, workload.batch)
      jax.block_until_ready(params)
      times[name].append((time.perf_counter() - t) / 5)
      settled[name] = (params, state)
  ratio = np.median(np.array(times["retry"]) / np.array(times["skip"]))
  print(
    f"finite step: skip {np.median(times['skip']) * 1e3:.2f} ms, retry"
    f" {np.median(times['retry']) * 1e3:.2f} ms, x{ratio:.3f}"
  )
  # A step that retries: the first step from 2**32 again, retries counted.
  tx, step = steps["retry"]
  first = []
  for _ in range(args.rounds):
    params, state = _copy(workload.params), tx.init(workload.params)
    jax.block_until_ready(params)
    t = time.perf_counter()
    params, state = step(params, state, workload.batch)
    jax.block_until_ready(params)
    first.append(time.perf_counter() - t)
  k = int(ols.metrics(state)["retries"])
  per_retry = (np.median(first) - np.median(times["retry"])) / max(k, 1)
  print(
    f"a step with {k} retries: {np.median(first) * 1e3:.2f} ms, {per_retry * 1e3:.2f} ms per"
    f" retry ({per_retry / np.median(times['skip']):.2f} of a finite step)"
  )
  print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
