"""Smoke test of the benchmark runner on a tiny workload (no timing asserted).

The runner is not part of the package, but `make bench` and BENCHMARKS.md
depend on it: every recipe must compile, step and stay finite, the compiled-step
columns must be filled in, and the markdown table must hold every variant.
"""

import importlib.util

import jax
import numpy as np

from benchmarks import recipes, run, workloads


def test_every_recipe_runs_and_is_reported():
  workload = workloads.optimizer_only(2**14)
  result = run.measure(workload, rounds=2, kind="optimizer", min_chunk_s=0.0)
  names = set(result["results"])
  expected = {*recipes.VARIANTS, run.PRE_CHANGE}
  # jmp and flax are optional: without them the runner skips their recipes.
  if importlib.util.find_spec("jmp") is None:
    expected.discard("jmp recipe")
  if importlib.util.find_spec("flax") is None:
    expected.discard("flax DynamicScale")
  assert names == expected
  assert all(result["params_finite_after"].values())
  for name, r in result["results"].items():
    assert len(r["round_ms"]) == 2 and min(r["round_ms"]) > 0, name
    assert r["ratio_to_one_read"] > 0, name
    assert r["temp_bytes"] is not None and r["host_transfer"] is (name == "ols cond + guard")
  assert result["results"][recipes.BASELINE]["ratio"] == 1.0
  # The fused step allocates no parameter-sized temporary; update-then-apply does.
  param_bytes = 4 * workloads.num_params(workload.params)
  assert result["results"]["ols apply_gradients"]["temp_bytes"] < param_bytes // 4
  assert result["results"]["ols cond"]["temp_bytes"] >= param_bytes
  report = {"meta": run.machine_info(), "workloads": [result]}
  table = run.markdown(report)
  for name in names:
    assert f"| {name} |" in table


def test_skipped_step_workload_poisons_only_the_scaled_recipes():
  poisoned = workloads.optimizer_only(2**14, inject_nan=True)
  clean = workloads.optimizer_only(2**14)
  leaves = jax.tree.leaves(poisoned.batch["grads"])
  assert sum(int(np.isnan(np.asarray(x)).sum()) for x in leaves) == 1
  workload = poisoned._replace(batch=clean.batch)
  result = run.measure(workload, rounds=1, kind="skip", skip_batch=poisoned.batch, min_chunk_s=0.0)
  # Every loss-scaling recipe skipped every step; the two references, fed the
  # clean gradients, moved their params.
  references = {recipes.BASELINE, recipes.ONE_READ}
  unchanged = result["params_unchanged_after"]
  assert {n for n, same in unchanged.items() if not same} == references
  assert all(result["params_finite_after"].values())
