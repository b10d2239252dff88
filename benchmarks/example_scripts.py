"""Loads a script of `examples/` as a module, for the benchmarks that measure on it."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(filename: str) -> types.ModuleType:
  name = f"optax_lossscale_example_{filename.removesuffix('.py')}"
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / filename)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up here
  spec.loader.exec_module(module)
  return module
