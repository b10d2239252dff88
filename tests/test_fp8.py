"""fp8 overwrite-with-gradient leaves, handled by both wrappers (issue 18).

The model is a real Flax fp8 layer (`flax.linen.fp8_ops.Fp8Einsum`, XLA
emulates fp8 on CPU): its `_overwrite_with_gradient` collection holds scales
and amax histories whose "gradient" is their new value. Expectations are
independent of the wrappers: the new values come from `jax.grad` itself.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

nn = pytest.importorskip("flax.linen")
fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
from optax_lossscale.flax import TrainState  # noqa: E402

OWG = "_overwrite_with_gradient"


class Fp8Net(nn.Module):
  dtype: object = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    for width in (16, 4):
      kernel = self.param(f"k{width}", nn.initializers.lecun_normal(), (x.shape[-1], width))
      x = fp8_ops.Fp8Einsum(name=f"fp8_{width}")(
        "bi,io->bo",
        x.astype(self.dtype),
        kernel.astype(self.dtype),
        preferred_element_type=jnp.float32,
      ).astype(self.dtype)
    return x


MODEL = Fp8Net()
X = jax.random.normal(jax.random.key(0), (8, 6))
Y = jax.random.normal(jax.random.key(1), (8, 4))
VARIABLES = MODEL.init(jax.random.key(2), X)


def loss_fn(variables, x=X, y=Y):
  return jnp.mean((MODEL.apply(variables, x).astype(jnp.float32) - y) ** 2)


def scaled_grads(variables, scale, x=X):
  return jax.grad(lambda v: loss_fn(v, x) * scale)(variables)


def wrappers():
  return {
    "loss_scale": ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**10)),
    "skip_bad_steps": ols.skip_bad_steps(optax.adam(1e-2), spike_threshold=4.0),
  }


def grads_for(kind, variables, x=X):
  return scaled_grads(variables, 2.0**10 if kind == "loss_scale" else 1.0, x)


def assert_bits_equal(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


class MarkedLeavesTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_written_bit_for_bit_on_apply_and_untouched_on_skip(self):
    for kind, tx in wrappers().items():
      step = self.variant(lambda g, s, p, tx=tx: ols.apply_gradients(tx, g, s, p))
      state = tx.init(VARIABLES)
      grads = grads_for(kind, VARIABLES)
      params, state = step(grads, state, VARIABLES)
      assert bool(ols.metrics(state)["last_step_applied"]), kind
      # Scales and histories hold exactly what the layers computed (no unscaling,
      # no optimizer); the loss-scale wrapper's scale has not changed (factor 1).
      assert_bits_equal(params[OWG], grads[OWG])
      assert not jnp.array_equal(params["params"]["k16"], VARIABLES["params"]["k16"])
      bad = grads_for(kind, params, X.at[0, 0].set(jnp.nan))
      again, state = step(bad, state, params)
      assert not bool(ols.metrics(state)["last_step_applied"]), kind
      assert_skipped(kind, params, again)

  def test_the_inner_optimizer_has_no_state_for_them(self):
    for tx in wrappers().values():
      state = tx.init(VARIABLES)
      mu = state.inner_state[0].mu
      assert all(
        isinstance(m, optax.MaskedNode)
        for m in jax.tree.leaves(mu[OWG], is_leaf=lambda x: isinstance(x, optax.MaskedNode))
      )
      assert jax.tree.structure(mu["params"]) == jax.tree.structure(VARIABLES["params"])

  def test_the_scaled_output_gradient_amax_is_written_as_scaled(self):
    tx = wrappers()["loss_scale"]
    grads = grads_for("loss_scale", VARIABLES)
    params, _ = ols.apply_gradients(tx, grads, tx.init(VARIABLES), VARIABLES)
    unscaled = scaled_grads(VARIABLES, 1.0)
    for layer in ("fp8_16", "fp8_4"):
      written = params[OWG][layer]["output_grad_amax_history"][0]
      plain = unscaled[OWG][layer]["output_grad_amax_history"][0]
      # In units of the scale (2**10), as the scaled cotangent it quantizes.
      np.testing.assert_allclose(written, plain * 2.0**10, rtol=1e-2)
      assert written == grads[OWG][layer]["output_grad_amax_history"][0]

  def test_a_nan_in_the_metadata_alone_skips_the_step(self):
    for kind, tx in wrappers().items():
      grads = grads_for(kind, VARIABLES)
      path = grads[OWG]["fp8_16"]
      grads[OWG]["fp8_16"] = {**path, "input_scale": jnp.full((1,), jnp.nan)}
      params, state = ols.apply_gradients(tx, grads, tx.init(VARIABLES), VARIABLES)
      assert not bool(ols.metrics(state)["last_step_applied"]), kind
      assert_skipped(kind, VARIABLES, params)

  def test_spike_norm_leaves_the_metadata_out(self):
    tx = ols.skip_bad_steps(optax.sgd(0.0), spike_threshold=4.0)
    grads = grads_for("skip_bad_steps", VARIABLES)
    _, state = ols.apply_gradients(tx, grads, tx.init(VARIABLES), VARIABLES)
    expected = jnp.sqrt(
      sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads["params"]))
    )
    np.testing.assert_allclose(ols.metrics(state)["grad_norm"], expected, rtol=1e-6)

  def test_the_update_path_warns_and_gives_new_minus_old(self):
    tx = wrappers()["skip_bad_steps"]
    grads = grads_for("skip_bad_steps", VARIABLES)
    with pytest.warns(UserWarning, match="within one rounding"):
      updates, _ = tx.update(grads, tx.init(VARIABLES), VARIABLES)
    chex.assert_trees_all_close(optax.apply_updates(VARIABLES, updates)[OWG], grads[OWG], rtol=1e-6)
    with pytest.raises(ValueError, match="need the params"):
      tx.update(grads, tx.init(VARIABLES))

  def test_rescaled_with_the_loss_scale_on_growth_and_backoff(self):
    tx = ols.loss_scale_optimizer(optax.sgd(0.0), ols.DynamicLossScale(2.0**10, increment_period=1))
    state, params = tx.init(VARIABLES), VARIABLES
    grads = grads_for("loss_scale", params)
    params, state = ols.apply_gradients(tx, grads, state, params)  # grows to 2**11
    assert float(ols.get_loss_scale(state)()) == 2.0**11
    for name, value in _meta(params).items():
      factor = 2.0 if _in_loss_scale_units(name) else 1.0
      np.testing.assert_array_equal(value, _meta({OWG: grads[OWG]})[name] * factor, err_msg=name)


_GRAD_META = ("output_grad_amax_history", "output_grad_scale")


def _in_loss_scale_units(name):
  return any(name.endswith(f"['{leaf}']") for leaf in _GRAD_META)


def assert_skipped(kind, before, after):
  """Untouched by a skipped step, but for the metadata in units of a loss scale that halved."""
  if kind == "skip_bad_steps":
    assert_bits_equal(after, before)
    return
  assert_bits_equal(after["params"], before["params"])
  for name, value in _meta(after).items():
    expected = _meta(before)[name] * (0.5 if _in_loss_scale_units(name) else 1.0)
    np.testing.assert_array_equal(value, expected, err_msg=name)


def _meta(params):
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params[OWG])}


class MarkingTest(chex.TestCase):
  def test_a_mask_tree_and_a_predicate_mark_the_same_leaves_as_auto(self):
    grads = grads_for("skip_bad_steps", VARIABLES)
    mask = {"params": False, OWG: True}
    predicate = lambda path, leaf: jax.tree_util.keystr(path).startswith(f"['{OWG}']")
    results = []
    for spec in ("auto", mask, predicate):
      tx = ols.skip_bad_steps(optax.adam(1e-2), overwrite_with_gradient=spec)
      results.append(ols.apply_gradients(tx, grads, tx.init(VARIABLES), VARIABLES))
    chex.assert_trees_all_equal(results[0], results[1])
    chex.assert_trees_all_equal(results[0], results[2])

  def test_none_marks_nothing_and_adam_then_moves_the_metadata(self):
    tx = ols.skip_bad_steps(optax.adam(1e-2), overwrite_with_gradient=None)
    grads = grads_for("skip_bad_steps", VARIABLES)
    params, _ = ols.apply_gradients(tx, grads, tx.init(VARIABLES), VARIABLES)
    assert not jnp.array_equal(
      params[OWG]["fp8_16"]["input_scale"], grads[OWG]["fp8_16"]["input_scale"]
    )

  def test_a_mask_that_does_not_match_the_params_is_a_clear_error(self):
    for spec, error, match in (
      ({"params": False}, ValueError, "does not match the params' structure"),
      ({"params": False, OWG: "yes"}, TypeError, "concrete bool"),
      (lambda path, leaf: 1, TypeError, "concrete bool"),
      ("flax", ValueError, "overwrite_with_gradient must be"),
    ):
      with pytest.raises(error, match=match):
        ols.skip_bad_steps(optax.sgd(0.1), overwrite_with_gradient=spec).init(VARIABLES)

  def test_a_transformation_after_a_writing_wrapper_is_refused(self):
    tx = optax.chain(wrappers()["loss_scale"], optax.scale(0.5))
    state = tx.init(VARIABLES)
    with pytest.raises(ValueError, match="would transform the values it writes"):
      tx.update(grads_for("loss_scale", VARIABLES), state, VARIABLES)


class AccumulationTest(chex.TestCase):
  def test_multisteps_inside_never_averages_them_each_micro_step_writes(self):
    inner = optax.MultiSteps(optax.adam(1e-2), 3).gradient_transformation()
    tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(2.0**10))
    state, params = tx.init(VARIABLES), VARIABLES
    assert not jax.tree.leaves(state.inner_state.acc_grads[OWG])  # no accumulator for them
    for i in range(3):
      grads = grads_for("loss_scale", params, X * (i + 1))
      params, state = ols.apply_gradients(tx, grads, state, params)
      # After each micro-step they hold that micro-batch's values, not a mean.
      assert_bits_equal(params[OWG], grads[OWG])
    assert int(state.inner_state.gradient_step) == 1


class FlaxTrainStateTest(chex.TestCase):
  def make(self, tx):
    return TrainState.create(apply_fn=MODEL.apply, params=VARIABLES, tx=tx)

  @chex.variants(with_jit=True, without_jit=True)
  def test_train_state_detects_the_collection_and_writes_it(self):
    state = self.make(wrappers()["loss_scale"])
    step = self.variant(
      lambda s, x: s.apply_gradients(
        grads=ols.value_and_grad(lambda v: loss_fn(v, x))(s, s.params)[1]
      )
    )
    grads = scaled_grads(state.params, 2.0**10)
    new = step(state, X)
    assert_bits_equal(new.params[OWG], grads[OWG])
    skipped = step(new, X.at[0, 0].set(jnp.inf))
    assert int(skipped.step) == 1
    assert_bits_equal(skipped.params["params"], new.params["params"])

  def test_scan_writes_what_eager_steps_write(self):
    state = self.make(wrappers()["skip_bad_steps"])
    xs = jnp.stack([X, X.at[0, 0].set(jnp.nan), X * 2])

    def body(s, x):
      s = s.apply_gradients(grads=jax.grad(lambda v: loss_fn(v, x))(s.params))
      return s, s.params[OWG]

    final, written = jax.lax.scan(body, state, xs)
    assert int(final.step) == 2
    eager = state
    for i, x in enumerate(xs):
      eager, _ = body(eager, x)
      # The amax and scale arithmetic of two XLA programs may differ in a last
      # bit on an accelerator; on CPU the scan writes exactly what eager writes.
      got = jax.tree.map(lambda w, i=i: w[i], written)
      if jax.default_backend() == "cpu":
        assert_bits_equal(got, eager.params[OWG])
      else:
        chex.assert_trees_all_close(got, eager.params[OWG], rtol=1e-6)
    # The NaN step (index 1) left them as the first step wrote them: bit for bit.
    assert_bits_equal(jax.tree.map(lambda w: w[1], written), jax.tree.map(lambda w: w[0], written))

  def test_a_chain_around_the_wrapper_is_refused_with_fp8(self):
    with pytest.raises(ValueError, match=r"only the\s+wrapper itself"):
      self.make(optax.chain(wrappers()["loss_scale"]))

  def test_orbax_resume_is_exact(self, tmp_path=None):
    ocp = pytest.importorskip("orbax.checkpoint")
    import tempfile

    from optax_lossscale.flax import restore_checkpoint, save_checkpoint

    state = self.make(wrappers()["loss_scale"])
    step = jax.jit(
      lambda s, x: s.apply_gradients(
        grads=ols.value_and_grad(lambda v: loss_fn(v, x))(s, s.params)[1]
      )
    )
    for i in range(3):
      state = step(state, X * (i + 1))
    with tempfile.TemporaryDirectory() as d:
      save_checkpoint(f"{d}/ckpt", state)
      target = jax.eval_shape(lambda: self.make(wrappers()["loss_scale"]))
      restored = restore_checkpoint(f"{d}/ckpt", target)
    del ocp
    assert_bits_equal(restored.params, state.params)
    assert_bits_equal(step(restored, X).params, step(state, X).params)


def test_no_warning_on_the_fused_path():
  tx = wrappers()["loss_scale"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ols.apply_gradients(tx, grads_for("loss_scale", VARIABLES), tx.init(VARIABLES), VARIABLES)
