"""Tests for `optax_lossscale.value_and_grad` (core, no Flax)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols


def _loss(params, x, *, offset=0.0):
  # Small dyadic numbers only: every result is exact, so jit and eager agree bit for bit.
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - offset) ** 2)


def _params():
  return {"w": jnp.array([[0.5], [-1.25], [2.0]]), "b": jnp.array([0.25])}


X = jnp.array([[1.0, 2.0, -1.0], [0.5, -0.5, 3.0]])


class ValueAndGradTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_value_is_the_unscaled_loss_and_grads_are_of_the_scaled_loss(self):
    ls = ols.DynamicLossScale(initial_loss_scale=2.0**12)
    fn = self.variant(ols.value_and_grad(_loss))
    loss, grads = fn(ls, _params(), X, offset=0.5)
    # Independent expectation: jax.grad of loss * 2**12 (a power of two, so exact).
    expected_grads = jax.grad(lambda p: _loss(p, X, offset=0.5) * 2.0**12)(_params())
    chex.assert_trees_all_equal(loss, _loss(_params(), X, offset=0.5))
    chex.assert_trees_all_equal(grads, expected_grads)

  def test_value_is_exact_where_dividing_the_scaled_loss_would_not_be(self):
    # With a scale that is not a power of two, (loss * S) / S is not always the loss.
    ls = ols.FixedLossScale(3.0)
    values = np.float32(np.random.default_rng(0).uniform(0.1, 10.0, 64))
    inexact = [v for v in values if (v * np.float32(3.0)) / np.float32(3.0) != v]
    self.assertTrue(inexact)
    for v in inexact[:3]:
      loss, grads = ols.value_and_grad(lambda w, v=v: v * jnp.sum(w))(ls, jnp.ones(2))
      self.assertEqual(loss.dtype, jnp.float32)
      self.assertEqual(float(loss), float(v * np.float32(2.0)))
    # A float16 loss keeps its dtype and value; its scaled twin is float32.
    fun = lambda w: jnp.sum(w * w).astype(jnp.float16)
    w = jnp.array([100.0, 200.0], jnp.float32)
    loss, grads = ols.value_and_grad(fun)(ols.FixedLossScale(2.0**10), w)
    self.assertEqual(loss.dtype, jnp.float16)
    chex.assert_trees_all_equal(loss, fun(w))
    chex.assert_trees_all_equal(grads, 2.0**11 * w)

  @chex.variants(with_jit=True, without_jit=True)
  def test_has_aux_returns_the_aux_untouched(self):
    def fun(params, x):
      loss = _loss(params, x)
      return loss, {"loss_twice": 2 * loss, "pred": x @ params["w"]}

    ls = ols.FixedLossScale(64.0)
    (loss, aux), grads = self.variant(ols.value_and_grad(fun, has_aux=True))(ls, _params(), X)
    chex.assert_trees_all_equal(loss, _loss(_params(), X))
    chex.assert_trees_all_equal(aux, fun(_params(), X)[1])
    chex.assert_trees_all_equal(grads, jax.grad(lambda p: _loss(p, X) * 64.0)(_params()))

  def test_argnums_tuple(self):
    fun = lambda a, b: jnp.sum(a * b)
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -4.0])
    loss, (ga, gb) = ols.value_and_grad(fun, argnums=(0, 1))(ols.FixedLossScale(4.0), a, b)
    chex.assert_trees_all_equal(loss, fun(a, b))
    chex.assert_trees_all_equal(ga, 4.0 * b)
    chex.assert_trees_all_equal(gb, 4.0 * a)

  def test_accepts_an_optimizer_state_and_feeds_the_wrapper(self):
    tx = optax.chain(
      ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**5),
      optax.scale(1.0),
    )
    state = tx.init(_params())
    loss, grads = ols.value_and_grad(_loss)(state, _params(), X)
    updates, _ = tx.update(grads, state, _params())
    true_grads = jax.grad(_loss)(_params(), X)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -0.1 * g, true_grads), rtol=1e-6)
    chex.assert_trees_all_equal(loss, _loss(_params(), X))

  def test_noop_scale_is_plain_value_and_grad(self):
    loss, grads = ols.value_and_grad(_loss)(ols.NoOpLossScale(), _params(), X)
    expected_loss, expected_grads = jax.value_and_grad(_loss)(_params(), X)
    chex.assert_trees_all_equal((loss, grads), (expected_loss, expected_grads))

  def test_bad_arguments(self):
    with self.assertRaisesRegex(TypeError, "fun must be callable"):
      ols.value_and_grad(3.0)
    with self.assertRaisesRegex(TypeError, "has_aux must be True or False"):
      ols.value_and_grad(_loss, has_aux="yes")
    with self.assertRaisesRegex(TypeError, r"has_aux=True, fun must return a pair"):
      ols.value_and_grad(lambda p: jnp.sum(p), has_aux=True)(ols.NoOpLossScale(), jnp.ones(2))
    with self.assertRaisesRegex(ValueError, "No LossScaleOptimizerState"):
      ols.value_and_grad(_loss)({"not": "a state"}, _params(), X)


def test_scale_is_read_at_call_time_from_a_jitted_state():
  # The same traced function must follow the scale stored in the state it gets.
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0)
  state = tx.init(jnp.ones(2))
  fn = jax.jit(ols.value_and_grad(lambda w: jnp.sum(w)))
  _, grads_8 = fn(state, jnp.ones(2))
  _, bad_state = tx.update(jnp.array([np.inf, 1.0]), state)  # backs off to 4
  _, grads_4 = fn(bad_state, jnp.ones(2))
  np.testing.assert_array_equal(grads_8, [8.0, 8.0])
  np.testing.assert_array_equal(grads_4, [4.0, 4.0])


if __name__ == "__main__":
  pytest.main([__file__])
