"""Long runs lose no batch (issue 19): retry an overflow, clip a spike, switch guards mid-run."""

import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._src.wrappers.state_conversion import innermost_state

PARAMS = {"w": jnp.array([1.0, 2.0, -0.5])}
X = jnp.array([3.0, 1.0, 2.0])


def f16_loss(params, x=X):
  """A float16 forward pass whose gradient, S * x in float16, overflows once S * max|x| > 65504."""
  return jnp.sum(params["w"].astype(jnp.float16) * x.astype(jnp.float16))


def largest_safe_scale(x=X, start=2.0**32):
  """Independent expectation: the largest power of two S with S * max|x| within float16."""
  scale = start
  while scale * float(jnp.max(jnp.abs(x))) > float(jnp.finfo(jnp.float16).max):
    scale /= 2
  return scale


class RetryTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_an_overflow_is_retried_at_lower_scales_and_the_step_applied(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**32))
    retrying = self.variant(ols.retry_on_overflow(ols.value_and_grad(f16_loss), max_retries=40))
    loss, grads, state = retrying(tx.init(PARAMS), PARAMS)
    safe = largest_safe_scale()
    assert float(ols.get_loss_scale(state)()) == safe
    m = ols.metrics(state)
    assert int(m["retries"]) == int(np.log2(2.0**32 / safe)) == int(m["total_retries"])
    chex.assert_trees_all_equal(grads, jax.grad(lambda p: f16_loss(p) * safe)(PARAMS))
    assert loss == f16_loss(PARAMS)
    params, state = ols.apply_gradients(tx, grads, state, PARAMS)
    m = ols.metrics(state)
    assert bool(m["last_step_applied"]) and int(m["total_skips"]) == 0
    chex.assert_trees_all_close(
      params, jax.tree.map(lambda p, g: p - 0.1 * g / safe, PARAMS, grads)
    )

  def test_a_finite_step_is_not_recomputed(self):
    calls = []
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**4))

    def counting(ls, params):
      calls.append(1)  # traced once per pass written in the program
      return ols.value_and_grad(f16_loss)(ls, params)

    _, _, state = ols.retry_on_overflow(counting)(tx.init(PARAMS), PARAMS)
    assert int(ols.metrics(state)["retries"]) == 0
    assert float(ols.get_loss_scale(state)()) == 16.0

  def test_a_real_nan_is_not_retried_and_skips_as_without_retry(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
    retrying = ols.retry_on_overflow(ols.value_and_grad(f16_loss))
    bad_x = X.at[0].set(jnp.nan)  # the loss itself is NaN: no scale helps
    _, grads, state = retrying(tx.init(PARAMS), PARAMS, bad_x)
    assert int(ols.metrics(state)["retries"]) == 0
    _, state = ols.apply_gradients(tx, grads, state, PARAMS)
    plain = tx.update(jax.grad(lambda p: f16_loss(p, bad_x) * 2.0**10)(PARAMS), tx.init(PARAMS))[1]
    assert float(ols.get_loss_scale(state)()) == float(ols.get_loss_scale(plain)()) == 512.0
    assert int(ols.metrics(state)["total_skips"]) == 1

  def test_gradients_that_stay_nan_with_a_finite_loss_leave_the_lowest_scale_tried(self):
    # d sqrt(w)/dw is Inf at 0, at every scale: the retries cannot help. The loss
    # is finite, so the halvings tried are kept (issue 25): the step leaves the
    # state at the lowest scale tried, and the wrapper's skip backs off once more.
    loss_fn = lambda p: jnp.sum(jnp.sqrt(p["w"]))
    params = {"w": jnp.array([0.0, 1.0])}
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
    _, grads, state = ols.retry_on_overflow(ols.value_and_grad(loss_fn), max_retries=3)(
      tx.init(params), params
    )
    assert float(ols.get_loss_scale(state)()) == 2.0**7  # three halvings tried
    assert int(ols.metrics(state)["retries"]) == 3
    new_params, state = ols.apply_gradients(tx, grads, state, params)
    chex.assert_trees_all_equal(new_params, params)
    assert float(ols.get_loss_scale(state)()) == 2.0**6
    assert int(ols.metrics(state)["total_skips"]) == 1

  def test_bounds_min_loss_scale_and_hysteresis(self):
    ls = ols.DynamicLossScale(2.0**20, min_loss_scale=2.0**16, hysteresis=2)
    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ls)
    _, grads, state = ols.retry_on_overflow(ols.value_and_grad(f16_loss))(tx.init(PARAMS), PARAMS)
    # Each retry backs off once (two overflows for hysteresis=2); at the floor it
    # stops, still overflowing, and leaves the state at the floor it reached.
    assert int(ols.metrics(state)["retries"]) == 4
    assert float(ols.get_loss_scale(state)()) == 2.0**16
    assert not bool(ols.all_finite(grads))
    _, state = ols.apply_gradients(tx, grads, state, PARAMS)
    assert float(ols.get_loss_scale(state)()) == 2.0**16  # skipped; no lower than the floor
    assert int(ols.metrics(state)["total_skips"]) == 1

  def test_scan_retries_each_step_and_counts_the_total(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.01), ols.DynamicLossScale(2.0**24, 2))
    retrying = ols.retry_on_overflow(ols.value_and_grad(f16_loss), max_retries=16)

    def body(carry, x):
      params, state = carry
      _, grads, state = retrying(state, params, x)
      params, state = ols.apply_gradients(tx, grads, state, params)
      return (params, state), ols.metrics(state)

    xs = jnp.stack([X, X * 2, X, X * 4])
    (_, state), m = jax.lax.scan(body, (PARAMS, tx.init(PARAMS)), xs)
    assert np.all(m["last_step_applied"]) and int(state.total_skips) == 0
    assert int(state.total_retries) == int(np.sum(m["retries"])) > 0

  def test_flax_train_state_and_nnx(self):
    pytest.importorskip("flax")
    from flax import nnx

    from optax_lossscale.flax import TrainState, nnx_retry_on_overflow

    tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**32))
    state = TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    step = jax.jit(
      lambda s: s.apply_gradients(
        grads=ols.retry_on_overflow(ols.value_and_grad(f16_loss), 40)(s, s.params)[1]
      )
    )
    _, _, backed = ols.retry_on_overflow(ols.value_and_grad(f16_loss), 40)(state, state.params)
    assert float(backed.loss_scale()) == largest_safe_scale()
    model = nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0), dtype=jnp.float16)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, x):
      loss_fn = lambda m, x: jnp.sum(m(x[None]).astype(jnp.float32) ** 2)
      _, grads = nnx_retry_on_overflow(loss_fn, 40)(optimizer, model, x)
      optimizer.update(model, grads)

    nnx_step(model, optimizer, X * 100)
    m = ols.metrics(optimizer)
    assert bool(m["last_step_applied"]) and int(m["retries"]) > 0
    del step

  def test_bad_arguments(self):
    with pytest.raises(ValueError, match="max_retries"):
      ols.retry_on_overflow(ols.value_and_grad(f16_loss), max_retries=0)
    with pytest.raises(TypeError, match="callable"):
      ols.retry_on_overflow(3)
    fixed = ols.loss_scale_optimizer(optax.sgd(0.1), 8.0).init(PARAMS)
    with pytest.raises(TypeError, match="dynamic loss scale"):
      ols.retry_on_overflow(ols.value_and_grad(f16_loss))(fixed, PARAMS)


