"""Training with bfloat16 parameters: what each remedy buys, and what it costs.

With round-to-nearest, an update below half an ulp of a bfloat16 weight is
lost (near 1.0: below 2**-9 or 2**-8). Three workloads train with Adam from
the same initialisation and data, with each way of storing the parameters:

* ``float32``: float32 parameters and Adam state (the reference);
* ``bfloat16``: bfloat16 parameters, Adam's moments bfloat16 (optax's default
  for them), round-to-nearest;
* ``master weights``: `ols.master_weights(adam)`, a float32 master copy and
  float32 moments; ``master weights, bf16 mu`` stores the first moment in
  bfloat16 (`ols.state_dtypes`);
* ``stochastic rounding``: `ols.stochastic_rounding(adam, key)`, bfloat16
  moments; ``stochastic rounding, f32 nu`` keeps the second moment in
  float32, the same bytes as Kahan, ``f32 moments`` both moments, the same
  bytes as ``Kahan, f32 nu``;
* ``master weights, remainder``: `master_weights(adam, store='remainder')`, the
  master as the bfloat16 parameter and a 16-bit remainder (the same parameters
  as ``master weights``); ``..., q8 moments`` and ``..., fp8 moments`` store
  Adam's moments in 8 bits (`state_dtypes(adam, {'mu': 'q8', 'nu': 'q8'})`);
  ``stochastic rounding, q8 moments`` likewise; ``... of every leaf`` quantizes
  the leaves under 4096 elements too (the regression's 256 weights are one);
* ``Kahan``: Kahan-compensated updates (Zamirai et al. 2020): a bfloat16
  compensation buffer per parameter holds what the last write rounded away
  and is added to the next update; bfloat16 moments (``Kahan, f32 nu``: the
  second moment in float32). Implemented here, for the measurement; see the
  docs for why the package does not ship it.

Workloads: a linear regression whose weights start at 1.0 (where the stall
is worst), scikit-learn's digits MLP (float32 compute: only the storage
differs) and the small transformer LM of `benchmarks/workloads.py` computing
in bfloat16 on a synthetic Markov-chain language (each token has 4 equally
likely successors: the best loss is log 4 = 1.386). Reported: the final loss
(mean over seeds, with the spread), bytes per parameter held by the
parameters and the optimizer state, and the step time relative to the
``bfloat16`` step, as a median of interleaved rounds (one process: each
round runs every variant for the same number of steps, in a shuffled order).

Two more measurements, with no training: the optimizer update alone on 4M
parameters (4 matrices of 1024 x 1024), each variant's median time over bare
Adam's and over ``master weights``'s, and the bytes its compiled program
accesses against the minimum (`update_cost`; it includes the stochastic
rounding of before, threefry bits and the inner step in bfloat16, for
comparison; the params and the state are donated in the order of the
outputs), and
the bytes per parameter of each variant on the benchmark LM and on a GPT-2
small-shaped model (124M parameters), counted from the shapes of the
parameters and of `tx.init`'s state (`bytes_table`).

`python -m benchmarks.low_precision_params [--quick] [--seeds K] [--out DIR]
[--only regression,digits,lm,update,bytes] [--update-side N] [--tag T]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import itertools
import json
import pathlib
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import workloads
import optax_lossscale as ols
from optax_lossscale._src.storage import rounding

BF16 = jnp.bfloat16
BASELINE = "bfloat16"


class KahanState(NamedTuple):
  inner_state: optax.OptState
  compensation: Any  # per 16-bit parameter: minus what the last write rounded away


def kahan(inner: optax.GradientTransformation) -> Callable[..., Any]:
  """`(init, step)` of Kahan-compensated updates of 16-bit parameters.

  Per parameter p (16-bit) with compensation c (same dtype), update u:
    y = u - c;  t = round(p + y);  c = (t - p) - y;  p = t      (arithmetic in float32)
  """

  def init(params: Any) -> KahanState:
    return KahanState(inner.init(params), jax.tree.map(jnp.zeros_like, params))

  def step(grads: Any, state: KahanState, params: Any) -> tuple[Any, KahanState]:
    updates, inner_state = inner.update(grads, state.inner_state, params)

    def one(p: jax.Array, u: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
      y = u.astype(jnp.float32) - c.astype(jnp.float32)
      t = (p.astype(jnp.float32) + y).astype(p.dtype)
      return t, ((t.astype(jnp.float32) - p.astype(jnp.float32)) - y).astype(c.dtype)

    pairs = jax.tree.map(one, params, updates, state.compensation)
    is_pair = lambda x: isinstance(x, tuple)
    new_params = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=is_pair)
    compensation = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=is_pair)
    return new_params, KahanState(inner_state, compensation)

  return init, step


class Variant(NamedTuple):
  dtype: Any  # of the parameters
  init: Callable[[Any], Any]
  step: Callable[[Any, Any, Any], tuple[Any, Any]]  # (grads, state, params) -> (params, state)


def _optax(tx: optax.GradientTransformation, dtype: Any) -> Variant:
  return Variant(dtype, tx.init, lambda g, s, p: ols.apply_gradients(tx, g, s, p))


def threefry_rounding(inner: optax.GradientTransformation, seed: int) -> Variant:
  """`stochastic_rounding` as it was: `inner` in the parameters' dtype, threefry bits."""

  def init(params: Any) -> Any:
    return inner.init(params), jax.random.key_data(jax.random.key(seed))

  def step(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    updates, inner_state = inner.update(grads, state[0], params)
    step_key, next_key = jax.random.split(jax.random.wrap_key_data(state[1]))
    leaves, treedef = jax.tree.flatten(params)
    new = []
    for i, (p, u) in enumerate(zip(leaves, treedef.flatten_up_to(updates), strict=True)):
      exact = p.astype(jnp.float32) + u.astype(jnp.float32)
      bits = jax.random.bits(jax.random.fold_in(step_key, i), p.shape, jnp.uint32)
      new.append(rounding.round_with_bits(exact, bits, p.dtype))
    return treedef.unflatten(new), (inner_state, jax.random.key_data(next_key))

  return Variant(BF16, init, step)


def variants(lr: float, seed: int) -> dict[str, Variant]:
  adam = lambda: optax.adam(lr)
  q8 = lambda: ols.state_dtypes(adam(), {"mu": "q8", "nu": "q8"})
  return {
    "float32": _optax(adam(), jnp.float32),
    "bfloat16": _optax(adam(), BF16),
    "master weights": _optax(ols.master_weights(adam()), BF16),
    "master weights, bf16 mu": _optax(
      ols.master_weights(ols.state_dtypes(adam(), {"mu": BF16})), BF16
    ),
    "stochastic rounding": _optax(ols.stochastic_rounding(adam(), key=seed), BF16),
    "stochastic rounding, f32 nu": _optax(
      ols.stochastic_rounding(ols.state_dtypes(adam(), {"nu": jnp.float32}), key=seed), BF16
    ),
    "stochastic rounding, f32 moments": _optax(
      ols.stochastic_rounding(ols.state_dtypes(adam(), jnp.float32), key=seed), BF16
    ),
    "master weights, remainder": _optax(ols.master_weights(adam(), store="remainder"), BF16),
    "master weights, remainder, q8 moments": _optax(
      ols.master_weights(q8(), store="remainder"), BF16
    ),
    "master weights, remainder, fp8 moments": _optax(
      ols.master_weights(ols.state_dtypes(adam(), {"mu": "fp8", "nu": "fp8"}), store="remainder"),
      BF16,
    ),
    "master weights, remainder, q8 moments of every leaf": _optax(
      ols.master_weights(
        ols.state_dtypes(adam(), {"mu": "q8", "nu": "q8"}, quantize_min_size=0),
        store="remainder",
      ),
      BF16,
    ),
    "stochastic rounding, q8 moments": _optax(ols.stochastic_rounding(q8(), key=seed), BF16),
    "Kahan": Variant(BF16, *kahan(adam())),
    "Kahan, f32 nu": Variant(BF16, *kahan(ols.state_dtypes(adam(), {"nu": jnp.float32}))),
  }


class Problem(NamedTuple):
  name: str
  description: str
  params: Any  # float32, cast to each variant's dtype
  loss_fn: Callable[[Any, Any], jax.Array]
  batch: Callable[[int], Any]  # the training batch of a step
  eval_batches: list[Any]  # the final loss is the mean over these
  lr: float
  steps: int


def regression(seed: int, steps: int) -> Problem:
  """y = x @ w_true, w_true uniform in [0.5, 1.5]; w starts at 1.0, float32 compute."""
  d, batch = 256, 64
  rng = np.random.default_rng(seed)
  w_true = jnp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
  params = {"w": jnp.ones(d, jnp.float32)}

  def make(i: int) -> Any:
    x = np.random.default_rng([seed, i]).standard_normal((batch, d)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(x) @ w_true

  def loss_fn(params: Any, data: Any) -> jax.Array:
    x, y = data
    return jnp.mean((x @ params["w"].astype(jnp.float32) - y) ** 2) / d

  evals = [make(10**6 + i) for i in range(4)]
  desc = f"linear regression, {d} weights from 1.0 to U(0.5, 1.5), batch {batch}"
  return Problem("regression", desc, params, loss_fn, make, evals, 1e-3, steps)


def digits_mlp(seed: int, steps: int) -> Problem:
  """scikit-learn's digits, MLP 64-256-256-10, float32 compute from the stored params."""
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = jnp.asarray((x / 16.0).astype(np.float32))
  y = jnp.asarray(y)
  sizes = (64, 256, 256, 10)
  keys = jax.random.split(jax.random.key(seed), len(sizes))
  params = {
    f"layer{i}": {
      "w": jax.random.normal(keys[i], (m, n)) * np.sqrt(2.0 / m),
      "b": jnp.zeros(n),
    }
    for i, (m, n) in enumerate(itertools.pairwise(sizes))
  }
  batch = 128

  def loss_fn(params: Any, data: Any) -> jax.Array:
    h, labels = data
    layers = [params[f"layer{i}"] for i in range(len(sizes) - 1)]
    for i, layer in enumerate(layers):
      h = h @ layer["w"].astype(jnp.float32) + layer["b"].astype(jnp.float32)
      h = jax.nn.relu(h) if i < len(layers) - 1 else h
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h, labels))

  def make(i: int) -> Any:
    idx = np.random.default_rng([seed, i]).choice(len(x), batch, replace=False)
    return x[idx], y[idx]

  desc = f"digits MLP {'-'.join(map(str, sizes))}, batch {batch}, float32 compute"
  return Problem("digits MLP", desc, params, loss_fn, make, [(x, y)], 1e-3, steps)


