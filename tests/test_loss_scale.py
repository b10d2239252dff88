"""Tests for the loss scales: pytree contract, arithmetic, algorithm, validation."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle

import chex
from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from tests import reference_models

F32_MAX = float(np.finfo(np.float32).max)

ALL_SCALES = [
  ols.NoOpLossScale(),
  ols.FixedLossScale(128.0),
  ols.DynamicLossScale(),
  ols.DynamicLossScale(
    1024,
    7,
    3.0,
    min_loss_scale=0.5,
    max_loss_scale=1e6,
    backoff_factor=0.25,
    hysteresis=3,
    consecutive_hysteresis=True,
  ),
]
SCALE_IDS = ["noop", "fixed", "dynamic", "dynamic_all_knobs"]


def flags_to_grads(finite: bool) -> dict[str, jax.Array]:
  return {"w": jnp.array([1.0, 2.0 if finite else jnp.nan]), "b": None}


# -- the pytree contract ------------------------------------------------------


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_leaves_are_only_the_changing_state(ls):
  leaves = jax.tree.leaves(ls)
  if isinstance(ls, ols.DynamicLossScale):
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32, jnp.int32]
    assert all(x.shape == () for x in leaves)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ls)]
    assert paths == [".loss_scale", ".counter", ".hysteresis_tracker"]
  else:
    assert leaves == []


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_hyperparameters_survive_transformations(ls):
  config = ls.get_config()
  leaves, treedef = jax.tree.flatten(ls)
  assert jax.tree.unflatten(treedef, leaves).get_config() == config
  assert jax.jit(lambda x: x)(ls).get_config() == config
  assert jax.tree.map(lambda x: x + 0, ls).get_config() == config
  abstract = jax.eval_shape(lambda x: x, ls)
  assert abstract.get_config() == config
  assert jax.jit(lambda x: x.update(flags_to_grads(False))[0])(ls).get_config() == config


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_unflatten_accepts_arbitrary_leaves(ls):
  treedef = jax.tree.structure(ls)
  for fill in (object(), jax.ShapeDtypeStruct((), jnp.float32), None, "text"):
    rebuilt = jax.tree.unflatten(treedef, [fill] * treedef.num_leaves)
    assert type(rebuilt) is type(ls)
    assert rebuilt.get_config() == ls.get_config()


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_assigning_an_attribute_raises(ls):
  with pytest.raises(dataclasses.FrozenInstanceError):
    ls.loss_scale = jnp.float32(2.0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    ls.anything_new = 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    del ls.loss_scale


def test_replace_changes_state_only():
  ls = ols.DynamicLossScale(8.0, 5)
  new = ls.replace(counter=jnp.int32(3))
  assert int(new.counter) == 3 and int(ls.counter) == 0
  assert new.get_config() == ls.get_config()
  with pytest.raises(TypeError, match="increment_period"):
    ls.replace(increment_period=3)


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_call_returns_float32_scalar(ls):
  value = ls()
  assert isinstance(value, jax.Array)
  assert value.dtype == jnp.float32 and value.shape == ()
  np.testing.assert_array_equal(value, ls.loss_scale)


def test_dynamic_call_is_the_leaf():
  ls = ols.DynamicLossScale(64.0)
  assert ls() is ls.loss_scale


def test_one_trace_per_gradient_structure():
  traces = []

  @jax.jit
  def step(ls, grads):
    traces.append(1)
    return ls.update(grads)

  ls = ols.DynamicLossScale(4.0, 2)
  for finite in [True, False, True, True, True, False]:
    ls, _ = step(ls, flags_to_grads(finite))
  assert len(traces) == 1


# -- scale and unscale -----------------------------------------------------------


def test_unscale_is_bit_exact():
  rng = np.random.default_rng(0)
  grads = rng.standard_normal((1000,)).astype(np.float32) * 1e4
  for value in (2.0**15, 2.0**-3, 123.0, 3.0):
    ls = (
      ols.FixedLossScale(value) if value >= 1 else ols.DynamicLossScale(value, min_loss_scale=value)
    )
    # Multiplication by the float32 reciprocal, as Keras does ...
    expected = grads * (np.float32(1) / np.float32(value))
    np.testing.assert_array_equal(ls.unscale(grads), expected)
    np.testing.assert_array_equal(jax.jit(ls.unscale)(grads), expected)
    np.testing.assert_array_equal(ls.scale(grads), grads * np.float32(value))
    if math.log2(value).is_integer():  # ... which is exact division for powers of two.
      np.testing.assert_array_equal(ls.unscale(grads), grads / np.float32(value))


def test_scale_promotes_narrow_floats_unscale_keeps_dtypes_other_leaves_pass_through():
  ls = ols.DynamicLossScale(2.0**10)
  float0 = np.zeros((2,), dtype=jax.dtypes.float0)
  tree = {
    "f32": jnp.ones(3, jnp.float32),
    "f16": jnp.ones(3, jnp.float16),
    "bf16": jnp.ones(3, jnp.bfloat16),
    "c64": jnp.ones(2, jnp.complex64),
    "int": jnp.arange(3, dtype=jnp.int32),
    "bool": jnp.array([True, False]),
    "float0": float0,
    "none": None,
  }
  # A loss narrower than float32 is scaled in float32, as jmp and Keras 3 do.
  f32, c64 = jnp.float32, jnp.complex64
  scaled_dtypes = {"f32": f32, "f16": f32, "bf16": f32, "c64": c64}
  unscaled_dtypes = {name: tree[name].dtype for name in scaled_dtypes}
  for out, factor, dtypes in (
    (ls.scale(tree), 1024.0, scaled_dtypes),
    (ls.unscale(tree), 1 / 1024.0, unscaled_dtypes),
  ):
    for name in ("f32", "f16", "bf16", "c64"):
      assert out[name].dtype == dtypes[name]
      np.testing.assert_array_equal(
        np.asarray(out[name], np.complex128), np.full(tree[name].shape, factor)
      )
    assert out["int"] is tree["int"]
    assert out["bool"] is tree["bool"]
    assert out["float0"] is float0
    assert out["none"] is None


def test_float16_scaling_does_not_overflow_the_scale_itself():
  # 2**16 is inf in float16; the product 0.0625 * 2**16 = 4096 is not.
  ls = ols.FixedLossScale(2.0**16)
  out = ls.scale(jnp.float16(0.0625))
  assert out.dtype == jnp.float32
  assert float(out) == 4096.0
  # A float16 loss of 16 at the default scale is not inf: it is scaled in float32.
  assert float(ols.DynamicLossScale().scale(jnp.float16(16.0))) == 16.0 * 2**15
  # The scaled loss is the float32 product exactly; unscaling float16 gradients
  # equals native float16 arithmetic for scales float16 can hold.
  x = jnp.asarray(np.random.default_rng(1).standard_normal(256), jnp.float16)
  np.testing.assert_array_equal(
    ols.FixedLossScale(2.0**8).scale(x), np.asarray(x, np.float32) * np.float32(256)
  )
  np.testing.assert_array_equal(ols.FixedLossScale(2.0**8).unscale(x), x / jnp.float16(256))


def test_scale_accepts_python_scalar_loss():
  out = ols.FixedLossScale(4.0).scale(1.5)
  assert float(out) == 6.0


def test_noop_is_identity():
  ls = ols.NoOpLossScale()
  tree = {"a": jnp.ones(2)}
  assert ls.scale(tree) is tree
  assert ls.unscale(tree) is tree


# -- update semantics -------------------------------------------------------------


@pytest.mark.parametrize("cls_ls", [ols.NoOpLossScale(), ols.FixedLossScale(8.0)])
def test_static_scales_always_apply_and_never_change(cls_ls):
  for grads in (flags_to_grads(False), {"w": jnp.array([jnp.inf])}, None):
    new, should_apply = cls_ls.update(grads)
    assert bool(should_apply)
    assert should_apply.dtype == jnp.bool_ and should_apply.shape == ()
    assert new == cls_ls


def test_dynamic_hand_computed_trajectory():
  # period 2, multiplier 2, from 4: grow every 2 finite steps, halve on overflow.
  ls = ols.DynamicLossScale(4.0, 2)
  pattern = [True, True, True, False, True, True, False, False, False, False]
  expected_scale = [4, 8, 8, 4, 4, 8, 4, 2, 1, 1]
  expected_counter = [1, 0, 1, 0, 1, 0, 0, 0, 0, 0]
  for finite, scale, counter in zip(pattern, expected_scale, expected_counter, strict=True):
    ls, should_apply = ls.update(flags_to_grads(finite))
    assert bool(should_apply) == finite
    assert float(ls()) == scale
    assert int(ls.counter) == counter


def test_growth_is_capped_by_max_and_by_float32_range():
  capped = ols.DynamicLossScale(8.0, 1, max_loss_scale=10.0)
  capped, _ = capped.update({"w": jnp.ones(1)})
  assert float(capped()) == 8.0 and int(capped.counter) == 0

  top = ols.DynamicLossScale(2.0**127, 1)  # 2**128 would be inf
  top, _ = top.update({"w": jnp.ones(1)})
  assert float(top()) == 2.0**127 and int(top.counter) == 0


def test_backoff_factor_and_min_loss_scale():
  ls = ols.DynamicLossScale(10.0, backoff_factor=0.25, min_loss_scale=1.5)
  ls, _ = ls.update(flags_to_grads(False))
  assert float(ls()) == 2.5
  ls, _ = ls.update(flags_to_grads(False))
  assert float(ls()) == 1.5


@pytest.mark.parametrize("grads", [None, {}, [], {"a": None, "b": [None]}, {"i": jnp.arange(3)}])
def test_empty_none_and_integer_gradients_count_as_finite(grads):
  ls, should_apply = ols.DynamicLossScale(4.0, 1).update(grads)
  assert bool(should_apply)
  assert float(ls()) == 8.0


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_any_nonfinite_value_in_any_leaf_skips(bad):
  grads = {"ok": jnp.ones(4), "bad": jnp.array([[0.0, 1.0], [2.0, bad]], jnp.bfloat16)}
  ls, should_apply = ols.DynamicLossScale(4.0).update(grads)
  assert not bool(should_apply)
  assert float(ls()) == 2.0


def test_hysteresis_megatron_and_deepspeed():
  flags = [False, True, False, False, True, True, True, False]
  megatron = ols.DynamicLossScale(64.0, 3, hysteresis=2)
  deepspeed = ols.DynamicLossScale(64.0, 3, hysteresis=2, consecutive_hysteresis=True)
  megatron_scales, deepspeed_scales = [], []
  for finite in flags:
    megatron, ok = megatron.update(flags_to_grads(finite))
    assert bool(ok) == finite  # tolerated overflows are still skipped
    deepspeed, _ = deepspeed.update(flags_to_grads(finite))
    megatron_scales.append(float(megatron()))
    deepspeed_scales.append(float(deepspeed()))
  # Megatron: the first overflow is tolerated; the tracker is only restored by
  # the growth at step 6, so the overflow at step 2 (tracker 0) backs off.
  assert megatron_scales == [64, 64, 32, 16, 16, 16, 32, 32]
  # DeepSpeed: the finite step 1 restores the tracker, so step 2 is tolerated.
  assert deepspeed_scales == [64, 64, 64, 32, 32, 32, 64, 64]


def test_adjust_matches_update():
  ls = ols.DynamicLossScale(16.0, 2)
  for finite in [True, False, True, True]:
    via_update, _ = ls.update(flags_to_grads(finite))
    assert ls.adjust(finite) == via_update
    assert ls.adjust(jnp.asarray(finite)) == via_update
    ls = via_update


# -- equality with TensorFlow's algorithm (property tests) --------------------------------

flag_lists = st.lists(st.booleans(), min_size=1, max_size=60)
tf_params = st.tuples(
  st.sampled_from([1.0, 2.0**15, 3.0, 1000.0, 2.0**120]),
  st.integers(1, 5),
  # TensorFlow divides on backoff; we multiply by 1/multiplier (as XLA does
  # under jit). The two agree bit for bit for power-of-two multipliers.
  st.sampled_from([2.0, 4.0, 2.0**10]),
)


def _run_eager(ls, flags):
  out = []
  for finite in flags:
    ls, _ = ls.update(flags_to_grads(finite))
    out.append((np.float32(ls()), int(ls.counter)))
  return out


_jitted_update = jax.jit(lambda ls, grads: ls.update(grads))


def _run_jit(ls, flags):
  out = []
  for finite in flags:
    ls, _ = _jitted_update(ls, flags_to_grads(finite))
    out.append((np.float32(ls()), int(ls.counter)))
  return out


def _run_scan(ls, flags):
  grads = jnp.where(jnp.asarray(flags)[:, None], 1.0, jnp.nan) * jnp.ones((len(flags), 2))

  def body(ls, g):
    ls, ok = ls.update({"w": g})
    return ls, (ls(), ls.counter, ok)

  _, (scales, counters, oks) = jax.lax.scan(body, ls, grads)
  np.testing.assert_array_equal(oks, np.asarray(flags))
  return [(np.float32(s), int(c)) for s, c in zip(scales, counters, strict=True)]


@settings(max_examples=40, deadline=None)
@given(flags=flag_lists, params=tf_params)
def test_default_rules_match_tensorflow_bit_for_bit(flags, params):
  initial, period, multiplier = params
  expected = reference_models.tensorflow_trajectory(flags, initial, period, multiplier)
  ls = ols.DynamicLossScale(initial, period, multiplier)
  for run in (_run_eager, _run_jit, _run_scan):
    got = run(ls, flags)
    assert [(s.tobytes(), c) for s, c in got] == [(s.tobytes(), c) for s, c in expected], run


def test_default_hyperparameters_match_tensorflow_over_a_long_run():
  rng = np.random.default_rng(0)
  flags = list(rng.random(6000) > 0.001)  # rare overflows, growth every 2000 steps
  expected = reference_models.tensorflow_trajectory(flags)
  got = _run_scan(ols.DynamicLossScale(), flags)
  assert got == expected


@settings(max_examples=40, deadline=None)
@given(
  flags=flag_lists,
  multiplier=st.sampled_from([2.0, 3.0, 1.5, 10.0]),
  period=st.integers(1, 4),
  hysteresis=st.integers(1, 3),
  consecutive=st.booleans(),
  backoff=st.sampled_from([None, 0.5, 0.3]),
  bounds=st.sampled_from([(1.0, F32_MAX), (0.25, 64.0), (2.0, 16.0)]),
)
def test_all_knobs_match_the_documented_algorithm(
  flags, multiplier, period, hysteresis, consecutive, backoff, bounds
):
  low, high = bounds
  kwargs = dict(
    initial_loss_scale=min(8.0, high),
    increment_period=period,
    multiplier=multiplier,
    min_loss_scale=low,
    max_loss_scale=high,
    backoff_factor=backoff,
    hysteresis=hysteresis,
    consecutive_hysteresis=consecutive,
  )
  expected = reference_models.GeneralModel(**kwargs).run(flags)
  eager = jitted = ols.DynamicLossScale(**kwargs)
  for finite, (scale, counter, tracker) in zip(flags, expected, strict=True):
    jitted, _ = _jitted_update(jitted, flags_to_grads(finite))
    eager, _ = eager.update(flags_to_grads(finite))
    for ls in (jitted, eager):
      assert np.float32(ls()).tobytes() == scale.tobytes()
      assert (int(ls.counter), int(ls.hysteresis_tracker)) == (counter, tracker)


# -- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "argument"),
  [
    (dict(initial_loss_scale=0.0), "initial_loss_scale"),
    (dict(initial_loss_scale=-1.0), "initial_loss_scale"),
    (dict(initial_loss_scale=math.inf), "initial_loss_scale"),
    (dict(initial_loss_scale=math.nan), "initial_loss_scale"),
    (dict(initial_loss_scale="big"), "initial_loss_scale"),
    (dict(initial_loss_scale=True), "initial_loss_scale"),
    (dict(increment_period=0), "increment_period"),
    (dict(increment_period=2.5), "increment_period"),
    (dict(increment_period=2**31), "increment_period"),
    (dict(multiplier=1.0), "multiplier"),
    (dict(multiplier=0.5), "multiplier"),
    (dict(multiplier=math.inf), "multiplier"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=1.5), "backoff_factor"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(hysteresis=1.5), "hysteresis"),
    (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(max_loss_scale=math.inf), "max_loss_scale"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0, initial_loss_scale=4.0), "min_loss_scale"),
    (dict(initial_loss_scale=0.5), "initial_loss_scale"),
    (dict(initial_loss_scale=100.0, max_loss_scale=64.0), "initial_loss_scale"),
    (dict(consecutive_hysteresis="yes"), "consecutive_hysteresis"),
    # Representable in Python but not as the float32 the scale is kept in.
    (dict(initial_loss_scale=1e39, max_loss_scale=1e40), "initial_loss_scale"),
    (dict(initial_loss_scale=1e-45, min_loss_scale=1e-46), "min_loss_scale"),
    (dict(initial_loss_scale=np.ones(2)), "initial_loss_scale"),
  ],
)
def test_dynamic_validation(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    ols.DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
  "value", [0.5, 0.0, -3.0, math.inf, math.nan, "8", None, False, 1e39, 10**400, np.ones(2)]
)
def test_fixed_validation(value):
  with pytest.raises(ValueError, match="loss_scale_value"):
    ols.FixedLossScale(value)


def test_validation_accepts_numpy_and_concrete_jax_numbers():
  ls = ols.DynamicLossScale(np.float32(1024), np.int64(10), jnp.float32(2.0))
  assert ls.get_config()["initial_loss_scale"] == 1024.0
  assert ls.get_config()["increment_period"] == 10
  assert isinstance(ls.get_config()["increment_period"], int)


def test_construction_inside_jit_with_traced_value_is_a_clear_error():
  with pytest.raises(ValueError, match="initial_loss_scale"):
    jax.jit(lambda v: ols.DynamicLossScale(v)())(jnp.float32(4.0))


# -- config, serialization, get ------------------------------------------------------------


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_config_round_trip_is_plain_json(ls):
  config = ls.get_config()
  assert json.loads(json.dumps(config, allow_nan=False)) == config
  assert type(ls).from_config(config) == ls
  assert ols.deserialize(json.loads(json.dumps(ols.serialize(ls)))) == ls


def test_from_config_gives_fresh_state():
  ls, _ = ols.DynamicLossScale(8.0).update(flags_to_grads(False))
  fresh = ols.DynamicLossScale.from_config(ls.get_config())
  assert float(fresh()) == 8.0 and ls != fresh


def test_equality():
  assert ols.DynamicLossScale(4.0) == ols.DynamicLossScale(4.0)
  assert ols.DynamicLossScale(4.0) != ols.DynamicLossScale(8.0)
  assert ols.DynamicLossScale(4.0) != ols.DynamicLossScale(4.0, 10)
  assert ols.FixedLossScale(4.0) != ols.DynamicLossScale(4.0)
  assert ols.NoOpLossScale() == ols.NoOpLossScale()


def test_get_accepted_forms():
  assert ols.get("dynamic") == ols.DynamicLossScale()
  assert ols.get(123) == ols.FixedLossScale(123.0)
  assert ols.get(np.float32(4.0)) == ols.FixedLossScale(4.0)
  ls = ols.DynamicLossScale(64.0, 3)
  assert ols.get(ls) is ls
  assert ols.get(ols.serialize(ls)) == ls


@pytest.mark.parametrize("bad", ["static", None, [1.0], True, {"class_name": "DynamicLossScale"}])
def test_get_rejects_other_forms_listing_the_accepted_ones(bad):
  with pytest.raises(ValueError, match=r"accepted|exactly the keys"):
    ols.get(bad)


def test_get_error_lists_forms():
  with pytest.raises(ValueError) as info:
    ols.get("static")
  message = str(info.value)
  for form in ("'dynamic'", "number", "LossScale", "serialize"):
    assert form in message


@pytest.mark.parametrize(
  "bad",
  [
    {"class_name": "FixedLossScale", "config": [8.0]},
    {"class_name": "FixedLossScale", "config": {"value": 8.0}},
    {"class_name": "DynamicLossScale", "config": {"initial_loss_scale": 4.0, "period": 3}},
  ],
)
def test_deserialize_rejects_malformed_configs(bad):
  with pytest.raises(ValueError, match="config"):
    ols.deserialize(bad)


def test_deserialize_unknown_class():
  with pytest.raises(ValueError, match="Unknown loss scale class_name 'Nope'"):
    ols.deserialize({"class_name": "Nope", "config": {}})


def test_serialize_rejects_non_loss_scale():
  with pytest.raises(TypeError, match="LossScale"):
    ols.serialize(2.0)


class DynamicUpdateVariantsTest(chex.TestCase):
  """The update is pure: the same results with and without jit."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_update_variants(self):
    update = self.variant(lambda ls, g: ls.update(g))
    ls = ols.DynamicLossScale(8.0, 2)
    ls1, ok1 = update(ls, flags_to_grads(True))
    ls2, ok2 = update(ls1, flags_to_grads(False))
    chex.assert_trees_all_equal((ls1(), ls1.counter, ok1), (jnp.float32(8), jnp.int32(1), True))
    chex.assert_trees_all_equal((ls2(), ls2.counter, ok2), (jnp.float32(4), jnp.int32(0), False))
    # The input is untouched: immutability, not aliasing.
    chex.assert_trees_all_equal((ls(), ls.counter), (jnp.float32(8), jnp.int32(0)))


