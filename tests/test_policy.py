"""The precision policy: jmp's `Policy`, `get_policy` and casts, and where we differ on purpose."""

import importlib.util
import os
import pathlib
import types
import unittest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)

# Every string jmp's grammar reads, and what it means (jmp's defaults: params
# float32, compute as params, output as compute).
SPECS = {
  "params=float32,compute=float16,output=float32": (F32, F16, F32),
  "p=f32,c=bf16,o=f32": (F32, BF16, F32),
  "c=f16": (F32, F16, F16),
  "c=bf16,o=full": (F32, BF16, F32),
  "p=f16,c=f16": (F16, F16, F16),
  "p=f16,c=bf16": (F16, BF16, BF16),
  "p=bf16": (BF16, BF16, BF16),
  "o=f32": (F32, F32, F32),
  "full": (F32, F32, F32),
  "f32": (F32, F32, F32),
  "float32": (F32, F32, F32),
  "bfloat16": (BF16, BF16, BF16),
  "bf16": (BF16, BF16, BF16),
  "float16": (F16, F16, F16),
  "f16": (F16, F16, F16),
}


def _dtypes(policy):
  return (
    np.dtype(policy.param_dtype),
    np.dtype(policy.compute_dtype),
    np.dtype(policy.output_dtype),
  )


@pytest.mark.parametrize("spec", SPECS)
def test_get_policy_reads_jmps_strings_with_jmps_defaults(spec):
  assert _dtypes(ols.get_policy(spec)) == SPECS[spec]


@pytest.mark.parametrize("spec", [*SPECS, "c=half", "half", "p=f32,c=half,o=f32"])
def test_get_policy_agrees_with_jmp(spec):
  jmp = pytest.importorskip("jmp")
  ours, theirs = ols.get_policy(spec), jmp.get_policy(spec)
  assert _dtypes(ours) == _dtypes(theirs)
  assert str(ours) == str(theirs)


def test_half_follows_the_backend():
  half = ols.get_policy("c=half").compute_dtype
  expected = BF16 if jax.devices()[0].platform == "tpu" else F16
  assert half == expected == ols.half_dtype()


@pytest.mark.parametrize(
  ("spec", "message"),
  [
    ("compute_float16", "Unknown dtype 'compute_float16': accepted names are full, half"),
    ("c=f17", "Unknown dtype 'f17'"),
    ("x=f32", "Unknown key 'x'"),
    ("p=f32,p=f16", "sets param_dtype twice"),
    ("c", "Unknown dtype 'c'"),
    ("p=f32,,c=f16", "Unknown key ''"),
  ],
)
def test_get_policy_refuses_what_it_cannot_read(spec, message):
  with pytest.raises(ValueError, match=message):
    ols.get_policy(spec)


def test_get_policy_takes_spaces_and_policies_but_no_other_types():
  assert ols.get_policy(" p = f32 , c = bf16 ") == ols.get_policy("p=f32,c=bf16")
  policy = ols.Policy(F32, F16, F32)
  assert ols.get_policy(policy) is policy
  with pytest.raises(TypeError, match="policy_name must be a string"):
    ols.get_policy(jnp.float16)


def test_policy_normalises_every_spelling_of_a_dtype():
  spellings = [jnp.bfloat16, np.dtype(jnp.bfloat16), "bfloat16", "bf16", jnp.dtype("bfloat16")]
  policies = {ols.Policy(jnp.float32, c, "full") for c in spellings}
  assert len(policies) == 1  # equal and hashing alike
  (policy,) = policies
  assert policy.compute_dtype == jnp.bfloat16 and isinstance(policy.compute_dtype, np.dtype)
  assert policy.param_dtype == np.float32 == jnp.float32


@pytest.mark.parametrize("value", [jnp.int32, "int8", object(), "f17", None])
def test_policy_refuses_a_dtype_that_is_not_floating(value):
  with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
    ols.Policy(jnp.float32, value, jnp.float32)


def test_policy_is_immutable_and_a_static_jit_argument():
  policy = ols.get_policy("p=f32,c=f16,o=f32")
  with pytest.raises(AttributeError):
    policy.compute_dtype = F32
  traces = []

  @jax.jit
  def run(x, policy):
    traces.append(policy)
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  run = jax.jit(run.__wrapped__, static_argnums=1)
  out = run(jnp.ones(2), policy)
  run(jnp.ones(2), ols.Policy("full", "f16", jnp.float32))  # equal: no new trace
  assert out.dtype == F32 and len(traces) == 1


