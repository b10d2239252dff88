"""What reverse mode keeps for the backward pass, under autocast and its peers.

For three Flax Linen models, a pre-LN MLP stack, a 2-block GPT and a conv +
BatchNorm CNN (4096 tokens or 32 images), the bytes of the residuals JAX saves
for the backward pass of the loss (`jax.ad_checkpoint.saved_residuals`, the
function's arguments left out), as a ratio of the same loss in float32:

* `hand-cast bf16`, `hand-cast f16`: the model's own `dtype=` (Flax's way);
* `autocast bf16`, `autocast f16`: the float32 model under `ols.autocast`.

The compiled temporary memory of `jit(value_and_grad(loss))` (XLA's
`memory_analysis().temp_size_in_bytes`, the figure a user meets) for float32,
the model's own bfloat16 (modules' `dtype=bfloat16`, parameters and inputs
cast) and autocast bf16.

And how far each variant's gradients are from float32's:
`|g - g_f32| / |g_f32|` over all parameters at once (float16 variants
differentiate the loss times 2**15 and divide, as loss scaling does).

Run: `python -m benchmarks.autocast_memory` (`--quick` for small shapes).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from optax_lossscale._src.utils import compat


class MLPBlocks(nn.Module):
  """Pre-LN residual MLP blocks: x + W2 gelu(W1 LN(x) + b1) + b2."""

  depth: int = 4
  width: int = 256
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for _ in range(self.depth):
      h = nn.LayerNorm(dtype=self.dtype)(x)
      h = nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype)(h))
      x = x + nn.Dense(self.width, dtype=self.dtype)(h)
    return nn.LayerNorm(dtype=self.dtype)(x)


class GPTBlock(nn.Module):
  width: int
  heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.LayerNorm(dtype=self.dtype)(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.MultiHeadDotProductAttention(self.heads, dtype=self.dtype)(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(self.width, dtype=self.dtype)(
      nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype)(h))
    )
    return x + h


class GPT(nn.Module):
  vocab: int = 1024
  width: int = 256
  heads: int = 4
  depth: int = 2
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(self.vocab, self.width, dtype=self.dtype)
    pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.width))
    x = embed(tokens) + pos.astype(self.dtype or jnp.float32)
    for _ in range(self.depth):
      x = GPTBlock(self.width, self.heads, dtype=self.dtype)(x)
    return embed.attend(nn.LayerNorm(dtype=self.dtype)(x))


class CNN(nn.Module):
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    for features in (32, 64, 64):
      x = nn.Conv(features, (3, 3), dtype=self.dtype)(x)
      x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(10, dtype=self.dtype)(x)


def _models(quick: bool) -> dict[str, tuple[Callable[[Any], nn.Module], Any, Any]]:
  """name -> (module for a dtype, inputs, labels)."""
  rng = np.random.default_rng(0)
  tokens, seq = (256, 64) if quick else (4096, 512)
  images = 4 if quick else 32
  x = jnp.asarray(rng.standard_normal((tokens // seq, seq, 256), np.float32))
  y = jnp.asarray(rng.standard_normal((tokens // seq, seq, 256), np.float32))
  toks = jnp.asarray(rng.integers(0, 1024, (tokens // seq, seq)), jnp.int32)
  imgs = jnp.asarray(rng.standard_normal((images, 32, 32, 3), np.float32))
  labels = jnp.asarray(rng.integers(0, 10, (images,)), jnp.int32)
  return {
    "MLP blocks": (lambda d: MLPBlocks(dtype=d), x, y),
    "GPT": (lambda d: GPT(dtype=d), toks, toks),
    "CNN": (lambda d: CNN(dtype=d), imgs, labels),
  }


def _loss(name: str, module: nn.Module) -> Callable[..., jax.Array]:
  def loss(params: Any, extra: Any, inputs: Any, targets: Any) -> jax.Array:
    variables = {"params": params, **extra}
    if name == "CNN":
      logits, _ = module.apply(variables, inputs, mutable=["batch_stats"])
    else:
      logits = module.apply(variables, inputs)
    logits = logits.astype(jnp.float32)
    if name == "MLP blocks":
      return jnp.mean((logits - targets) ** 2)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

  return loss


def residual_bytes(fun: Callable[..., Any], *args: Any) -> int:
  """Bytes of what reverse mode saves for the backward pass, arguments left out."""
  total = 0
  for aval, where in compat.saved_residuals(fun, *args):
    if "from the argument" in where:
      continue
    total += int(np.prod(aval.shape)) * aval.dtype.itemsize
  return total


def temp_bytes(fun: Callable[..., Any], *args: Any) -> int:
  """XLA's temporary memory for `jit(value_and_grad(fun))` (arguments and outputs left out)."""
  compiled = jax.jit(jax.value_and_grad(fun)).lower(*args).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def _to_bf16(tree: Any) -> Any:
  floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if floating(x) else x, tree)


