"""Checks the built distributions (`make dist-check`).

python .ci/check_dist.py DIST_DIR   the wheel and the sdist hold the license, the
                                    typing marker and the classifiers
python -I .ci/check_dist.py --import  run in a fresh environment holding only the
                                    wheel: the package imports from there
"""

from __future__ import annotations

import email.parser
import importlib.util
import pathlib
import re
import sys
import tarfile
import zipfile

CLASSIFIERS = ("License :: OSI Approved :: Apache Software License", "Typing :: Typed")


def check_files(dist: pathlib.Path) -> list[str]:
  errors = []
  (wheel,) = dist.glob("*.whl")
  (sdist,) = dist.glob("*.tar.gz")
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    metadata_path = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = email.parser.Parser().parsestr(z.read(metadata_path).decode())
  for wanted in ("optax_lossscale/py.typed", "licenses/LICENSE"):
    if not any(n.endswith(wanted) for n in names):
      errors.append(f"{wheel.name} has no {wanted}")
  if any(n.startswith(("tests/", "docs/", "examples/")) for n in names):
    errors.append(f"{wheel.name} ships more than the package")
  if metadata["License-Expression"] != "Apache-2.0":
    errors.append(f"License-Expression is {metadata['License-Expression']!r}")
  missing = set(CLASSIFIERS) - set(metadata.get_all("Classifier") or [])
  errors += [f"{wheel.name} lacks the classifier {c!r}" for c in sorted(missing)]
  requires = metadata.get_all("Requires-Dist") or []
  # The name of each requirement ("jax>=0.7.1", "optax<1,>=0.2.4").
  runtime = sorted(re.match(r"[A-Za-z0-9._-]+", r)[0] for r in requires if "extra ==" not in r)
  if runtime != ["jax", "jaxlib", "optax"]:
    errors.append(f"runtime dependencies are {runtime}, expected jax, jaxlib and optax")
  with tarfile.open(sdist) as t:
    sdist_names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  for wanted in ("LICENSE", "optax_lossscale/py.typed", "pyproject.toml"):
    if wanted not in sdist_names:
      errors.append(f"{sdist.name} has no {wanted}")
  if any(n.startswith("docs/_build/") for n in sdist_names):
    errors.append(f"{sdist.name} holds the built documentation")
  return errors


def check_import() -> list[str]:
  import optax_lossscale

  location = pathlib.Path(optax_lossscale.__file__).resolve()
  if "site-packages" not in location.parts:
    return [f"optax_lossscale was imported from {location}, not from the installed wheel"]
  if not (location.parent / "py.typed").exists():
    return ["the installed package has no py.typed"]
  if importlib.util.find_spec("flax") is not None:
    import optax_lossscale.flax
  print(f"imported optax_lossscale {optax_lossscale.__version__} from {location.parent}")
  return []


def main(argv: list[str]) -> int:
  errors = check_import() if argv == ["--import"] else check_files(pathlib.Path(argv[0]))
  for error in errors:
    print(error, file=sys.stderr)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
