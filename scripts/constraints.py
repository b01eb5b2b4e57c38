"""Print constraints.txt: the exact installed versions of beyond-averaging[all extras]'s closure.

pyproject.toml states ranges; constraints.txt pins what the project was tested with (flwr 1.39,
the gRPC Fleet API), constraints-http.txt the same for the newest Flower (the HTTP Fleet API;
``FLEET=http bash scripts/setup.sh``). After a deliberate upgrade in the environment, regenerate
the file::

    .venv/bin/python scripts/constraints.py > constraints.txt
    .venvs/fleet-http/bin/python scripts/constraints.py --fleet http > constraints-http.txt

Only the project's own dependency closure is written (walked through the installed packages'
metadata, extras included), not whatever else the environment holds.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

PROJECT = "beyond-averaging"
EXTRAS = ("app", "bench", "dev", "tensorboard", "mlflow", "mlflow-ui", "wandb")
HEADER = """\
# Exact versions for a reproducible set-up: {setup} installs the project with
# `pip install -c {file} -e ".[{extras}]"`, and the deployment images{image} install with
# the same file (docker/Dockerfile, docker/make-wheelhouse.sh). pyproject.toml itself states only
# ranges, so that the library installs into other Flower apps. This is the dependency closure of
# beyond-averaging[{extras}] as tested (CPython 3.11, Linux) with {flower};
# torch==2.13.0 also admits its +cpu and +cuXXX builds. Regenerate after a deliberate upgrade:
#   {python} scripts/constraints.py{option} > {file}"""
#: Per Fleet transport: the constraints file and how its environment is made.
FLEETS = {
    "grpc": {
        "file": "constraints.txt",
        "setup": "scripts/setup.sh",
        "image": "",
        "flower": "flwr 1.39 (gRPC Fleet API)",
        "python": ".venv/bin/python",
        "option": "",
    },
    "http": {
        "file": "constraints-http.txt",
        "setup": "`FLEET=http bash scripts/setup.sh`",
        "image": " built with FLEET=http",
        "flower": "the newest flwr (HTTP Fleet API)",
        "python": ".venvs/fleet-http/bin/python",
        "option": " --fleet http",
    },
}


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(project: str, extras: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Name and version of each installed distribution that `project[extras]` needs."""
    found: dict[str, tuple[str, str]] = {}
    extras_seen: dict[str, set[str]] = {}
    pending: list[tuple[str, frozenset[str]]] = [(project, frozenset(extras))]
    while pending:
        name, wanted = pending.pop()
        key = _key(name)
        new_extras = set(wanted) - extras_seen.get(key, set())
        if key in found and not new_extras:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"constraints.py: {name} is required but not installed; run scripts/setup.sh")
        found[key] = (dist.metadata["Name"], dist.version)
        extras_seen.setdefault(key, set()).update(wanted)
        for line in dist.requires or []:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in ("", *sorted(extras_seen[key]))]
            if requirement.marker is None or any(
                requirement.marker.evaluate(environment) for environment in environments
            ):
                pending.append((requirement.name, frozenset(requirement.extras)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", choices=sorted(FLEETS), default="grpc")
    fleet = FLEETS[parser.parse_args().fleet]
    closure = dependency_closure(PROJECT, EXTRAS)
    closure.pop(_key(PROJECT))
    print(HEADER.format(**fleet, extras=",".join(EXTRAS)))
    for name, version in sorted(closure.values(), key=lambda item: _key(item[0])):
        print(
            f"{name}=={version.split('+')[0]}"
        )  # the local label (+cpu) is the build, not the pin
    return 0


if __name__ == "__main__":
    sys.exit(main())
