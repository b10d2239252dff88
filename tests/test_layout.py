"""The package layout: subpackages by concern, imports only downward, old names still load."""

import ast
import importlib
import pathlib
import pickle
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale import _src

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "optax_lossscale" / "_src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, pathlib.Path]:
  """Dotted name relative to `_src` (e.g. 'step.composition') -> path."""
  return {
    ".".join(p.relative_to(SRC).with_suffix("").parts): p
    for p in sorted(SRC.rglob("*.py"))
    if p.name != "__init__.py"
  }


def _imports(path: pathlib.Path) -> set[str]:
  """Every `optax_lossscale...` module a file imports, at any depth (function-level too)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("optax_lossscale"))
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optax_lossscale"):
      # `from pkg import mod` imports pkg.mod when mod is a module.
      for alias in node.names:
        candidate = f"{node.module}.{alias.name}"
        relative = candidate.removeprefix("optax_lossscale._src.")
        found.add(candidate if relative in _modules() else node.module)
  return found


def test_every_module_lives_in_a_layer_subpackage():
  for name in _modules():
    layer = name.split(".")[0]
    assert "." in name, f"_src/{name}.py sits outside the subpackages {_src.LAYERS}"
    assert layer in _src.LAYERS, f"_src/{layer}/ is not one of the layers {_src.LAYERS}"
  for layer in _src.LAYERS:
    assert (SRC / layer / "__init__.py").read_text().startswith('"""'), layer


def test_imports_only_go_down_the_layers():
  rank = {layer: i for i, layer in enumerate(_src.LAYERS)}
  for name, path in _modules().items():
    own = rank[name.split(".")[0]]
    for target in _imports(path):
      assert target != "optax_lossscale", f"_src/{name}.py imports the public package"
      if target.startswith("optax_lossscale._src."):
        layer = target.split(".")[2]
        assert rank[layer] <= own, f"_src/{name}.py imports upward: {target}"


def test_no_import_cycle_between_modules():
  graph = {
    name: {
      t.removeprefix("optax_lossscale._src.")
      for t in _imports(path)
      if t.removeprefix("optax_lossscale._src.") in _modules()
    }
    for name, path in _modules().items()
  }
  done, active = set(), []

  def visit(node):
    if node in active:
      raise AssertionError("import cycle: " + " -> ".join([*active[active.index(node) :], node]))
    if node in done:
      return
    active.append(node)
    for nxt in graph[node]:
      visit(nxt)
    active.pop()
    done.add(node)

  for node in graph:
    visit(node)


@pytest.mark.parametrize("flat_name", sorted(_src.FLAT_MODULES))
def test_flat_module_names_of_0_1_0_still_import(flat_name):
  if flat_name.startswith(("flax_", "equinox_")):
    pytest.importorskip(flat_name.split("_")[0])
  layer = _src.FLAT_MODULES[flat_name]
  new = importlib.import_module(f"optax_lossscale._src.{layer}.{flat_name}")
  old = importlib.import_module(f"optax_lossscale._src.{flat_name}")
  assert old is new
  assert getattr(_src, flat_name) is new  # attribute access, as `ols._src.optimizer`
  # The module keeps its own identity: name and spec are the new ones.
  assert new.__name__ == new.__spec__.name == f"optax_lossscale._src.{layer}.{flat_name}"


def test_flat_names_cover_every_module_of_0_1_0():
  # The 28 modules of release 0.1.0, all moved; none is lost from the alias table.
  moved = {name.split(".")[-1] for name in _modules()}
  assert set(_src.FLAT_MODULES) <= moved
  assert len(_src.FLAT_MODULES) == 28


def test_a_pickle_written_by_the_flat_layout_loads_and_continues():
  # tests/data/states_0.1.0_flat_layout.pkl was written at commit c8e12a1 (the
  # flat layout) by the same steps as below; its classes are named by the old
  # module paths (optax_lossscale._src.dynamic_loss_scale, ...).
  data = (ROOT / "tests" / "data" / "states_0.1.0_flat_layout.pkl").read_bytes()
  assert b"optax_lossscale._src.dynamic_loss_scale" in data
  assert b"optax_lossscale._src.optimizer" in data
  old = pickle.loads(data)

  params = {"w": jnp.arange(3, dtype=jnp.float32)}
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale(2.0**10, increment_period=3))
  state = tx.init(params)
  _, state = tx.update({"w": jnp.ones(3)}, state, params)
  _, state = tx.update({"w": jnp.full(3, jnp.nan)}, state, params)
  skip = ols.skip_bad_steps(optax.sgd(0.1))
  skip_state = skip.init(params)
  _, skip_state = skip.update({"w": jnp.ones(3)}, skip_state, params)

  assert type(old["dynamic"]) is ols.LossScaleOptimizerState
  assert type(old["dynamic"].loss_scale) is type(state.loss_scale)
  assert type(old["skip"]) is ols.SkipBadStepsState
  assert isinstance(old["noop"], ols.NoOpLossScale)
  assert old["fixed"].loss_scale == ols.FixedLossScale(8.0)
  leaves_old, tree_old = jax.tree.flatten(old["dynamic"])
  leaves_new, tree_new = jax.tree.flatten(state)
  assert tree_old == tree_new
  for a, b in zip(leaves_old, leaves_new, strict=True):
    assert jnp.asarray(a).dtype == b.dtype and bool(jnp.array_equal(a, b))
  # The restored state steps on: the next update sees the old state's scale.
  _, resumed = tx.update({"w": jnp.ones(3)}, old["dynamic"], params)
  assert float(resumed.loss_scale()) == 512.0 and int(resumed.loss_scale.counter) == 1
  # A new pickle names the new modules.
  assert b"optax_lossscale._src.wrappers.optimizer" in pickle.dumps(jax.device_get(state))


def test_architecture_page_names_every_module_and_only_real_ones():
  text = ARCHITECTURE.read_text()
  named = {m for m in re.findall(r"`(\w+)/(\w+)\.py", text) if m[0] in _src.LAYERS}
  actual = {tuple(name.split(".")) for name in _modules()}
  assert named - actual == set(), f"the page names modules that do not exist: {named - actual}"
  assert actual - named == set(), f"the page does not name: {sorted(actual - named)}"
  # The layer order of the page's picture is the one the code enforces.
  order = re.search(r"<!-- layers: ([\w <]+) -->", text).group(1).split(" < ")
  assert tuple(order) == _src.LAYERS