def test_a_run_started_far_too_high_loses_no_batch_with_retry():
  """From initial_scale=2**32: skips lose ~20 batches; retries lose none."""
  tx = ols.loss_scale_optimizer(optax.sgd(0.01), ols.DynamicLossScale(2.0**32))
  xs = jnp.stack([X * (1 + 0.1 * i) for i in range(24)])

  def run(retry):
    retrying = ols.retry_on_overflow(ols.value_and_grad(f16_loss), max_retries=32)

    def body(carry, x):
      params, state = carry
      if retry:
        _, grads, state = retrying(state, params, x)
      else:
        _, grads = ols.value_and_grad(f16_loss)(state, params, x)
      return ols.apply_gradients(tx, grads, state, params), None

    (_, state), _ = jax.lax.scan(body, (PARAMS, tx.init(PARAMS)), xs)
    return ols.metrics(state)

  without, with_retry = run(False), run(True)
  assert int(without["total_skips"]) >= 16  # a lost batch per halving
  assert int(with_retry["total_skips"]) == 0  # none: each halving was a retry instead
  assert int(with_retry["total_retries"]) >= 16


class ClipTest(chex.TestCase):
  def _warm(self, tx, n=4):
    params, state = PARAMS, tx.init(PARAMS)
    for i in range(n):
      params, state = ols.apply_gradients(tx, {"w": jnp.full(3, 1.0 + 0.01 * i)}, state, params)
    return params, state

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_norm_spike_is_applied_scaled_to_the_threshold(self):
    tx = ols.skip_bad_steps(optax.sgd(1.0), spike_threshold=3.0, warmup_steps=4, on_spike="clip")
    params, state = self._warm(tx)
    stat = state.grad_norm
    spike = {"w": jnp.array([100.0, -50.0, 20.0])}
    # Independent expectation: the threshold of the log-norm statistic, mean + 3 std.
    threshold = np.exp(float(stat.mean) + 3.0 * max(np.sqrt(float(stat.var)), 0.05))
    norm = float(np.linalg.norm(np.asarray(spike["w"])))
    new, state2 = self.variant(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
      spike, state, params
    )
    np.testing.assert_allclose(new["w"], params["w"] - spike["w"] * threshold / norm, rtol=1e-5)
    m = ols.metrics(state2)
    assert (int(m["spike_clips"]), int(m["spike_skips"])) == (1, 0)
    assert bool(m["last_step_applied"])
    assert int(state2.grad_norm.count) == int(stat.count)  # a clipped step feeds nothing

  def test_a_loss_spike_and_an_overflowing_norm_are_still_skipped(self):
    tx = ols.skip_bad_steps(
      optax.sgd(1.0),
      spike_threshold=3.0,
      warmup_steps=4,
      monitor=("grad_norm", "loss"),
      on_spike="clip",
    )
    params, state = PARAMS, tx.init(PARAMS)
    for i in range(4):
      params, state = ols.apply_gradients(
        tx, {"w": jnp.full(3, 1.0 + 0.01 * i)}, state, params, loss=jnp.float32(1.0 + 0.01 * i)
      )
    _, s1 = ols.apply_gradients(tx, {"w": jnp.full(3, 1.0)}, state, params, loss=jnp.float32(50.0))
    _, s2 = ols.apply_gradients(tx, {"w": jnp.full(3, 3e19)}, state, params, loss=jnp.float32(1.0))
    for s in (s1, s2):
      assert (int(s.spike_skips), int(s.spike_clips)) == (1, 0)

  def test_a_streak_of_clipped_spikes_is_bounded_like_skips(self):
    tx = ols.skip_bad_steps(
      optax.sgd(1.0),
      spike_threshold=3.0,
      warmup_steps=4,
      on_spike="clip",
      max_consecutive_spike_skips=2,
    )
    params, state = self._warm(tx)
    for _ in range(3):
      params, state = ols.apply_gradients(tx, {"w": jnp.full(3, 100.0)}, state, params)
    assert (int(state.spike_clips), int(state.spike_rebases)) == (2, 1)

  def test_clip_needs_the_norm(self):
    with pytest.raises(ValueError, match=r"on_spike='clip'.*grad_norm"):
      ols.skip_bad_steps(optax.sgd(1.0), spike_threshold=3.0, monitor="loss", on_spike="clip")
    with pytest.raises(ValueError, match="on_spike must be one of"):
      ols.skip_bad_steps(optax.sgd(1.0), spike_threshold=3.0, on_spike="drop")


