"""The README's migration tables, row by row, against the peers themselves.

jmp, Flax and optax run where they are installed (`pytest.importorskip`).
TensorFlow, Keras and PyTorch are not installed in the test environment: their
rows are checked against the rules their documentation states, written down
independently in `tests/reference_models` and `tests/test_peer_semantics`.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests import reference_models

# Finite (True) and overflowing (False) steps, with growths, back-offs and
# back-to-back overflows.
PATTERN = [True] * 9 + [False] + [True] * 7 + [False, False] + [True] * 8
TINY = float(jnp.finfo(jnp.float32).tiny)


def _our_trajectory(ls, pattern=PATTERN):
  scales = []
  for finite in pattern:
    ls = ls.adjust(finite)
    scales.append(float(ls()))
  return scales


def _grad_sequence(seed=0, n=12, bad=(2, 5, 6, 9)):
  """Gradients with NaN/Inf injected at the `bad` steps."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    g = rng.standard_normal(3).astype(np.float32)
    if i in bad:
      g[i % 3] = np.inf if i % 2 else np.nan
    out.append({"w": jnp.asarray(g)})
  return out


# -- From jmp.


def test_jmp_row_dynamic_loss_scale_has_the_same_trajectory():
  jmp = pytest.importorskip("jmp")
  theirs = jmp.DynamicLossScale(jnp.float32(2**15), period=3, factor=2)
  expected = []
  for finite in PATTERN:
    theirs = theirs.adjust(jnp.asarray(finite))
    expected.append(float(theirs.loss_scale))
  assert _our_trajectory(ols.DynamicLossScale(2**15, increment_period=3, multiplier=2)) == expected


def test_jmp_row_static_and_noop_scales_scale_and_unscale_alike():
  jmp = pytest.importorskip("jmp")
  tree = {"f32": jnp.float32(0.75), "f16": jnp.float16(3.0)}
  for theirs, ours in (
    (jmp.StaticLossScale(jnp.float32(128)), ols.FixedLossScale(128)),
    (jmp.NoOpLossScale(), ols.NoOpLossScale()),
  ):
    for a, b in (
      (ours.scale(tree), theirs.scale(tree)),
      (ours.unscale(tree), theirs.unscale(tree)),
    ):
      for name in tree:
        assert float(a[name]) == float(b[name]), name
    assert a["f32"].dtype == b["f32"].dtype
    assert float(ours.scale(jnp.float16(2.0))) == float(theirs.scale(jnp.float16(2.0)))


def test_jmp_row_min_loss_scale_survives_jit_where_jmps_does_not():
  jmp = pytest.importorskip("jmp")
  theirs = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(4.0))
  ours = ols.DynamicLossScale(4.0, min_loss_scale=4.0)
  theirs = jax.jit(lambda ls: ls)(theirs)
  ours = jax.jit(lambda ls: ls)(ours)
  assert float(theirs.min_loss_scale) == 1.0  # what the row warns about
  assert ours.min_loss_scale == 4.0
  assert float(ours.adjust(False)()) == 4.0


def test_jmp_row_the_recipe_and_the_wrapper_give_the_same_steps():
  jmp = pytest.importorskip("jmp")
  inner = optax.adam(0.1)
  params = {"w": jnp.array([1.0, -2.0, 0.5])}
  tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(2.0**10, increment_period=3))
  ours_params, ours_state = params, tx.init(params)
  their_params, their_opt, their_ls = (
    params,
    inner.init(params),
    jmp.DynamicLossScale(jnp.float32(2.0**10), period=3),
  )
  for grads in _grad_sequence():
    our_scale, their_scale = ols.get_loss_scale(ours_state)(), their_ls.loss_scale
    scaled_ours = jax.tree.map(lambda g, s=our_scale: g * s, grads)
    scaled_theirs = jax.tree.map(lambda g, s=their_scale: g * s, grads)
    _, their_ls, their_params, their_opt = reference_models.jmp_recipe_step(
      jmp, inner, their_ls, scaled_theirs, their_params, their_opt
    )
    # Ours.
    updates, ours_state = tx.update(scaled_ours, ours_state, ours_params)
    ours_params = optax.apply_updates(ours_params, updates)
    chex.assert_trees_all_close(ours_params, their_params, rtol=1e-6)
    chex.assert_trees_all_close(ours_state.inner_state, their_opt, rtol=1e-6)
    assert float(ols.get_loss_scale(ours_state)()) == float(their_ls.loss_scale)


