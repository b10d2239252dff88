"""master_weights: 16-bit parameters stepped through a float32 master copy.

Every applied step is compared bit for bit with a hand-written master loop
(float32 master, the inner optimizer on it with float32-promoted gradients,
param = the master rounded to the param's dtype: to nearest, a bfloat16 tie
away from zero), eagerly, under `jit` and in `lax.scan`.
"""

from __future__ import annotations

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests import assert_trees_equal_across_programs
from tests.autocast_helpers import equations

BF16 = jnp.bfloat16
SCALE = 2.0**10  # a power of two: scaling and unscaling are exact

INNERS = {
  "adam": lambda: optax.adam(1e-3),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "clip_adamw_schedule": lambda: optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adamw)(
      learning_rate=optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=1e-2
    ),
  ),
}


def make_params(dtype=BF16):
  """Weights near 1.0 in `dtype` and one float32 leaf, which keeps no master."""
  return {
    "w": (1.0 + jnp.linspace(-0.1, 0.1, 12, dtype=jnp.float32).reshape(3, 4)).astype(dtype),
    "b": jnp.array([0.5, -0.25, 0.125, 1.0], dtype),
    "c": jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32),
  }


def loss_fn(params, x):
  f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  pred = jnp.tanh(x @ f32["w"] + f32["b"] + f32["c"])
  return jnp.mean((pred - 0.3) ** 2)


def batch(step):
  return jnp.cos(jnp.arange(6.0).reshape(2, 3) + step)


grads_of = jax.jit(jax.grad(loss_fn))
scaled_grads_of = jax.jit(jax.grad(lambda p, x, s: loss_fn(p, x) * s))


def written(master, dtype):
  """The parameter of `dtype` that master_weights writes from a float32 `master`: the
  cast (to nearest even), but a bfloat16 tie (low 16 bits 0x8000) away from zero."""
  master = jnp.asarray(master, jnp.float32)
  nearest = master.astype(dtype)
  if np.dtype(dtype) != np.dtype(BF16):
    return nearest
  bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
  tie = ((bits & 0xFFFF) == 0x8000) & ~jnp.isnan(master)
  away = jax.lax.bitcast_convert_type(((bits >> 16) + 1).astype(jnp.uint16), BF16)
  return jnp.where(tie, away, nearest)


def reference_run(inner, params, batches, jit=True, scale=None):
  """The hand-written master loop; `None` in `batches` is a skipped step.

  Each step is one compiled program, or with `jit=False` runs op by op (XLA
  may round a fused program's multiply-adds differently from eager ops).
  With `scale`, the gradients are of the scaled loss, unscaled in the step
  (where the loss-scale wrapper unscales them), exactly (a power of two).
  """
  narrow = {k: v.dtype for k, v in params.items() if v.dtype != jnp.float32}
  master = {k: v.astype(jnp.float32) for k, v in params.items()}
  state = inner.init(master)

  def step(grads, state, master):
    if scale is not None:
      grads = jax.tree.map(lambda g: g * jnp.asarray(1 / scale, g.dtype), grads)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = inner.update(grads, state, master)
    return optax.apply_updates(master, updates), state

  step = jax.jit(step) if jit else step
  history = []
  for x in batches:
    if x is not None:
      grads = grads_of(params, x) if scale is None else scaled_grads_of(params, x, scale)
      master, state = step(grads, state, master)
      params = {k: written(v, narrow[k]) if k in narrow else v for k, v in master.items()}
    history.append((params, master, state))
  return history


def assert_bits_equal(a, b):
  chex.assert_trees_all_equal_dtypes(a, b)
  chex.assert_trees_all_equal(a, b)


def assert_matches_reference(params, state, reference):
  # Two programs: bit for bit on CPU (see assert_trees_equal_across_programs);
  # elsewhere within bfloat16's units, the parameters' (the float32 master and
  # moments are computed from them).
  ref_params, ref_master, ref_state = reference
  same = functools.partial(assert_trees_equal_across_programs, narrowest=jnp.bfloat16)
  same(params, ref_params)
  same(state.master["w"], ref_master["w"])
  same(state.master["b"], ref_master["b"])
  assert state.master["c"] is None
  same(state.inner_state, ref_state)


def test_control_plain_bfloat16_adam_does_not_move_weights_near_one():
  # The stall the issue describes: every Adam step (about lr = 1e-3) is below
  # half an ulp of a bfloat16 weight near 1.0 (2**-8 or 2**-9).
  params = {"w": (1.0 + jnp.linspace(-0.05, 0.05, 64)).astype(BF16)}
  tx = optax.adam(1e-3)
  state = tx.init(params)
  start = params
  for step in range(50):
    grads = {"w": (1.0 + 0.5 * jnp.cos(jnp.arange(64.0) + step)).astype(BF16)}
    params, state = ols.apply_gradients(tx, grads, state, params)
  assert_bits_equal(params, start)
  # The same steps through a master copy move every weight.
  tx = ols.master_weights(optax.adam(1e-3))
  params, state = start, tx.init(start)
  for step in range(50):
    grads = {"w": (1.0 + 0.5 * jnp.cos(jnp.arange(64.0) + step)).astype(BF16)}
    params, state = ols.apply_gradients(tx, grads, state, params)
  assert params["w"].dtype == BF16
  assert bool(jnp.all(params["w"] != start["w"]))


