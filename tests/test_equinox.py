"""Loss scaling with Equinox: `optax_lossscale.equinox` and `examples/equinox_fp16.py`."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from tests.example_loader import load_example

eqx = pytest.importorskip("equinox")
from optax_lossscale.equinox import filter_value_and_grad  # noqa: E402

SCALE = 2.0**6  # a power of two: grad(S * loss) == S * grad(loss) bit for bit


def _model():
  return eqx.nn.MLP(3, 1, width_size=8, depth=1, key=jax.random.PRNGKey(0))


def _data(bad=False):
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
  if bad:
    x = x.at[0, 1].set(jnp.inf)
  return x, jnp.sum(x, axis=1, keepdims=True)


def _loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _arrays(model):
  return eqx.filter(model, eqx.is_inexact_array)


class FilterValueAndGradTest(chex.TestCase):
  @pytest.mark.filterwarnings("error")
  def test_unscaled_loss_and_scaled_grads_with_and_without_filter_jit(self):
    model, (x, y) = _model(), _data()
    for transform in (lambda f: f, eqx.filter_jit):
      # The reference compiled alike: two XLA programs may round differently.
      ref_loss, ref_grads = transform(eqx.filter_value_and_grad(_loss))(model, x, y)
      fn = transform(filter_value_and_grad(_loss))
      loss, grads = fn(ols.DynamicLossScale(SCALE), model, x, y)
      self.assertEqual(float(loss), float(ref_loss))
      chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: g * SCALE, ref_grads))
      # Shaped like the module, None where it holds no array (its activations).
      self.assertIsNone(grads.activation)
      self.assertEqual(jax.tree.structure(grads), jax.tree.structure(_arrays(model)))

  def test_has_aux_returns_the_aux_and_checks_the_pair(self):
    model, (x, y) = _model(), _data()
    fun = lambda m, x, y: (_loss(m, x, y), {"n": x.shape[0]})
    (loss, aux), _ = filter_value_and_grad(fun, has_aux=True)(
      ols.FixedLossScale(SCALE), model, x, y
    )
    self.assertEqual((float(loss), aux), (float(_loss(model, x, y)), {"n": 4}))
    with pytest.raises(TypeError, match="has_aux=False"):
      filter_value_and_grad(_loss, has_aux=True)(ols.FixedLossScale(SCALE), model, x, y)

  def test_the_wrapper_skips_an_overflowing_step_and_applies_a_finite_one(self):
    model = _model()
    params = _arrays(model)
    tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(SCALE))
    opt_state = tx.init(params)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
      loss, grads = filter_value_and_grad(_loss)(
        opt_state, model, x, y
      )  # the state holds the scale
      params, opt_state = ols.apply_gradients(tx, grads, opt_state, _arrays(model))
      return eqx.combine(params, model), opt_state, loss

    skipped, opt_state, _ = step(model, opt_state, *_data(bad=True))
    chex.assert_trees_all_equal(_arrays(skipped), params)  # bit for bit
    self.assertIs(skipped.activation, model.activation)
    self.assertEqual(float(ols.get_loss_scale(opt_state)()), SCALE / 2)
    applied, opt_state, loss = step(skipped, opt_state, *_data())
    self.assertTrue(math.isfinite(float(loss)))
    self.assertTrue(bool(ols.metrics(opt_state)["last_step_applied"]))
    self.assertFalse(np.array_equal(applied.layers[0].weight, model.layers[0].weight))

  def test_skip_bad_steps_with_eqx_apply_updates(self):
    model, (x, y) = _model(), _data(bad=True)
    tx = ols.skip_bad_steps(optax.sgd(0.1))
    opt_state = tx.init(_arrays(model))
    _, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, _arrays(model))
    new_model = eqx.apply_updates(model, updates)
    chex.assert_trees_all_equal(_arrays(new_model), _arrays(model))
    self.assertEqual(int(ols.metrics(opt_state)["nonfinite_skips"]), 1)

  def test_rejects_a_function_that_is_not_callable(self):
    with pytest.raises(TypeError, match="callable"):
      filter_value_and_grad("loss")


pytest.importorskip("sklearn")
example = load_example("equinox_fp16.py", "optax_lossscale_equinox_example")
CI_STEPS = 40


@pytest.fixture(scope="module")
def results():
  return example.run_all(CI_STEPS, seed=0)


def test_float16_with_loss_scaling_tracks_float32(results):
  reference, scaled = results["float32"], results["float16 + loss scaling"]
  assert scaled.final_loss == pytest.approx(reference.final_loss, rel=0.02)
  assert scaled.final_scale is not None and scaled.final_scale >= 1
  assert reference.final_loss < results["float32"].losses[0]


def test_nan_batch_ruins_the_unguarded_bfloat16_run_and_is_skipped_by_the_guard(results):
  bad = example.nan_step(CI_STEPS)
  unguarded = results["bfloat16 + NaN batch"]
  assert all(math.isfinite(v) for v in unguarded.losses[:bad])
  assert math.isnan(unguarded.final_loss)
  guarded = results["bfloat16 + NaN batch + skip_bad_steps"]
  assert guarded.skipped_steps == [bad]
  assert guarded.final_loss == pytest.approx(results["float32"].final_loss, rel=0.05)


def test_table_and_arguments(results, capsys):
  table = example.format_table(results)
  assert len(table.splitlines()) == 2 + len(example.RUNS)
  row = next(line for line in table.splitlines() if line.startswith(example.RUNS[-1]))
  assert row.rstrip().endswith(str(example.nan_step(CI_STEPS)))
  with pytest.raises(SystemExit):
    example.parse_args(["--steps", "1"])
  assert "--steps must be at least 2" in capsys.readouterr().err