def test_jmp_row_all_finite_and_select_tree_agree_on_plain_trees():
  jmp = pytest.importorskip("jmp")
  trees = [
    {"a": jnp.ones(3), "b": jnp.float16(2.0)},
    {"a": jnp.array([1.0, np.nan]), "b": jnp.float16(2.0)},
    {"a": jnp.ones(3), "b": jnp.float16(np.inf)},
  ]
  for tree in trees:
    assert bool(ols.all_finite(tree)) == bool(jmp.all_finite(tree))
  for pred in (True, False):
    chex.assert_trees_all_equal(
      ols.select_tree(jnp.asarray(pred), trees[0], trees[2]),
      jmp.select_tree(jnp.asarray(pred), trees[0], trees[2]),
    )


# -- From Flax's DynamicScale.


def _flax_dynamic_scale():
  return pytest.importorskip("flax.training.dynamic_scale")


def test_flax_row_dynamic_scale_matches_with_one_more_growth_step():
  dynamic_scale = _flax_dynamic_scale()
  theirs = dynamic_scale.DynamicScale(growth_interval=3)
  expected = []
  for finite in PATTERN:
    factor = jnp.float32(1.0 if finite else jnp.inf)
    theirs, is_finite, _, _ = theirs.value_and_grad(lambda p, f=factor: p * f)(jnp.float32(1.0))
    assert bool(is_finite) == finite
    expected.append(float(theirs.scale))
  ours = ols.DynamicLossScale(
    2**16, increment_period=3 + 1, backoff_factor=0.5, min_loss_scale=TINY
  )
  assert _our_trajectory(ours) == expected


def test_flax_rows_value_and_grad_and_apply_gradients_train_alike():
  """Flax's recipe (DynamicScale + where over state) against our TrainState, step by step."""
  _flax_dynamic_scale()
  from flax.training import dynamic_scale, train_state

  from optax_lossscale.flax import TrainState

  def loss_fn(p, x):
    return jnp.sum((p["w"] * x) ** 2)

  params = {"w": jnp.array([1.0, -2.0, 0.5])}
  tx = optax.adam(0.05)
  flax_state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  ds = dynamic_scale.DynamicScale(growth_interval=2)
  ours = TrainState.create(
    apply_fn=None,
    params=params,
    tx=ols.loss_scale_optimizer(
      tx, ols.DynamicLossScale(2**16, increment_period=3, backoff_factor=0.5, min_loss_scale=TINY)
    ),
  )
  for x in _grad_sequence(seed=1):
    # Theirs, as the rows describe it.
    ds, is_fin, loss, grads = ds.value_and_grad(loss_fn)(flax_state.params, x["w"])
    new_state = flax_state.apply_gradients(grads=grads)
    keep = lambda new, old, fin=is_fin: jax.tree.map(lambda n, o: jnp.where(fin, n, o), new, old)
    flax_state = new_state.replace(
      opt_state=keep(new_state.opt_state, flax_state.opt_state),
      params=keep(new_state.params, flax_state.params),
    )
    # Ours.
    our_loss, our_grads = ols.value_and_grad(loss_fn)(ours, ours.params, x["w"])
    chex.assert_trees_all_close(
      ols.get_unscaled_gradients(our_grads, ours), grads, rtol=1e-6
    )  # Flax returns unscaled gradients; ours unscales inside the wrapper
    ours = ours.apply_gradients(grads=our_grads)
    m = ols.metrics(ours)
    assert bool(m["last_step_applied"]) == bool(is_fin)
    assert float(m["loss_scale"]) == float(ds.scale)
    if bool(is_fin):
      assert float(our_loss) == pytest.approx(float(loss), rel=1e-6)
    chex.assert_trees_all_close(ours.params, flax_state.params, rtol=1e-6)


def test_flax_row_axis_name_agrees_across_replicas_as_flax_does():
  dynamic_scale = _flax_dynamic_scale()
  params = {"w": jnp.ones(2)}
  xs = jnp.array([[1.0, 2.0], [np.inf, 1.0]])  # replica 1 overflows
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(4.0), axis_name="batch")
  state = tx.init(params)

  def ours(x):
    grads = jax.grad(lambda p: ols.get_scaled_loss(jnp.sum(p["w"] * x), state))(params)
    grads = jax.lax.pmean(grads, "batch")
    _, new_state = tx.update(grads, state, params)
    return new_state.last_step_applied, new_state.loss_scale()

  def theirs(x):
    ds = dynamic_scale.DynamicScale(scale=4.0)
    ds, finite, _, _ = ds.value_and_grad(lambda p: jnp.sum(p["w"] * x), axis_name="batch")(params)
    return finite, ds.scale

  applied, scale = jax.vmap(ours, axis_name="batch")(xs)
  finite, their_scale = jax.vmap(theirs, axis_name="batch")(xs)
  np.testing.assert_array_equal(applied, finite)
  np.testing.assert_array_equal(scale, their_scale)
  assert not np.any(applied)