class EquivalenceTest(parameterized.TestCase):
  @parameterized.product(inner=sorted(INNERS), dtype=["bfloat16", "float16"])
  def test_applied_steps_equal_the_hand_written_master_loop(self, inner, dtype):
    dtype = jnp.dtype(dtype)
    batches = [batch(i) for i in range(8)]
    reference = reference_run(INNERS[inner](), make_params(dtype), batches)
    tx = ols.master_weights(INNERS[inner]())
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    params = make_params(dtype)
    state = tx.init(params)
    for x, expected in zip(batches, reference, strict=True):
      params, state = step(grads_of(params, x), state, params)
      assert_matches_reference(params, state, expected)
    self.assertFalse(bool(jnp.all(params["w"] == make_params(dtype)["w"])))

  def test_eager_update_and_apply_updates_land_on_the_same_bits(self):
    batches = [batch(i) for i in range(6)]
    reference = reference_run(optax.adam(1e-3), make_params(), batches, jit=False)
    tx = ols.master_weights(optax.adam(1e-3))
    params = make_params()
    state = tx.init(params)
    for x, expected in zip(batches, reference, strict=True):
      updates, state = tx.update(grads_of(params, x), state, params)  # eager, op by op
      self.assertEqual(updates["w"].dtype, jnp.float32)
      params = optax.apply_updates(params, updates)
      assert_matches_reference(params, state, expected)

  def test_scan_equals_the_master_loop_in_scan(self):
    xs = jnp.stack([batch(i) for i in range(6)])
    inner = optax.adam(1e-3)
    tx = ols.master_weights(inner)

    def ours(carry, x):
      params, state = carry
      return ols.apply_gradients(tx, jax.grad(loss_fn)(params, x), state, params), None

    def hand(carry, x):
      params, master, state = carry
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss_fn)(params, x))
      updates, state = inner.update(grads, state, master)
      master = optax.apply_updates(master, updates)
      params = {k: written(v, params[k].dtype) for k, v in master.items()}
      return (params, master, state), None

    params = make_params()
    (got_params, got_state), _ = jax.jit(lambda c: jax.lax.scan(ours, c, xs))(
      (params, tx.init(params))
    )
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    (ref_params, ref_master, ref_state), _ = jax.jit(lambda c: jax.lax.scan(hand, c, xs))(
      (params, master, inner.init(master))
    )
    assert_matches_reference(got_params, got_state, (ref_params, ref_master, ref_state))

  def test_a_float32_parameter_is_left_as_it_is(self):
    params = {"c": jnp.linspace(-1.0, 1.0, 4), "w": jnp.ones(3, BF16)}
    tx = ols.master_weights(optax.adam(1e-2))
    state = tx.init(params)
    self.assertIsNone(state.master["c"])
    self.assertEqual(state.master["w"].dtype, jnp.float32)
    # Adam's moments: float32 on the master, and float32 for the float32 leaf.
    self.assertEqual(state.inner_state[0].mu["w"].dtype, jnp.float32)
    grads = {"c": jnp.array([1.0, -2.0, 3.0, 0.5]), "w": jnp.ones(3, BF16)}
    new_params, new_state = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
      grads, state, params
    )
    self.assertIsNone(new_state.master["c"])
    # The float32 leaf is stepped as the hand-written loop steps it (optax's eager Adam
    # rounds a leaf's last bit differently in another tree: the same tree here).
    bare = optax.adam(1e-2)
    on_master = {"c": params["c"], "w": params["w"].astype(jnp.float32)}
    promoted = {"c": grads["c"], "w": grads["w"].astype(jnp.float32)}
    bare_updates, _ = jax.jit(bare.update)(promoted, bare.init(on_master))
    expected = jax.jit(optax.apply_updates)(on_master, bare_updates)["c"]
    np.testing.assert_array_equal(new_params["c"], expected)
    # Through update, the float32 leaf's update is the inner optimizer's own.
    updates, _ = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(updates["c"], bare_updates["c"])

  @parameterized.named_parameters(("update", False), ("apply_gradients", True))
  def test_in_the_jaxpr_only_the_write_is_16_bit(self, fused):
    # The claim on the program, not on its outputs: the inner optimizer runs on
    # the float32 master (every equation of the step computes in float32), and
    # the one equation per parameter with a 16-bit result is the write: the
    # master's bits rounded to bfloat16 (ties away from zero, a bitcast of the
    # uint16 result), or cast to float16 (convert_element_type).
    params = {"a": jnp.ones((4, 3), BF16), "b": jnp.ones(5, jnp.float16)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    tx = ols.master_weights(INNERS["clip_adamw_schedule"]())
    step = (lambda g, s, p: ols.apply_gradients(tx, g, s, p)) if fused else tx.update
    jaxpr = jax.make_jaxpr(step)(grads, tx.init(params), params)
    half = [
      (e.primitive.name, str(e.invars[0].aval.dtype), str(v.aval.dtype), v.aval.shape)
      for e in equations(jaxpr)
      for v in e.outvars
      if getattr(v.aval, "dtype", None) in (BF16, jnp.float16)
    ]
    self.assertCountEqual(
      half,
      [
        ("bitcast_convert_type", "uint16", "bfloat16", (4, 3)),
        ("convert_element_type", "float32", "float16", (5,)),
      ],
    )
    floats = {
      str(v.aval.dtype)
      for e in equations(jaxpr)
      for v in e.outvars
      if jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.floating)
    }
    self.assertEqual(floats, {"float32", "bfloat16", "float16"})

  def test_a_float64_master_for_float32_parameters(self):
    # jax.enable_x64 since jax 0.9; jax.experimental.enable_x64 before.
    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:
      from jax.experimental import enable_x64
    with enable_x64(True):
      params = {"w": jnp.ones(2, jnp.float32)}
      tx = ols.master_weights(optax.sgd(1e-9), master_dtype=jnp.float64)
      state = tx.init(params)
      self.assertEqual(state.master["w"].dtype, jnp.float64)
      for _ in range(10):
        params, state = ols.apply_gradients(tx, {"w": jnp.ones(2, jnp.float32)}, state, params)
      np.testing.assert_allclose(np.asarray(state.master["w"]), 1 - 1e-8, rtol=0, atol=1e-15)
      self.assertEqual(params["w"].dtype, jnp.float32)

  def test_master_is_a_copy_sharing_no_buffer(self):
    params = {"w": jnp.ones(3, BF16)}
    state = ols.master_weights(optax.sgd(0.1)).init(params)
    params["w"].delete()  # a donated parameter must not take the master with it
    self.assertEqual(float(state.master["w"][0]), 1.0)


