"""float16 for RL fine-tuning: the sampler/trainer mismatch of float32, float16 and bfloat16.

A small decoder-only transformer policy (2 layers, d=64, 4 heads), written
once in float32 JAX, learns a task with a verifiable reward: the prompt
``<bos> t t =`` states a target ``tt`` (two digits, 0 to 36) and the policy
writes four tokens; the reward is 1 when they are digits that sum to the
target, else 0. The targets are the sums of four random digits, so every
prompt has an answer. NumPy generates every prompt, example and sampling
noise from ``--seed``: no download, and the same for every precision.

1. **Supervised start**, once, in float32: a few hundred steps of next-token
   cross-entropy on random digit strings behind the sum they make. Every
   precision starts RL from these parameters, which hit the target on a
   minority of the prompts.
2. **RL fine-tuning**, GRPO-style, per precision: each step samples a group of
   ``GROUP`` completions for each of ``PROMPTS`` prompts, normalises the
   rewards within each group (the advantages), and takes one step on
   ``-mean(advantage * log p(token))`` over the written tokens (REINFORCE with
   group-normalised advantages; one update per batch, so no importance ratio).

Like an RL stack, it computes the log-probabilities twice, with the same
parameters: the **sampler** is an incremental decoder with a key/value cache
(a prefill of the prompt, then one token at a time, as an inference engine
runs) and records the log-probability of each token it samples; the
**trainer** recomputes them with one full causal forward over the sequence
(as a trainer does) and differentiates that. Each is its own jitted program,
and both run in the run's precision:

* ``float32``: the model as written;
* ``float16``: sampler and trainer wrapped in
  ``ols.autocast(..., 'p=f32,c=f16,o=f32')`` (matrix products in float16 with
  float32 accumulation; the norms' statistics, the softmax and the
  log-softmax in float32), the optimizer in ``ols.loss_scale_optimizer``;
* ``bfloat16``: the same with ``c=bf16``, and ``ols.skip_bad_steps``.

The optimizer is Adam with a short warm-up and global-norm clipping, inside
the wrapper (which hands it unscaled gradients); the parameters stay float32.
Per run it reports the training-inference mismatch
``|log p(sampler) - log p(trainer)|`` over every sampled token (mean, max and
the share of tokens where it is not 0), the reward curve, the skipped steps
and the loss scale. docs/guides/fp16_rl.md discusses the numbers. Run
``python examples/fp16_policy_gradient.py --help``; it prints a table and
writes ``fp16_policy_gradient.png`` and ``fp16_policy_gradient.json`` (every
number of the table and the plot) to ``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import functools
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

Params = dict[str, Any]

BOS, SEP = 10, 11  # the tokens after the ten digits
VOCAB = 12
DIGITS = 4  # tokens the policy writes
PROMPT_LEN = 4  # <bos> t t =
SEQ_LEN = PROMPT_LEN + DIGITS
D_MODEL, HEADS, LAYERS = 64, 4, 2

SFT_STEPS, RL_STEPS = 200, 300
QUICK_SFT_STEPS, QUICK_RL_STEPS = 60, 20  # --quick, for the tests
PROMPTS, GROUP = 32, 8
SFT_BATCH = PROMPTS * GROUP  # the RL batch: the two phases share a compiled step
# A fresh Adam state's first steps move every weight by about the learning rate,
# which throws a trained policy off (measured at 1e-3 without a warm-up: the
# reward fell from 0.32 to 0.02 in one step), so each phase warms it up.
LEARNING_RATE, WARMUP_STEPS, CLIP_NORM = 5e-4, 20, 1.0
EVAL_ROLLOUTS = 4  # held-out batches of PROMPTS x GROUP samples
# Loss scaling for RL: a skipped step throws a whole batch of rollouts away, so
# the scale grows rarely (PyTorch's and TensorFlow's default period is 2000).
INITIAL_LOSS_SCALE, GROWTH_INTERVAL = 2.0**15, 2000


@dataclasses.dataclass(frozen=True)
class Precision:
  """One precision of the RL phase: its autocast policy and its optimizer wrapper."""

  name: str
  policy: str | None  # None: the float32 code as written


PRECISIONS = (
  Precision("float32", None),
  Precision("float16", "p=f32,c=f16,o=f32"),
  Precision("bfloat16", "p=f32,c=bf16,o=f32"),
)


@dataclasses.dataclass
class RunResult:
  """What one precision's RL run produced; every number comes from the run."""

  name: str
  rewards: list[float]  # mean reward of each step's samples
  mismatch_mean: list[float]  # per step: mean |log p(sampler) - log p(trainer)| over its tokens
  mismatch_max: list[float]  # per step: the largest one
  mismatch_share: list[float]  # per step: the share of its tokens whose two log p differ
  loss_scales: list[float]  # the scale each step's gradients were computed at (1 if none)
  skipped_steps: list[int]
  eval_reward: float  # the final policy on held-out prompts, sampled in float32
  seconds: float

  @property
  def mean_mismatch(self) -> float:
    """Mean |log p(sampler) - log p(trainer)| over every sampled token of the run."""
    return float(np.mean(self.mismatch_mean))  # every step samples as many tokens

  @property
  def max_mismatch(self) -> float:
    return float(np.max(self.mismatch_max))

  @property
  def share_differing(self) -> float:
    """The share of the run's sampled tokens whose sampler and trainer log p differ at all."""
    return float(np.mean(self.mismatch_share))

  @property
  def first_reward(self) -> float:
    """Mean reward of the first tenth of the steps' samples."""
    return float(np.mean(self.rewards[: max(1, len(self.rewards) // 10)]))

  @property
  def final_reward(self) -> float:
    """Mean reward of the last tenth of the steps' samples."""
    return float(np.mean(self.rewards[-max(1, len(self.rewards) // 10) :]))

  @property
  def final_scale(self) -> float:
    return self.loss_scales[-1]


# The task.


def make_prompts(rng: np.random.Generator, n: int) -> np.ndarray:
  """`n` prompts `<bos> t t =`, each target the sum of four random digits."""
  target = rng.integers(0, 10, (n, DIGITS)).sum(axis=1)
  return np.stack([np.full(n, BOS), target // 10, target % 10, np.full(n, SEP)], 1).astype(np.int32)


def make_examples(rng: np.random.Generator, n: int) -> np.ndarray:
  """`n` whole sequences for the supervised phase: random digits behind their sum."""
  digits = rng.integers(0, 10, (n, DIGITS))
  target = digits.sum(axis=1)
  head = np.stack([np.full(n, BOS), target // 10, target % 10, np.full(n, SEP)], 1)
  return np.concatenate([head, digits], axis=1).astype(np.int32)


def reward(sequences: jax.Array) -> jax.Array:
  """1 where the policy wrote digits only and they sum to the target, else 0 (float32)."""
  target = sequences[:, 1] * 10 + sequences[:, 2]
  written = sequences[:, PROMPT_LEN:]
  hit = jnp.all(written < 10, axis=1) & (jnp.sum(written, axis=1) == target)
  return hit.astype(jnp.float32)


# The policy, written once in float32.


def init_params(seed: int) -> Params:
  """A pre-norm decoder-only transformer's float32 parameters, the layers stacked."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, fan_in: rng.normal(size=shape) / np.sqrt(fan_in)
  residual = np.sqrt(2 * LAYERS)  # the residual branches' outputs start small
  params = {
    "embed": normal((VOCAB, D_MODEL), 4.0),
    "pos": normal((SEQ_LEN, D_MODEL), 4.0),
    "layers": {
      "norm1": np.ones((LAYERS, D_MODEL)),
      "qkv": normal((LAYERS, D_MODEL, 3 * D_MODEL), D_MODEL),
      "out": normal((LAYERS, D_MODEL, D_MODEL), D_MODEL) / residual,
      "norm2": np.ones((LAYERS, D_MODEL)),
      "up": normal((LAYERS, D_MODEL, 4 * D_MODEL), D_MODEL),
      "down": normal((LAYERS, 4 * D_MODEL, D_MODEL), 4 * D_MODEL) / residual,
    },
    "norm": np.ones(D_MODEL),
    "unembed": normal((D_MODEL, VOCAB), D_MODEL),
  }
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def split_heads(x: jax.Array) -> jax.Array:
  """(batch, time, D_MODEL) -> (batch, HEADS, time, D_MODEL // HEADS)."""
  b, t, _ = x.shape
  return x.reshape(b, t, HEADS, D_MODEL // HEADS).transpose(0, 2, 1, 3)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
  """Causal attention of queries at positions `q_pos` to keys at positions 0, 1, ..."""
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
  visible = jnp.arange(k.shape[2])[None, :] <= q_pos[:, None]
  weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
  out = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
  b, _, t, _ = out.shape
  return out.transpose(0, 2, 1, 3).reshape(b, t, D_MODEL)


def block(
  layer: Params, x: jax.Array, positions: jax.Array, cache: tuple | None
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """One layer over the tokens at `positions`; returns its output and its keys and values.

  Without `cache` the tokens attend to one another (a full forward, or the
  prefill); with `cache` (the keys and values of all SEQ_LEN positions) the new
  keys and values are written into it at `positions` first, as a decoder does.
  """
  q, k, v = jnp.split(rms_norm(x, layer["norm1"]) @ layer["qkv"], 3, axis=-1)
  q, k, v = split_heads(q), split_heads(k), split_heads(v)
  if cache is not None:
    k = jax.lax.dynamic_update_slice_in_dim(cache[0], k, positions[0], axis=2)
    v = jax.lax.dynamic_update_slice_in_dim(cache[1], v, positions[0], axis=2)
  x = x + attend(q, k, v, positions) @ layer["out"]
  x = x + jax.nn.gelu(rms_norm(x, layer["norm2"]) @ layer["up"]) @ layer["down"]
  return x, (k, v)


def forward(
  params: Params, tokens: jax.Array, start: jax.Array | int = 0, cache: tuple | None = None
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """Log-probabilities of the token after each of `tokens` (at `start`, `start+1`, ...).

  Also returns every layer's keys and values, stacked (LAYERS, batch, HEADS,
  time, D_MODEL // HEADS); `cache` is such a pair, of all SEQ_LEN positions.
  The layers run as one `lax.scan`, which XLA compiles once.
  """
  positions = start + jnp.arange(tokens.shape[1])
  # Lookups as one-hot products: their gradients are products too, not scatters,
  # which XLA:CPU compiles faster.
  x = jax.nn.one_hot(tokens, VOCAB) @ params["embed"]
  x = x + jax.nn.one_hot(positions, SEQ_LEN) @ params["pos"]

  def layer_step(x: jax.Array, inputs: tuple) -> tuple[jax.Array, tuple]:
    layer, layer_cache = inputs
    return block(layer, x, positions, layer_cache)

  x, keys_values = jax.lax.scan(layer_step, x, (params["layers"], cache))
  logits = rms_norm(x, params["norm"]) @ params["unembed"]
  return jax.nn.log_softmax(logits, axis=-1), keys_values


def token_log_probs(params: Params, sequences: jax.Array) -> jax.Array:
  """The trainer's view: log p of each written token, from one full forward."""
  log_probs, _ = forward(params, sequences[:, :-1])
  written = log_probs[:, PROMPT_LEN - 1 :]
  return jnp.sum(jax.nn.one_hot(sequences[:, PROMPT_LEN:], VOCAB) * written, axis=-1)


def sample(params: Params, prompts: jax.Array, noise: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The sampler's view: an incremental decoder with a key/value cache.

  A prefill runs the prompts and fills the cache at their positions; then each
  step samples a token from the last log-probabilities (temperature 1: the
  argmax of log p plus Gumbel `noise`, as `jax.random.categorical` samples),
  records its log-probability and feeds it back, attending to the cache.
  Returns the whole sequences and the log-probabilities of the written tokens.
  """
  log_probs, prefix = forward(params, prompts)
  pad = [(0, 0)] * 3 + [(0, SEQ_LEN - PROMPT_LEN), (0, 0)]
  cache = jax.tree.map(lambda a: jnp.pad(a, pad), prefix)

  def step(carry: tuple, inputs: tuple) -> tuple[tuple, tuple[jax.Array, jax.Array]]:
    (cache, last), (i, step_noise) = carry, inputs
    token = jnp.argmax(last + step_noise, axis=-1)
    chosen = jnp.sum(jax.nn.one_hot(token, VOCAB) * last, axis=-1)
    log_probs, cache = forward(params, token[:, None], PROMPT_LEN + i, cache)
    return (cache, log_probs[:, 0]), (token, chosen)

  _, (tokens, chosen) = jax.lax.scan(step, (cache, log_probs[:, -1]), (jnp.arange(DIGITS), noise))
  return jnp.concatenate([prompts, tokens.T], axis=1), chosen.T


# Training: the supervised start, then RL.


def group_advantages(rewards: jax.Array) -> jax.Array:
  """GRPO: each reward minus its group's mean, over the group's standard deviation."""
  grouped = rewards.reshape(-1, GROUP)
  centred = grouped - grouped.mean(axis=1, keepdims=True)
  return (centred / (grouped.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)


def policy_gradient_loss(
  params: Params, sequences: jax.Array, advantages: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """-mean(advantage * log p) over the written tokens; the trainer's log-probs as aux.

  With every advantage 1 it is the supervised phase's cross-entropy.
  """
  log_probs = token_log_probs(params, sequences)
  return -jnp.mean(advantages[:, None] * log_probs), log_probs


def in_precision(fun: Callable, precision: Precision) -> Callable:
  """`fun` as written for float32, or autocast to the precision's policy."""
  return fun if precision.policy is None else ols.autocast(fun, precision.policy)


def make_optimizer(precision: Precision) -> optax.GradientTransformation:
  """Clipping and Adam; float16 wraps them in loss scaling, bfloat16 in skip_bad_steps."""
  learning_rate = optax.linear_schedule(0.0, LEARNING_RATE, WARMUP_STEPS)
  inner = optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adam(learning_rate))
  if precision.name == "float16":
    scale = ols.DynamicLossScale(INITIAL_LOSS_SCALE, increment_period=GROWTH_INTERVAL)
    return ols.loss_scale_optimizer(inner, scale)
  if precision.name == "bfloat16":
    return ols.skip_bad_steps(inner)
  return inner


@functools.cache
def make_rollout(precision: Precision) -> Callable:
  """The jitted inference side: samples (in the precision), rewards, advantages."""
  sampler = in_precision(sample, precision)

  @jax.jit
  def rollout(params: Params, prompts: jax.Array, noise: jax.Array) -> dict[str, jax.Array]:
    sequences, log_probs = sampler(params, prompts, noise)
    rewards = reward(sequences)
    return {
      "sequences": sequences,
      "log_probs": log_probs,
      "advantages": group_advantages(rewards),
      "reward": jnp.mean(rewards),
    }

  return rollout


def rollout_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """One step's prompts, each GROUP times, and the Gumbel noise that samples the tokens."""
  prompts = np.repeat(make_prompts(rng, PROMPTS), GROUP, axis=0)
  noise = rng.gumbel(size=(DIGITS, len(prompts), VOCAB)).astype(np.float32)
  return prompts, noise


@functools.cache
def make_train_step(precision: Precision) -> tuple[optax.GradientTransformation, Callable]:
  """The optimizer and the jitted trainer side: recompute log p, differentiate, update.

  The step also compares its log-probabilities with the sampler's (same
  parameters, same tokens): the training-inference mismatch.
  """
  tx = make_optimizer(precision)
  loss_fn = in_precision(policy_gradient_loss, precision)

  @jax.jit
  def train_step(
    params: Params,
    opt_state: Any,
    sequences: jax.Array,
    advantages: jax.Array,
    sampler_log_probs: jax.Array,
  ) -> tuple[Params, Any, dict]:
    if precision.name == "float16":
      scale = ols.get_loss_scale(opt_state)()  # the scale these gradients are computed at
      grad_fn = functools.partial(ols.value_and_grad(loss_fn, has_aux=True), opt_state)
    else:
      scale = jnp.float32(1.0)
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, log_probs), grads = grad_fn(params, sequences, advantages)
    params, opt_state = ols.apply_gradients(tx, grads, opt_state, params)
    gap = jnp.abs(sampler_log_probs - log_probs)
    applied = ols.metrics(opt_state)["last_step_applied"] if precision.policy else True
    record = {
      "mismatch_mean": jnp.mean(gap),
      "mismatch_max": jnp.max(gap),
      "mismatch_share": jnp.mean(gap > 0),
      "loss_scale": scale,
      "applied": jnp.asarray(applied),
    }
    return params, opt_state, record

  return tx, train_step


def supervised_start(seed: int, steps: int) -> Params:
  """The shared starting point: float32 cross-entropy on random digits behind their sum.

  It runs float32's RL train step with every advantage 1, so XLA compiles one
  step for both phases.
  """
  tx, train_step = make_train_step(PRECISIONS[0])
  params = init_params(seed)
  opt_state = jax.jit(tx.init)(params)
  rng = np.random.default_rng(seed + 1)
  ones, zeros = np.ones(SFT_BATCH, np.float32), np.zeros((SFT_BATCH, DIGITS), np.float32)
  for _ in range(steps):
    params, opt_state, _ = train_step(params, opt_state, make_examples(rng, SFT_BATCH), ones, zeros)
  return params


def evaluate(params: Params, seed: int) -> float:
  """Mean reward on EVAL_ROLLOUTS held-out batches of prompts, sampled in float32."""
  rollout = make_rollout(PRECISIONS[0])
  rng = np.random.default_rng(10_000 + seed)
  return float(
    np.mean([rollout(params, *rollout_inputs(rng))["reward"] for _ in range(EVAL_ROLLOUTS)])
  )


def fine_tune(precision: Precision, start: Params, steps: int, seed: int) -> RunResult:
  """One precision's RL run from the shared start; the same prompts and noise for all."""
  began = time.perf_counter()
  rollout = make_rollout(precision)
  tx, train_step = make_train_step(precision)
  params, opt_state = start, jax.jit(tx.init)(start)
  rng = np.random.default_rng(seed + 2)
  records = []
  for _ in range(steps):
    batch = rollout(params, *rollout_inputs(rng))
    params, opt_state, record = train_step(
      params, opt_state, batch["sequences"], batch["advantages"], batch["log_probs"]
    )
    records.append(record | {"reward": batch["reward"]})
  history = {k: np.array([r[k] for r in jax.device_get(records)]) for k in records[0]}
  return RunResult(
    name=precision.name,
    rewards=history["reward"].tolist(),
    mismatch_mean=history["mismatch_mean"].tolist(),
    mismatch_max=history["mismatch_max"].tolist(),
    mismatch_share=history["mismatch_share"].tolist(),
    loss_scales=history["loss_scale"].tolist(),
    skipped_steps=np.flatnonzero(~history["applied"]).tolist(),
    eval_reward=evaluate(params, seed),
    seconds=time.perf_counter() - began,
  )


# Reporting.


def format_scale(scale: float) -> str:
  exponent = np.log2(scale)
  return f"2^{int(exponent)}" if scale > 1 and exponent == int(exponent) else f"{scale:.4g}"


def format_table(results: Sequence[RunResult], start_reward: float) -> str:
  """One row per precision: the mismatch, the rewards, the skips and the scale."""
  header = (
    f"{'precision':<9} {'mean |dlogp|':>12} {'max |dlogp|':>11} {'differ':>6} {'reward':>12}"
    f" {'eval':>5} {'skipped':>7} {'scale':>5} {'time':>6}"
  )
  lines = [header, "-" * len(header)]
  for r in results:
    rewards = f"{r.first_reward:.2f} -> {r.final_reward:.2f}"
    lines.append(
      f"{r.name:<9} {r.mean_mismatch:>12.2e} {r.max_mismatch:>11.2e}"
      f" {100 * r.share_differing:>5.1f}% {rewards:>12} {r.eval_reward:>5.2f}"
      f" {len(r.skipped_steps):>7d} {format_scale(r.final_scale):>5} {r.seconds:>5.1f}s"
    )
  lines.append(f"eval reward of the supervised start: {start_reward:.2f}")
  return "\n".join(lines)


def plot(results: Sequence[RunResult], path: pathlib.Path) -> None:
  """Writes the mismatch, the reward curves and the loss scale with the skipped steps."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_gap, ax_reward, ax_scale) = plt.subplots(1, 3, figsize=(15, 4.2))
  for i, r in enumerate(results):
    ax_gap.plot(r.mismatch_mean, color=f"C{i}", label=f"{r.name} mean")
    ax_gap.plot(r.mismatch_max, ":", color=f"C{i}", label=f"{r.name} max")
  ax_gap.set(
    yscale="log",
    ylim=(1e-9, 3.0),
    xlabel="RL step",
    ylabel="|log p(sampler) - log p(trainer)|",
    title="Training-inference mismatch (per step)",
  )
  ax_gap.legend(fontsize=7, ncol=3, loc="lower center")
  for i, r in enumerate(results):
    window = max(1, len(r.rewards) // 20)
    smooth = np.convolve(r.rewards, np.ones(window) / window, mode="valid")
    ax_reward.plot(np.arange(len(smooth)) + window - 1, smooth, color=f"C{i}", label=r.name)
  ax_reward.set(xlabel="RL step", ylabel="mean reward (moving average)", title="Reward")
  ax_reward.legend()
  scaled = next(r for r in results if r.name == "float16")
  ax_scale.plot(scaled.loss_scales, color="C1", label="float16 loss scale")
  for i, r in enumerate(results):
    if r.name != "float32":  # float32 has no wrapper: it skips nothing
      marks = [r.loss_scales[s] for s in r.skipped_steps]  # at 1 for bfloat16 (no scale)
      ax_scale.plot(
        r.skipped_steps, marks, "x", color=f"C{i}", label=f"{r.name} skipped ({len(marks)})"
      )
  ax_scale.set(xlabel="RL step", ylabel="scale", title="Loss scale and skipped steps")
  ax_scale.set_yscale("log", base=2)
  ax_scale.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110, metadata={"Software": None})
  plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"{QUICK_SFT_STEPS} supervised and {QUICK_RL_STEPS} RL steps (for the tests)",
  )
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/fp16_rl"))
  parser.add_argument("--seed", type=int, default=0, help="initialisation, prompts, samples")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
  """Trains the supervised start, fine-tunes it in each precision, prints and writes."""
  args = parse_args(argv)
  sft_steps, rl_steps = (QUICK_SFT_STEPS, QUICK_RL_STEPS) if args.quick else (SFT_STEPS, RL_STEPS)
  began = time.perf_counter()
  start = supervised_start(args.seed, sft_steps)
  start_reward = evaluate(start, args.seed)
  results = [fine_tune(p, start, rl_steps, args.seed) for p in PRECISIONS]
  seconds = time.perf_counter() - began

  print(
    f"{LAYERS}-layer transformer (d={D_MODEL}), {sft_steps} supervised steps, then {rl_steps}"
    f" RL steps of {PROMPTS} prompts x {GROUP} samples per precision"
  )
  print(format_table(results, start_reward))
  print(
    "|dlogp|: |log p(sampler) - log p(trainer)| per sampled token, same parameters; differ:"
    " share of tokens where it is not 0; reward: first -> last tenth of the RL steps;"
    " eval: final policy, held-out prompts, sampled in float32"
  )
  print(f"({seconds:.1f} s in all)")
  args.out.mkdir(parents=True, exist_ok=True)
  plot(results, args.out / "fp16_policy_gradient.png")
  summary = {
    "quick": args.quick,
    "seed": args.seed,
    "supervised_steps": sft_steps,
    "rl_steps": rl_steps,
    "start_eval_reward": start_reward,
    "seconds": seconds,
    "runs": [
      dataclasses.asdict(r)
      | {
        "mean_mismatch": r.mean_mismatch,
        "max_mismatch": r.max_mismatch,
        "share_differing": r.share_differing,
        "first_reward": r.first_reward,
        "final_reward": r.final_reward,
        "final_scale": r.final_scale,
      }
      for r in results
    ],
  }
  (args.out / "fp16_policy_gradient.json").write_text(json.dumps(summary, indent=1))
  print(
    f"wrote {args.out / 'fp16_policy_gradient.png'} and {args.out / 'fp16_policy_gradient.json'}"
  )
  return results


if __name__ == "__main__":
  main()
