"""The lower bounds of pyproject.toml's dependencies, as exact pins.

  python .ci/lower_bounds.py [EXTRA ...]          prints `name==version`, one a line
  python .ci/lower_bounds.py --check [EXTRA ...]  fails unless this environment holds exactly them

Every runtime dependency (and every dependency of the named extras) must be
declared as `name>=version`: the lower bound is the version CI tests
(`make test-lowest`), so a dependency without one is an error.
"""

from __future__ import annotations

from importlib import metadata
import pathlib
import re
import sys
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
# `name>=version`, optionally with an upper bound: `name>=version,<version`.
_LOWER_BOUND = re.compile(
  r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9.]*)(?:\s*,\s*<\s*[0-9][0-9.]*)?"
)


def lower_bounds(extras: list[str]) -> dict[str, str]:
  project = tomllib.loads(PYPROJECT.read_text())["project"]
  optional = project.get("optional-dependencies", {})
  unknown = sorted(set(extras) - set(optional))
  if unknown:
    raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
  bounds = {}
  for requirement in project["dependencies"] + [r for e in extras for r in optional[e]]:
    match = _LOWER_BOUND.fullmatch(requirement.strip())
    if match is None:
      raise SystemExit(f"{requirement!r} is not of the form 'name>=version[,<version]'")
    bounds[match[1]] = match[2]
  return bounds


def _release(version: str) -> tuple[int, ...]:
  """`0.11` and `0.11.0` are the same release."""
  parts = [int(p) for p in version.split(".")]
  while parts and parts[-1] == 0:
    parts.pop()
  return tuple(parts)


def main(argv: list[str]) -> int:
  check = "--check" in argv
  bounds = lower_bounds([a for a in argv if a != "--check"])
  if not check:
    print("\n".join(f"{name}=={version}" for name, version in bounds.items()))
    return 0
  wrong = []
  for name, version in bounds.items():
    try:
      installed = metadata.version(name)
    except metadata.PackageNotFoundError:
      installed = "not installed"
    if installed == "not installed" or _release(installed) != _release(version):
      wrong.append(f"{name}: pyproject.toml's lower bound is {version}, installed is {installed}")
  if wrong:
    print("This environment does not hold the declared lower bounds:", *wrong, sep="\n  ")
    return 1
  print("Installed: exactly the declared lower bounds,", *(f"{n}=={v}" for n, v in bounds.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
