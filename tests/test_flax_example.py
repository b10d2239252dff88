"""The Flax mixed-precision example trains in float16 compute with float32 params."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("flax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flax_mixed_precision.py"


@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location("flax_mixed_precision", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_example_skips_the_overflowing_start_then_learns(example, api):
  steps, period = 40, 10
  result = getattr(example, f"train_{api}")(steps, period)
  skips = result["total_skips"]
  # 2**24 overflows float16's backward pass: the first steps are skipped...
  assert 1 <= skips < steps // 2
  # ... each halving the scale; every `period` applied steps double it again.
  applied = steps - skips
  assert result["loss_scale"] == 2.0 ** (24 - skips + applied // period)
  assert result["last_step_applied"] and result["consecutive_skips"] == 0
  assert result["last_loss"] < result["first_loss"] / 4
  # TrainState counts applied updates; nnx.Optimizer counts calls.
  assert result["step"] == (applied if api == "linen" else steps)


def test_example_keeps_float32_params_and_float16_compute(example):
  import jax
  import jax.numpy as jnp

  model = example.LinenMLP()
  x = jnp.ones((2, 16))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  assert model.apply({"params": params}, x).dtype == jnp.float16
