"""state_dtypes: an optimizer's state stored in chosen dtypes, leaf kind by leaf kind."""

from __future__ import annotations

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from tests import assert_trees_equal_across_programs

BF16 = jnp.bfloat16


def params_of(dtype=jnp.float32):
  return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4).astype(dtype), "b": jnp.ones(4, dtype)}


def grads_at(step, dtype=jnp.float32):
  return {
    "w": (jnp.cos(jnp.arange(12.0) + step) * 1e-2).reshape(3, 4).astype(dtype),
    "b": (jnp.sin(jnp.arange(4.0) + step) * 1e-3).astype(dtype),
  }


def dtypes_of(state):
  return jax.tree.map(lambda x: jnp.result_type(x), state)


def hand_written(inner, storage, params, steps):
  """`inner` with its state cast by hand: up to float32 before, down after each update."""
  state = inner.init(params)
  store = lambda s: jax.tree_util.tree_map_with_path(
    lambda path, x: x.astype(storage(path)) if storage(path) else x, s
  )
  state = store(state)
  history = []
  for step in range(steps):
    up = jax.tree_util.tree_map_with_path(
      lambda path, x: x.astype(jnp.float32) if storage(path) else x, state
    )
    updates, state = jax.jit(inner.update)(grads_at(step, params["w"].dtype), up, params)
    state = store(state)
    params = optax.apply_updates(params, updates)
    history.append((params, state))
  return history


def by_field(names):
  def storage(path):
    for key in path:
      if getattr(key, "name", None) in names:
        return names[key.name]
    return None

  return storage


class StateDtypesTest(parameterized.TestCase):
  @parameterized.parameters(jnp.float32, BF16)
  def test_adam_first_moment_in_bfloat16_second_in_float32(self, param_dtype):
    choice = {"mu": BF16, "nu": jnp.float32}
    tx = ols.state_dtypes(optax.adam(1e-2), choice)
    params = params_of(param_dtype)
    state = tx.init(params)
    self.assertEqual(state[0].mu["w"].dtype, BF16)
    self.assertEqual(state[0].nu["w"].dtype, jnp.float32)
    self.assertEqual(state[0].count.dtype, jnp.int32)
    expected = hand_written(optax.adam(1e-2), by_field(choice), params, 5)
    update = jax.jit(tx.update)
    for step, (ref_params, ref_state) in enumerate(expected):
      updates, state = update(grads_at(step, param_dtype), state, params)
      params = optax.apply_updates(params, updates)
      # Two programs: bit for bit on CPU (see assert_trees_equal_across_programs).
      assert_trees_equal_across_programs(state, ref_state)
      chex.assert_trees_all_equal_dtypes(state, ref_state)
      assert_trees_equal_across_programs(params, ref_params)

  def test_close_to_float32_state_and_the_dtypes_hold_in_scan(self):
    tx = ols.state_dtypes(optax.adam(1e-2), {"mu": BF16})
    bare = optax.adam(1e-2)

    def run(tx):
      def body(carry, step):
        params, state = carry
        updates, state = tx.update(grads_at(step), state, params)
        return (optax.apply_updates(params, updates), state), None

      params = params_of()
      return jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(20)))((params, tx.init(params)))[0]

    (ours, state), (reference, _) = run(tx), run(bare)
    self.assertEqual(state[0].mu["w"].dtype, BF16)
    chex.assert_trees_all_close(ours, reference, atol=2e-3)
    self.assertFalse(bool(jnp.all(ours["w"] == reference["w"])))  # it is another run

  def test_one_dtype_for_every_floating_leaf_of_any_optimizer(self):
    for inner in (optax.sgd(0.1, momentum=0.9), optax.lion(1e-3), optax.adafactor(1e-2)):
      tx = ols.state_dtypes(inner, BF16)
      params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
      state = tx.init(params)
      _, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
      for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
          self.assertEqual(leaf.dtype, BF16)
        else:
          self.assertIn(leaf.dtype, (jnp.int32, jnp.uint32))

  def test_a_function_chooses_by_path_and_leaf(self):
    pick = lambda path, leaf: BF16 if leaf.ndim == 2 else None
    tx = ols.state_dtypes(optax.adam(1e-2), pick)
    state = tx.init(params_of())
    self.assertEqual((state[0].mu["w"].dtype, state[0].mu["b"].dtype), (BF16, jnp.float32))

  def test_a_named_chain_part_by_its_name(self):
    inner = optax.named_chain(("momentum", optax.trace(0.9)), ("adam", optax.scale_by_adam()))
    state = ols.state_dtypes(inner, {"momentum": BF16}).init(params_of())
    self.assertEqual(state["momentum"].trace["w"].dtype, BF16)
    self.assertEqual(state["adam"].mu["w"].dtype, jnp.float32)

  def test_inside_master_weights_the_master_moments_are_stored_narrow(self):
    tx = ols.master_weights(ols.state_dtypes(optax.adam(1e-3), {"mu": BF16}))
    params = params_of(BF16)
    state = tx.init(params)
    self.assertEqual(state.inner_state[0].mu["w"].dtype, BF16)
    self.assertEqual(state.inner_state[0].nu["w"].dtype, jnp.float32)
    bytes_of = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    n = sum(x.size for x in jax.tree.leaves(params))
    # params 2 + master 4 + mu 2 + nu 4 bytes per parameter, and Adam's count.
    self.assertEqual(bytes_of(params) + bytes_of(state), 12 * n + 4)
    params, state = ols.apply_gradients(tx, grads_at(0, BF16), state, params)
    self.assertEqual(state.inner_state[0].mu["w"].dtype, BF16)

  def test_a_skipped_step_leaves_the_stored_state(self):
    tx = ols.loss_scale_optimizer(ols.state_dtypes(optax.adam(1e-2), {"mu": BF16}))
    params = params_of()
    state = tx.init(params)
    params, state = ols.apply_gradients(tx, grads_at(0), state, params)
    poisoned = {**grads_at(1), "b": jnp.full(4, jnp.nan)}
    new_params, new_state = ols.apply_gradients(tx, poisoned, state, params)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    chex.assert_trees_all_equal_dtypes(new_state.inner_state, state.inner_state)


