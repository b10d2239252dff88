"""Flax is an optional extra: the core package must work where it cannot be imported."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Installed as a pytest plugin or run as a prelude: any import of flax (or
# orbax) fails as if the extra were not installed.
BLOCKER = textwrap.dedent(
  """
  import importlib.abc
  import sys


  class BlockFlax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name.split(".")[0] in ("flax", "orbax"):
        raise ModuleNotFoundError(f"No module named {name!r} (blocked for this test)")
      return None


  sys.meta_path.insert(0, BlockFlax())
  """
)

SCRIPT = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, optax
  import optax_lossscale as ols

  tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**4))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    loss, grads = ols.value_and_grad(lambda p: jnp.sum(p["w"] * x))(state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  new_params, state, _ = step(params, state, jnp.array([1.0, jnp.nan, 0.0]))
  assert bool(jnp.all(new_params["w"] == params["w"])), new_params
  new_params, state, loss = step(new_params, state, jnp.array([1.0, 2.0, 0.0]))
  assert float(loss) == 3.0 and not bool(jnp.all(new_params["w"] == params["w"]))
  metrics = ols.metrics(state)
  assert (int(metrics["total_skips"]), float(metrics["loss_scale"])) == (1, 8.0), metrics
  # Any holder with an `opt_state` attribute works, as TrainState and nnx.Optimizer do.
  import types
  holder = types.SimpleNamespace(opt_state=state, params=params)
  assert float(ols.get_loss_scale(holder)()) == 8.0
  assert int(ols.metrics(holder)["total_skips"]) == 1
  assert not [m for m in sys.modules if m.split(".")[0] in ("flax", "orbax")]
  try:
    import optax_lossscale.flax
  except ImportError:
    print("optax_lossscale.flax needs flax: OK")
  """
)


def _env(extra_path=None):
  env = dict(os.environ)
  paths = [str(ROOT), *([str(extra_path)] if extra_path else [])]
  env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
  env["JAX_PLATFORMS"] = "cpu"
  return env


def test_core_imports_and_trains_without_flax():
  result = subprocess.run(
    [sys.executable, "-c", BLOCKER + SCRIPT],
    env=_env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  assert "optax_lossscale.flax needs flax: OK" in result.stdout


def test_suite_collects_without_flax(tmp_path):
  (tmp_path / "block_flax.py").write_text(BLOCKER)
  result = subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "block_flax", "--collect-only", "-q", "-rs"],
    env=_env(tmp_path),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  # The core doctests are collected, the Flax modules' are not, and the Flax
  # test files skip rather than error.
  doctest = "_src/wrappers/grad.py::optax_lossscale._src.wrappers.grad.value_and_grad"
  assert doctest in result.stdout
  assert "_src/integrations/flax_train_state.py::" not in result.stdout
  assert "tests/test_grad.py::" in result.stdout
  assert "tests/test_flax_nnx.py::" not in result.stdout
  assert re.search(r"test_flax_nnx.py:\d+: could not import 'flax'", result.stdout)
