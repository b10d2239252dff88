"""What PyTorch keeps for the backward pass of the MLP blocks, in float32 and under torch.autocast.

The PyTorch twin of `benchmarks/autocast_memory.py`'s "MLP blocks" model: 4
pre-LN residual blocks, x + W2 gelu(W1 LN(x) + b1) + b2 (tanh GELU, LayerNorm
epsilon 1e-6, as Flax's), width 256, 4096 tokens, a squared loss, with the
JAX benchmark's own weights and batch. The bytes of the tensors autograd
saves (`torch.autograd.graph.saved_tensors_hooks`), parameters and the input
left out (as `saved_residuals` leaves out the function's arguments), each
storage counted once; the ratio of `torch.autocast(dtype=bfloat16)` to
float32; and the gradients' distance from float32's, as the JAX benchmark
measures it.

torch is not a dependency of this project: run it in an environment that has
it and numpy (`pip install torch numpy`), from the weights the JAX benchmark
writes::

  python -m benchmarks.autocast_memory --export-mlp /tmp/mlp.npz
  python benchmarks/torch_autocast_memory.py /tmp/mlp.npz

CPU autocast is enough: what is saved does not depend on the device.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

DEPTH, WIDTH, TOKENS = 4, 256, 4096


class Block(nn.Module):
  def __init__(self) -> None:
    super().__init__()
    self.norm = nn.LayerNorm(WIDTH, eps=1e-6)
    self.up = nn.Linear(WIDTH, 4 * WIDTH)
    self.down = nn.Linear(4 * WIDTH, WIDTH)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return x + self.down(nn.functional.gelu(self.up(self.norm(x)), approximate="tanh"))


class MLPBlocks(nn.Module):
  def __init__(self) -> None:
    super().__init__()
    self.blocks = nn.Sequential(*[Block() for _ in range(DEPTH)])
    self.norm = nn.LayerNorm(WIDTH, eps=1e-6)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.norm(self.blocks(x))


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> int:
  given = {p.untyped_storage().data_ptr() for p in model.parameters()}
  given.add(x.untyped_storage().data_ptr())
  seen: dict[int, int] = {}

  def pack(t: torch.Tensor) -> torch.Tensor:
    ptr = t.untyped_storage().data_ptr()
    if ptr not in given:
      seen[ptr] = t.untyped_storage().nbytes()
    return t

  with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
      loss = ((model(x).float() - y) ** 2).mean()
  loss.backward()
  return sum(seen.values())


def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
  model.zero_grad()
  with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
    loss = ((model(x).float() - y) ** 2).mean()
  loss.backward()
  return torch.cat([p.grad.flatten() for p in model.parameters()])


def load(model: MLPBlocks, path: str) -> tuple[torch.Tensor, torch.Tensor]:
  """The JAX benchmark's weights (Flax names: Dense_0.., LayerNorm_0..) into `model`."""
  data = np.load(path)
  t = lambda name: torch.from_numpy(np.array(data[name]))
  with torch.no_grad():
    for i, block in enumerate(model.blocks):
      block.norm.weight.copy_(t(f"LayerNorm_{i}/scale"))
      block.norm.bias.copy_(t(f"LayerNorm_{i}/bias"))
      for linear, j in ((block.up, 2 * i), (block.down, 2 * i + 1)):
        linear.weight.copy_(t(f"Dense_{j}/kernel").T)  # Flax's kernel is (in, out)
        linear.bias.copy_(t(f"Dense_{j}/bias"))
    model.norm.weight.copy_(t(f"LayerNorm_{DEPTH}/scale"))
    model.norm.bias.copy_(t(f"LayerNorm_{DEPTH}/bias"))
  return t("x"), t("y")


def main() -> None:
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  model = MLPBlocks()
  x, y = load(model, sys.argv[1])
  f32 = saved_bytes(model, x, y, autocast=False)
  bf16 = saved_bytes(model, x, y, autocast=True)
  g32 = gradients(model, x, y, autocast=False)
  g16 = gradients(model, x, y, autocast=True)
  error = float((g16 - g32).norm() / g32.norm())
  print(f"torch {torch.__version__}, MLP blocks ({DEPTH} x width {WIDTH}, {TOKENS} tokens)")
  print(f"saved for backward, float32: {f32 / 2**20:.1f} MiB")
  print(f"torch.autocast bf16 vs float32: {bf16 / f32:.3f}")
  print(f"gradient error vs float32, torch.autocast bf16: {error:.2e}")


if __name__ == "__main__":
  main()