def transformer_lm(seed: int, steps: int, quick: bool = False) -> Problem:
  """The benchmark LM in bfloat16 compute, on a 4-successor Markov-chain language."""
  size = dict(vocab=256, d_model=128, heads=4, layers=2, seq=64, batch=8)
  if quick:
    size = dict(vocab=64, d_model=32, heads=2, layers=1, seq=16, batch=4)
  batch = size.pop("batch")
  model = workloads._lm_model(**size, dtype=BF16)
  vocab, seq = size["vocab"], size["seq"]

  def make(i: int) -> jax.Array:
    return workloads.markov_tokens(seed, i, vocab=vocab, seq=seq, batch=batch)

  params = model.init(jax.random.key(seed), make(0)[:, :-1])["params"]

  def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))

  evals = [make(10**6 + i) for i in range(8)]
  n = workloads.num_params(params)
  desc = (
    f"transformer LM {size['layers']}x{size['d_model']}, {n / 1e6:.2f}M params,"
    f" {batch}x{seq} tokens, bfloat16 compute, best loss log 4 = 1.386"
  )
  return Problem("transformer LM", desc, params, loss_fn, make, evals, 1e-3, steps)


def _bytes_per_param(params: Any, state: Any) -> float:
  total = sum(x.nbytes for x in jax.tree.leaves((params, state)))
  return total / workloads.num_params(params)


