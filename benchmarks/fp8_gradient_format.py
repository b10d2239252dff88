"""Rowwise fp8's gradient format: e5m2 or e4m3, and the weight gradient in bfloat16 (issue 38).

A study behind a decision, not a benchmark to rerun often (CPU, about 25
minutes on 2 busy cores). Each variant trains the benchmarks' LM
(`fp8_autocast_bench.markov_lm`, 300 steps of Adam, every product of
dimensions >= 16 in fp8) and is compared with float32 on the same seed;
and one product of N(0, 1) 256x256 matrices gives each format's gradient
errors. Variants: the gradient in `float8_e5m2` or `float8_e4m3fn`
(torchao's rowwise recipe), and torchao's `rowwise_with_gw_hp` (the input
gradient in e4m3, the weight gradient a bfloat16 product). The formats are
switched by patching the private `fp8.GRADIENTS` table.

  python -m benchmarks.fp8_gradient_format [SEEDS] [STEPS]

Measured 2026-11-27 (seeds 0-1, 300 steps): distance from float32 e5m2
0.0038, e4m3 0.0025, e4m3 with a bfloat16 weight gradient 0.0021 (0.0037 and
0.0005: no consistent gain); bfloat16 0.00006. Products: e5m2 0.059, e4m3
0.038 (dx and dW alike, both recipes).
"""

import sys
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import fp8_autocast_bench as bench
import optax_lossscale as ols
from optax_lossscale._src.autocast import fp8

ORIGINAL = fp8.fp8_dot_general
DEFAULTS = dict(fp8.GRADIENTS)
BF16 = "p=f32,c=bf16,o=f32"
MATMUL = (((1,), (0,)), ((), ()))
VARIANTS = {
  "float32": None,
  "bfloat16": ("bf16", None),
  "rowwise e5m2": ("rowwise", jnp.float8_e5m2),
  "rowwise e4m3": ("rowwise", jnp.float8_e4m3fn),
  "rowwise e4m3, dW bf16": ("gw_hp", jnp.float8_e4m3fn),
}


def set_gradient(recipe, fmt):
  fp8.GRADIENTS.update(DEFAULTS)
  if fmt is not None:
    fp8.GRADIENTS[recipe] = fmt
  fp8._product.cache_clear()


def with_high_precision_weight_gradient(lhs, rhs, **kw):
  """The fp8 product, its weight gradient replaced by a bfloat16 product."""
  call = lambda a, b: ORIGINAL(a, b, **kw)
  dims = kw["dimension_numbers"]
  plain = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)

  @jax.custom_vjp
  def f(a, b):
    return call(a, b)

  def fwd(a, b):
    out, vjp = jax.vjp(call, a, b)
    return out, (vjp, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))

  def bwd(res, g):
    vjp, a16, b16 = res
    grad_a, _ = vjp(g)
    _, grad_b = jax.vjp(plain, a16, b16)[1](g.astype(jnp.bfloat16))
    return grad_a, grad_b.astype(jnp.float32)

  f.defvjp(fwd, bwd)
  return f(lhs, rhs)


def product_errors():
  keys = jax.random.split(jax.random.key(0), 3)
  a, b, g = (jax.random.normal(k, (256, 256)) for k in keys)
  ref = jax.vjp(lambda a, b: a @ b, a, b)[1](g)
  rel = lambda x, r: float(jnp.linalg.norm(x - r) / jnp.linalg.norm(r))
  out = {}
  for recipe in fp8.RECIPES:
    for fmt in (jnp.float8_e5m2, jnp.float8_e4m3fn):
      set_gradient(recipe, fmt)
      f = lambda a, b, r=recipe: ORIGINAL(
        a, b, dimension_numbers=MATMUL, recipe=r, compute_dtype=jnp.bfloat16,
        out_dtype=jnp.float32,
      )  # fmt: skip
      da, db = jax.jit(lambda a, b, f=f: jax.vjp(f, a, b)[1](g))(a, b)
      out[recipe, np.dtype(fmt).name] = (rel(da, ref[0]), rel(db, ref[1]))
  set_gradient("rowwise", None)
  return out


def train(problem, name, steps):
  spec = VARIANTS[name]
  if spec is None:
    loss = problem.loss_fn
  elif spec[0] == "bf16":
    loss = ols.autocast(problem.loss_fn, BF16)
  else:
    set_gradient("rowwise", spec[1])
    if spec[0] == "gw_hp":
      fp8.fp8_dot_general = with_high_precision_weight_gradient
    loss = ols.autocast(problem.loss_fn, BF16, fp8="rowwise", fp8_products="all")
  tx = optax.adam(bench.LEARNING_RATE)

  def step(params, state, data):
    value, grads = jax.value_and_grad(loss)(params, data)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  params, state = problem.params, tx.init(problem.params)
  try:  # the products are chosen, and the formats read, when the step is traced
    compiled = jax.jit(step).lower(params, state, problem.batch(0)).compile()
  finally:
    fp8.fp8_dot_general = ORIGINAL
    set_gradient("rowwise", None)
  for i in range(steps):
    params, state, _ = compiled(params, state, problem.batch(i))
  evaluate = jax.jit(problem.loss_fn)
  return float(np.mean([evaluate(params, b) for b in problem.eval_batches]))


def main(argv):
  seeds, steps = (int(a) for a in [*argv, "2", "300"][:2])
  for key, (dx, dw) in product_errors().items():
    print(f"product {key}: dx {dx:.4f} dW {dw:.4f}", flush=True)
  results = {name: [] for name in VARIANTS}
  for seed in range(seeds):
    problem = bench.markov_lm(seed)
    for name in VARIANTS:
      start = time.perf_counter()
      results[name].append(train(problem, name, steps))
      print(f"seed {seed} {name:24s} {results[name][-1]:.5f}"
            f" ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
  reference = results["float32"]
  for name, losses in results.items():
    distance = np.mean([abs(a - b) for a, b in zip(losses, reference, strict=True)])
    print(f"{name:24s} mean {np.mean(losses):.4f} distance from float32 {distance:.2g}")


if __name__ == "__main__":
  main(sys.argv[1:])