class SkipTest(parameterized.TestCase):
  @parameterized.product(skip_mode=["cond", "select"], fused=[True, False])
  def test_a_nan_step_inside_loss_scale_optimizer_leaves_master_and_params(self, skip_mode, fused):
    bad = 3
    batches = [batch(i) for i in range(7)]
    reference = reference_run(
      optax.adam(1e-3),
      make_params(),
      [None if i == bad else x for i, x in enumerate(batches)],
      scale=SCALE,
    )
    tx = ols.loss_scale_optimizer(
      ols.master_weights(optax.adam(1e-3)),
      ols.DynamicLossScale(SCALE, increment_period=1000),
      skip_mode=skip_mode,
    )

    @jax.jit
    def step(params, state, x, poison):
      grads = scaled_grads_of(params, x, state.loss_scale())
      grads = {**grads, "w": jnp.where(poison, jnp.nan, grads["w"])}
      if fused:
        return ols.apply_gradients(tx, grads, state, params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params = make_params()
    state = tx.init(params)
    for i, (x, expected) in enumerate(zip(batches, reference, strict=True)):
      before_params, before_state = params, state
      params, state = step(params, state, x, i == bad)
      if i == bad:
        self.assertFalse(bool(state.last_step_applied))
        assert_bits_equal(params, before_params)
        assert_bits_equal(state.inner_state, before_state.inner_state)
      assert_matches_reference(params, state.inner_state, expected)
    self.assertEqual(int(state.total_skips), 1)

  @parameterized.parameters(True, False)
  def test_a_nan_step_inside_skip_bad_steps_leaves_master_and_params(self, fused):
    tx = ols.skip_bad_steps(ols.master_weights(optax.adam(1e-3)))
    params = make_params()
    state = tx.init(params)
    params, state = ols.apply_gradients(tx, grads_of(params, batch(0)), state, params)
    grads = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads_of(params, batch(1)))
    if fused:
      new_params, new_state = ols.apply_gradients(tx, grads, state, params)
    else:
      updates, new_state = tx.update(grads, state, params)
      new_params = optax.apply_updates(params, updates)
    assert_bits_equal(new_params, params)
    assert_bits_equal(new_state.inner_state, state.inner_state)
    self.assertEqual(int(new_state.nonfinite_skips), 1)


