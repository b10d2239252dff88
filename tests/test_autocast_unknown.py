"""A primitive `autocast` has no rule for runs as written, with one warning; or raises.

The primitives here are defined as a library defines its own
(`jax.extend.core.Primitive` with an implementation, an abstract evaluation,
a lowering, a JVP and a batching rule), each under a name of its own: the
warning is given once per primitive per process.
"""

import itertools
import warnings

import jax
from jax import lax
from jax.interpreters import ad, batching, mlir
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from tests.autocast_helpers import inputs_of

HALVES = {"float16": "p=f32,c=f16,o=f32", "bfloat16": "p=f32,c=bf16,o=f32"}
_names = itertools.count()


def _name(what):
  return f"ols_test_{what}_{next(_names)}"


def double_primitive(name):
  """An elementwise `2 * x` that keeps its input's dtype: jit, grad and vmap work on it."""
  p = jax.extend.core.Primitive(name)
  impl = lambda x: 2 * x
  p.def_impl(impl)
  p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
  ad.defjvp(p, lambda g, x: 2 * g)
  batching.defvectorized(p)
  return p


def bitcast_primitive(name):
  """A bitcast to the unsigned integer of the input's width: right only on the declared dtype."""
  p = jax.extend.core.Primitive(name)
  to = lambda dtype: np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
  impl = lambda x: lax.bitcast_convert_type(x, to(x.dtype))
  p.def_impl(impl)
  p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, to(x.dtype)))
  mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
  batching.defvectorized(p)
  return p


