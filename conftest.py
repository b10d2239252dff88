"""Pytest configuration shared by the doctests, the documentation and the test suite."""

import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent

# XLA compiling every program once per process is most of this suite's time on
# a CPU. The tests check what our code computes, not how fast the backend's
# machine code runs, so they ask XLA for unoptimised machine code: the same HLO
# passes (fusion, the compiled-step facts the tests read) and about a third less
# compile time. Set before JAX starts; the xdist workers and the subprocesses
# the tests launch inherit it (tests/__init__.py: child_xla_flags).
# OLS_TEST_XLA_DEFAULTS=1 runs the suite with XLA's own defaults instead.
FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
)
if os.environ.get("OLS_TEST_XLA_DEFAULTS") != "1":
  _flags = os.environ.get("XLA_FLAGS", "").split()
  _names = {f.split("=")[0] for f in _flags}
  _flags += [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in _names]
  os.environ["XLA_FLAGS"] = " ".join(_flags)


def _installed(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ImportError:
    return False


# The Sphinx configuration and the built site are not tests.
collect_ignore = ["docs/conf.py"]
collect_ignore_glob = ["docs/_build/*"]
# Flax and Equinox are optional extras: without them, skip the modules that
# need them instead of failing to collect their doctests (their tests skip
# themselves).
if not _installed("flax"):
  collect_ignore_glob += [
    "optax_lossscale/flax.py",
    "optax_lossscale/_src/integrations/flax_*.py",
  ]
if not _installed("equinox"):
  collect_ignore_glob += [
    "optax_lossscale/equinox.py",
    "optax_lossscale/_src/integrations/equinox_*.py",
  ]

# Every Python block of the Markdown documents (the README and the pages of
# docs/, the paths pyproject.toml's testpaths name) runs, in order, in one
# namespace per document, as a reader would run them top to bottom. A block
# that is deliberately a fragment is preceded by an HTML comment that skips it
# and says why: <!-- skip: next "a fragment of the step above" -->.
DOCUMENT_PATTERNS = ("README.md", "docs/*.md", "docs/*/*.md")
# Documents whose blocks are known not to run yet, and why: their blocks still
# run, and report XFAIL (or XPASS) instead of failing the suite.
NOT_YET_RUNNABLE: dict[str, str] = {}

if _installed("sybil"):
  import doctest

  from sybil import Sybil
  from sybil.parsers.myst import PythonCodeBlockParser, SkipParser

  pytest_collect_file = Sybil(
    parsers=[
      PythonCodeBlockParser(doctest_optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS),
      SkipParser(),
    ],
    patterns=DOCUMENT_PATTERNS,
    excludes=["docs/_build/*"],
  ).pytest()
else:
  # Without sybil (the lowest-versions environment installs only the test
  # dependencies) each document is one skipped test, which says why.

  class _NotRun(pytest.Item):
    def runtest(self) -> None:
      pytest.skip("sybil is not installed: the code blocks of this document are not run")

  class _Document(pytest.File):
    def collect(self) -> list[pytest.Item]:
      return [_NotRun.from_parent(self, name="code blocks")]

  def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector) -> pytest.File | None:
    if file_path.is_relative_to(ROOT):
      relative = file_path.relative_to(ROOT)
      if any(relative.match(pattern) for pattern in DOCUMENT_PATTERNS):
        return _Document.from_parent(parent, path=file_path)
    return None


UNSCALED_AS_ERROR = "error::optax_lossscale.UnscaledGradientsWarning"
UNSCALED_IGNORED = "ignore::optax_lossscale.UnscaledGradientsWarning"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  for item in items:
    relative = item.path.relative_to(ROOT).as_posix() if item.path.is_relative_to(ROOT) else ""
    if relative in NOT_YET_RUNNABLE:
      item.add_marker(pytest.mark.xfail(reason=NOT_YET_RUNNABLE[relative], strict=False))
    if not relative.startswith("tests/"):
      # A reader who runs the documentation's code or a docstring's example
      # must never see the check against unscaled gradients fire: there it
      # would be a false alarm.
      item.add_marker(pytest.mark.filterwarnings(UNSCALED_AS_ERROR))
    else:
      # The unit tests feed the wrappers gradients made by hand (scaled by
      # construction), which the check cannot tell from those of a plain loss.
      # tests/test_unscaled_gradients.py sets its own filters: the mistake is
      # loud and every documented way of scaling is quiet.
      item.add_marker(pytest.mark.filterwarnings(UNSCALED_IGNORED))