class ErrorTest(parameterized.TestCase):
  @parameterized.parameters(
    (jnp.int8, r"dtypes must be a floating dtype"),
    (None, r"dtypes must be a floating dtype .* or a function"),
    ({}, r"got an empty mapping"),
    ({"mu": jnp.int32}, r"dtypes\['mu'\] must be a floating dtype"),
    ({0: BF16}, r"got the key 0, not a name"),
    ("no such dtype", r"dtypes must be"),
  )
  def test_dtypes_are_checked_when_built(self, dtypes, message):
    with self.assertRaisesRegex(ValueError, message):
      ols.state_dtypes(optax.adam(1e-3), dtypes)

  def test_a_name_that_matches_no_floating_leaf_is_refused_at_init(self):
    tx = ols.state_dtypes(optax.adam(1e-3), {"m": BF16, "nu": jnp.float32})
    with self.assertRaisesRegex(ValueError, r"named 'm'; the names .* \['b', 'mu', 'nu', 'w'\]"):
      tx.init(params_of())
    with self.assertRaisesRegex(ValueError, r"named 'count'"):  # an integer leaf: not cast
      ols.state_dtypes(optax.adam(1e-3), {"count": jnp.float32}).init(params_of())

  def test_a_function_returning_no_dtype_is_refused(self):
    tx = ols.state_dtypes(optax.adam(1e-3), lambda path, leaf: "nope")
    with self.assertRaisesRegex(ValueError, r"the dtype dtypes returned must be a floating dtype"):
      tx.init(params_of())

  def test_inner_must_be_a_transformation(self):
    with self.assertRaisesRegex(TypeError, r"inner must be an optax.GradientTransformation"):
      ols.state_dtypes(lambda p: p, BF16)


def test_optax_mu_dtype_covers_only_adams_first_moment():
  # The comparison the docs make: optax's own option sets mu; ours sets any leaf.
  state = optax.adam(1e-3, mu_dtype=BF16).init(params_of())
  assert (state[0].mu["w"].dtype, state[0].nu["w"].dtype) == (BF16, jnp.float32)
  state = ols.state_dtypes(optax.adam(1e-3), {"nu": BF16}).init(params_of())
  assert (state[0].mu["w"].dtype, state[0].nu["w"].dtype) == (jnp.float32, BF16)
  np.testing.assert_array_equal(state[0].nu["w"], np.zeros((3, 4)))
