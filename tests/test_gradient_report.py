"""gradient_report and format_gradient_report, checked against NumPy on hand-built leaves."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import optax_lossscale as ols

F16_TINY = float(np.finfo(np.float16).smallest_subnormal)  # 2**-24
F16_NORMAL = float(np.finfo(np.float16).smallest_normal)  # 2**-14

# Every case the definitions distinguish, as float32.
TRICKY_F32 = np.array(
  [
    0.0,
    -0.0,
    np.nan,
    -np.nan,
    np.inf,
    -np.inf,
    np.inf,
    1e-40,  # float32 subnormal: zero in float16, subnormal in bfloat16
    -1e-45,  # the smallest float32 subnormal
    F16_TINY,  # the smallest float16 subnormal, exactly
    -F16_TINY / 2,  # a tie: rounds to even, i.e. to zero
    np.nextafter(np.float32(F16_TINY / 2), np.float32(1)),  # just above the tie: subnormal
    3e-8,
    1e-7,
    -6e-5,  # float16 subnormal
    F16_NORMAL,  # the smallest float16 normal: not subnormal
    np.nextafter(np.float32(F16_NORMAL), np.float32(0)),  # rounds up to the smallest normal
    1.0,
    -2.5,
    65504.0,  # float16 max
    65519.0,  # still rounds to 65504
    -65520.0,  # rounds to -inf in float16
    1e5,
    3.0e38,  # overflows bfloat16 too
  ],
  np.float32,
)


COUNTS = ("nan", "posinf", "neginf", "zero", "underflow", "subnormal", "overflow")


def numpy_stats(x: np.ndarray, target: np.dtype) -> dict:
  """The reference: NumPy (no denormals-are-zero) and ml_dtypes casts."""
  x = np.asarray(x)
  if np.iscomplexobj(x):
    x = np.stack([x.real, x.imag])
  x = x.astype(np.float64) if x.dtype == ml_dtypes.bfloat16 else x
  finite = np.isfinite(x)
  with np.errstate(over="ignore"):
    cast = x.astype(target).astype(np.float64)
  tiny = float(ml_dtypes.finfo(target).smallest_normal)
  abs_finite = np.abs(x[finite]).astype(np.float64)
  return {
    "nan": int(np.isnan(x).sum()),
    "posinf": int((x == np.inf).sum()),
    "neginf": int((x == -np.inf).sum()),
    "zero": int((x == 0).sum()),
    "underflow": int((finite & (x != 0) & (cast == 0)).sum()),
    "subnormal": int((finite & (cast != 0) & (np.abs(cast) < tiny)).sum()),
    "overflow": int((finite & np.isinf(cast)).sum()),
    "max_abs": float(abs_finite.max(initial=0.0)),
  }


def assert_matches_numpy(report: ols.GradientReport, leaves: dict, target: np.dtype) -> None:
  assert list(report.leaves) == list(leaves)
  for path, x in leaves.items():
    s = report.leaves[path]
    got = {f: int(getattr(s, f)) for f in COUNTS}
    expected = numpy_stats(x, target)
    assert float(s.max_abs) == expected.pop("max_abs"), path
    assert got == expected, path
    assert s.dtype == np.asarray(x).dtype.name and s.shape == np.shape(x)


class ReportTest(chex.TestCase):
  GRADS = {  # noqa: RUF012
    "f32": TRICKY_F32,
    "bf16": TRICKY_F32.astype(ml_dtypes.bfloat16),
    "f16": np.array([6e-8, -3e-6, 0.0, np.inf, 65504.0, -np.inf, np.nan], np.float16),
    "c64": (TRICKY_F32[:12] + 1j * TRICKY_F32[12:]).astype(np.complex64),
  }
  PATHS = {f"['{k}']": v for k, v in sorted(GRADS.items())}  # noqa: RUF012

  @chex.variants(with_jit=True, without_jit=True)
  def test_tricky_values_against_numpy(self):
    report = self.variant(ols.gradient_report)(self.GRADS)
    assert report.target_dtype == "float16"
    assert_matches_numpy(report, self.PATHS, np.dtype(np.float16))

  def test_other_targets_against_numpy(self):
    for target, np_target in (("bfloat16", ml_dtypes.bfloat16), (jnp.float32, np.float32)):
      report = jax.jit(ols.gradient_report, static_argnums=1)(self.GRADS, target)
      assert report.target_dtype == np.dtype(np_target).name
      assert_matches_numpy(report, self.PATHS, np.dtype(np_target))

  def test_random_bit_patterns_against_numpy(self):
    # Uniform bit patterns hit every exponent, subnormals, NaN payloads and both infinities.
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    x32 = bits.view(np.float32)
    # Concentrate a second sample around float16's underflow boundary.
    near = (rng.standard_normal(4096) * 2.0 ** rng.integers(-30, -10, 4096)).astype(np.float32)
    grads = [x32, near, bits[:1024].astype(np.uint16).view(np.float16)]
    report = jax.jit(ols.gradient_report)(grads)
    assert_matches_numpy(report, {f"[{i}]": g for i, g in enumerate(grads)}, np.dtype(np.float16))
    s = report.leaves["[1]"]
    # The sample straddles the boundary, so the test exercises both outcomes.
    assert int(s.underflow) > 100 and int(s.subnormal) > 100

  def test_skips_none_and_non_float_leaves_and_names_the_root(self):
    grads = {"w": jnp.ones(2), "step": jnp.arange(3), "frozen": None}
    assert list(ols.gradient_report(grads).leaves) == ["['w']"]
    assert list(ols.gradient_report(jnp.ones(3)).leaves) == ["<root>"]
    assert ols.gradient_report({}).leaves == {}

  def test_empty_leaf_has_zero_counts(self):
    s = ols.gradient_report({"e": jnp.zeros((0, 3))}).leaves["['e']"]
    assert int(s.nonfinite) == 0 and float(s.max_abs) == 0.0 and s.size == 0

  def test_rejects_unknown_target_dtype(self):
    for bad in ("int8", jnp.int32, "float8_e4m3fn", "nonsense"):
      with pytest.raises(ValueError, match="dtype must be one of"):
        ols.gradient_report({"w": jnp.ones(2)}, bad)


class FormatTest(chex.TestCase):
  def setUp(self):
    super().setUp()
    self.grads = {
      "fine": jnp.ones(4),
      "tiny": jnp.array([1e-9, 1e-9, 1.0, 1e-10]),  # 3 of 4 underflow
      "little": jnp.array([1e-9, 1.0, 1.0, 1.0]),  # 1 of 4 underflow
      "inf": jnp.array([jnp.inf, 1.0]),
      "nan": jnp.array([jnp.nan, jnp.nan, -jnp.inf]),
      "big": jnp.array([1e5, 1.0]),
    }
    self.report = ols.gradient_report(self.grads)

  def test_offending_leaves_first(self):
    rows = ols.format_gradient_report(self.report).splitlines()
    assert rows[0] == (
      "Gradient report (target float16): 2 of 6 leaves non-finite, 2 with values lost to"
      " underflow, 1 overflow in float16."
    )
    assert rows[1].split() == (
      "status leaf dtype shape NaN +Inf -Inf zero underflow subnormal overflow max|g|".split()
    )
    order = [(r.split()[0], r.split()[1]) for r in rows[2:]]
    assert order == [
      ("NONFINITE", "['nan']"),
      ("NONFINITE", "['inf']"),
      ("OVERFLOW", "['big']"),
      ("UNDERFLOW", "['tiny']"),
      ("UNDERFLOW", "['little']"),
      ("ok", "['fine']"),
    ]
    assert rows[2].split()[4:] == ["2", "0", "1", "0", "0", "0", "0", "0"]
    assert rows[4].split()[-1] == "1e+05"

  def test_str_and_max_rows(self):
    assert str(self.report) == ols.format_gradient_report(self.report)
    rows = ols.format_gradient_report(self.report, max_rows=2).splitlines()
    assert len(rows) == 2 + 2 + 1 and rows[-1] == "... 4 more leaves not shown."
    for bad in (0, -1, 1.5, True):
      with pytest.raises(ValueError, match="max_rows"):
        ols.format_gradient_report(self.report, max_rows=bad)

  def test_report_from_jit_formats_the_same(self):
    jitted = jax.jit(ols.gradient_report)(self.grads)
    assert str(jitted) == str(self.report)
    assert jitted.nonfinite_paths() == ["['inf']", "['nan']"]


def test_tree_order_survives_jit():
  # Twelve list leaves: sorted path strings would put '[10]' before '[2]'.
  grads = [jnp.full((2,), float(i)) for i in range(12)]
  grads[7] = grads[7].at[0].set(jnp.nan)
  for report in (ols.gradient_report(grads), jax.jit(ols.gradient_report)(grads)):
    expected = [f"[{i}]" for i in range(12)]
    assert report.paths == tuple(expected)
    assert [path for path, _ in report.items()] == expected
    assert report.nonfinite_paths() == ["[7]"]
    rows = ols.format_gradient_report(report).splitlines()[2:]
    assert [row.split()[1] for row in rows] == ["[7]"] + [p for p in expected if p != "[7]"]
