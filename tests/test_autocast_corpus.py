"""`autocast` on a corpus of real JAX functions, under float16 (bfloat16: the `_bf16` file).

The corpus (`tests/autocast_corpus.py`) holds about 800 functions over
jax.numpy, jax.nn, jax.scipy, lax, jax.random and optax's losses; each case
runs one of them under `p=f32,c=f16,o=f32` or `p=f32,c=bf16,o=f32`, eagerly,
under `jit`, `grad` or `vmap` (`tests/autocast_corpus_run.py`) and checks it
against the float32 function: it runs; floating outputs are float32, complex
ones complex, integer, boolean and key outputs exact; no NaN or inf where
float32 has none; errors within a bound in units of the compute dtype's
rounding; every product on compute-dtype inputs. Known failures are strict
xfails listed in `tests/autocast_known_failures.py`.

By default one case per entry runs (its dtype and mode drawn from its name);
`OLS_AUTOCAST_CORPUS=full pytest -n 2 tests/test_autocast_corpus*.py` runs
all of them.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from tests import autocast_corpus_run as corpus
from tests.autocast_corpus import BY_NAME, ENTRIES
from tests.autocast_known_failures import (
  KNOWN_FAILURES,
  RECORDED_ON,
  _pattern,
  known_failure,
  strict,
)


@pytest.mark.parametrize(("name", "dtype", "mode"), corpus.params("f16"))
def test_corpus_case(name, dtype, mode):
  corpus.check_case(name, dtype, mode)


def test_the_corpus_spans_the_libraries_a_model_calls():
  families = collections.Counter(e.family for e in ENTRIES)
  assert len(ENTRIES) >= 700, len(ENTRIES)
  least = {"jnp": 250, "nn": 40, "special": 40, "stats": 25, "lax": 60, "random": 40, "optax": 20,
           "linalg": 30, "fft": 15, "control": 20, "complex": 15, "extreme": 30}  # fmt: skip
  for family, n in least.items():
    assert families[family] >= n, (family, families[family])


def test_every_dtype_and_mode_is_sampled():
  sampled = collections.Counter(
    (d, m) for dtype in corpus.POLICIES for _, d, m in corpus.selected_cases(dtype)
  )
  for dtype in corpus.POLICIES:
    for mode in corpus.MODES:
      assert sampled[dtype, mode] >= 30, (dtype, mode, sampled[dtype, mode])


def test_every_known_failure_names_a_case():
  if not strict():
    pytest.skip(f"the known failures name jax {RECORDED_ON}'s entries (some are absent here)")
  cases = corpus.cases()
  stale = [
    key
    for key in KNOWN_FAILURES
    if not any(all(_pattern(k).match(v) for k, v in zip(key, case, strict=True)) for case in cases)
  ]
  assert not stale, f"keys that match no case (delete them): {stale}"
  assert known_failure("no such entry", "f16", "jit") is None


def test_the_inputs_are_fixed_and_exact_in_16_bits():
  entry = BY_NAME["jnp.log"]
  x, _ = corpus.inputs(entry.name)
  np.testing.assert_array_equal(x, entry.args(np.random.default_rng(corpus.seed(entry.name)))[0])
  assert bool(jnp.all(x > 0))  # log's domain
  for dtype in (jnp.float16, jnp.bfloat16):
    np.testing.assert_array_equal(np.asarray(x, dtype).astype(np.float32), x)


# -- the checks of the checks: each fails on the wrong result it is there for.


def _check(name, mode, dtype, got, want):
  corpus.check_values(BY_NAME[name], mode, dtype, got, want)


def test_check_values_accepts_a_16_bit_rounding_and_refuses_what_is_wrong():
  want = jnp.linspace(-2.0, 3.0, 12, dtype=jnp.float32).reshape(3, 4)
  rounded = want.astype(jnp.bfloat16).astype(jnp.float32)
  _check("jnp.tanh", "jit", "bf16", rounded, want)
  wrong = {
    "not the policy's output float32": want.astype(jnp.bfloat16),
    "non-finite": want.at[0, 0].set(jnp.inf),
    "error": want * (1 + 64 * corpus.EPS["bf16"]),
    "shape": want[:2],
  }
  for message, got in wrong.items():
    with pytest.raises(AssertionError, match=message):
      _check("jnp.tanh", "jit", "bf16", got, want)
  # The bound is the compute dtype's: an error of 2**-6 is within bfloat16's, not float16's.
  _check("jnp.tanh", "jit", "bf16", want * (1 + 2.0**-6), want)
  with pytest.raises(AssertionError, match="error"):
    _check("jnp.tanh", "jit", "f16", want * (1 + 2.0**-6), want)


def test_check_values_refuses_a_complex_result_cast_to_real_and_a_moved_integer():
  z = jnp.array([1.0 + 2.0j, -1.0j])
  with pytest.raises(AssertionError, match="not complex"):
    _check("fft.fft", "jit", "f16", jnp.real(z), z)
  labels = jnp.array([0, 3, 1])
  _check("jnp.argmax[axis=1]", "jit", "f16", labels, labels)
  with pytest.raises(AssertionError, match="integer/boolean"):
    _check("jnp.argmax[axis=1]", "jit", "f16", labels.at[1].set(2), labels)
  with pytest.raises(AssertionError, match="int32"):
    _check("jnp.argmax[axis=1]", "jit", "f16", labels.astype(jnp.float32), labels)
  key = jax.random.key(0)
  _check("random.key_data", "jit", "f16", key, key)
  with pytest.raises(AssertionError):
    _check("random.key_data", "jit", "f16", jax.random.key(1), key)


def test_check_products_refuses_a_float32_product():
  mixed = ols.autocast(lambda x, w: x @ w, "p=f32,c=f16,o=f32")
  x = jnp.ones((2, 3))
  corpus.check_products(BY_NAME["nn.relu[dense]"], "f16", jax.make_jaxpr(mixed)(x, x.T))
  plain = jax.make_jaxpr(jax.jit(lambda x, w: jnp.tanh(x @ w)))(x, x.T)  # in a sub-jaxpr
  with pytest.raises(AssertionError, match="products not on float16 inputs"):
    corpus.check_products(BY_NAME["nn.relu[dense]"], "f16", plain)
  corpus.check_products(BY_NAME["lax.dot[preferred=f32]"], "f16", plain)  # fixes its own types