LOSS_SCALE = 2.0**15


def gradient_error(fun: Callable[..., Any], reference: Any, *args: Any, scale: float) -> float:
  """`|g - g_ref| / |g_ref|` over every parameter's gradient at once."""
  grads = jax.jit(jax.grad(lambda *a: fun(*a) * scale))(*args)
  diff = sum(
    float(jnp.sum((g.astype(jnp.float32) / scale - r) ** 2))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
  )
  norm = sum(float(jnp.sum(r**2)) for r in jax.tree.leaves(reference))
  return (diff / norm) ** 0.5


def measure(quick: bool = False) -> dict[str, dict[str, Any]]:
  results: dict[str, dict[str, Any]] = {}
  for name, (build, inputs, targets) in _models(quick).items():
    variables = build(None).init(jax.random.key(0), inputs)
    params = variables["params"]
    extra = {k: v for k, v in variables.items() if k != "params"}
    args = (params, extra, inputs, targets)
    f32_loss = _loss(name, build(None))
    f32 = residual_bytes(f32_loss, *args)
    reference = jax.jit(jax.grad(f32_loss))(*args)
    row: dict[str, Any] = {"float32 MiB": f32 / 2**20, "gradient error": {}}
    variants = {
      "hand-cast bf16": _loss(name, build(jnp.bfloat16)),
      "hand-cast f16": _loss(name, build(jnp.float16)),
      "autocast bf16": ols.autocast(f32_loss, "p=f32,c=bf16,o=f32"),
      "autocast f16": ols.autocast(f32_loss, "p=f32,c=f16,o=f32"),
    }
    for variant, fun in variants.items():
      row[variant] = residual_bytes(fun, *args) / f32
      scale = LOSS_SCALE if variant.endswith("f16") and "bf16" not in variant else 1.0
      row["gradient error"][variant] = gradient_error(fun, reference, *args, scale=scale)
    own_bf16 = (_to_bf16(params), extra, _to_bf16(inputs), targets)
    row["temp MiB"] = {
      "float32": temp_bytes(f32_loss, *args) / 2**20,
      "own bf16": temp_bytes(variants["hand-cast bf16"], *own_bf16) / 2**20,
      "autocast bf16": temp_bytes(variants["autocast bf16"], *args) / 2**20,
    }
    results[name] = row
  return results


def export_mlp(path: str) -> None:
  """Writes the MLP blocks' float32 weights, input and target (`.npz`) for the PyTorch twin."""
  build, inputs, targets = _models(False)["MLP blocks"]
  params = build(None).init(jax.random.key(0), inputs)["params"]
  flat = {
    jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  np.savez(path, x=np.asarray(inputs), y=np.asarray(targets), **flat)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
  parser.add_argument("--json", help="write the results to this file")
  parser.add_argument(
    "--export-mlp", help="only write the MLP blocks' weights and batch to this .npz (for PyTorch)"
  )
  args = parser.parse_args()
  if args.export_mlp:
    export_mlp(args.export_mlp)
    return
  results = measure(args.quick)
  variants = list(next(iter(results.values()))["gradient error"])
  print(f"{'saved residuals vs float32':28}" + "".join(f"{m:>14}" for m in results))
  print(f"{'float32 (MiB)':28}" + "".join(f"{r['float32 MiB']:14.1f}" for r in results.values()))
  for variant in variants:
    print(f"{variant:28}" + "".join(f"{r[variant]:14.3f}" for r in results.values()))
  print(f"\n{'compiled temp memory (MiB)':28}" + "".join(f"{m:>14}" for m in results))
  for variant in next(iter(results.values()))["temp MiB"]:
    print(f"{variant:28}" + "".join(f"{r['temp MiB'][variant]:14.1f}" for r in results.values()))
  print(f"\n{'gradient error vs float32':28}" + "".join(f"{m:>14}" for m in results))
  for variant in variants:
    errors = [r["gradient error"][variant] for r in results.values()]
    print(f"{variant:28}" + "".join(f"{e:14.2e}" for e in errors))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