# -- the pytree twin ----------------------------------------------------------------------


def pickle_round_trip(x):
  return pickle.loads(pickle.dumps(x))


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_instances_are_the_registered_twin_of_their_class(ls):
  public = {c.__name__: c for c in (ols.NoOpLossScale, ols.FixedLossScale, ols.DynamicLossScale)}[
    type(ls).__name__
  ]
  assert type(ls) is public._Node and isinstance(ls, public) and isinstance(ls, ols.LossScale)
  assert repr(ls).startswith(f"{public.__name__}(")
  rebuilt = jax.tree.unflatten(jax.tree.structure(ls), jax.tree.leaves(ls))
  assert type(rebuilt) is type(ls) and rebuilt == ls and not rebuilt != ls


def test_inequality_mirrors_equality():
  a, b = ols.DynamicLossScale(4.0), ols.DynamicLossScale(4.0)
  nan = a.replace(loss_scale=jnp.float32(jnp.nan))
  assert a == b and not a != b
  assert a != a.replace(counter=jnp.int32(1)) and nan != nan and not nan == nan
  assert ols.FixedLossScale(4.0) != ols.FixedLossScale(8.0)
  assert (ols.NoOpLossScale() != ols.FixedLossScale(1.0)) is True


@pytest.mark.parametrize("ls", ALL_SCALES, ids=SCALE_IDS)
def test_pickle_and_deepcopy_round_trip(ls):
  for clone in (pickle_round_trip(ls), copy.deepcopy(ls), copy.copy(ls)):
    assert type(clone) is type(ls) and clone == ls
    with pytest.raises(dataclasses.FrozenInstanceError):
      clone.foo = 1