def _compile(problem: Problem, variant: Variant) -> tuple[Any, Any, Any]:
  params = jax.tree.map(lambda p: jnp.array(p, variant.dtype, copy=True), problem.params)
  state = variant.init(params)

  def train_step(params: Any, state: Any, data: Any) -> tuple[Any, Any]:
    grads = jax.grad(problem.loss_fn)(params, data)
    return variant.step(grads, state, params)

  return jax.jit(train_step, donate_argnums=(0, 1)), params, state


def train(
  problem: Problem, variant: Variant, evaluate: Callable[[Any, Any], jax.Array]
) -> tuple[dict[str, float], list[Any]]:
  """Trains `problem.steps` steps; the results and `[step, params, state]` to time on."""
  step, params, state = _compile(problem, variant)
  bytes_per_param = _bytes_per_param(params, state)
  for i in range(problem.steps):
    params, state = step(params, state, problem.batch(i))
  final = float(np.mean([evaluate(params, b) for b in problem.eval_batches]))
  return {"loss": final, "bytes_per_param": bytes_per_param}, [step, params, state]


def time_steps(
  runs: dict[str, list[Any]], data: Any, rounds: int, steps: int, seed: int = 0
) -> dict[str, dict[str, float]]:
  """Median ms per step and the median over rounds of the ratio to the baseline.

  `runs` maps each variant to `[compiled step, params, state]`; each round runs
  every variant `steps` steps on `data`, in a freshly shuffled order.
  """
  rng = np.random.default_rng(seed)
  order = list(runs)
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(rounds):
    rng.shuffle(order)
    for name in order:
      step, params, state = runs[name]
      start = time.perf_counter()
      for _ in range(steps):
        params, state = step(params, state, data)
      jax.block_until_ready(params)
      times[name].append((time.perf_counter() - start) / steps)
      runs[name][1:] = [params, state]
  base = np.asarray(times[BASELINE])
  return {
    name: {"ms": float(np.median(t) * 1e3), "ratio": float(np.median(np.asarray(t) / base))}
    for name, t in times.items()
  }