# -- From optax.apply_if_finite.


def test_apply_if_finite_row_pinned_dynamic_scale_skips_alike():
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


def test_skip_step_table_apply_if_finite_row():
  inner = optax.adam(0.1)
  theirs = optax.apply_if_finite(inner, max_consecutive_errors=10)
  ours = ols.skip_bad_steps(inner)
  params = {"w": jnp.array([1.0, -2.0])}
  their_state, our_state = theirs.init(params), ours.init(params)
  for grad in ([0.5, 1.0], [np.nan, 1.0], [np.inf, 0.0], [-1.0, 2.0]):
    grads = {"w": jnp.array(grad)}
    their_updates, their_state = theirs.update(grads, their_state, params)
    our_updates, our_state = ours.update(grads, our_state, params)
    chex.assert_trees_all_equal(our_updates, their_updates)
    chex.assert_trees_all_equal(our_state.inner_state, their_state.inner_state)
    m = ols.metrics(our_state)
    assert int(m["consecutive_skips"]) == int(their_state.notfinite_count)
    assert int(m["nonfinite_skips"]) == int(their_state.total_notfinite)


# -- From PyTorch's GradScaler (not installed: its documented rule).


def test_pytorch_row_grad_scaler_rule():
  # GradScaler: x backoff_factor on an inf step (no floor); x growth_factor after
  # growth_interval finite steps in a row, unless the grown scale is not finite.
  def grad_scaler(pattern, scale=2.0**16, growth_interval=3):
    scale, tracker, out = np.float32(scale), 0, []
    for finite in pattern:
      if not finite:
        scale, tracker = scale * np.float32(0.5), 0
      else:
        tracker += 1
        if tracker == growth_interval:
          grown = scale * np.float32(2.0)
          scale, tracker = (grown if np.isfinite(grown) else scale), 0
      out.append(float(scale))
    return out

  pattern = [False] * 20 + PATTERN
  row = ols.DynamicLossScale(2**16, increment_period=3, multiplier=2.0, backoff_factor=0.5)
  floored = _our_trajectory(row, pattern)
  assert min(floored) == 1.0  # the row's own form floors at 1 ...
  below = ols.DynamicLossScale(
    2**16, increment_period=3, multiplier=2.0, backoff_factor=0.5, min_loss_scale=TINY
  )
  assert _our_trajectory(below, pattern) == grad_scaler(pattern)  # ... add min_loss_scale to match


def test_pytorch_row_disabled_scaler_is_noop():
  ls = ols.NoOpLossScale()
  tree = {"w": jnp.float16(3.0)}
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree


# -- From TensorFlow / Keras (not installed: their documented rules).


def test_tensorflow_row_same_arguments_same_trajectory():
  expected = [float(s) for s, _ in reference_models.tensorflow_trajectory(PATTERN, 2**15, 3, 2.0)]
  assert _our_trajectory(ols.DynamicLossScale(2**15, 3, 2.0)) == expected


def test_tensorflow_rows_fixed_scale_update_and_keyword_forms():
  fixed = ols.FixedLossScale(123)
  assert float(fixed()) == 123.0
  new, should_apply = fixed.update({"w": jnp.array([np.nan])})  # TF: always applies
  assert new is fixed and bool(should_apply)
  ls = ols.DynamicLossScale(8.0)
  new, should_apply = ls.update({"w": jnp.array([np.inf])})
  assert float(new()) == 4.0 and not bool(should_apply) and float(ls()) == 8.0  # not mutated
  a = ols.loss_scale_optimizer(optax.sgd(0.1), dynamic=False, initial_scale=123)
  b = ols.loss_scale_optimizer(optax.sgd(0.1), 123)
  assert a.get_config() == b.get_config() and not a.dynamic
  with pytest.raises(ValueError, match="loss_scale_value"):
    ols.FixedLossScale(0.5)  # TF: at least 1
