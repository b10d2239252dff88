"""Every primitive the installed jax defines has an `autocast` rule, or is known never to reach it.

A new jax release adds primitives; a function that emits one runs it as
written under `autocast` with a warning (never in 16 bits), or fails with
`UnknownPrimitiveError` (`unknown_primitives='error'`). These tests find every
primitive the installed jax defines (in a subprocess: jax, its public modules, every
`jax.experimental` module importable without extra dependencies, Pallas
included, then every `jax.extend.core.Primitive` held by a module whose name
starts with `jax`), so that CI meets a new primitive before a user does.

Two lists stand beside the table of rules:

- `KERNEL_ONLY`: primitives that exist only inside the body of a Pallas
  (Mosaic TPU, Mosaic GPU, Triton) kernel. A kernel is the jaxpr of a
  `pallas_call`, which `autocast` binds as written and never interprets, so
  they never reach it.
- `KNOWN_MISSING`: primitives that can reach `autocast` and have no rule yet
  (recorded on jax 0.7.1 and 0.10.2). Each is a strict xfail of
  `test_known_missing_primitive_has_a_rule`: give it a rule (or move it to
  `KERNEL_ONLY` with a reason) and delete it here.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import optax_lossscale as ols
from optax_lossscale._src.autocast import rules as autocast_rules
from tests import child_xla_flags

# Modules that hold only the primitives of a kernel's body.
KERNEL_MODULES = (
  "jax._src.pallas.primitives", "jax._src.pallas.mosaic.primitives",
  "jax._src.pallas.mosaic.sc_primitives", "jax._src.pallas.mosaic.pipeline",
  "jax._src.pallas.mosaic.interpret", "jax._src.pallas.mosaic.verification",
  "jax._src.pallas.mosaic_gpu.primitives", "jax._src.pallas.mosaic_gpu.core",
  "jax._src.pallas.mosaic_gpu.lowering", "jax._src.pallas.triton.primitives",
  "jax._src.pallas.einshape",
)  # fmt: skip

# Pallas, Mosaic and Triton kernel-body primitives (loads, stores, DMAs, semaphores, barriers,
# program ids, in-kernel PRNG, MMA units, FIFOs, reductions across lanes): only inside a
# pallas_call's kernel jaxpr. Some were renamed in jax 0.11 and 0.12 (`debug_barrier_p` to
# `debug_barrier`), so both names stand here.
KERNEL_ONLY = frozenset({
  "_copysign", "add_dependency", "all_reduce_ffs", "all_reduce_population_count",
  "assume_for_verification", "async_copy_scales_to_tmem", "async_copy_smem_to_tmem",
  "async_copy_sparse_metadata_to_tmem", "async_load", "async_prefetch", "async_store_smem",
  "async_store_tmem", "atomic_cas", "atomic_rmw", "barrier", "barrier_arrive",
  "barrier_arrive_and_wait", "barrier_test", "barrier_wait", "bitcast", "commit_group",
  "commit_smem", "commit_tmem", "conv", "copy_gmem_to_smem", "copy_smem_to_gmem", "debug_barrier",
  "debug_barrier_p", "delay", "dma_start", "dma_wait", "einshape_lo", "elementwise_inline_asm",
  "elementwise_inline_asm_p", "emit_pipeline", "get_barrier_semaphore", "get_global",
  "griddepcontrol_launch_dependents", "griddepcontrol_wait", "has_memory_space", "inline_mgpu",
  "inline_mgpu_p", "jaxpr_call", "layout_cast", "load", "masked_cummax", "masked_cummin",
  "masked_cumsum", "masked_load", "masked_sort", "masked_swap", "matmul_acc_lhs",
  "matmul_lhs_fifo", "matmul_pop", "matmul_pop_fifo", "matmul_push_rhs", "max_contiguous",
  "mgpu_atomic_store", "mma", "mosaic_gpu_reduce_max", "mosaic_gpu_reduce_min",
  "mosaic_gpu_reduce_prod", "mosaic_gpu_reduce_sum", "multimem_load_reduce", "multimem_store",
  "multiple_of", "num_programs", "pack", "pack_elementwise", "parallel_loop", "pipeline_body",
  "pretend_for_verification", "print_layout", "prng_join", "prng_random_bits", "prng_seed",
  "prng_split", "program_id", "query_cluster_cancel", "reciprocal", "remove_memory_space",
  "repeat", "roll", "run_scoped", "sc_fetch_and_add", "scan_count", "semaphore_read",
  "semaphore_signal", "semaphore_signal_multicast", "semaphore_signal_parallel", "semaphore_wait",
  "set_max_registers", "set_max_registers_p", "stochastic_round", "store", "tcgen05_commit_arrive",
  "tcgen05_mma", "trace_value", "try_cluster_cancel", "unique", "unpack", "unpack_elementwise",
  "wait_gmem_to_smem", "wait_load_tmem", "wait_smem_to_gmem", "wgmma", "wgmma_accumulator_deref",
  "wgmma_accumulator_deref_p", "wgmma_accumulator_store", "wgmma_accumulator_store_p", "wgmma_ref",
  "wgmma_wait",
})  # fmt: skip

# Primitives with no rule yet: the work queue. Delete a name when its rule lands.
KNOWN_MISSING: frozenset[str] = frozenset()  # fmt: skip

_ENUMERATE = textwrap.dedent(
  """
  import importlib, json, pkgutil, sys, warnings
  warnings.simplefilter("ignore")
  import jax, jax.numpy, jax.scipy, jax.lax, jax.lax.linalg, jax.random, jax.nn, jax.experimental
  for info in pkgutil.walk_packages(jax.experimental.__path__, "jax.experimental.",
                                    onerror=lambda name: None):
    try:
      importlib.import_module(info.name)
    except Exception:  # needs an optional dependency (TensorFlow, flatbuffers, a GPU build)
      pass
  from jax.extend.core import Primitive
  found = {}
  for name, module in list(sys.modules.items()):
    if not name.startswith("jax") or module is None:
      continue
    for value in list(vars(module).values()):
      items = [value]
      if isinstance(value, dict):
        items = [*value, *value.values()]
      elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
      for item in items:
        if isinstance(item, Primitive):
          where = name if item is value else name + ":table"
          found.setdefault(item.name, set()).add(where)
  print(json.dumps({k: sorted(v) for k, v in found.items()}))
  """
)


@pytest.fixture(scope="module")
def defined():
  """`{primitive name: [modules holding it]}` of the installed jax (":table": in a dict, list)."""
  env = {**os.environ, "XLA_FLAGS": child_xla_flags(), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", _ENUMERATE], capture_output=True, text=True, env=env, timeout=300,
    check=True,
  )  # fmt: skip
  return json.loads(out.stdout.strip().splitlines()[-1])


def _homes(modules):
  return {m for m in modules if not m.endswith(":table")}


def test_the_walk_finds_the_primitives_of_everyday_code(defined):
  jit_name = "jit" if "jit" in defined else "pjit"
  for name in ("dot_general", "while", "scan", "cond", jit_name, "random_bits", "custom_jvp_call",
               "reduce_sum", "conv_general_dilated", "sort"):  # fmt: skip
    assert name in defined, name
  assert len(defined) > 250


def test_every_primitive_jax_defines_has_a_rule(defined):
  unexplained = {
    name: sorted(_homes(mods) or mods)
    for name, mods in defined.items()
    if name not in autocast_rules.RULES and name not in KERNEL_ONLY and name not in KNOWN_MISSING
  }
  assert not unexplained, (
    f"jax {jax.__version__} defines primitives autocast has no rule for (give each a rule in"
    " autocast_rules, or list it in KERNEL_ONLY with its reason):\n"
    + "\n".join(f"  {name}: {mods}" for name, mods in sorted(unexplained.items()))
  )


def test_kernel_only_primitives_are_only_held_by_kernel_modules(defined):
  # A name shared with a primitive of ordinary code (state's `get`, `swap`) needs a rule.
  outside = {
    name: sorted(_homes(mods))
    for name, mods in defined.items()
    if name in KERNEL_ONLY and not all(m.startswith(KERNEL_MODULES) for m in _homes(mods))
  }
  assert not outside, outside
  assert not KERNEL_ONLY & KNOWN_MISSING
  assert not KERNEL_ONLY & set(autocast_rules.RULES), KERNEL_ONLY & set(autocast_rules.RULES)


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"no autocast rule for {n!r} yet"))
    for n in sorted(KNOWN_MISSING)
  ],
)
def test_known_missing_primitive_has_a_rule(name):
  assert name in autocast_rules.RULES


def _unknown_primitive_message():
  halve_p = jax.extend.core.Primitive("ols_test_halve")
  halve_p.def_impl(lambda x: x / 2)
  halve_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  fn = lambda w, x: jnp.sum(halve_p.bind(x @ w))
  with pytest.raises(ols.UnknownPrimitiveError) as info:
    ols.autocast(fn, "p=f32,c=f16,o=f32", unknown_primitives="error")(jnp.eye(2), jnp.ones((2, 2)))
  return str(info.value)


def test_the_unknown_primitive_error_names_the_rule_that_keeps_16_bit_work_in_16_bits():
  # Today the message suggests only 'as_written', which runs the primitive on the float32 the
  # function declares: silently float32. It must offer 'widest' too, and say that 'widest' is
  # the one that keeps 16-bit work in 16 bits (as_written: right for typed kernels).
  message = _unknown_primitive_message()
  assert "'ols_test_halve'" in message
  assert "'widest'" in message and "'as_written'" in message
  clauses = re.split(r"[.;:(]\s", message)
  keeps = [c for c in clauses if "'widest'" in c and re.search(r"16[- ]bit", c)]
  assert keeps, f"no clause says that 'widest' keeps 16-bit work in 16 bits: {message!r}"