class CompositionTest(parameterized.TestCase):
  def test_a_wrapper_inside_is_refused_when_built(self):
    for wrapper in (ols.loss_scale_optimizer, ols.skip_bad_steps):
      with self.assertRaisesRegex(ValueError, r"goes inside the .* wrapper"):
        ols.master_weights(wrapper(optax.adam(1e-3)))

  def test_a_wrapper_inside_through_a_chain_is_refused_at_init(self):
    tx = ols.master_weights(optax.chain(ols.loss_scale_optimizer(optax.adam(1e-3))))
    with self.assertRaisesRegex(ValueError, r"inside master_weights, which must go inside"):
      tx.init(make_params())

  def test_master_weights_and_stochastic_rounding_do_not_nest(self):
    with self.assertRaisesRegex(ValueError, "Use one"):
      ols.master_weights(ols.stochastic_rounding(optax.adam(1e-3), 0))
    with self.assertRaisesRegex(ValueError, "Use one"):
      ols.stochastic_rounding(ols.master_weights(optax.adam(1e-3)), 0)

  def test_a_transformation_after_it_in_a_chain_is_refused(self):
    tx = optax.chain(ols.master_weights(optax.adam(1e-3)), optax.scale(0.5))
    params = make_params()
    with self.assertRaisesRegex(ValueError, r"optax.scale comes after it"):
      tx.update(grads_of(params, batch(0)), tx.init(params), params)
    # optax.identity() after it, and anything before it, are fine.
    for ok in (
      optax.chain(ols.master_weights(optax.adam(1e-3)), optax.identity()),
      optax.chain(optax.clip_by_global_norm(1.0), ols.master_weights(optax.adam(1e-3))),
    ):
      ok.update(grads_of(params, batch(0)), ok.init(params), params)

  @parameterized.parameters(ols.loss_scale_optimizer, ols.skip_bad_steps)
  def test_a_transformation_after_the_wrapper_around_it_is_refused(self, wrapper):
    tx = optax.chain(wrapper(ols.master_weights(optax.adam(1e-3))), optax.scale(0.5))
    params = make_params()
    with self.assertRaisesRegex(ValueError, r"wraps master_weights.*optax.scale comes after"):
      tx.update(grads_of(params, batch(0)), tx.init(params), params)

  @parameterized.parameters("outside", "inside")
  def test_multisteps_writes_once_every_k_steps(self, where):
    k, lr = 3, 0.05
    if where == "inside":
      tx = ols.master_weights(optax.MultiSteps(optax.adam(lr), k).gradient_transformation())
      master_of = lambda state: state.master
    else:
      tx = optax.MultiSteps(ols.master_weights(optax.adam(lr)), k).gradient_transformation()
      master_of = lambda state: state.inner_opt_state.master
    params = make_params()
    state = tx.init(params)
    start = params
    step = jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    for i in range(k - 1):
      params, state = step(grads_of(params, batch(i)), state, params)
      assert_bits_equal(params, start)  # accumulating: nothing written yet
    params, state = step(grads_of(params, batch(k - 1)), state, params)
    # One step of the master loop on the mean of the k gradients (accumulated in
    # float32 inside master_weights; in the gradients' dtype by MultiSteps outside).
    grads = [grads_of(start, batch(i)) for i in range(k)]
    mean = jax.tree.map(lambda *g: sum(x.astype(jnp.float32) for x in g) / k, *grads)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), start)
    inner = optax.adam(lr)
    updates, _ = inner.update(mean, inner.init(master), master)
    expected_master = optax.apply_updates(master, updates)
    rtol = 1e-6 if where == "inside" else 1e-4
    chex.assert_trees_all_close(master_of(state)["w"], expected_master["w"], rtol=rtol)
    assert_bits_equal(params["w"], written(master_of(state)["w"], BF16))
    self.assertFalse(bool(jnp.any(params["w"] == start["w"])))

  def test_multi_transform_steps_each_partition(self):
    labels = {"w": "master", "b": "master", "c": "plain"}
    tx = optax.multi_transform(
      {"master": ols.master_weights(optax.adam(1e-3)), "plain": optax.sgd(0.1)}, labels
    )
    params = make_params()
    state = tx.init(params)
    grads = grads_of(params, batch(0))
    new_params, _ = ols.apply_gradients(tx, grads, state, params)
    reference = reference_run(optax.adam(1e-3), make_params(), [batch(0)])[0][0]
    assert_trees_equal_across_programs(new_params["w"], reference["w"])
    assert_trees_equal_across_programs(new_params["b"], reference["b"])
    np.testing.assert_array_equal(new_params["c"], params["c"] - 0.1 * grads["c"])

  def test_convert_state_carries_the_master_between_wrappers(self):
    params = make_params()
    guarded = ols.loss_scale_optimizer(ols.master_weights(optax.adam(1e-3)))
    state = guarded.init(params)
    for i in range(3):
      grads = scaled_grads_of(params, batch(i), state.loss_scale())
      params, state = ols.apply_gradients(guarded, grads, state, params)
    other = ols.skip_bad_steps(ols.master_weights(optax.adam(1e-3)))
    converted = ols.convert_state(other, state, params)
    assert_bits_equal(converted.inner_state, state.inner_state)
    bare = ols.master_weights(optax.adam(1e-3))
    back = ols.convert_state(bare, converted, params)
    assert_bits_equal(back, state.inner_state)
    with self.assertRaisesRegex(ValueError, "does not have the structure"):
      ols.convert_state(optax.adam(1e-3), state, params)

  def test_fp8_metadata_leaves_bypass_the_master(self):
    # The wrapper splits the overwrite-with-gradient leaves off before master_weights
    # sees them: they keep no master and are written with their new value.
    params = {
      **make_params(),
      "_overwrite_with_gradient": {"kernel_scale": jnp.ones(1), "amax": jnp.zeros(4)},
    }
    tx = ols.loss_scale_optimizer(ols.master_weights(optax.adam(1e-3)), ols.DynamicLossScale(SCALE))
    state = tx.init(params)
    self.assertIsInstance(
      state.inner_state.master["_overwrite_with_gradient"]["amax"], optax.MaskedNode
    )
    grads = {
      **jax.tree.map(lambda g: g * SCALE, grads_of(make_params(), batch(0))),
      "_overwrite_with_gradient": {"kernel_scale": jnp.full(1, 2.0), "amax": jnp.arange(4.0)},
    }
    new_params, state = ols.apply_gradients(tx, grads, state, params)
    assert_bits_equal(new_params["_overwrite_with_gradient"], grads["_overwrite_with_gradient"])
    reference = reference_run(optax.adam(1e-3), make_params(), [batch(0)])[0][0]
    assert_trees_equal_across_programs(new_params["w"], reference["w"])
    # A NaN skips: metadata, master and params stay.
    poisoned = {**grads, "w": grads["w"].at[0, 0].set(jnp.nan)}
    skipped, new_state = ols.apply_gradients(tx, poisoned, state, new_params)
    assert_bits_equal(skipped, new_params)
    assert_bits_equal(new_state.inner_state, state.inner_state)