PROBLEMS = ("regression", "digits", "lm")
PARTS = (*PROBLEMS, "update", "bytes", "bits")


def update_variants(seed: int = 0) -> dict[str, Variant]:
  """The optimizer-update variants timed by `update_cost`: bare Adam, then each way."""
  adam = lambda: optax.adam(1e-3)
  q8 = lambda: ols.state_dtypes(adam(), {"mu": "q8", "nu": "q8"})
  fp8 = lambda: ols.state_dtypes(adam(), {"mu": "fp8", "nu": "fp8"})
  return {
    "Adam, float32 parameters": _optax(adam(), jnp.float32),
    "Adam, bfloat16 parameters": _optax(adam(), BF16),
    "master_weights": _optax(ols.master_weights(adam()), BF16),
    "master_weights, remainder": _optax(ols.master_weights(adam(), store="remainder"), BF16),
    "stochastic_rounding": _optax(ols.stochastic_rounding(adam(), key=seed), BF16),
    "stochastic_rounding before (threefry, bfloat16 Adam)": threefry_rounding(adam(), seed),
    "master_weights, remainder, q8 moments": _optax(
      ols.master_weights(q8(), store="remainder"), BF16
    ),
    "stochastic_rounding, q8 moments": _optax(ols.stochastic_rounding(q8(), key=seed), BF16),
    "Adam, float32 parameters, q8 moments": _optax(q8(), jnp.float32),
    "Adam, float32 parameters, fp8 moments": _optax(fp8(), jnp.float32),
  }


