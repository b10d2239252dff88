"""storage/schedule.py: identities bit for bit, and the bytes XLA:CPU's program then moves.

The bytes are XLA's cost analysis of the compiled update (4 matrices of
1024 x 1024 bfloat16 parameters, one Adam step, the parameters and the state
donated in the order of the outputs), against the minimum: every input read
once (gradients, parameters, state) and every output written once. They hold
on the CPU backend only (XLA:GPU fuses several outputs into one kernel, and
the hints are not applied there) and were measured with the XLA of jax 0.10;
elsewhere the test skips.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import hlo_stats
import optax_lossscale as ols
from optax_lossscale._src.storage import schedule
from tests.autocast_helpers import depends_on

BF16 = jnp.bfloat16


def _every_pattern(dtype):
  bits = np.arange(2**16, dtype=np.uint32)
  if np.dtype(dtype) == np.int32:
    return (bits * np.uint32(0x10001)).view(np.int32)
  if np.dtype(dtype).itemsize == 2:
    return bits.astype(np.uint16).view(dtype)
  # float32: every high half over a few low halves, and every low half under a few highs.
  low = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF], np.uint32)
  high = np.array([0, 0x3F80, 0x7F80, 0x7FC0, 0x8000, 0xFF80], np.uint32)
  both = np.concatenate([(bits[:, None] << 16 | low).ravel(), (high[:, None] << 16 | bits).ravel()])
  return both.view(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, np.int16, np.uint16, np.int32])
def test_materialized_and_after_are_the_identity_bit_for_bit(dtype):
  x = jnp.asarray(_every_pattern(dtype))
  kind = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
  same = lambda a, b: np.testing.assert_array_equal(
    np.asarray(a).view(kind), np.asarray(b).view(kind)
  )
  same(jax.jit(schedule.materialized)(x), x)
  dep = [jnp.asarray(_every_pattern(BF16))[::-1]]  # first element 0xFFFF: a NaN
  state = {"x": x, "count": jnp.int32(7), "flag": jnp.bool_(True)}
  out = jax.jit(schedule.after)(state, dep)
  same(out["x"], x)
  assert int(out["count"]) == 7 and bool(out["flag"])
  same(schedule.after(state, dep)["x"], x)  # eagerly too
  whole = jax.jit(schedule.after_whole)(state, dep, jnp.uint32(0xFFFFFFFF))
  same(whole["x"], x)
  assert int(whole["count"]) == 7 and bool(whole["flag"])
  same(schedule.after_whole(state, dep, 3)["x"], x)


@settings(max_examples=200, deadline=None)
@given(
  sizes=st.lists(st.integers(0, 40), max_size=30),  # an empty leaf too
  window=st.integers(1, 100),
)
def test_waits_for_the_latest_leaf_a_window_of_elements_before(sizes, window):
  # Checked against its definition: leaf i waits for the latest j whose leaves j to
  # i - 1 hold at least `window` elements; for none where all before it hold fewer.
  out = schedule.waits(sizes, window)
  assert len(out) == len(sizes)
  for i, j in enumerate(out):
    if sum(sizes[:i]) < window:
      assert j is None
    else:
      assert j is not None and 0 <= j < i
      assert sum(sizes[j:i]) >= window > sum(sizes[j + 1 : i])


def test_waits_chains_leaves_as_large_as_the_window():
  assert schedule.waits([2**20] * 4) == [None, 0, 1, 2]
  assert schedule.waits([schedule.WINDOW // 4] * 6) == [None] * 4 + [0, 1]
  assert schedule.waits([]) == []
  with pytest.raises(ValueError, match="positive"):
    schedule.waits([4, 4], window=0)  # (0 would have a leaf wait for itself)


def test_the_remainder_of_small_leaves_waits_a_window_of_elements():
  # Each leaf's new master (the buffer both halves read) waits for an earlier leaf's
  # remainder, so that their temporaries are reused: the leaf before for a leaf as large
  # as the window, a window of elements before for small ones (a chain of small loops
  # ran on one core of XLA:CPU). In the jaxpr, on every backend (a platform_dependent
  # branch).
  tx = ols.master_weights(optax.adam(1e-3), store="remainder")
  side = int(np.sqrt(schedule.WINDOW // 4))
  params = {f"w{i}": jnp.full((side, side), 0.5 + i, BF16) for i in range(6)}
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(params, state, params)
  new_params, new_state = jax.tree.unflatten(
    jax.tree.structure((params, state)), jaxpr.jaxpr.outvars
  )
  remainder = new_state.master
  waits_for = lambda i, j: depends_on(jaxpr, new_params[f"w{i}"], remainder[f"w{j}"])
  assert waits_for(4, 0) and waits_for(5, 1)
  assert not any(waits_for(i, j) for i in range(4) for j in range(4) if i != j)
  assert not waits_for(4, 1) and not waits_for(5, 0) and not waits_for(5, 4)


def _compiled(tx, grads_dtype=BF16):
  base = jnp.linspace(-1.0, 1.0, 1024 * 1024, dtype=jnp.float32).reshape(1024, 1024)
  params = {f"w{i}": (base * (i + 1)).astype(BF16) for i in range(4)}
  grads = {
    k: (jnp.cos(v.astype(jnp.float32) * 37.0) * 1e-2).astype(grads_dtype) for k, v in params.items()
  }
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: ols.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
  return step.lower(params, state, grads).compile(), params, state, grads


def _bytes(tx, grads_dtype=BF16):
  return _bytes_of(*_compiled(tx, grads_dtype))


def _bytes_of(compiled, params, state, grads):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  minimum = 2 * nbytes(params) + 2 * nbytes(state) + nbytes(grads)
  # Full-size copies: a donated buffer that some loop still reads after another wrote it.
  copies = re.findall(r"= \w+\[1024,1024\]\{[0-9,]*\} copy\(", compiled.as_text())
  return cost["bytes accessed"] / minimum, len(copies)


cpu_only = pytest.mark.skipif(
  jax.default_backend() != "cpu" or tuple(map(int, jax.__version__.split(".")[:2])) < (0, 10),
  reason="bytes of XLA:CPU's program (fusion per output, copies of donated buffers), measured"
  " with the XLA of jax 0.10",
)


@cpu_only
def test_on_cpu_the_remainder_moves_at_most_twice_the_minimum():
  # Minimum 26 B/param (gradient 2, parameter 2 + 2, remainder 2 + 2, moments 8 + 8);
  # before storage/schedule.py, 58 (x2.23: the update materialized and read twice, the
  # donated parameters copied); now 48 (x1.85): the moments' loops, the new master
  # computed once into a buffer, and from it the parameter and the remainder.
  ratio, copies = _bytes(ols.master_weights(optax.adam(1e-3), store="remainder"))
  assert copies == 0
  assert ratio <= 2.0


@cpu_only
def test_on_cpu_the_remainder_holds_one_leafs_master_at_a_time():
  # Each leaf's new master is computed into a buffer of 4 B/param, which its parameter
  # and remainder read; the next leaf's waits for this leaf's remainder, so XLA reuses
  # one buffer: 4 MiB here, where it held all four at once before (16 MiB; at 16M
  # parameters, 64 MiB that the allocator faulted in afresh every step, x1.96 the time).
  compiled = _compiled(ols.master_weights(optax.adam(1e-3), store="remainder"))[0]
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert 4 * 1024 * 1024 <= temp < 5 * 1024 * 1024


@cpu_only
def test_on_cpu_stochastic_rounding_writes_no_copy_of_the_moments():
  # Minimum 14 B/param (gradient, parameter and the two bfloat16 moments read, three
  # written); before, 30 (x2.14: both moments copied before their loops overwrote them,
  # since the parameter's loop still read the old ones); now the parameter's loop (10),
  # then the moments' (6 each), and four one-element reads that order them, which XLA's
  # cost analysis counts as the whole array read (2 more): 24, x1.71.
  ratio, copies = _bytes(ols.stochastic_rounding(optax.adam(1e-3), key=0))
  assert copies == 0
  assert ratio <= 1.75


@cpu_only
@pytest.mark.parametrize("store, bound, masters", [("remainder", 2.7, 0), ("copy", 1.8, 4)])
def test_on_cpu_master_weights_over_8_bit_moments_writes_no_float32_gradient(store, bound, masters):
  # Minimum 14.06 B/param with the remainder (gradient 2, parameter 2 + 2, remainder
  # 2 + 2, codes 2 + 2, block scales), 18.06 with the float32 copy. The 8-bit codes
  # wait for what alone reads the old state, the new master (the copy, or the
  # remainder split from it), not for the bfloat16 parameters written from it: 36.7
  # (x2.61) and 30.7 (x1.70) on jax 0.10 and 0.12. Before, 40.7 and 34.7 on jax 0.10,
  # and 78.7 and 72.7 on jax 0.12, whose XLA:CPU wrote the float32 conversion of the
  # gradient out in full (it went through an optimization barrier) and counted the
  # masters' buffers whole in each loop of codes.
  inner = ols.state_dtypes(optax.adam(1e-3), {"mu": "q8", "nu": "q8"})
  tx = ols.master_weights(inner, store=store)
  compiled = _compiled(tx)
  ratio, copies = _bytes_of(*compiled)
  assert copies == 0
  assert ratio <= bound
  entry = compiled[0].as_text().split("ENTRY")[1]
  wide = [
    line for line in entry.splitlines() if "= f32[1024,1024]" in line and " parameter(" not in line
  ]
  assert len(wide) == masters, wide


@cpu_only
@pytest.mark.parametrize("how", ["after", "after_whole"])
def test_on_cpu_after_whole_waits_for_a_loop_that_after_would_repeat(how):
  # An 8-bit array overwritten in place by a cheap loop (as state_dtypes' codes), and
  # a parameter whose loop must come after it. `after` reads one element of the new
  # codes, which XLA computes on its own inside the parameter's loop (from the old
  # codes): nothing orders the two. `after_whole` reads it through a conditional.
  def step(p0, p1, c0, g):
    new_p0 = p0 + g / (1.0 + c0.astype(jnp.float32))  # reads the old codes
    new_c0 = (c0.astype(jnp.float32) * 0.5 + jnp.abs(g)).astype(jnp.uint8)
    new_c0 = schedule.after(new_c0, [new_p0])
    wait = getattr(schedule, how)
    args = (g, [new_c0], g[0, 0]) if how == "after_whole" else (g, [new_c0])
    new_p1 = p1 - wait(*args)
    return new_p0, new_p1, new_c0

  shape = (256, 512)
  args = (jnp.ones(shape), jnp.ones(shape), jnp.ones(shape, jnp.uint8), jnp.full(shape, 0.25))
  compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(*args).compile()
  text = compiled.as_text()
  copies = re.findall(r"\[256,512\]\{[0-9,]*\} copy\(", text)
  p0, p1, c0 = hlo_stats.output_positions(text)
  assert p0 < c0  # `after`, on a loop holding a division: it orders
  if how == "after_whole":
    assert c0 < p1 and not copies
  else:  # XLA's fact, which after_whole exists for: the old codes copied, or read first
    assert copies or p1 < c0
  out = jax.jit(step)(*args)
  np.testing.assert_array_equal(np.asarray(out[1]), np.full(shape, 0.75, np.float32))
