"""The benchmark's workloads: parameters, a batch and a loss for each.

* `optimizer_only(n)`: about `n` float32 parameters in four matrices and four
  biases; the batch *is* the gradient, as buffers (unscaled for bare optax,
  scaled by 2**15 for the loss-scaling recipes), so what is timed is the
  update, the unscale, the check and the skip. Flax's `DynamicScale` only
  offers `value_and_grad`, so it differentiates `linear_loss`, whose gradient
  is the given one and which XLA reduces to a multiply fused into the unscale.
* `mlp()`, `transformer_lm()`: Flax models computing in float16 from float32
  master parameters, trained with softmax cross-entropy computed in float32.
  `transformer_lm(**GPU_LM)` is the GPU-size one (186M parameters, the GPT-style
  LM of the H100 measurements), run only by `run.py --gpu-size`;
  `transformer_lm_shapes` builds its parameters' shapes without allocating them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

COMPUTE_DTYPE = jnp.float16


class Workload(NamedTuple):
  name: str
  params: Any
  batch: Any
  loss_fn: Any
  description: str


def num_params(params: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def linear_loss(params: Any, grads: Any) -> jax.Array:
  """`sum(params * grads)`: its gradient with respect to params is `grads`."""
  leaves = zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True)
  return sum(jnp.sum(p * g) for p, g in leaves)


# The loss_fn of the optimizer-only workload: the batch holds the gradients
# themselves, {'grads': g, 'scaled': g * SCALE}, as buffers, the way a backward
# pass leaves them.
GIVEN_GRADIENTS = None
SCALE = 2.0**15


def optimizer_only(n: int, *, seed: int = 0, inject_nan: bool = False) -> Workload:
  """Adam on ~n parameters; with `inject_nan`, one gradient element is NaN."""
  width = 1024
  rows = max(n // 4 // width, 1)
  rng = np.random.default_rng(seed)
  params, grads = {}, {}
  for i in range(4):
    params[f"w{i}"] = jnp.asarray(rng.standard_normal((rows, width), np.float32) * 0.02)
    params[f"b{i}"] = jnp.zeros((width,), jnp.float32)
    grads[f"w{i}"] = jnp.asarray(rng.standard_normal((rows, width), np.float32) * 1e-3)
    grads[f"b{i}"] = jnp.asarray(rng.standard_normal((width,), np.float32) * 1e-3)
  if inject_nan:
    grads["w2"] = grads["w2"].at[rows // 2, 7].set(jnp.nan)
  batch = {"grads": grads, "scaled": jax.tree.map(lambda g: g * SCALE, grads)}
  name = f"adam_{_size_label(num_params(params))}" + ("_nan" if inject_nan else "")
  return Workload(name, params, batch, GIVEN_GRADIENTS, "optimizer update only (Adam)")


def _size_label(n: int) -> str:
  return f"{n / 2**20:.0f}M" if n >= 2**20 else f"{n / 2**10:.0f}K"


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return jnp.mean(logz - picked)


def mlp(*, width: int = 1024, depth: int = 4, batch: int = 64, classes: int = 16) -> Workload:
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      for _ in range(depth):
        x = nn.relu(nn.Dense(width, dtype=COMPUTE_DTYPE)(x))
      return nn.Dense(classes, dtype=COMPUTE_DTYPE)(x)

  model = MLP()
  key_x, key_y, key_init = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (batch, width), COMPUTE_DTYPE)
  y = jax.random.randint(key_y, (batch,), 0, classes)
  params = model.init(key_init, x)["params"]

  def loss_fn(params: Any, data: Any) -> jax.Array:
    inputs, labels = data
    return _cross_entropy(model.apply({"params": params}, inputs), labels)

  desc = f"MLP {depth}x{width}, batch {batch}, float16 compute"
  return Workload(f"mlp_{_size_label(num_params(params))}", params, (x, y), loss_fn, desc)


# A GPT-style LM of 186M parameters: sized for a GPU (about 45 ms a step on an
# H100), far too slow for a CPU run.
GPU_LM: dict[str, int] = {
  "vocab": 32768,
  "d_model": 1024,
  "heads": 16,
  "layers": 12,
  "seq": 1024,
  "batch": 8,
}


def _lm_model(
  *, vocab: int, d_model: int, heads: int, layers: int, seq: int, dtype: Any = COMPUTE_DTYPE
) -> Any:
  """The GPT-style LM; `dtype` is its modules' compute dtype (None: the float32 model)."""
  import flax.linen as nn

  cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
      h = nn.LayerNorm(dtype=dtype)(x)
      h = nn.MultiHeadDotProductAttention(num_heads=heads, dtype=dtype)(h, h, mask=mask)
      x = x + h
      h = nn.LayerNorm(dtype=dtype)(x)
      h = nn.gelu(nn.Dense(4 * d_model, dtype=dtype)(h))
      return x + nn.Dense(d_model, dtype=dtype)(h)

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
      embed = nn.Embed(vocab, d_model, dtype=dtype)
      pos = self.param("pos", nn.initializers.normal(0.02), (seq, d_model))
      x = embed(tokens) + cast(pos)
      mask = nn.make_causal_mask(tokens)
      for _ in range(layers):
        x = Block()(x, mask)
      return embed.attend(nn.LayerNorm(dtype=dtype)(x))

  return LM()