def test_casts_touch_floating_array_leaves_only():
  policy = ols.get_policy("p=f32,c=bf16,o=f16")
  marker = object()
  tree = {
    "f": jnp.ones(2),
    "n": np.ones(2, np.float32),
    "s": np.float32(1.5),
    "i": jnp.ones(2, jnp.int32),
    "b": jnp.ones(2, bool),
    "none": None,
    "zero": np.zeros((), jax.dtypes.float0),
    "py": 1.5,
    "o": marker,
  }
  out = policy.cast_to_compute(tree)
  assert out["f"].dtype == BF16 and isinstance(out["f"], jax.Array)
  assert out["n"].dtype == BF16 and isinstance(out["n"], np.ndarray)  # NumPy stays NumPy
  assert out["s"].dtype == BF16
  assert out["i"].dtype == jnp.int32 and out["b"].dtype == bool
  assert out["none"] is None and out["zero"].dtype == jax.dtypes.float0
  assert out["py"] == 1.5 and out["o"] is marker
  assert policy.cast_to_output(tree)["f"].dtype == F16
  assert policy.cast_to_param(out)["f"].dtype == F32
  assert jax.jit(policy.cast_to_compute)({"f": jnp.ones(2)})["f"].dtype == BF16


def test_with_output_dtype_and_str():
  policy = ols.Policy(jnp.float32, jnp.float16, jnp.float16).with_output_dtype("f32")
  assert _dtypes(policy) == (F32, F16, F32)
  assert str(policy) == "p=full,c=f16,o=full"
  assert str(ols.Policy(np.dtype("float64"), "bf16", "f16")) == "p=f64,c=bf16,o=f16"


def test_str_works_for_dtype_objects_where_jmp_raises():
  # jmp looks str() up in a table keyed by jnp.float32 and friends, so a
  # policy holding np.dtype objects (what `x.dtype` gives) raises KeyError.
  jmp = pytest.importorskip("jmp")
  with pytest.raises(KeyError):
    str(jmp.Policy(F32, F16, F32))
  assert str(ols.Policy(F32, F16, F32)) == "p=full,c=f16,o=full"
  assert ols.dtype_to_names[F16] == ols.dtype_to_names[jnp.float16] == ("f16", "float16")


def test_cast_to_full_and_half():
  marker = object()
  half = ols.half_dtype()
  tree = {"h": jnp.ones(2, half), "f": jnp.ones(2), "i": jnp.ones(2, jnp.int16), "o": marker}
  full = ols.cast_to_full(tree)
  assert full["h"].dtype == F32 and full["i"].dtype == jnp.int16 and full["o"] is marker
  assert ols.cast_to_half(tree)["f"].dtype == half


def _jmp_policy_test_module() -> types.ModuleType:
  """jmp's own `policy_test.py`, importing `optax_lossscale` where it imported jmp's policy."""
  spec = importlib.util.find_spec("jmp")
  path = pathlib.Path(spec.origin).parent / "_src" / "policy_test.py"
  if not path.exists():
    pytest.skip(f"jmp's policy tests are not installed ({path})")
  source = path.read_text()
  original = "from jmp._src import policy as jmp"
  assert original in source
  module = types.ModuleType("jmp_policy_test_on_ols")
  exec(compile(source.replace(original, "import optax_lossscale as jmp"), str(path), "exec"),
       module.__dict__)  # fmt: skip
  return module


def test_jmps_own_policy_tests_pass_against_optax_lossscale():
  pytest.importorskip("jmp")
  pytest.importorskip("absl.testing.parameterized")
  module = _jmp_policy_test_module()
  suite = unittest.defaultTestLoader.loadTestsFromTestCase(module.PolicyTest)
  with open(os.devnull, "w") as quiet:
    result = unittest.TextTestRunner(verbosity=0, stream=quiet).run(suite)
  problems = [f"{test}: {trace}" for test, trace in result.failures + result.errors]
  assert result.testsRun >= 60 and not problems, "\n".join(problems)
