"""Loads a script of `examples/` as a module, for the tests of the demos."""

import importlib.util
import pathlib
import sys
import types

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(filename: str, module_name: str) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / filename)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up here
  spec.loader.exec_module(module)
  return module
