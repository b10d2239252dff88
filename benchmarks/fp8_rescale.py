"""Should the loss-scale wrapper rescale fp8 output-gradient metadata when the scale changes?

Flax's fp8 layers quantize each output gradient (the cotangent, in e5m2) with
a scale derived from the maximum of its amax history. With loss scaling the
cotangents are scaled too, so that history is in units of the loss scale:
when the scale doubles, the next step's cotangents are twice what the
history says and `quantize` clips the largest ones silently; when it halves,
they use half the e5m2 range. `loss_scale_optimizer` multiplies
`output_grad_amax_history` and `output_grad_scale` by the factor the scale
changed by. This measures, on the float16 run of `examples/fp8_flax.py`, with
and without that rescaling (an ablation: the rescaling switched off by
patching the module that decides it):

* steps whose output gradients were clipped in e5m2 (some layer's amax above
  the e5m2 range of the scale it was quantized with), and by how much;
* steps whose output gradients used less than half of that range (a lost bit);
* the final loss and test accuracy.

`python -m benchmarks.fp8_rescale [--steps N] [--period P] [--seeds K]`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks import example_scripts
import optax_lossscale as ols
from optax_lossscale._src.step import overwrite


def measure(steps: int, period: int, seed: int, rescale: bool) -> dict[str, float]:
  """One float16 + loss-scaling fp8 run; what its output-gradient quantization did."""
  example = example_scripts.load("fp8_flax.py")
  saved = overwrite._FLAX_GRAD_META
  overwrite._FLAX_GRAD_META = saved if rescale else ()
  try:
    loss_scale = ols.DynamicLossScale(2.0**15, increment_period=period)
    result = example.run("float16 + loss scaling", steps, seed, loss_scale=loss_scale)
  finally:
    overwrite._FLAX_GRAD_META = saved
  applied = np.ones(steps, bool)
  applied[result.skipped] = False
  ratio = np.asarray(result.grad_ratio)[applied]
  scales = np.asarray(result.loss_scales)
  return {
    "clipped": int(np.sum(ratio > 1)),
    "worst": float(np.max(ratio)),
    "half_range": int(np.sum(ratio < 0.5)),
    "changes": int(np.sum(scales[1:] != scales[:-1])),
    "skipped": len(result.skipped),
    "final_loss": result.final_loss,
    "test_accuracy": result.test_accuracy,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--period", type=int, default=10, help="finite steps between growths")
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  header = (
    f"{'seed':>4} {'rescale':>8} {'scale changes':>14} {'skipped':>8} {'clipped steps':>14}"
    f" {'worst amax/range':>17} {'< half range':>13} {'final loss':>11} {'test acc':>9}"
  )
  print(header)
  print("-" * len(header))
  for seed in range(args.seeds):
    for rescale in (True, False):
      m = measure(args.steps, args.period, seed, rescale)
      print(
        f"{seed:>4} {'on' if rescale else 'off':>8} {m['changes']:>14} {m['skipped']:>8}"
        f" {m['clipped']:>14} {m['worst']:>17.2f} {m['half_range']:>13}"
        f" {m['final_loss']:>11.4f} {m['test_accuracy']:>9.1%}"
      )
  print(
    f"\n{args.steps} steps, growth every {args.period} finite steps;"
    f" {time.perf_counter() - start:.0f} s"
  )


if __name__ == "__main__":
  main()
