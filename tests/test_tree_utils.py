"""Tests for all_finite, select_tree and axis-name handling."""

from __future__ import annotations

import chex
from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols


class AllFiniteTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_finite_and_nonfinite_trees(self):
    all_finite = self.variant(ols.all_finite)
    finite = {"a": jnp.ones((2, 3)), "b": [jnp.zeros(4, jnp.float16), None]}
    self.assertTrue(bool(all_finite(finite)))
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
      for bad in (jnp.nan, jnp.inf, -jnp.inf):
        tree = {"a": jnp.ones((2, 3)), "b": jnp.array([0.0, bad, 1.0], dtype)}
        self.assertFalse(bool(all_finite(tree)))

  @chex.variants(with_jit=True, without_jit=True)
  def test_result_is_a_bool_scalar(self):
    out = self.variant(ols.all_finite)({"a": jnp.ones(3)})
    chex.assert_shape(out, ())
    chex.assert_type(out, jnp.bool_)

  @chex.variants(with_jit=True, without_jit=True)
  def test_complex_leaves_are_checked(self):
    tree = [jnp.array([1 + 1j, complex(0, np.inf)], jnp.complex64)]
    self.assertFalse(bool(self.variant(ols.all_finite)(tree)))


# float16 and the 8-bit floats take the uint8-min check, the others a sum of
# x - x; both must agree with numpy on every input, extremes included.
CHECK_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]
_SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 1e-45, 3e38, -3e38, 65504.0, 448.0]
_check = jax.jit(ols.all_finite)


@settings(max_examples=60, deadline=None)
@given(
  dtype=st.sampled_from(CHECK_DTYPES),
  size=st.integers(1, 300),
  specials=st.lists(st.tuples(st.integers(0, 299), st.sampled_from(_SPECIALS)), max_size=4),
  seed=st.integers(0, 2**16),
)
def test_all_finite_matches_numpy_for_any_values(dtype, size, specials, seed):
  x = np.random.default_rng(seed).standard_normal(size).astype(np.float32) * 100
  for index, value in specials:
    x[index % size] = value
  # The cast is where a value overflows the narrow dtypes (e.g. 3e38 in float16).
  x = jnp.asarray(x).astype(dtype)
  expected = bool(np.all(np.isfinite(np.asarray(x).astype(np.float32))))
  assert bool(_check({"x": x, "y": jnp.ones(3)})) is expected
  assert bool(ols.all_finite([x])) is expected


@pytest.mark.parametrize("tree", [None, {}, [], (None, {"x": None}), {"i": jnp.arange(3)}])
def test_empty_none_and_integer_trees_are_finite(tree):
  assert bool(ols.all_finite(tree))


def test_float0_and_bool_leaves_are_ignored():
  tree = {"f0": np.zeros((3,), jax.dtypes.float0), "mask": jnp.array([True]), "w": jnp.ones(2)}
  assert bool(ols.all_finite(tree))


def test_axis_name_makes_shards_agree():
  # vmap with an axis name runs the same collectives as shard_map/pmap.
  shards = jnp.array([[1.0, 2.0], [1.0, jnp.nan], [3.0, 4.0]])
  local = jax.vmap(ols.all_finite)(shards)
  np.testing.assert_array_equal(local, [True, False, True])
  agreed = jax.vmap(lambda g: ols.all_finite(g, axis_name="batch"), axis_name="batch")(shards)
  np.testing.assert_array_equal(agreed, [False, False, False])


def test_axis_name_tuple():
  shards = jnp.ones((2, 3, 4)).at[1, 2, 0].set(jnp.inf)
  fn = lambda g: ols.all_finite(g, axis_name=("x", "y"))
  agreed = jax.vmap(jax.vmap(fn, axis_name="y"), axis_name="x")(shards)
  np.testing.assert_array_equal(agreed, np.zeros((2, 3), bool))
  only_y = jax.vmap(jax.vmap(lambda g: ols.all_finite(g, "y"), axis_name="y"), axis_name="x")
  np.testing.assert_array_equal(only_y(shards), [[True] * 3, [False] * 3])


@pytest.mark.parametrize("bad", [(), [], [["x"]]])
def test_invalid_axis_name(bad):
  with pytest.raises(TypeError, match="axis_name"):
    ols.all_finite({"a": jnp.ones(2)}, axis_name=bad)


class SelectTreeTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_selects_whole_trees(self):
    select = self.variant(ols.select_tree)
    a = {"w": jnp.ones(3), "n": None, "i": jnp.array([1, 2])}
    b = {"w": jnp.zeros(3), "n": None, "i": jnp.array([3, 4])}
    chex.assert_trees_all_equal(select(jnp.array(True), a, b), a)
    chex.assert_trees_all_equal(select(jnp.array(False), a, b), b)


def test_select_tree_rejects_mismatches():
  with pytest.raises(ValueError, match="same tree structure"):
    ols.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
  with pytest.raises(TypeError, match=r"\['a'\].*bfloat16"):
    ols.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)})
  with pytest.raises(TypeError, match="shape"):
    ols.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"a": jnp.ones(3)})
  with pytest.raises(TypeError, match="scalar bool"):
    ols.select_tree(jnp.array([True, False]), jnp.ones(2), jnp.ones(2))
  with pytest.raises(TypeError, match="scalar bool"):
    ols.select_tree(jnp.array(1), jnp.ones(2), jnp.ones(2))