def _nbytes(tree: Any) -> int:
  return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def compiled_update(
  variant: Variant, params: Any, grads: Any, compiler_options: dict[str, Any] | None = None
) -> tuple[Any, Any, Any]:
  """`variant`'s update compiled as `(params, state, grads) -> (params, state)`, donating
  the params and the state; `(compiled, params, state)` in the variant's dtype.
  `compiler_options` are XLA's, for this compile (`Lowered.compile`'s).

  The donated arguments come in the order of the outputs: JAX pairs each donated
  buffer with the first unclaimed output of its shape and dtype, in argument
  order, so donating `(state, params)` for `(params, state)` hands the new
  parameters mu's buffer (and mu nu's, nu the parameters'), and XLA copies each
  whole (float32 Adam then moves 72 bytes a parameter instead of 40). And
  the unused arguments are kept (`keep_unused`): `master_weights`' update
  never reads the old bfloat16 parameters, which `jit` would otherwise drop
  with their donation, and XLA:CPU would write the new ones to fresh memory
  every step (2,049 page faults a step, 8 MiB, measured on 4 leaves of
  2048 x 2048).
  """
  cast = lambda t: jax.tree.map(lambda x: jnp.array(x, variant.dtype, copy=True), t)
  p = cast(params)
  state = variant.init(p)
  step = jax.jit(lambda p, s, g: variant.step(g, s, p), donate_argnums=(0, 1), keep_unused=True)
  return step.lower(p, state, cast(grads)).compile(compiler_options), p, state