def markov_tokens(seed: int, i: int, *, vocab: int, seq: int, batch: int) -> jax.Array:
  """Batch `i` of seed `seed` of a language with 4 equally likely successors per token.

  The successor table is the same for every seed (its best loss is log 4 = 1.386);
  each batch is `(batch, seq + 1)` tokens, a sequence and its next tokens.
  """
  successors = np.random.default_rng(1234).integers(0, vocab, (vocab, 4))
  rng = np.random.default_rng([seed, i])
  tokens = np.empty((batch, seq + 1), np.int32)
  tokens[:, 0] = rng.integers(0, vocab, batch)
  choices = rng.integers(0, 4, (batch, seq))
  for t in range(seq):
    tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
  return jnp.asarray(tokens)


def equations(jaxpr: Any) -> Any:
  """Every equation of a jaxpr, those of its sub-jaxprs (jit, scan, cond, ...) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from equations(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from equations(sub)


def _lm_tokens(*, vocab: int, seq: int, batch: int) -> jax.Array:
  return jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, vocab)


def transformer_lm_shapes(
  *,
  vocab: int = 512,
  d_model: int = 256,
  heads: int = 4,
  layers: int = 4,
  seq: int = 64,
  batch: int = 8,
) -> tuple[Any, Any, Any]:
  """`(params, tokens, loss_fn)` of `transformer_lm` as shapes: nothing allocated or run."""
  model = _lm_model(vocab=vocab, d_model=d_model, heads=heads, layers=layers, seq=seq)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  init = lambda t: model.init(jax.random.key(2), t[:, :-1])["params"]
  return jax.eval_shape(init, tokens), tokens, _lm_loss(model)


def _lm_loss(model: Any) -> Any:
  def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens[:, :-1])
    return _cross_entropy(logits, tokens[:, 1:])

  return loss_fn


def transformer_lm(
  *,
  vocab: int = 512,
  d_model: int = 256,
  heads: int = 4,
  layers: int = 4,
  seq: int = 64,
  batch: int = 8,
) -> Workload:
  model = _lm_model(vocab=vocab, d_model=d_model, heads=heads, layers=layers, seq=seq)
  tokens = _lm_tokens(vocab=vocab, seq=seq, batch=batch)
  params = model.init(jax.random.key(2), tokens[:, :-1])["params"]
  desc = f"Transformer LM {layers}x{d_model}, {heads} heads, {batch}x{seq} tokens, float16 compute"
  return Workload(f"lm_{_size_label(num_params(params))}", params, tokens, _lm_loss(model), desc)