def test_abstract_loss_scale_cannot_be_instantiated():
  with pytest.raises(TypeError, match="abstract class LossScale"):
    ols.LossScale()

  class Incomplete(ols.LossScale):
    pass

  with pytest.raises(TypeError, match=r"abstract class Incomplete.*update"):
    Incomplete()


def test_a_user_subclass_gets_its_own_twin_and_keeps_its_fields_through_jit():
  class Clipped(ols.DynamicLossScale):
    _config_fields = (*ols.DynamicLossScale._config_fields, "ceiling")

    def __init__(self, initial_loss_scale, ceiling):
      super().__init__(initial_loss_scale)
      self._set(ceiling=float(ceiling))

    def adjust(self, grads_finite):
      new = super().adjust(grads_finite)
      return new.replace(loss_scale=jnp.minimum(new.loss_scale, self.ceiling))

  ls = Clipped(4.0, ceiling=6.0)
  assert type(ls) is Clipped._Node and type(ls) is not ols.DynamicLossScale._Node
  out = jax.jit(lambda ls: ls.replace(counter=ls.counter + 1999).adjust(True))(ls)
  assert type(out) is Clipped._Node and out.ceiling == 6.0
  assert float(out()) == 6.0  # grown to 8, clipped to the ceiling
  assert ls.get_config()["ceiling"] == 6.0
