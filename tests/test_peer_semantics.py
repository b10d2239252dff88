"""Where we claim a peer's behaviour, we have it (issue 17, items 4-9).

TensorFlow and Keras are not installed in the test environment: their
semantics are written down from their documentation (`tests/reference_models`
and the expectations below). jmp runs itself where it is installed.
"""

import json
import math
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests import reference_models

PARAMS = {"w": jnp.ones(2)}


class ScaledLossTest(chex.TestCase):
  """`get_scaled_loss`: callables (TensorFlow) and float32 promotion (jmp, Keras 3)."""

  def setUp(self):
    super().setUp()
    self.state = ols.loss_scale_optimizer(optax.sgd(1.0), 8.0).init(PARAMS)

  def test_a_callable_loss_gives_a_callable_scaled_loss(self):
    scaled = ols.get_scaled_loss(lambda x, y=1.0: x * y, self.state)
    assert callable(scaled)
    assert float(scaled(jnp.float32(0.5), y=3.0)) == 12.0
    grad = jax.grad(ols.get_scaled_loss(lambda w: jnp.sum(w**2), self.state))(jnp.ones(2))
    np.testing.assert_array_equal(grad, [16.0, 16.0])

  def test_what_is_not_a_floating_loss_is_refused_by_path(self):
    for loss, where in (
      ("loss", "str"),
      ({"a": jnp.float32(1.0), "b": jnp.int32(3)}, r"int32 at \['b'\]"),
      (object(), "object"),
      (True, "bool"),
    ):
      with pytest.raises(TypeError, match=f"floating loss.*{where}"):
        ols.get_scaled_loss(loss, self.state)
    # A Python number is a loss like any other.
    assert float(ols.get_scaled_loss(2, self.state)) == 16.0

  def test_a_half_precision_loss_is_scaled_in_float32(self):
    state = ols.loss_scale_optimizer(optax.sgd(1.0)).init(PARAMS)  # the default 2**15
    for dtype in (jnp.float16, jnp.bfloat16):
      out = ols.get_scaled_loss(jnp.asarray(16.0, dtype), state)
      assert out.dtype == jnp.float32 and float(out) == 16.0 * 2**15
    assert ols.get_scaled_loss(jnp.float32(1.0), state).dtype == jnp.float32

  def test_gradients_flow_back_in_the_model_dtype(self):
    state = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(2.0**10)).init(PARAMS)
    w16 = jnp.full(2, 0.5, jnp.float16)
    loss_fn = lambda w: jnp.sum(w * w)  # a float16 loss
    grads = jax.grad(lambda w: ols.get_scaled_loss(loss_fn(w), state))(w16)
    assert grads.dtype == jnp.float16
    np.testing.assert_array_equal(grads, np.full(2, 1024.0, np.float16))
    loss, grads = ols.value_and_grad(loss_fn)(state, w16)
    assert loss.dtype == jnp.float16 and grads.dtype == jnp.float16

  def test_scaling_matches_jmp(self):
    jmp = pytest.importorskip("jmp")
    theirs = jmp.DynamicLossScale(jnp.float32(2**15))
    ours = ols.DynamicLossScale(2**15)
    for loss in (jnp.float16(16.0), jnp.bfloat16(3.0), jnp.float32(0.25)):
      a, b = ours.scale(loss), theirs.scale(loss)
      assert a.dtype == b.dtype and float(a) == float(b)


