"""The README's migration tables claim equivalences with peer libraries; check them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

# Finite (True) and overflowing (False) steps, with growths, back-offs and
# back-to-back overflows.
PATTERN = [True] * 9 + [False] + [True] * 7 + [False, False] + [True] * 8


def _our_trajectory(ls):
  scales = []
  for finite in PATTERN:
    ls = ls.adjust(finite)
    scales.append(float(ls()))
  return scales


def test_jmp_dynamic_loss_scale_has_the_same_trajectory():
  jmp = pytest.importorskip("jmp")
  theirs = jmp.DynamicLossScale(jnp.float32(2**15), period=3, factor=2)
  expected = []
  for finite in PATTERN:
    theirs = theirs.adjust(jnp.asarray(finite))
    expected.append(float(theirs.loss_scale))
  assert _our_trajectory(ols.DynamicLossScale(2**15, increment_period=3, multiplier=2)) == expected


def test_flax_dynamic_scale_matches_with_one_more_growth_step():
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  theirs = dynamic_scale.DynamicScale(growth_interval=3)
  expected = []
  for finite in PATTERN:
    factor = jnp.float32(1.0 if finite else jnp.inf)
    theirs, is_finite, _, _ = theirs.value_and_grad(lambda p, f=factor: p * f)(jnp.float32(1.0))
    assert bool(is_finite) == finite
    expected.append(float(theirs.scale))
  ours = ols.DynamicLossScale(
    2**16,
    increment_period=3 + 1,
    backoff_factor=0.5,
    min_loss_scale=float(jnp.finfo(jnp.float32).tiny),
  )
  assert _our_trajectory(ours) == expected


def test_pinned_dynamic_scale_skips_like_apply_if_finite():
  inner = optax.adam(0.1)
  theirs = optax.apply_if_finite(inner, max_consecutive_errors=10)
  ours = ols.loss_scale_optimizer(
    inner, ols.DynamicLossScale(1, min_loss_scale=1, max_loss_scale=1)
  )
  params = {"w": jnp.array([1.0, -2.0])}
  their_state, our_state = theirs.init(params), ours.init(params)
  for grad in ([0.5, 1.0], [np.nan, 1.0], [np.inf, 0.0], [-1.0, 2.0], [3.0, 0.25]):
    grads = {"w": jnp.array(grad)}
    their_updates, their_state = theirs.update(grads, their_state, params)
    our_updates, our_state = ours.update(grads, our_state, params)
    chex.assert_trees_all_equal(our_updates, their_updates)
    chex.assert_trees_all_equal(our_state.inner_state, their_state.inner_state)
    metrics = ols.metrics(our_state)
    assert metrics["loss_scale"] == 1.0
    assert bool(metrics["last_step_applied"]) == bool(their_state.last_finite)
    assert int(metrics["consecutive_skips"]) == int(their_state.notfinite_count)
    assert int(metrics["total_skips"]) == int(their_state.total_notfinite)
    params = jax.tree.map(jnp.add, params, our_updates)
