"""The overflow guard fires whatever part of the new state the caller returns.

The guard is a pure callback: a caller who drops the output it feeds would let
the compiler prune it. Each test below keeps a different subset of the outputs.
Results are blocked on inside `pytest.raises`: on a GPU the callback's error
surfaces at the next block.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols

PARAMS = {"w": jnp.ones(3)}
FINITE = {"w": jnp.ones(3)}
NAN = {"w": jnp.array([1.0, jnp.nan, 1.0])}
CALLBACK_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
MATCH = "OverflowGuardError"


def guarded():
  return ols.loss_scale_optimizer(optax.sgd(0.1), max_consecutive_skips=1)


def test_a_step_returning_params_scale_and_total_skips_still_raises():
  tx = guarded()

  @jax.jit
  def step(params, state, grads):
    params, state = ols.apply_gradients(tx, grads, state, params)
    return params, ols.get_loss_scale(state)(), state.total_skips  # no consecutive_skips

  _, state = tx.update(NAN, tx.init(PARAMS), PARAMS)  # one skip is tolerated
  jax.block_until_ready(step(PARAMS, state, FINITE))
  with pytest.raises(CALLBACK_ERRORS, match=MATCH):
    jax.block_until_ready(step(PARAMS, state, NAN))


@pytest.mark.parametrize("keep", ["loss_scale", "total_skips", "last_step_applied"])
def test_each_scalar_of_the_state_alone_keeps_the_guard(keep):
  tx = guarded()
  read = {
    "loss_scale": lambda s: ols.get_loss_scale(s)(),
    "total_skips": lambda s: s.total_skips,
    "last_step_applied": lambda s: s.last_step_applied,
  }[keep]
  step = jax.jit(lambda s, g: read(tx.update(g, s, PARAMS)[1]))
  _, state = tx.update(NAN, tx.init(PARAMS), PARAMS)
  with pytest.raises(CALLBACK_ERRORS, match=MATCH):
    jax.block_until_ready(step(state, NAN))


def test_scan_whose_final_carry_is_dropped_still_raises():
  tx = guarded()

  def body(carry, grads):
    params, state = carry
    params, state = ols.apply_gradients(tx, grads, state, params)
    return (params, state), params["w"][0]

  run = jax.jit(lambda state, grads: jax.lax.scan(body, (PARAMS, state), grads)[1])
  stacked = lambda *trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  jax.block_until_ready(run(tx.init(PARAMS), stacked(NAN, FINITE, NAN)))  # no streak of 2
  with pytest.raises(CALLBACK_ERRORS, match=MATCH):
    jax.block_until_ready(run(tx.init(PARAMS), stacked(FINITE, NAN, NAN)))


def test_jit_of_vmap_returning_only_the_scale_still_raises():
  tx = guarded()
  _, state = tx.update(NAN, tx.init(PARAMS), PARAMS)
  step = jax.jit(
    jax.vmap(lambda g: ols.get_loss_scale(tx.update(g, state, PARAMS)[1])(), in_axes=0)
  )
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), FINITE, NAN)
  with pytest.raises(CALLBACK_ERRORS, match=MATCH):
    jax.block_until_ready(step(stacked))


def test_the_folded_guard_leaves_the_state_values_unchanged():
  plain = ols.loss_scale_optimizer(optax.sgd(0.1))
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), max_consecutive_skips=5)
  for grads in (FINITE, NAN):
    want = jax.jit(plain.update)(grads, plain.init(PARAMS), PARAMS)
    got = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)
    jax.tree.map(
      lambda a, b: (a.dtype == b.dtype and bool(jnp.all(a == b))) or pytest.fail(f"{a} != {b}"),
      want,
      got,
    )


# -- skip_bad_steps: the same construction --------------------------------------


def skip_guarded():
  return ols.skip_bad_steps(optax.sgd(0.1), max_consecutive_skips=1)


@pytest.mark.parametrize("keep", ["total_skips", "nonfinite_skips", "last_step_applied"])
def test_skip_bad_steps_guard_fires_whichever_scalar_is_kept(keep):
  tx = skip_guarded()
  step = jax.jit(lambda s, g: getattr(tx.update(g, s, PARAMS)[1], keep))
  _, state = tx.update(NAN, tx.init(PARAMS), PARAMS)  # one skip is tolerated
  jax.block_until_ready(step(state, FINITE))
  with pytest.raises(CALLBACK_ERRORS, match=MATCH):
    jax.block_until_ready(step(state, NAN))


def test_skip_bad_steps_guard_leaves_the_state_values_unchanged():
  plain = ols.skip_bad_steps(optax.sgd(0.1), spike_threshold=3.0, warmup_steps=1)
  tx = ols.skip_bad_steps(
    optax.sgd(0.1), spike_threshold=3.0, warmup_steps=1, max_consecutive_skips=5
  )
  for grads in (FINITE, NAN):
    want = jax.jit(plain.update)(grads, plain.init(PARAMS), PARAMS)
    got = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)
    chex.assert_trees_all_equal_dtypes(want, got)
    chex.assert_trees_all_equal(want, got)  # NaN equals NaN: the NaN step's statistic


def test_folding_the_guard_keeps_every_bit_of_a_scalar_including_negative_zero():
  from optax_lossscale._src.diagnostics import overflow_guard

  zero = jnp.zeros((), jnp.int32)
  scalars = {"neg0": jnp.float32(-0.0), "nan": jnp.float32(jnp.nan), "i": jnp.int32(-3)}
  folded = jax.jit(overflow_guard.fold_into_scalars)(zero, scalars)
  for k, x in scalars.items():
    assert folded[k].dtype == x.dtype
    if k == "nan" and jax.default_backend() != "cpu":
      # GPU arithmetic returns its own canonical NaN bits; the value is NaN.
      assert bool(jnp.isnan(folded[k]))
      continue
    assert jnp.asarray(folded[k]).tobytes() == jnp.asarray(x).tobytes(), k
