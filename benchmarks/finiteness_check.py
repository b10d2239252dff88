"""Times the finiteness check alone: `jnp.all` of bools vs min of uint8 flags.

`python -m benchmarks.finiteness_check` prints the median time of
`all_finite(unscale(grads))` over 4 leaves of float32 and float16 gradients,
for the check `optax_lossscale` used before (`jnp.all(jnp.isfinite(x))`) and
the one it uses now (`min(isfinite(x).astype(uint8)) == 1`), interleaved.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.run import _jnp_all_check
import optax_lossscale as ols


def main() -> None:
  scale = ols.DynamicLossScale()
  for dtype in (jnp.float32, jnp.float16):
    for n in (2**22, 2**24):
      grads = {f"w{i}": jnp.ones((n // 4 // 1024, 1024), dtype) for i in range(4)}
      # A fresh function each time: jit caches traces per function object.
      check = lambda: jax.jit(lambda g, ls: ols.all_finite(ls.unscale(g)))
      fns = {"uint8 min (now)": check().lower(grads, scale).compile()}
      with _jnp_all_check():
        fns["jnp.all (before)"] = check().lower(grads, scale).compile()
      times = {k: [] for k in fns}
      for _ in range(15):
        for name, fn in fns.items():
          start = time.perf_counter()
          for _ in range(5):
            out = fn(grads, scale)
          out.block_until_ready()
          times[name].append((time.perf_counter() - start) / 5)
      medians = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
      ratio = medians["uint8 min (now)"] / medians["jnp.all (before)"]
      print(
        f"{jnp.dtype(dtype).name} {n / 2**20:.0f}M: "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items())
        + f", ratio {ratio:.2f}"
      )


if __name__ == "__main__":
  main()