def _recorded(fn, *args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fn(*args)
  return out, [w for w in caught if "autocast has no rule" in str(w.message)]


W = jax.random.normal(jax.random.key(0), (8, 4)) / 3
X = jax.random.normal(jax.random.key(1), (5, 8))


@pytest.mark.parametrize("half", HALVES)
def test_an_unknown_primitive_runs_as_written_under_jit_grad_and_vmap(half):
  name = _name("double")
  p = double_primitive(name)
  loss = lambda w, x: jnp.sum(jnp.tanh(p.bind(x @ w)) ** 2)
  mixed = ols.autocast(loss, HALVES[half])
  out, warned = _recorded(jax.jit(mixed), W, X)
  assert len(warned) == 1
  np.testing.assert_allclose(out, loss(W, X), rtol=2e-2)
  # It ran on the dtype the function declares (a product's result: float32), and the
  # products around it still run in the compute dtype.
  jaxpr = jax.make_jaxpr(jax.grad(mixed))(W, X)
  assert inputs_of(jaxpr, name) == [("float32",)]
  assert set(inputs_of(jaxpr, "dot_general")) == {(half, half)}
  grads, warned = _recorded(jax.jit(jax.grad(mixed)), W, X)
  assert warned == []  # once per primitive per process
  want = jax.grad(loss)(W, X)  # bfloat16 products: a relative error of the whole gradient
  assert float(jnp.linalg.norm(grads - want) / jnp.linalg.norm(want)) < 2e-2
  batched = jax.vmap(mixed, in_axes=(None, 0))(W, jnp.stack([X, 2 * X]))
  np.testing.assert_allclose(batched, [loss(W, X), loss(W, 2 * X)], rtol=2e-2)


def test_one_warning_per_primitive_naming_it_and_the_rule_that_keeps_16_bit_work():
  name, other = _name("double"), _name("double")
  p, q = double_primitive(name), double_primitive(other)
  fn = lambda w, x: jnp.sum(q.bind(p.bind(x @ w)))
  _, warned = _recorded(ols.autocast(fn, HALVES["bfloat16"]), W, X)
  assert [w.category for w in warned] == [UserWarning, UserWarning]
  first, second = (str(w.message) for w in warned)
  assert repr(name) in first and repr(other) in second
  assert f"rules={{{name!r}: 'widest'}}" in first and "16-bit work in 16 bits" in first
  assert "unknown_primitives='error'" in first
  # Another wrapper, another policy, the same process: no second warning.
  _, warned = _recorded(ols.autocast(fn, HALVES["float16"]), W, X)
  assert warned == []


def test_a_rule_for_the_primitive_silences_the_warning_and_widest_keeps_16_bits():
  # 16-bit weights meeting float32 data: autocast traces the float32 program (the weights
  # as float32) and holds the 16-bit weights. 'widest' runs the primitive on them in 16
  # bits; 'as_written' on the float32 the program declares.
  name = _name("double")
  p = double_primitive(name)
  fn = lambda w, x: (p.bind(w), lax.add(w, x))
  w16, x = W[0].astype(jnp.bfloat16), X[0, :4]
  for kind, want in (("widest", "bfloat16"), ("as_written", "float32")):
    mixed = ols.autocast(fn, HALVES["bfloat16"], rules={name: kind})
    jaxpr, warned = _recorded(jax.make_jaxpr(mixed), w16, x)
    assert warned == []
    assert inputs_of(jaxpr, name) == [(want,)]
    np.testing.assert_allclose(mixed(w16, x)[0], 2 * w16.astype(jnp.float32), rtol=1e-2)


def test_the_strict_option_raises_the_unknown_primitive_error():
  name = _name("double")
  p = double_primitive(name)
  fn = lambda w, x: jnp.sum(p.bind(x @ w))
  with pytest.raises(ols.UnknownPrimitiveError, match=repr(name)):
    ols.autocast(fn, HALVES["float16"], unknown_primitives="error")(W, X)
  # Inside control flow too (a scan's body, a jit's).
  looped = lambda w, x: lax.scan(lambda c, _: (p.bind(c), None), x @ w, None, length=2)[0]
  with pytest.raises(ols.UnknownPrimitiveError, match=repr(name)):
    ols.autocast(jax.jit(looped), HALVES["float16"], unknown_primitives="error")(W, X)
  with pytest.raises(ValueError, match="unknown_primitives must be one of"):
    ols.autocast(fn, HALVES["float16"], unknown_primitives="ignore")


@pytest.mark.parametrize("half", HALVES)
def test_a_bitcast_of_a_16_bit_value_reads_the_bits_the_function_declares(half):
  # The function bitcasts a 16-bit value it computed: a float32 input would give uint32 bits
  # (another shape of result, other values). As written, the bits are the function's own.
  name = _name("bitcast")
  p = double_primitive(_name("double"))
  bits = bitcast_primitive(name)
  fn = lambda w, x: bits.bind(jnp.tanh(p.bind(x @ w)).astype(half))
  mixed = ols.autocast(fn, HALVES[half])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = jax.jit(mixed)(W, X)
    jaxpr = jax.make_jaxpr(mixed)(W, X)
  assert inputs_of(jaxpr, name) == [(half,)]
  want = fn(W, X)
  assert out.dtype == want.dtype == np.uint16
  # The 16-bit values the function bitcasts agree to a few units in the last place.
  got = lax.bitcast_convert_type(out, half).astype(np.float32)
  np.testing.assert_allclose(got, lax.bitcast_convert_type(want, half).astype(np.float32),
                             rtol=2e-2, atol=1e-2)  # fmt: skip


def test_a_bitcast_of_a_16_bit_argument_traced_as_float32_reads_float32_bits():
  # 16-bit weights meeting float32 data do not trace as written: autocast traces the float32
  # program the user meant (the weights as float32) and runs it on the 16-bit weights. The
  # unknown primitive gets the float32 the program declares, not the 16-bit value it holds,
  # and inside a scan whose carry starts as that 16-bit value.
  name = _name("bitcast")
  bits = bitcast_primitive(name)
  fn = lambda w, x: (bits.bind(w), lax.add(w, x))
  w16, x = W[0].astype(jnp.bfloat16), X[0, :4]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    got_bits, got_sum = jax.jit(ols.autocast(fn, HALVES["bfloat16"]))(w16, x)
  want_bits, want_sum = fn(w16.astype(jnp.float32), x)
  assert got_bits.dtype == np.uint32
  np.testing.assert_array_equal(got_bits, want_bits)
  np.testing.assert_allclose(got_sum, want_sum, rtol=1e-2)

  p = double_primitive(_name("double"))
  looped = lambda w, x: lax.scan(
    lambda c, _: (p.bind(lax.add(c, x)), bits.bind(c)), w, None, length=3
  )  # fmt: skip
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    (carry, ys) = jax.jit(ols.autocast(looped, HALVES["bfloat16"]))(w16, x)
  want_carry, want_ys = looped(w16.astype(jnp.float32), x)
  assert carry.dtype == np.float32 and ys.dtype == np.uint32
  np.testing.assert_allclose(carry, want_carry, rtol=1e-2)
  np.testing.assert_array_equal(ys[0], want_ys[0])