class ErrorTest(parameterized.TestCase):
  def test_an_integer_gradient_leaf_gets_the_integer_leaf_error(self):
    params = {"w": jnp.ones(2, BF16), "n": jnp.arange(2)}
    tx = ols.master_weights(optax.adam(1e-3))
    state = tx.init(params)
    self.assertIsNone(state.master["n"])  # not floating: no master copy
    grads = {"w": jnp.ones(2, BF16), "n": jnp.arange(2)}
    with self.assertRaisesRegex(
      TypeError, r"master_weights got an integer gradient leaf at \['n'\]"
    ):
      tx.update(grads, state, params)
    # Inside the loss-scale wrapper the error is the wrapper's own, as without master weights.
    wrapped = ols.loss_scale_optimizer(ols.master_weights(optax.adam(1e-3)))
    with self.assertRaisesRegex(
      TypeError, r"loss_scale_optimizer got an integer gradient leaf at \['n'\]"
    ):
      ols.apply_gradients(wrapped, grads, wrapped.init(params), params)

  def test_a_leaf_that_is_not_an_array_gets_the_params_error(self):
    with self.assertRaisesRegex(
      TypeError, r"master_weights.init got params with a leaf that is not"
    ):
      ols.master_weights(optax.adam(1e-3)).init({"w": jnp.ones(2, BF16), "act": jax.nn.relu})

  def test_arguments_are_checked_when_built(self):
    with self.assertRaisesRegex(ValueError, r"master_dtype must be a floating dtype"):
      ols.master_weights(optax.adam(1e-3), master_dtype=jnp.int32)
    with self.assertRaisesRegex(ValueError, r"master_dtype must be a floating dtype"):
      ols.master_weights(optax.adam(1e-3), master_dtype=None)  # NumPy would read float64
    with self.assertRaisesRegex(ValueError, r"master_dtype must be a floating dtype"):
      ols.master_weights(optax.adam(1e-3), master_dtype="not a dtype")
    with self.assertRaisesRegex(TypeError, r"inner must be an optax.GradientTransformation"):
      ols.master_weights(optax.MultiSteps(optax.adam(1e-3), 2))

  def test_a_parameter_cast_up_since_init_is_refused(self):
    # eqx.apply_updates adds the float32 updates without casting back: the next
    # step would train a float32 copy without a word.
    tx = ols.master_weights(optax.sgd(0.1))
    params = make_params()
    state = tx.init(params)
    updates, state = tx.update(grads_of(params, batch(0)), state, params)
    promoted = jax.tree.map(lambda p, u: p + u, params, updates)  # what eqx.apply_updates does
    self.assertEqual(promoted["w"].dtype, jnp.float32)
    with self.assertRaisesRegex(TypeError, r"at \['b'\], which is now float32.*eqx.apply_updates"):
      tx.update(grads_of(promoted, batch(1)), state, promoted)

  def test_update_needs_the_params_and_its_own_state(self):
    tx = ols.master_weights(optax.adam(1e-3))
    params = make_params()
    state = tx.init(params)
    with self.assertRaisesRegex(ValueError, r"its update needs them"):
      tx.update(grads_of(params, batch(0)), state)
    with self.assertRaisesRegex(TypeError, r"expects the MasterWeightsState"):
      tx.update(grads_of(params, batch(0)), state.inner_state, params)


