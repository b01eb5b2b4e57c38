"""Print the requirements a deployment image installs, read from pyproject.toml.

pyproject.toml stays the single list of dependencies. An image runs this repository's app on a
SuperLink or a SuperNode, so it installs the library's dependencies plus the ``node`` extra (what a
process of the app needs: not the ``app`` extra's simulation runtime, scikit-learn or pathspec,
nor ``bench`` or ``dev``), and differs from a development install in two places only:

- ``flwr[...]`` becomes ``flwr``: SuperLink and SuperNode containers run the deployment
  runtime, so Ray (the simulation engine, hundreds of MB) is left out;
- ``--torch SPEC`` replaces the torch requirement (e.g. for a CUDA build from another index).

Usage: ``python docker/requirements.py [--torch 'torch==2.13.0'] [--build] > requirements.txt``;
``--build`` adds the project's build backend (``[build-system] requires``), which installing the
project from a wheelhouse needs. The exact versions come from constraints.txt (or, for the HTTP
Fleet API, constraints-http.txt), which the image build and docker/make-wheelhouse.sh pass to pip
with ``-c``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
#: The optional dependencies a deployment needs besides the library's own: a node's of the app.
DEPLOYMENT_EXTRAS = ("node",)


def requirement_name(requirement: str) -> str:
    """The distribution name a requirement string starts with, lower-cased."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read a package name from requirement {requirement!r}")
    return match.group(1).lower()


def _extra_requirements(project: dict[str, Any], wanted: tuple[str, ...]) -> list[str]:
    """The requirements of extras ``wanted``, with the project's references to its own extras
    (``beyond-averaging[node]`` inside ``app``) replaced by what they list."""
    extras = project.get("optional-dependencies", {})
    own = requirement_name(project["name"])
    found: list[str] = []
    for extra in wanted:
        for requirement in extras.get(extra, []):
            if requirement_name(requirement) == own:
                inner = re.search(r"\[([^\]]*)\]", requirement)
                names = tuple(e.strip() for e in inner.group(1).split(",")) if inner else ()
                found += _extra_requirements(project, names)
            else:
                found.append(requirement)
    return found


def deployment_requirements(pyproject: Path, torch_spec: str | None, build: bool) -> list[str]:
    """The project's dependencies and its node extra as the deployment images install them."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data["project"]
    declared = [*project["dependencies"], *_extra_requirements(project, DEPLOYMENT_EXTRAS)]
    requirements = []
    for requirement in declared:
        name = requirement_name(requirement)
        if name == "flwr":
            requirement = re.sub(r"^flwr\[[^\]]*\]", "flwr", requirement.strip())
        elif name == "torch" and torch_spec:
            requirement = torch_spec
        requirements.append(requirement)
    if build:
        requirements += data["build-system"]["requires"]
    return requirements


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="", help="replace the torch requirement")
    parser.add_argument(
        "--build", action="store_true", help="add the build backend (setuptools) too"
    )
    args = parser.parse_args()
    for requirement in deployment_requirements(PYPROJECT, args.torch or None, args.build):
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