class SteppedLossScaleTest(chex.TestCase):
  """Item 5: the wrapper starts where its config says, as TensorFlow restarts."""

  def test_a_stepped_scale_restarts_from_its_initial_state_with_a_warning(self):
    ls = ols.DynamicLossScale(2.0**10, increment_period=2)
    for _ in range(3):
      ls = ls.adjust(True)  # 2**11 after two finite steps, counter 1
    with pytest.warns(UserWarning, match=r"initial state .*scale 1024.*current state .*2048"):
      tx = ols.loss_scale_optimizer(optax.sgd(1.0), ls)
    again = ols.LossScaleOptimizer.from_config(tx.get_config(), optax.sgd(1.0))
    for wrapper in (tx, again):
      state = wrapper.init(PARAMS)
      assert float(ols.get_loss_scale(state)()) == 1024.0
      assert int(ols.get_loss_scale(state).counter) == 0
    grads = {"w": jnp.full(2, 1024.0)}
    chex.assert_trees_all_equal(
      tx.update(grads, tx.init(PARAMS), PARAMS), again.update(grads, again.init(PARAMS), PARAMS)
    )

  def test_a_fresh_scale_gives_no_warning(self):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(2.0**10))
      ols.loss_scale_optimizer(optax.sgd(1.0), ols.FixedLossScale(4.0))


class KerasTableTest(chex.TestCase):
  """Item 7: every Keras attribute of the README's table, on both kinds, with TF's values."""

  def test_attributes_of_a_dynamic_and_a_fixed_wrapper(self):
    inner = optax.sgd(0.1)
    expected = {
      # kind: (dynamic, initial_scale, dynamic_growth_steps, loss_scale, dynamic_counter)
      "dynamic": (True, 1024.0, 100, 1024.0, 0),
      "fixed": (False, 128.0, None, 128.0, None),
    }
    built = {
      "dynamic": ols.loss_scale_optimizer(inner, initial_scale=1024, dynamic_growth_steps=100),
      "fixed": ols.loss_scale_optimizer(inner, dynamic=False, initial_scale=128),
    }
    for kind, tx in built.items():
      state = tx.init(PARAMS)
      counter = ols.get_loss_scale(state).counter
      got = (
        tx.dynamic,
        tx.initial_scale,
        tx.dynamic_growth_steps,
        float(ols.get_loss_scale(state)()),
        None if counter is None else int(counter),
      )
      assert got == expected[kind], kind
      assert tx.inner_optimizer is inner
      assert json.loads(json.dumps(tx.get_config()))["dynamic"] == expected[kind][0]
    assert ols.NoOpLossScale().counter is None

  def test_keras_config_forms_are_read(self):
    keras2 = {
      "inner_optimizer": {"class_name": "SGD", "config": {}},
      "dynamic": True,
      "initial_scale": 256.0,
      "dynamic_growth_steps": 10,
    }
    keras2_fixed = {**keras2, "dynamic": False, "dynamic_growth_steps": None}
    keras2_legacy = {
      "optimizer": {},
      "loss_scale": {
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 256.0, "increment_period": 10, "multiplier": 2.0},
      },
    }
    keras3 = {
      "name": "loss_scale_optimizer",
      "inner_optimizer": {},
      "initial_scale": 256.0,
      "dynamic_growth_steps": 10,
    }
    for config, dynamic, growth in (
      (keras2, True, 10),
      (keras2_fixed, False, None),
      (keras3, True, 10),
    ):
      tx = ols.LossScaleOptimizer.from_config(config, optax.sgd(0.1))
      assert (tx.dynamic, tx.initial_scale, tx.dynamic_growth_steps) == (dynamic, 256.0, growth)
    legacy = ols.LossScaleOptimizer.from_config(keras2_legacy, optax.sgd(0.1))
    assert (legacy.dynamic, legacy.initial_scale, legacy.dynamic_growth_steps) == (True, 256.0, 10)
    with pytest.raises(ValueError, match="'loss_scale' or 'initial_scale'"):
      ols.LossScaleOptimizer.from_config({"name": "x"}, optax.sgd(0.1))