@pytest.mark.parametrize("dtype, ratio", [(BF16, 2.0**15), (jnp.float16, 2.0**12)])
def test_update_path_is_exact_unless_a_parameter_shrinks_past_the_documented_ratio(dtype, ratio):
  # The float32 update new - old, added by optax.apply_updates in float32 and cast
  # back, lands on `new` whenever |old| <= ratio * |new| (and whenever |new| > |old|),
  # but for the sign of a zero. Past the ratio it can miss (shown below). (bfloat16
  # values near float32's subnormals are left out: XLA:CPU flushes those to zero.)
  from optax_lossscale._src.storage import param_write

  rng = np.random.default_rng(0)
  n = 200_000
  finfo = jnp.finfo(dtype)
  low = max(float(finfo.tiny), 2.0**-100)
  magnitude = np.exp(rng.uniform(np.log(low), np.log(float(finfo.max) / 2**22), n))
  old = (rng.choice([-1.0, 1.0], n) * magnitude).astype(np.float32)
  log_factor = rng.uniform(-np.log(ratio), np.log(2.0**20), n)
  new = (old * np.exp(log_factor) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
  old16, new16 = jnp.asarray(old).astype(dtype), jnp.asarray(new).astype(dtype)
  keep = jnp.isfinite(old16) & jnp.isfinite(new16) & (old16 != 0) & (new16 != 0)
  keep &= jnp.abs(old16.astype(jnp.float32)) <= ratio * jnp.abs(new16.astype(jnp.float32))
  old16, new16 = old16[keep], new16[keep]
  updates = param_write.closest_update(new16, old16, jnp.float32)
  landed = optax.apply_updates(old16, updates)
  np.testing.assert_array_equal(
    np.asarray(landed).view(np.uint16), np.asarray(new16).view(np.uint16)
  )
  # Beyond the ratio it misses, by float32's rounding of the old value: 1.0 shrinking
  # to 3e-6 of itself (bfloat16), 1000.5 to 1.2345e-4 (float16).
  old, new = (1.0 + 2**-7, 3e-6) if dtype == BF16 else (1000.5, 1.2345e-4)
  old16, new16 = jnp.array([old], dtype), jnp.array([new], dtype)
  landed = optax.apply_updates(old16, param_write.closest_update(new16, old16, jnp.float32))
  assert float(landed[0]) != float(new16[0])
  # An infinite parameter stays infinite (inf - inf would be NaN).
  old16, new16 = jnp.array([jnp.inf, 1.0], dtype), jnp.array([jnp.inf, -jnp.inf], dtype)
  landed = optax.apply_updates(old16, param_write.closest_update(new16, old16, jnp.float32))
  np.testing.assert_array_equal(np.asarray(landed, np.float32), [np.inf, -np.inf])


def _bits32(x):
  return np.asarray(x).view(np.uint32)


SPECIAL_HIGH_HALVES = np.array(
  [0, 0x40, 0x80, 0x3F80, 0x3F81, 0x7F7F, 0x7F80, 0x7FC0, 0x7FFF], np.uint32
)


class RemainderTest(parameterized.TestCase):
  """store='remainder': the float32 master as the bfloat16 parameter and 16 more bits."""

  def test_split_then_join_gives_every_master_back_over_bit_patterns(self):
    from optax_lossscale._src.storage.rounding import join_bfloat16 as join
    from optax_lossscale._src.storage.rounding import split_bfloat16 as split

    chosen = np.array([0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF], np.uint32)
    every = np.arange(2**16, dtype=np.uint32)
    patterns = np.concatenate(
      [
        (every[:, None] << 16 | chosen[None, :]).ravel(),  # every high half
        # every low half under zero, a subnormal, the smallest normal, 1.0 and its
        # neighbour, the largest finite bfloat16, infinity, NaNs, and their negatives
        (SPECIAL_HIGH_HALVES[:, None] << 16 | every[None, :]).ravel(),
      ]
    )
    patterns = np.concatenate([patterns, patterns | np.uint32(0x80000000)])
    master = patterns.view(np.float32)
    param, remainder = jax.jit(split)(jnp.asarray(master))
    self.assertEqual((param.dtype, remainder.dtype), (BF16, jnp.int16))
    nan = np.isnan(master)
    # The parameter is the master rounded to nearest (ml_dtypes rounds independently)
    # but for a tie, which goes away from zero (ml_dtypes: to even).
    with np.errstate(invalid="ignore", over="ignore"):
      nearest = master.astype(ml_dtypes.bfloat16).view(np.uint16)
    high, low = patterns >> 16, patterns & 0xFFFF
    tie = (low == 0x8000) & ~nan
    expected = np.where(tie, high + 1, nearest).astype(np.uint16)
    got = np.asarray(param).view(np.uint16)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    self.assertGreater(int(np.sum(got[tie] != nearest[tie])), 2**15)  # half the ties differ
    # Past the largest bfloat16 by half an ulp and more: infinity, as the cast gives.
    past = ((high & 0x7FFF) == 0x7F7F) & tie
    self.assertTrue(np.all(np.isinf(np.asarray(param, np.float32)[past])))
    # A NaN stays a NaN of its sign (its payload may not carry into infinity or the sign).
    as_f32 = np.asarray(param, np.float32)
    self.assertTrue(np.all(np.isnan(as_f32[nan])))
    np.testing.assert_array_equal(np.signbit(as_f32[nan]), np.signbit(master[nan]))
    # The remainder is the master's low half; every master but a NaN comes back bit for
    # bit: zeros, subnormals, infinities, finite masters whose parameter is infinite.
    np.testing.assert_array_equal(np.asarray(remainder).view(np.uint16), low.astype(np.uint16))
    back = _bits32(jax.jit(join)(param, remainder))
    np.testing.assert_array_equal(back[~nan], patterns[~nan])
    self.assertTrue(np.all(np.isnan(back.view(np.float32)[nan])))

  def test_every_bfloat16_value_owns_two_to_the_sixteen_masters(self):
    # What makes the remainder exact: rounded ties away from zero, each nonzero finite
    # parameter (a zero: the 2**15 masters of its sign below half its ulp) is
    # the rounding of exactly 2**16 masters, as many as 16 bits tell apart; to nearest
    # even, an even one would have 2**16 + 1 (both halfway points) and an odd one
    # 2**16 - 1.
    from optax_lossscale._src.storage.rounding import round_half_away_bfloat16

    for param_bits in (0x3F80, 0x3F81, 0x0001, 0x8001, 0x7F7F):
      around = np.arange((param_bits << 16) - 2**16, (param_bits << 16) + 2**16, dtype=np.uint32)
      ours = np.asarray(jax.jit(round_half_away_bfloat16)(around.view(np.float32)))
      self.assertEqual(int(np.sum(ours.view(np.uint16) == param_bits)), 2**16, hex(param_bits))
      with np.errstate(over="ignore"):
        nearest = around.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
      self.assertEqual(
        int(np.sum(nearest == param_bits)), 2**16 + (1 if param_bits % 2 == 0 else -1)
      )

  @parameterized.parameters(sorted(INNERS))
  def test_200_steps_write_the_parameters_of_the_full_copy_bit_for_bit(self, inner):
    full = ols.master_weights(INNERS[inner]())
    split_tx = ols.master_weights(INNERS[inner](), store="remainder")
    run = lambda tx: jax.jit(lambda g, s, p: ols.apply_gradients(tx, g, s, p))
    step_full, step_split = run(full), run(split_tx)
    params = make_params()
    p_full, s_full, p_split, s_split = params, full.init(params), params, split_tx.init(params)
    self.assertEqual(s_split.master["w"].dtype, jnp.int16)
    self.assertIsNone(s_split.master["c"])  # float32: nothing to complete
    for i in range(200):
      grads = grads_of(p_full, batch(i))
      p_full, s_full = step_full(grads, s_full, p_full)
      p_split, s_split = step_split(grads, s_split, p_split)
      assert_bits_equal(p_split, p_full)
      assert_bits_equal(s_split.inner_state, s_full.inner_state)
    from optax_lossscale._src.storage.rounding import join_bfloat16 as join

    for name in ("w", "b"):
      np.testing.assert_array_equal(join(p_split[name], s_split.master[name]), s_full.master[name])
    self.assertFalse(bool(jnp.all(p_split["w"] == params["w"])))

  @parameterized.parameters(True, False)
  def test_inside_loss_scale_optimizer_with_nan_steps_skipped(self, fused):
    def make(store):
      return ols.loss_scale_optimizer(
        ols.master_weights(optax.adam(1e-3), store=store),
        ols.DynamicLossScale(SCALE, increment_period=1000),
      )

    def stepper(tx):
      @jax.jit
      def step(params, state, x, poison):
        grads = scaled_grads_of(params, x, state.loss_scale())
        grads = {**grads, "b": jnp.where(poison, jnp.nan, grads["b"])}
        if fused:
          return ols.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      return step

    full, split_tx = make("copy"), make("remainder")
    step_full, step_split = stepper(full), stepper(split_tx)
    params = make_params()
    p_full, s_full, p_split, s_split = params, full.init(params), params, split_tx.init(params)
    for i in range(200):
      poison = i % 37 == 5
      p_full, s_full = step_full(p_full, s_full, batch(i), poison)
      p_split, s_split = step_split(p_split, s_split, batch(i), poison)
      self.assertEqual(bool(s_split.last_step_applied), not poison)
      assert_bits_equal(p_split, p_full)
    self.assertEqual(int(s_split.total_skips), 6)
    assert_bits_equal(s_split.inner_state.inner_state, s_full.inner_state.inner_state)

  def test_float16_parameters_and_other_masters_are_refused(self):
    tx = ols.master_weights(optax.adam(1e-3), store="remainder")
    with self.assertRaisesRegex(ValueError, r"store='remainder'.*at \['h'\] is float16"):
      tx.init({"w": jnp.ones(2, BF16), "h": jnp.ones(2, jnp.float16)})
    with self.assertRaisesRegex(ValueError, r"master_dtype must then be float32"):
      ols.master_weights(optax.adam(1e-3), master_dtype=jnp.float16, store="remainder")
    with self.assertRaisesRegex(ValueError, r"store must be one of \('copy', 'remainder'\)"):
      ols.master_weights(optax.adam(1e-3), store="half")

  def test_two_bytes_per_parameter_instead_of_four(self):
    params = {"w": jnp.ones((8, 16), BF16)}
    bytes_of = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    copy = ols.master_weights(optax.sgd(0.1)).init(params)
    remainder = ols.master_weights(optax.sgd(0.1), store="remainder").init(params)
    self.assertEqual(bytes_of(copy.master), 4 * 128)
    self.assertEqual(bytes_of(remainder.master), 2 * 128)


class RemainderTrainingTest(parameterized.TestCase):
  """store='remainder' in a real run: the gradients come from the parameters written,
  so one master held differently would change the whole trajectory after it."""

  VOCAB, EMBED, HIDDEN = 64, 48, 384  # 100k parameters

  def _model(self):
    keys = jax.random.split(jax.random.key(3), 3)
    init = lambda k, shape: (jax.random.normal(k, shape) / np.sqrt(shape[0])).astype(BF16)
    params = {
      "embed": init(keys[0], (self.VOCAB, self.EMBED)),
      "w1": init(keys[1], (2 * self.EMBED, self.HIDDEN)),
      "w2": init(keys[2], (self.HIDDEN, self.VOCAB)),
      "b1": jnp.zeros(self.HIDDEN, jnp.float32),  # float32: kept as it is
    }

    def loss(params, tokens):
      # The next character from the two before it, computing in bfloat16.
      e = params["embed"][tokens[:, :-1]].reshape(tokens.shape[0], -1, 2 * self.EMBED)
      h = jnp.tanh(e @ params["w1"] + params["b1"].astype(BF16))
      logits = (h @ params["w2"]).astype(jnp.float32)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 2::2]))

    def batch(step):
      # A Markov chain: each character is followed by one of 4 (a learnable language).
      rng = np.random.default_rng(step)
      succ = np.random.default_rng(0).integers(0, self.VOCAB, (self.VOCAB, 4))
      tokens = np.empty((16, 33), np.int32)
      tokens[:, 0] = rng.integers(0, self.VOCAB, 16)
      for t in range(1, 33):
        tokens[:, t] = succ[tokens[:, t - 1], rng.integers(0, 4, 16)]
      return jnp.asarray(tokens)

    return params, jax.jit(jax.value_and_grad(loss)), batch

  def test_a_char_lm_trains_bit_for_bit_as_the_full_copy_and_the_master_loop(self):
    from optax_lossscale._src.storage.rounding import join_bfloat16 as join

    params, value_and_grad, batch = self._model()
    inner = lambda: optax.adamw(3e-3, weight_decay=1e-2)
    copy, split_tx = ols.master_weights(inner()), ols.master_weights(inner(), store="remainder")
    step = lambda tx: jax.jit(
      lambda g, s, p: ols.apply_gradients(tx, g, s, p), donate_argnums=(1, 2)
    )
    step_copy, step_split = step(copy), step(split_tx)
    p_copy, s_copy = jax.tree.map(jnp.copy, params), copy.init(params)
    p_split, s_split = jax.tree.map(jnp.copy, params), split_tx.init(params)
    # The hand-written loop: a float32 master, the parameters written from it (written()).
    ref_opt = inner()
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    ref_state, p_ref = ref_opt.init(master), params

    @jax.jit
    def ref_step(grads, state, master):
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      updates, state = ref_opt.update(grads, state, master)
      return optax.apply_updates(master, updates), state

    narrow = ("embed", "w1", "w2")
    ties_above_even, losses = 0, []
    for i in range(40):
      tokens = batch(i)
      loss, g_copy = value_and_grad(p_copy, tokens)
      _, g_split = value_and_grad(p_split, tokens)
      _, g_ref = value_and_grad(p_ref, tokens)
      losses.append(float(loss))
      p_copy, s_copy = step_copy(g_copy, s_copy, p_copy)
      p_split, s_split = step_split(g_split, s_split, p_split)
      master, ref_state = ref_step(g_ref, ref_state, master)
      p_ref = {k: written(v, BF16) if k in narrow else v for k, v in master.items()}
      for k in narrow:
        bits = _bits32(master[k])
        # A master rounding to nearest even would have written another parameter.
        ties_above_even += int(np.sum(((bits & 0xFFFF) == 0x8000) & ((bits >> 16) % 2 == 0)))
        np.testing.assert_array_equal(_bits32(join(p_split[k], s_split.master[k])), bits)
        np.testing.assert_array_equal(_bits32(s_copy.master[k]), bits)
      assert_bits_equal(p_split, p_ref)
      assert_bits_equal(p_copy, p_ref)
    # The run met the masters the old split could not hold (one in 2**17 element-steps),
    # and learned.
    self.assertGreater(ties_above_even, 0)
    self.assertLess(np.mean(losses[-5:]), np.mean(losses[:5]) - 0.3)
