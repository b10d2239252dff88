"""The API reference documents every public name, from the reST sources (no build needed).

Each page of `docs/api/` sets a module with `.. currentmodule::` and documents
names with `.. autofunction::`, `.. autoclass::` or `.. autoexception::`, after
an `.. autosummary::` table of the same names. Every name of the three public
`__all__` tuples must have exactly one entry, and every entry must be public.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
PUBLIC_MODULES = {
  "optax_lossscale": ROOT / "optax_lossscale" / "__init__.py",
  "optax_lossscale.flax": ROOT / "optax_lossscale" / "flax.py",
  "optax_lossscale.equinox": ROOT / "optax_lossscale" / "equinox.py",
}
_DIRECTIVE = re.compile(
  r"^\.\. (currentmodule|auto(?:function|class|exception|data)|autosummary)::\s*(\S*)"
)


def _all(path):
  """A module's `__all__`, read from its source: the extras need not be installed."""
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Assign) and any(
      getattr(t, "id", "") == "__all__" for t in node.targets
    ):
      return tuple(ast.literal_eval(node.value))
  raise AssertionError(f"{path} has no __all__")


def _pages():
  """Per page: the names it documents and the names its autosummary tables list."""
  pages = {}
  for path in sorted(API.glob("*.rst")):
    module, documented, summarized, in_summary = None, [], [], False
    for line in path.read_text().splitlines():
      match = _DIRECTIVE.match(line)
      if match:
        kind, argument = match.groups()
        in_summary = kind == "autosummary"
        if kind == "currentmodule":
          module = argument
        elif kind != "autosummary":
          assert module, f"{path.name}: {argument} documented before any currentmodule"
          documented.append(f"{module}.{argument}")
      elif in_summary and line.startswith("   ") and not line.strip().startswith(":"):
        summarized.append(f"{module}.{line.strip()}")
      elif in_summary and line and not line.startswith(" "):
        in_summary = False
    pages[path.name] = (documented, summarized)
  return pages


PUBLIC = sorted(
  f"{module}.{name}" for module, path in PUBLIC_MODULES.items() for name in _all(path)
)
DOCUMENTED = [name for documented, _ in _pages().values() for name in documented]


def test_the_core_all_matches_the_package():
  import optax_lossscale

  assert _all(PUBLIC_MODULES["optax_lossscale"]) == optax_lossscale.__all__


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_one_api_entry(name):
  assert DOCUMENTED.count(name) == 1, f"{name}: {DOCUMENTED.count(name)} entries in docs/api/"


def test_every_api_entry_is_public():
  assert sorted(set(DOCUMENTED) - set(PUBLIC)) == []


@pytest.mark.parametrize("page", sorted(_pages()))
def test_summary_table_lists_what_the_page_documents(page):
  documented, summarized = _pages()[page]
  assert documented, f"{page} documents nothing"
  assert summarized == documented


def test_every_api_page_is_in_the_api_index():
  index = (API / "index.md").read_text()
  toctree = index.split("```{toctree}", 1)[1].split("```", 1)[0]
  lines = [line.strip() for line in toctree.splitlines()]
  entries = [line for line in lines if line and not line.startswith(":")]  # not the options
  assert sorted(entries) == sorted(p.stem for p in API.glob("*.rst"))
