"""Implementation subpackages; the public API is `optax_lossscale`.

Grouped by concern, each importing only those before it in this order
(`tests/test_layout.py` checks it, and `docs/architecture.md` draws it):

  utils < loss_scales < diagnostics < step < wrappers < storage < autocast < integrations

Until 0.1.0 the modules lay side by side in this package. Pickles name a
class by its module, so the old flat names (`optax_lossscale._src.optimizer`,
...) still import, as aliases of the modules that now hold those classes.
"""

from __future__ import annotations

from collections.abc import Sequence
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

LAYERS = (
  "utils",
  "loss_scales",
  "diagnostics",
  "step",
  "wrappers",
  "storage",
  "autocast",
  "integrations",
)

# The flat module names of releases up to 0.1.0, and where each module lives now.
FLAT_MODULES = {
  "compat": "utils",
  "params_check": "utils",
  "tree_utils": "utils",
  "validation": "utils",
  "dynamic_loss_scale": "loss_scales",
  "keras_compat": "loss_scales",
  "loss_scale": "loss_scales",
  "serialization": "loss_scales",
  "gradient_report": "diagnostics",
  "overflow_guard": "diagnostics",
  "scale_advisor": "diagnostics",
  "skip_guard": "diagnostics",
  "apply_gradients": "step",
  "composition": "step",
  "conditional_step": "step",
  "overwrite": "step",
  "skip_branch": "step",
  "grad": "wrappers",
  "optimizer": "wrappers",
  "retry": "wrappers",
  "skip_bad_steps": "wrappers",
  "spike_statistic": "wrappers",
  "state_access": "wrappers",
  "state_conversion": "wrappers",
  "equinox_grad": "integrations",
  "flax_checkpoint": "integrations",
  "flax_nnx": "integrations",
  "flax_train_state": "integrations",
}


class _FlatNameAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports `optax_lossscale._src.<flat name>` as the module that now holds it."""

  def find_spec(
    self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
  ) -> importlib.machinery.ModuleSpec | None:
    del path, target
    package, _, name = fullname.rpartition(".")
    if package != __name__ or name not in FLAT_MODULES:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    name = spec.name.rpartition(".")[2]
    module = importlib.import_module(f"{__name__}.{FLAT_MODULES[name]}.{name}")
    spec.loader_state = module.__spec__  # importlib overwrites it with the alias's spec
    return module

  def exec_module(self, module: types.ModuleType) -> None:
    # Already executed under its own name: only give it back its own spec.
    module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _FlatNameAlias) for finder in sys.meta_path):
  sys.meta_path.append(_FlatNameAlias())


def __getattr__(name: str) -> types.ModuleType:
  # `optax_lossscale._src.optimizer` as an attribute, as 0.1.0 code may read it.
  if name in FLAT_MODULES:
    return importlib.import_module(f"{__name__}.{FLAT_MODULES[name]}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
