"""Times the finiteness check alone, three ways, against one plain read.

`python -m benchmarks.finiteness_check` prints, for float32, bfloat16 and
float16 gradients of 4M and 64M elements (4 leaves), the median time of:

* `plain read`: `jnp.sum(x)`, the cost of reading the gradients once (the
  yardstick; it is not a finiteness check);
* `jnp.all`: `jnp.all(jnp.isfinite(x))`, the obvious check;
* `uint8 min`: `min(isfinite(x).astype(uint8)) == 1`;
* `sum(x - x)`: `isfinite(sum(x - x))`, which `optax_lossscale.all_finite`
  uses for float32, float64, bfloat16 and complex leaves (uint8 min for the
  rest);

on the gradients as given (`raw`, what the wrapper checks when
`min_loss_scale >= 1`) and multiplied by 1/S first (`unscaled`). Variants
run interleaved in one process; the temporary memory of each executable is
printed beside its time.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import optax_lossscale as ols

CHECKS = {
  "plain read": lambda x: jnp.sum(x) != 12345,
  "jnp.all": lambda x: jnp.all(jnp.isfinite(x)),
  "uint8 min": lambda x: jnp.min(jnp.isfinite(x).astype(jnp.uint8)) == 1,
  "sum(x - x)": lambda x: jnp.isfinite(jnp.sum(x - x)),
}


def _compile(check, raw: bool, grads, loss_scale):
  def fn(grads, loss_scale):
    # The library's own unscaling: in float32 at least, back to each dtype.
    leaves = jax.tree.leaves(grads if raw else loss_scale.unscale(grads))
    flags = [check(g) for g in leaves]
    return jnp.all(jnp.stack(flags))

  return jax.jit(fn).lower(grads, loss_scale).compile()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--sizes", default="4,64", help="millions of elements (2**20)")
  args = parser.parse_args(argv)
  scale = ols.DynamicLossScale()  # a traced scale, as in a train step
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    for millions in (int(m) for m in args.sizes.split(",")):
      n = millions * 2**20
      rng = np.random.default_rng(0)
      grads = {
        f"w{i}": jnp.asarray(rng.standard_normal((n // 4 // 1024, 1024)), dtype) for i in range(4)
      }
      fns = {
        (name, raw): _compile(check, raw, grads, scale)
        for name, check in CHECKS.items()
        for raw in (True, False)
      }
      poisoned = {**grads, "w2": grads["w2"].at[3, 5].set(jnp.inf)}
      for (name, _), fn in fns.items():
        if name != "plain read":
          assert bool(fn(grads, scale)) and not bool(fn(poisoned, scale)), name
      times = {key: [] for key in fns}
      order = list(fns)
      for _ in range(args.rounds):
        np.random.default_rng().shuffle(order)
        for key in order:
          start = time.perf_counter()
          for _ in range(3):
            out = fns[key](grads, scale)
          out.block_until_ready()
          times[key].append((time.perf_counter() - start) / 3)
      print(f"{jnp.dtype(dtype).name}, {millions}M elements:")
      base = {raw: np.median(times[("plain read", raw)]) for raw in (True, False)}
      for (name, raw), values in times.items():
        ms = float(np.median(values)) * 1e3
        temp = fns[(name, raw)].memory_analysis().temp_size_in_bytes / 2**20
        print(
          f"  {'raw' if raw else 'unscaled':8s} {name:11s} {ms:8.2f} ms"
          f"  x{ms / 1e3 / base[raw]:.2f} of a plain read  temp {temp:7.1f} MiB"
        )


if __name__ == "__main__":
  main()
