"""The documentation promises: every public name is documented with a runnable
example, and the README shows the demo and links the notebooks that exist."""

import inspect
import pathlib
import re
import tomllib

import pytest

import optax_lossscale as ols

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", ols.__all__)
def test_public_name_has_summary_and_example(name):
  doc = inspect.getdoc(getattr(ols, name))
  assert doc, f"{name} has no docstring"
  summary = doc.splitlines()[0]
  assert summary.endswith("."), f"{name}: the first line should be a one-sentence summary"
  assert "Example:" in doc and ">>> " in doc, f"{name} has no runnable Example"


@pytest.mark.parametrize("name", [n for n in ols.__all__ if inspect.isfunction(getattr(ols, n))])
def test_public_function_documents_args_and_returns(name):
  function = getattr(ols, name)
  doc = inspect.getdoc(function)
  if inspect.signature(function).parameters:
    assert "Args:" in doc, f"{name} documents no Args"
  assert "Returns:" in doc, f"{name} documents no Returns"


def test_readme_embeds_the_committed_demo_image():
  images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", README)
  assert "docs/demo.png" in images
  assert (ROOT / "docs" / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_links_every_notebook():
  notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
  assert notebooks
  for name in notebooks:
    assert f"notebooks/{name}" in README, f"README does not link {name}"


def test_version_table_states_the_tested_versions():
  # The lowest column is pyproject.toml's lower bounds (what `make test-lowest`
  # installs), the pinned one the pins of constraints.txt (what `make test`
  # installs), the newest those of constraints-newest.txt (`make test-newest`).
  # Every runtime dependency and every one of the `flax` extra has a row; a row
  # for another extra's package states its lower bound, one for a test
  # dependency the pins of the constraint files.
  section = (ROOT / "docs" / "supported_versions.md").read_text()
  assert "docs/supported_versions.md" in README  # the README's one line links it
  rows = re.findall(r"^\| ([^|]+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", section, re.MULTILINE)
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  requirements = project["dependencies"] + project["optional-dependencies"]["flax"]
  lower = lambda r: r.split(",")[0].split(">=")  # name>=version[,<upper]
  lowest = dict(lower(r) for r in requirements)
  extras = [r for e in project["optional-dependencies"].values() for r in e if ">=" in r]
  declared = {**dict(lower(r) for r in extras), **lowest}
  pinned, lowest_pins, newest = (
    {
      name: version
      for name, version in (p.split("==") for p in (ROOT / f).read_text().split() if "==" in p)
    }
    for f in ("constraints.txt", "constraints-lowest.txt", "constraints-newest.txt")
  )
  stated = set()
  for package, low, mid, high in rows:
    names = re.sub(r"\(.*\)", "", package).replace(" ", "").split(",")
    stated.update(names)
    if names == ["Python"]:
      assert project["requires-python"] == f">={low}"
      continue
    for name in names:
      got = (declared.get(name, lowest_pins.get(name)), pinned[name], newest[name])
      assert got == (low, mid, high), name
  # No upper bound on jax: the newest tested release is allowed.
  assert not any("<" in r for r in project["dependencies"]), project["dependencies"]
  assert stated >= {"Python", *lowest}, sorted({"Python", *lowest} - stated)