def bytes_accessed(compiled: Any) -> float:
  """XLA's count of the bytes a compiled program reads and writes."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list on older jax
  return float(cost["bytes accessed"])


def update_problem(shapes: list[tuple[int, int]]) -> tuple[dict[str, Any], dict[str, Any]]:
  """The parameters (`w0`, `w1`, ...: evenly spaced in [-1, 1]) and the fixed gradient
  that `update_cost` (and `lowbit_optim_vs_torch`) step, float32."""
  params = {f"w{i}": jnp.linspace(-1.0, 1.0, np.prod(s)).reshape(s) for i, s in enumerate(shapes)}
  return params, jax.tree.map(lambda p: jnp.cos(p * 37.0) * 1e-2, params)


def update_cost(
  quick: bool = False,
  rounds: int = 15,
  steps: int = 5,
  shapes: list[tuple[int, int]] | None = None,
  names: list[str] | None = None,
  compiler_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """The update alone (4 matrices of 1024 x 1024 unless `shapes`): median ms, the median
  per-round ratio to bare Adam on float32 parameters and to `master_weights`, variants
  interleaved; and per parameter the bytes held (params and state), the bytes the
  compiled program accesses (XLA's cost analysis) and the minimum it must (read the
  gradient, the params and the state, write the params and the state, as allocated).

  `names` picks some of `update_variants` (bare Adam and `master_weights` always run).
  `compiler_options` (XLA's, such as `{"xla_cpu_prefer_vector_width": 512}`) compile
  every variant, the baselines included.
  """
  if shapes is None:
    shapes = [(64, 256)] if quick else [(1024, 1024)] * 4
  if quick:
    rounds, steps = 1, 1
  chosen = update_variants()
  if names is not None:
    keep = {"Adam, float32 parameters", "master_weights", *names}
    chosen = {name: v for name, v in chosen.items() if name in keep}
  params, grads = update_problem(shapes)
  n = int(sum(np.prod(s) for s in shapes))
  runs, sizes = {}, {}
  for name, variant in chosen.items():
    step, p, state = compiled_update(variant, params, grads, compiler_options)
    g = jax.tree.map(lambda x, d=variant.dtype: jnp.array(x, d, copy=True), grads)
    held = _nbytes((p, state))
    sizes[name] = {
      "held": held / n,
      "accessed": bytes_accessed(step) / n,
      "minimum": (2 * held + _nbytes(g)) / n,
    }
    runs[name] = [step, g, p, state]
  order = list(runs)
  times: dict[str, list[float]] = {name: [] for name in runs}
  rng = np.random.default_rng(0)
  for _ in range(rounds + 1):  # the first round warms up and is dropped
    rng.shuffle(order)
    for name in order:
      step, g, p, state = runs[name]
      start = time.perf_counter()
      for _ in range(steps):
        p, state = step(p, state, g)
      jax.block_until_ready(p)
      times[name].append((time.perf_counter() - start) / steps)
      runs[name][2:] = [p, state]
  times = {name: np.asarray(t[1:] if len(t) > 1 else t) for name, t in times.items()}
  bare, master = times["Adam, float32 parameters"], times["master_weights"]
  return {
    "params": n,
    "leaves": len(shapes),
    "rounds": rounds,
    "compiler_options": dict(compiler_options or {}),
    "results": {
      name: {
        "ms": float(np.median(t) * 1e3),
        "vs_adam": float(np.median(t / bare)),
        "vs_master_weights": float(np.median(t / master)),
        **{f"{k}_bytes_per_param": v for k, v in sizes[name].items()},
      }
      for name, t in times.items()
    },
  }


def _one_round_hash(seed: Any, shape: tuple[int, ...]) -> jax.Array:
  """A cheaper alternative measured: one round (Wellons' lowbias32) of a Weyl sequence."""
  x = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * np.uint32(shape[1])
  x = (x + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)) * np.uint32(0x9E3779B9) + seed[0]
  x = (x ^ (x >> 16)) * np.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * np.uint32(0x846CA68B)
  return (x ^ (x >> 16)) ^ seed[1]


def bits_cost(quick: bool = False, rounds: int = 15) -> dict[str, float]:
  """Median ms to draw one uint32 per element of a 1024 x 1024 array, each way."""
  shape = (64, 256) if quick else (1024, 1024)
  rounds = 1 if quick else rounds
  ways = {
    "threefry (jax.random.bits)": lambda k: jax.random.bits(jax.random.wrap_key_data(k), shape),
    "unsafe_rbg (jax.random.bits)": lambda k: jax.random.bits(
      jax.random.key(k[0], impl="unsafe_rbg"), shape
    ),
    "hash, one round of a pre-mixed word (rounding.hash_bits, shipped)": lambda k: (
      rounding.hash_bits(k, shape)
    ),
    "hash, one round": lambda k: _one_round_hash(k, shape),
  }
  key = jax.random.key_data(jax.random.key(0))
  compiled = {name: jax.jit(f) for name, f in ways.items()}
  for f in compiled.values():
    jax.block_until_ready(f(key))
  times: dict[str, list[float]] = {name: [] for name in ways}
  for _ in range(rounds):
    for name, f in compiled.items():
      start = time.perf_counter()
      for _ in range(5):
        jax.block_until_ready(f(key))
      times[name].append((time.perf_counter() - start) / 5)
  return {name: float(np.median(t) * 1e3) for name, t in times.items()}


def _gpt2_small_shapes() -> Any:
  """GPT-2 small's parameter shapes (124M) in the benchmark's LM code: nothing allocated."""
  model = workloads._lm_model(vocab=50257, d_model=768, heads=12, layers=12, seq=1024)
  tokens = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def bytes_table(quick: bool = False) -> dict[str, Any]:
  """Bytes per parameter, the parameters included, of each variant's pytrees (shapes only)."""
  models = {"benchmark LM": transformer_lm(0, 1, quick=quick).params}
  if not quick:
    models["GPT-2 small shapes"] = _gpt2_small_shapes()
  table: dict[str, dict[str, float]] = {}
  for model, params in models.items():
    n = workloads.num_params(params)
    table[model] = {"params": n}
    for name, variant in variants(1e-3, 0).items():
      typed = jax.tree.map(lambda p, d=variant.dtype: jax.ShapeDtypeStruct(p.shape, d), params)
      state = jax.eval_shape(variant.init, typed)
      total = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves((typed, state)))
      table[model][name] = total / n
  return table


