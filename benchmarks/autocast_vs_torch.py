"""`ols.autocast` against `torch.autocast` on CPU: each one's error relative to its own float32.

A subset of the autocast corpus (`tests/autocast_corpus.py`) that PyTorch
also has, written twice: once in JAX, once in PyTorch, each the same
function of the same float32 inputs, each starting with a matrix product so
that 16-bit values reach the op. For each op and each framework:

    error = max |f_mixed(x) - f_float32(x)| / max |f_float32(x)|

with `f_mixed` the framework's autocast in bfloat16 (`ols.autocast(f,
"p=f32,c=bf16,o=f32")`; `torch.autocast("cpu", dtype=torch.bfloat16)`), in
units of bfloat16's rounding (2**-8), plus whether the result is finite.
Rows at magnitudes 300 and 3e4 run in float16 too (`--dtype float16`): their
squares and sums overflow float16.

Not part of `make test` (it needs PyTorch, not a dependency of this
project); `tests/test_benchmarks.py` runs its quick mode when torch is
installed. Run it from a virtual environment holding both:

  python -m venv /tmp/tv && /tmp/tv/bin/pip install torch jax jaxlib optax numpy
  PYTHONPATH=. /tmp/tv/bin/python -m benchmarks.autocast_vs_torch [--dtype float16] [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


Op = tuple[Callable[..., Any], Callable[..., Any], tuple[float, float]]


def _ops(torch: Any) -> dict[str, Op]:
  """name -> (jax function of h, torch function of h, the range of h)."""
  F = torch.nn.functional

  def jax_layer_norm(h):
    mean = jnp.mean(h, -1, keepdims=True)
    return (h - mean) * lax.rsqrt(jnp.mean(jnp.square(h - mean), -1, keepdims=True) + 1e-5)

  def jax_rms_norm(h):
    return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)

  def torch_rms_norm(h):
    return h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True) + 1e-6)

  def jax_attention(h):
    q = k = v = h.reshape(1, 4, 2, 4)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(4, 8)

  def torch_attention(h):
    q = h.reshape(1, 4, 2, 4).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return out.transpose(1, 2).reshape(4, 8)

  labels = np.array([0, 3, 5, 7])
  targets = np.linspace(-1.0, 1.0, 32).reshape(4, 8).astype(np.float32)
  t_targets = torch.tensor(targets)
  small, mid = (-4.0, 4.0), (0.25, 8.0)
  return {
    "exp": (jnp.exp, torch.exp, small),
    "log": (jnp.log, torch.log, mid),
    "tanh": (jnp.tanh, torch.tanh, small),
    "sigmoid": (jax.nn.sigmoid, torch.sigmoid, small),
    "gelu": (lambda h: jax.nn.gelu(h, approximate=False), F.gelu, small),
    "silu": (jax.nn.silu, F.silu, small),
    "softplus": (jax.nn.softplus, F.softplus, small),
    "erf": (jax.scipy.special.erf, torch.erf, small),
    "sqrt": (jnp.sqrt, torch.sqrt, mid),
    "rsqrt": (lax.rsqrt, torch.rsqrt, mid),
    "pow3": (lambda h: h**3, lambda h: h**3, small),
    "softmax": (jax.nn.softmax, lambda h: torch.softmax(h, -1), small),
    "log_softmax": (jax.nn.log_softmax, lambda h: torch.log_softmax(h, -1), small),
    "logsumexp": (lambda h: jax.nn.logsumexp(h, -1), lambda h: torch.logsumexp(h, -1), small),
    "sum": (lambda h: jnp.sum(h, -1), lambda h: torch.sum(h, -1), small),
    "mean": (lambda h: jnp.mean(h, -1), lambda h: torch.mean(h, -1), small),
    "var": (lambda h: jnp.var(h, -1), lambda h: torch.var(h, -1, unbiased=False), small),
    "cumsum": (lambda h: jnp.cumsum(h, -1), lambda h: torch.cumsum(h, -1), small),
    "norm": (lambda h: jnp.linalg.norm(h, axis=-1), lambda h: torch.linalg.norm(h, dim=-1), small),
    "layer_norm": (jax_layer_norm, lambda h: F.layer_norm(h, (8,)), small),
    "rms_norm (h * h)": (jax_rms_norm, torch_rms_norm, small),
    "cross_entropy": (
      lambda h: optax.softmax_cross_entropy_with_integer_labels(h, labels),
      lambda h: F.cross_entropy(h, torch.tensor(labels), reduction="none"),
      small,
    ),
    "mse": (lambda h: jnp.mean((h - targets) ** 2), lambda h: F.mse_loss(h, t_targets), small),
    "bce_with_logits": (
      lambda h: jnp.mean(optax.sigmoid_binary_cross_entropy(h, (targets > 0).astype(np.float32))),
      lambda h: F.binary_cross_entropy_with_logits(h, (t_targets > 0).float()),
      small,
    ),
    "huber": (
      lambda h: jnp.mean(optax.huber_loss(h, targets)),
      lambda h: F.huber_loss(h, t_targets),
      small,
    ),
    "cosine_similarity": (
      lambda h: optax.cosine_similarity(h, targets),
      lambda h: F.cosine_similarity(h, t_targets, dim=-1),
      small,
    ),
    "attention": (jax_attention, torch_attention, small),
    "matmul again": (lambda h: h @ h.T, lambda h: h @ h.T, small),
    "norm at 300": (
      lambda h: jnp.linalg.norm(h, axis=-1),
      lambda h: torch.linalg.norm(h, dim=-1),
      (256.0, 384.0),
    ),
    "rms_norm at 300": (jax_rms_norm, torch_rms_norm, (256.0, 384.0)),
    "var at 300": (
      lambda h: jnp.var(h, -1),
      lambda h: torch.var(h, -1, unbiased=False),
      (256.0, 384.0),
    ),
    "mean at 3e4": (lambda h: jnp.mean(h, -1), lambda h: torch.mean(h, -1), (16384.0, 32768.0)),
    "softmax at 3e4": (jax.nn.softmax, lambda h: torch.softmax(h, -1), (16384.0, 32768.0)),
  }


QUICK = ("exp", "softmax", "layer_norm", "cross_entropy", "norm at 300")


def _inputs(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
  """`(x, w)` with `x @ w == x`: values in [lo, hi] exact in 16 bits (8 significant bits)."""
  rng = np.random.default_rng(0)
  step = 2.0 ** (np.ceil(np.log2(max(abs(lo), abs(hi)))) - 7)
  x = rng.integers(int(np.ceil(lo / step)), int(hi // step), (4, 8), endpoint=True) * step
  return x.astype(np.float32), np.eye(8, dtype=np.float32)


def _error(got: Any, want: Any) -> tuple[float, bool]:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  finite = bool(np.all(np.isfinite(got)))
  if not finite:
    return float("inf"), False
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)), True


def measure(dtype: str = "bfloat16", quick: bool = False) -> dict[str, Any]:
  import torch  # optional: only this benchmark needs it

  ops = _ops(torch)
  names = QUICK if quick else tuple(ops)
  policy = "p=f32,c=bf16,o=f32" if dtype == "bfloat16" else "p=f32,c=f16,o=f32"
  torch_dtype = getattr(torch, dtype)
  rows = {}
  for name in names:
    jax_op, torch_op, (lo, hi) = ops[name]
    x, w = _inputs(lo, hi)
    f = lambda x, w, op=jax_op: op(x @ w)
    want = f(x, w)
    ours = ols.autocast(f, policy)(x, w)
    tx, tw = torch.tensor(x), torch.tensor(w)
    with torch.no_grad():
      t_want = torch_op(tx @ tw)
      with torch.autocast("cpu", dtype=torch_dtype):
        t_mixed = torch_op(tx @ tw)
    ours_err, ours_finite = _error(ours, want)
    torch_err, torch_finite = _error(t_mixed.float().numpy(), t_want.numpy())
    rows[name] = {
      "ours": ours_err / EPS[dtype], "torch": torch_err / EPS[dtype],
      "ours_dtype": str(np.asarray(ours).dtype), "torch_dtype": str(t_mixed.dtype),
      "ours_finite": ours_finite, "torch_finite": torch_finite,
    }  # fmt: skip
  return {"dtype": dtype, "jax": jax.__version__, "torch": torch.__version__, "rows": rows}


def table(report: dict[str, Any]) -> str:
  lines = [
    f"Error relative to float32, in units of {report['dtype']}'s rounding"
    f" ({EPS[report['dtype']]:g}); inf: not finite. jax {report['jax']}, torch {report['torch']}.",
    "",
    "| op | ols.autocast | torch.autocast | torch output dtype |",
    "| --- | --- | --- | --- |",
  ]
  for name, r in report["rows"].items():
    lines.append(f"| {name} | {r['ours']:.2f} | {r['torch']:.2f} | {r['torch_dtype']} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", choices=sorted(EPS), default="bfloat16")
  parser.add_argument("--quick", action="store_true", help="five ops, for the smoke test")
  parser.add_argument("--out", help="also write the report as JSON here")
  args = parser.parse_args(argv)
  report = measure(args.dtype, args.quick)
  print(table(report))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
