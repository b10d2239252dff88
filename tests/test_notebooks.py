"""Executes every notebook in `notebooks/` and checks they are stored clean.

The notebooks assert their own claims (a skipped step leaves the state
untouched, shardings survive an update, ...), so running them to the end is
the test. The kernel is this interpreter, with this checkout first on the path,
whatever kernels the machine has installed.
"""

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

from tests import child_xla_flags  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
# What each notebook imports beyond the core dependencies (extras `dev`, `flax`).
NOTEBOOKS = {
  "01_quickstart": (),
  "02_flax_fp16_training": ("flax", "matplotlib", "sklearn"),
  "03_multi_device": (),
  "04_skip_bad_steps": ("matplotlib", "sklearn"),
}
KERNEL_NAME = "optax-lossscale-tests"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
  """A kernelspec that runs this interpreter with this checkout importable."""
  kernels = tmp_path_factory.mktemp("kernels")
  spec_dir = kernels / KERNEL_NAME
  spec_dir.mkdir()
  pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  spec = {
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "optax_lossscale tests",
    "language": "python",
    # Notebooks pick their own device count; an inherited one must not leak in.
    "env": {"PYTHONPATH": pythonpath, "XLA_FLAGS": child_xla_flags(), "MPLBACKEND": "Agg"},
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  return kernels


def _read(name):
  return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, kernel_dir, tmp_path):
  for module in NOTEBOOKS[name]:
    pytest.importorskip(module)
  notebook = _read(name)
  manager = KernelManager(
    kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)])
  )
  client = nbclient.NotebookClient(
    notebook, km=manager, timeout=240, resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()
  errors = [
    out for cell in notebook.cells for out in cell.get("outputs", []) if out.output_type == "error"
  ]
  assert not errors


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
  notebook = _read(name)
  nbformat.validate(notebook)
  code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert code_cells
  for cell in code_cells:
    assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