class ConvertTest(chex.TestCase):
  def _grads(self, i):
    return {"w": jnp.array([0.5, -1.0, 2.0]) * (1 + i)}

  @pytest.mark.filterwarnings("ignore::UserWarning")
  def test_a_bare_run_resumed_from_orbax_continues_under_each_wrapper_bit_for_bit(self):
    ocp = pytest.importorskip("orbax.checkpoint")
    bare = optax.adam(1e-2)
    params, state = PARAMS, bare.init(PARAMS)
    for i in range(3):
      updates, state = bare.update(self._grads(i), state, params)
      params = optax.apply_updates(params, updates)
    with tempfile.TemporaryDirectory() as d, ocp.StandardCheckpointer() as ckpt:
      ckpt.save(f"{d}/bare", {"params": params, "opt_state": state})
      ckpt.wait_until_finished()
      restored = ckpt.restore(f"{d}/bare", {"params": params, "opt_state": state})
    params, state = restored["params"], restored["opt_state"]
    step = jax.jit(lambda tx, g, s, p: ols.apply_gradients(tx, g, s, p), static_argnums=0)
    expected, _ = step(bare, self._grads(3), state, params)
    for tx, scale in (
      (ols.loss_scale_optimizer(bare), 2.0**15),
      (ols.skip_bad_steps(bare), 1.0),
      (ols.loss_scale_optimizer(ols.skip_bad_steps(bare)), 2.0**15),
    ):
      wrapped = ols.convert_state(tx, state, params)
      chex.assert_trees_all_equal(innermost_state(wrapped), state)
      scaled = jax.tree.map(lambda g, s=scale: g * s, self._grads(3))
      got, new_state = step(tx, scaled, wrapped, params)
      # Power-of-two scales unscale exactly, so Adam sees the same gradients; on
      # CPU the fused step rounds as bare optax's does, bit for bit (another
      # backend may fuse the two programs' arithmetic differently).
      if jax.default_backend() == "cpu":
        chex.assert_trees_all_equal(got, expected)
      else:
        chex.assert_trees_all_close(got, expected, rtol=1e-6)
      # And back: drop the wrapper, keep the inner state.
      back = ols.convert_state(bare, new_state, got)
      chex.assert_trees_all_equal(back, innermost_state(new_state))

  def test_a_different_inner_optimizer_is_refused(self):
    state = optax.sgd(0.1, momentum=0.9).init(PARAMS)
    with pytest.raises(ValueError, match="does not have the structure"):
      ols.convert_state(ols.loss_scale_optimizer(optax.adam(1e-3)), state, PARAMS)

  def test_train_state_and_nnx_optimizer(self):
    pytest.importorskip("flax")
    from flax import nnx
    from flax.training import train_state

    from optax_lossscale.flax import TrainState, convert_train_state, nnx_convert_optimizer

    bare = optax.adam(1e-2)
    flax_state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=bare)
    flax_state = flax_state.apply_gradients(grads=self._grads(0))
    ours = convert_train_state(flax_state, ols.skip_bad_steps(bare))
    assert isinstance(ours, TrainState) and int(ours.step) == 1
    chex.assert_trees_all_equal(ours.opt_state.inner_state, flax_state.opt_state)
    chex.assert_trees_all_equal(
      ours.apply_gradients(grads=self._grads(1)).params,
      flax_state.apply_gradients(grads=self._grads(1)).params,
    )
    back = convert_train_state(ours, bare)
    assert type(back) is train_state.TrainState
    chex.assert_trees_all_equal(back.opt_state, flax_state.opt_state)

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, bare, wrt=nnx.Param)
    x = jnp.ones((2, 3))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)
    guarded = nnx_convert_optimizer(optimizer, model, ols.loss_scale_optimizer(bare))
    count = lambda o: int(jax.tree.leaves(nnx.state(o.opt_state))[0])
    assert int(guarded.step[...]) == 1
    assert int(ols.metrics(guarded)["total_skips"]) == 0
    plain = nnx_convert_optimizer(guarded, model, bare)
    assert count(plain) == count(optimizer)


class TrainStateExtraArgsTest(chex.TestCase):
  def test_loss_reaches_skip_bad_steps_from_a_train_state(self):
    pytest.importorskip("flax")
    from optax_lossscale.flax import TrainState

    tx = ols.skip_bad_steps(
      optax.sgd(0.1), spike_threshold=3.0, monitor=("grad_norm", "loss"), warmup_steps=2
    )
    state = TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    step = jax.jit(lambda s, g, loss: s.apply_gradients(grads=g, loss=loss))
    for loss in (1.0, 1.1, 1.05, 500.0):
      state = step(state, {"w": jnp.ones(3)}, jnp.float32(loss))
    m = ols.metrics(state)
    assert int(m["spike_skips"]) == 1 and float(m["loss"]) == 500.0
    # A field of the state is still replaced, not forwarded.
    apply_fn = lambda *a: None
    new = state.apply_gradients(grads={"w": jnp.ones(3)}, loss=jnp.float32(1.0), apply_fn=apply_fn)
    assert new.apply_fn is apply_fn
