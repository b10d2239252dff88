"""Sphinx configuration of the documentation site (`make docs`)."""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optax_lossscale  # noqa: E402
from optax_lossscale import LossScale  # noqa: E402

project = "optax_lossscale"
author = "optax_lossscale developers"
copyright = "optax_lossscale developers"
release = version = optax_lossscale.__version__

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
  "sphinx_copybutton",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# Our docstrings are Google style and write code in single backticks, as
# Markdown does: render it as code rather than as a cross-reference.
default_role = "literal"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autosummary_generate = False

# Every reference must resolve, except to the libraries we build on: their
# inventories (intersphinx) would need the network at build time.
nitpicky = True
_EXTERNAL = r"(jax|jaxlib|optax|flax|equinox|numpy|np|chex|orbax|etils|typing_extensions)(\..+)?"
nitpick_ignore_regex = [
  ("py:class", _EXTERNAL),
  ("py:obj", _EXTERNAL),
  ("py:exc", _EXTERNAL),
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# BENCHMARKS.md (included as the full benchmark report) puts its generated
# per-workload tables under H4 headings directly below an H2.
suppress_warnings = ["myst.header"]

# The notebooks are stored without outputs and executed by the test suite
# (tests/test_notebooks.py); `make docs` executes them again so that the
# pages show their outputs and plots (about a minute on 2 CPU cores).
# NB_EXECUTION_MODE=off builds the site without running them.
nb_execution_mode = os.environ.get("NB_EXECUTION_MODE", "force")
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True

html_theme = "sphinx_book_theme"
html_title = "optax_lossscale"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
  "use_download_button": False,
  # pydata-sphinx-theme 0.20 would add a header bar holding a second search field.
  "navbar_persistent": [],
}
# The right-hand table of contents lists `inner_optimizer`, not
# `LossScaleOptimizer.inner_optimizer`.
toc_object_entries_show_parents = "hide"
html_last_updated_fmt = None
copybutton_prompt_text = r">>> |\.\.\. "
copybutton_prompt_is_regexp = True

# The standard library is referenced from signatures too; without intersphinx
# (no network at build time) it cannot resolve either.
nitpick_ignore_regex += [
  ("py:class", r"(collections\.abc|os|typing|types)\..+"),
  # Private helpers that appear in signatures and attribute types: not public.
  ("py:class", r"ArrayTree|stat_lib\.RunningStatistic|optax_lossscale\._src\..+\._Self"),
  # autocast's product description and report rows: described in `autocast` and
  # `autocast_report` (their fields), not public names of their own.
  ("py:class", r"optax_lossscale\._src\.autocast\.(fp8_choice\.Product|report\.Report)"),
]

_CODE = re.compile(r"(``.*?``|`[^`]*`)")


def _escape_bars(line: str) -> str:
  """`|g|` in prose is a substitution reference in reST; outside code, escape it."""
  parts = _CODE.split(line)
  return "".join(p if i % 2 else p.replace("|", r"\|") for i, p in enumerate(parts))


def _preprocess_docstring(
  app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
  """Adapts our Markdown-flavoured docstrings before napoleon reads them."""
  lines[:] = [
    line if line.lstrip().startswith((">>>", "...")) else _escape_bars(line) for line in lines
  ]
  # Napoleon reads "Words: more words" on a property's first line as "type:
  # description"; a leading colon gives it an empty type instead.
  if what == "property" and lines and ":" in _CODE.sub("", lines[0]):
    lines[0] = ": " + lines[0]


def _resolve_public_name(app: Any, env: Any, node: Any, contnode: Any) -> Any:
  """Resolves a module-alias annotation (`loss_scale_lib.LossScale`) to the public name."""
  if node.get("refdomain") != "py":
    return None
  name = node["reftarget"].rpartition(".")[2]
  for module in ("optax_lossscale", "optax_lossscale.flax", "optax_lossscale.equinox"):
    target = f"{module}.{name}"
    if target in env.get_domain("py").objects:
      return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], target, node, contnode
      )
  return None


def _loss_scale_signature(
  app: Any, what: str, name: str, obj: Any, options: Any, signature: str, annotation: str
) -> tuple[str, str] | None:
  """A loss scale's constructor signature, not its metaclass's `(*args, **kwargs)`."""
  if what != "class" or not (isinstance(obj, type) and issubclass(obj, LossScale)):
    return None
  if obj is LossScale:  # the abstract base: built only through subclasses
    return "", annotation
  init = inspect.signature(obj.__init__, eval_str=True)
  params = [
    p for p in list(init.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
  ]
  return str(init.replace(parameters=params, return_annotation=inspect.Signature.empty)), annotation


def setup(app: Any) -> None:
  app.connect("autodoc-process-docstring", _preprocess_docstring, priority=400)
  app.connect("autodoc-process-signature", _loss_scale_signature)
  app.connect("missing-reference", _resolve_public_name)