def measure(
  quick: bool = False,
  seeds: int = 3,
  rounds: int = 7,
  only: set[str] | None = None,
  update_side: int = 1024,
  compiler_options: dict[str, Any] | None = None,
  update_leaves: int = 4,
) -> dict[str, Any]:
  """Trains every variant on every problem and seed, then times the first seed's steps;
  then `update_cost` (`update_leaves` matrices of `update_side` squared, compiled with
  `compiler_options`) and `bytes_table`."""
  if only is not None and not only <= set(PARTS):
    raise ValueError(f"only must name some of {PARTS}; got {sorted(only)}.")
  # (problem maker, seeds, steps timed per round: enough that a round outlasts the noise)
  if quick:
    sizes = {
      "regression": (lambda s: regression(s, 30), 1, 1),
      "digits": (lambda s: digits_mlp(s, 20), 1, 1),
      "lm": (lambda s: transformer_lm(s, 5, quick=True), 1, 1),
    }
    rounds = 1
  else:
    sizes = {
      "regression": (lambda s: regression(s, 1000), seeds, 400),
      "digits": (lambda s: digits_mlp(s, 1000), seeds, 100),
      "lm": (lambda s: transformer_lm(s, 400), seeds, 10),
    }
  problems = [sizes[name] for name in PROBLEMS if only is None or name in only]
  report = []
  for make, n_seeds, timed_steps in problems:
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[Any]] = {}
    for seed in range(n_seeds):
      problem = make(seed)
      if seed == 0:
        first = problem
      evaluate = jax.jit(problem.loss_fn)  # compiled once per parameter dtype
      for name, variant in variants(problem.lr, seed).items():
        start = time.perf_counter()
        out, run = train(problem, variant, evaluate)
        if seed == 0:
          runs[name] = run
        entry = results.setdefault(name, {"losses": [], "bytes_per_param": out["bytes_per_param"]})
        entry["losses"].append(out["loss"])
        print(
          f"{problem.name:15s} seed {seed} {name:28s} loss {out['loss']:.4g}"
          f" ({time.perf_counter() - start:.0f} s)",
          flush=True,
        )
    timing = time_steps(runs, first.batch(0), rounds, timed_steps)
    for name, entry in results.items():
      entry.update(timing[name])
    report.append(
      {
        "problem": first.name,
        "description": first.description,
        "steps": first.steps,
        "seeds": n_seeds,
        "timed_steps": timed_steps,
        "results": results,
      }
    )
  meta = {
    "backend": jax.default_backend(),
    "devices": str(jax.devices()),
    "jax": jax.__version__,
    "quick": quick,
    "rounds": rounds,
  }
  out = {"meta": meta, "workloads": report}
  if only is None or "update" in only:
    out["update"] = update_cost(
      quick=quick,
      shapes=None if quick else [(update_side,) * 2] * update_leaves,
      compiler_options=compiler_options,
    )
  if only is None or "bytes" in only:
    out["bytes"] = bytes_table(quick=quick)
  if only is None or "bits" in only:
    out["bits"] = bits_cost(quick=quick)
  return out