class WholeNumbersTest(chex.TestCase):
  """Item 8: whole-number floats and NumPy/JAX scalars, as TensorFlow and jmp accept them."""

  def test_whole_number_floats_are_taken_and_fractions_refused(self):
    tx = ols.loss_scale_optimizer(optax.sgd(1.0), dynamic_growth_steps=2.0)
    assert tx.dynamic_growth_steps == 2 and isinstance(tx.dynamic_growth_steps, int)
    ls = ols.DynamicLossScale(increment_period=np.float64(3.0), hysteresis=jnp.float32(2.0))
    assert (ls.increment_period, ls.hysteresis) == (3, 2)
    for bad in (2.5, math.inf, math.nan, True, "3"):
      with pytest.raises(ValueError, match="increment_period"):
        ols.DynamicLossScale(increment_period=bad)
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
      ols.loss_scale_optimizer(optax.sgd(1.0), dynamic_growth_steps=2.5)

  def test_jmp_period_as_a_float_gives_jmp_trajectory(self):
    jmp = pytest.importorskip("jmp")
    flags = [True] * 6 + [False] + [True] * 5
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**10), period=5.0)
    ours = ols.DynamicLossScale(2.0**10, increment_period=5.0)
    for finite in flags:
      theirs, ours = theirs.adjust(jnp.asarray(finite)), ours.adjust(finite)
      assert float(theirs.loss_scale) == float(ours())

  def test_scalar_arrays_are_numbers(self):
    for value in (jnp.float32(128), np.float64(128.0), np.int32(128), jnp.asarray(128)):
      tx = ols.loss_scale_optimizer(optax.sgd(1.0), value)
      assert not tx.dynamic and tx.initial_scale == 128.0
      assert ols.get(value) == ols.FixedLossScale(128.0)
    for bad in (jnp.ones(2), jnp.asarray(True)):
      with pytest.raises(ValueError, match="Cannot interpret"):
        ols.get(bad)

  def test_axis_name_is_checked_when_the_wrapper_is_built(self):
    for bad in (("data", None), [["data"]], True, ()):
      for build in (ols.loss_scale_optimizer, ols.skip_bad_steps):
        with pytest.raises(TypeError, match="axis_name"):
          build(optax.sgd(1.0), axis_name=bad)
    assert ols.loss_scale_optimizer(optax.sgd(1.0), axis_name=["a", "b"]).axis_name == ("a", "b")


class Keras3Test(chex.TestCase):
  """Item 9: Keras 3's rule (halving without a floor), its config and its refusals."""

  def test_the_keras3_row_gives_keras3_trajectory_below_one(self):
    flags = [False] * 6 + [True] * 3 + [False] + [True] * 7
    expected = reference_models.keras3_trajectory(flags, initial_scale=4.0, dynamic_growth_steps=3)
    ours = ols.DynamicLossScale(
      4.0, increment_period=3, min_loss_scale=float(jnp.finfo(jnp.float32).tiny)
    )
    got = []
    for finite in flags:
      ours = ours.adjust(finite)
      got.append(np.float32(ours()))
    assert got == expected
    assert min(got) == np.float32(1 / 16)
    # The keyword form is TensorFlow's rule: it floors at 1, where Keras 3 does not.
    floored = ols.DynamicLossScale(4.0, increment_period=3)
    for finite in flags[:6]:
      floored = floored.adjust(finite)
    assert float(floored()) == 1.0

  def test_inner_optimizer_options_are_refused_naming_the_optax_transformation(self):
    cases = {
      "weight_decay": (1e-4, "add_decayed_weights"),
      "clipnorm": (1.0, "clip_by_block_rms"),
      "global_clipnorm": (1.0, "clip_by_global_norm"),
      "clipvalue": (1.0, r"optax\.clip\("),
      "use_ema": (True, "moving average"),
      "ema_momentum": (0.9, "moving average"),
      "ema_overwrite_frequency": (10, "moving average"),
      "loss_scale_factor": (128.0, "FixedLossScale"),
      "gradient_accumulation_steps": (4, "MultiSteps"),
    }
    for name, (value, fix) in cases.items():
      with pytest.raises(ValueError, match=rf"does not take {name}=.*{fix}"):
        ols.loss_scale_optimizer(optax.sgd(1.0), **{name: value})
    # Keras 3 accepts them at their defaults, and so do we.
    ols.loss_scale_optimizer(optax.sgd(1.0), use_ema=False, ema_momentum=0.99, clipnorm=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rate'"):
      ols.loss_scale_optimizer(optax.sgd(1.0), learning_rate=0.1)
