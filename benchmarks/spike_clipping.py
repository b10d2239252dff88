"""What should a clipped step feed the spike statistic? Skip or clip a spike?

`skip_bad_steps(..., on_spike='clip')` applies a gradient-norm spike with its
gradients scaled down to the threshold norm `exp(mean + z * std)` of the
running statistic of the log-norm. What that step feeds the statistic decides
how the threshold moves afterwards. Three rules, switched by patching the
module that decides it (an ablation):

* ``clipped``: the norm after clipping, the threshold (ZClip's rule);
* ``none``: nothing, as a skipped step;
* ``raw``: the norm before clipping.

Each is run, beside ``on_spike='skip'`` and no guard, on the bfloat16 digits
MLP of `examples/skip_bad_steps_demo.py` (Adam, batches of 64, 300 steps,
spike_threshold 6, warm-up 50, watching the gradient norm) in three
scenarios, over several seeds:

* ``one bad batch``: the demo's batch 150 with its features scaled by 100;
* ``recurring bad batches``: every 15th batch from 120 on scaled by 30;
* ``shift``: every batch from 150 on scaled by 30, a legitimate change of
  regime that the statistic must follow rather than clip for ever.

It reports the final float32 training loss relative to the same scenario's
run without bad data (for ``shift``, relative to the unguarded run, since
there is no bad data to remove), and the steps clipped or skipped.
`python -m benchmarks.spike_clipping [--seeds K] [--quick]`.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import example_scripts
import optax_lossscale as ols
from optax_lossscale._src.wrappers import skip_bad_steps as skip_lib

FEEDS = ("clipped", "none", "raw")
SCENARIOS = ("one bad batch", "recurring bad batches", "shift")


def _scenarios(batch_x: np.ndarray) -> dict[str, np.ndarray]:
  one = batch_x.copy()
  one[150] *= 100.0
  recurring = batch_x.copy()
  recurring[120::15] *= 30.0
  shift = batch_x.copy()
  shift[150:] *= 30.0
  return dict(zip(SCENARIOS, (one, recurring, shift), strict=True))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--quick", action="store_true", help="the first scenario only (a smoke test)")
  args = parser.parse_args(argv)
  scenarios = SCENARIOS[:1] if args.quick else SCENARIOS
  demo = example_scripts.load("skip_bad_steps_demo.py")
  guard = {"spike_threshold": 6.0, "warmup_steps": 50, "monitor": "grad_norm"}
  variants = ["no guard", "skip", *(f"clip, feeds {f}" for f in FEEDS)]
  rows: dict[tuple[str, str], list[tuple[float, int]]] = {}
  start = time.perf_counter()
  for seed in range(args.seeds):
    train_x, train_y, _, _, batch_x, batch_y = demo.load_batches(args.steps, seed)
    params0 = demo.init_mlp(seed)

    xy = (jnp.asarray(train_x), jnp.asarray(train_y))

    def final(params, xy=xy):
      return float(demo.loss_fn(params, *xy, jnp.float32))

    reference = final(demo.train("clean", params0, batch_x, batch_y, optax.adam(3e-3))[0])
    for scenario, bx in _scenarios(batch_x).items():
      if scenario not in scenarios:
        continue
      for variant in variants:
        if variant == "no guard":
          tx = optax.adam(demo.LEARNING_RATE)
        elif variant == "skip":
          tx = ols.skip_bad_steps(optax.adam(demo.LEARNING_RATE), **guard)
        else:
          tx = ols.skip_bad_steps(optax.adam(demo.LEARNING_RATE), **guard, on_spike="clip")
        saved = skip_lib._CLIPPED_FEEDS
        skip_lib._CLIPPED_FEEDS = variant.rsplit(" ", 1)[-1] if "clip" in variant else saved
        try:
          params, _, _, spikes, clips = demo.train(variant, params0, bx, batch_y, tx)
        finally:
          skip_lib._CLIPPED_FEEDS = saved
        rows.setdefault((scenario, variant), []).append(
          (final(params), int(spikes[-1]) + int(clips[-1]))
        )
      rows.setdefault((scenario, "reference"), []).append((reference, 0))
  print(
    f"{'scenario':<23} {'variant':<20} {'final loss vs reference (per seed)':<40} {'spikes':>7}"
  )
  print("-" * 94)
  for scenario in scenarios:
    base = rows[(scenario, "no guard" if scenario == "shift" else "reference")]
    for variant in variants:
      results = rows[(scenario, variant)]
      rel = [f"{loss / b - 1:+.1%}" for (loss, _), (b, _) in zip(results, base, strict=True)]
      spikes = np.mean([n for _, n in results])
      print(f"{scenario:<23} {variant:<20} {', '.join(rel):<40} {spikes:>7.1f}")
  print(f"\n{args.seeds} seeds, {args.steps} steps; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