def markdown(report: dict[str, Any]) -> str:
  lines = []
  for w in report["workloads"]:
    lines += [
      f"**{w['problem']}**: {w['description']}; {w['steps']} Adam steps (lr 1e-3),"
      f" {w['seeds']} seed{'s' if w['seeds'] > 1 else ''}.",
      "",
      "| variant | final loss | bytes / param | step time vs bfloat16 |",
      "| --- | --- | --- | --- |",
    ]
    for name, r in w["results"].items():
      losses = np.asarray(r["losses"])
      spread = f" ({losses.min():.3g} to {losses.max():.3g})" if len(losses) > 1 else ""
      lines.append(
        f"| {name} | {losses.mean():.4g}{spread} | {r['bytes_per_param']:.1f} | x{r['ratio']:.2f} |"
      )
    lines.append("")
  if "update" in report:
    u = report["update"]
    lines += [
      f"**Optimizer update alone**: {u['params'] / 1e6:.2f}M parameters"
      f" in {u.get('leaves', 4)} matrices, median of"
      f" {u['rounds']} interleaved rounds{_compiled_with(u)}; bytes per parameter held"
      " (params and state),"
      " accessed by the compiled program (XLA's cost analysis) and the minimum (read"
      " the gradient, params and state, write params and state).",
      "",
      "| variant | held B/param | accessed B/param | minimum | ratio | ms | vs Adam (float32)"
      " | vs master_weights |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in u["results"].items():
      held, acc, low = (r[f"{k}_bytes_per_param"] for k in ("held", "accessed", "minimum"))
      lines.append(
        f"| {name} | {held:.2f} | {acc:.1f} | {low:.1f} | x{acc / low:.2f} | {r['ms']:.2f}"
        f" | x{r['vs_adam']:.2f} | x{r['vs_master_weights']:.2f} |"
      )
    lines.append("")
  if "bits" in report:
    lines += [
      "**Random bits** for 1M elements (median ms):",
      "",
      "| generator | ms |",
      "| --- | --- |",
      *(f"| {name} | {ms:.3f} |" for name, ms in report["bits"].items()),
      "",
    ]
  if "bytes" in report:
    models = list(report["bytes"])
    heads = [f"{m} ({report['bytes'][m]['params'] / 1e6:.2f}M)" for m in models]
    lines += [
      "**Bytes per parameter**, the parameters included, counted from the pytrees:",
      "",
      "| variant | " + " | ".join(heads) + " |",
      "| --- |" + " --- |" * len(models),
    ]
    for name in report["bytes"][models[0]]:
      if name != "params":
        row = " | ".join(f"{report['bytes'][m][name]:.3f}" for m in models)
        lines.append(f"| {name} | {row} |")
    lines.append("")
  return "\n".join(lines)


def _compiled_with(update: dict[str, Any]) -> str:
  options = update.get("compiler_options") or {}
  if not options:
    return ""
  return ", every variant compiled with " + ", ".join(f"`{k}={v}`" for k, v in options.items())


def compiler_option(text: str) -> tuple[str, Any]:
  """`KEY=VALUE` as XLA's compile option `(KEY, VALUE)`: an integer, a boolean or a string."""
  key, sep, value = text.partition("=")
  if not sep or not key.startswith("xla_"):
    raise argparse.ArgumentTypeError(f"expected xla_<option>=<value>, got {text!r}")
  if value.lstrip("-").isdigit():
    return key, int(value)
  if value.lower() in ("true", "false"):
    return key, value.lower() == "true"
  return key, value


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes and steps (a smoke test)")
  parser.add_argument("--seeds", type=int, default=3, help="seeds of each problem")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write <backend>.json here")
  parser.add_argument(
    "--only", default=None, help=f"a comma-separated subset of: {', '.join(PARTS)}"
  )
  parser.add_argument(
    "--update-side",
    type=int,
    default=1024,
    help="the update part's 4 matrices are this square (1024: 4M parameters, 2048: 16M)",
  )
  parser.add_argument(
    "--update-leaves",
    type=int,
    default=4,
    help="how many matrices the update part steps (many small leaves, as a model's: 64 of 256)",
  )
  parser.add_argument(
    "--compiler-option",
    type=compiler_option,
    action="append",
    default=[],
    metavar="xla_OPTION=VALUE",
    help="an XLA option every variant of the update part is compiled with (repeatable),"
    " e.g. xla_cpu_prefer_vector_width=512 (XLA:CPU's vectors are 256 bits by default)",
  )
  parser.add_argument(
    "--tag",
    default="",
    help="written as low_precision_params-<backend>-<tag>.json/.md (runs kept side by side)",
  )
  args = parser.parse_args(argv)
  start = time.perf_counter()
  only = None if args.only is None else set(args.only.split(","))
  report = measure(
    quick=args.quick,
    seeds=args.seeds,
    rounds=args.rounds,
    only=only,
    update_side=args.update_side,
    update_leaves=args.update_leaves,
    compiler_options=dict(args.compiler_option) or None,
  )
  table = markdown(report)
  print(table)
  print(f"total {time.perf_counter() - start:.0f} s")
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    path = args.out / f"low_precision_params-{jax.default_backend()}{suffix}.json"
    path.write_text(json.dumps(report, indent=1))
    (path.with_suffix(".md")).write_text(table)


if __name__ == "__main__":
  main()
