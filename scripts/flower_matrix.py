"""The Flower compatibility matrix: the user-app tests against several flwr releases, as a table.

Runs ``pytest -m userapp tests/test_user_apps.py`` once, with one clean virtual environment per
requested release (the library's wheel, ``flwr[simulation]==<release>`` and torch; no
constraints.txt), and prints the runs as the Markdown table of docs/install.md ("Flower
versions"): both test apps x every rule for 2 rounds in Flower's simulation, one run on a local
deployment (SuperLink + 4 SuperNodes), and Flower's default ``flwr run`` with runtime dependency
installation. The exit status is pytest's.

    .venv/bin/python scripts/flower_matrix.py --flwr oldest 1.39.0 newest
    .venv/bin/python scripts/flower_matrix.py --flwr newest --python 3.12 --table build/py312.md
    .venv/bin/python scripts/flower_matrix.py --flwr 1.21.0 -- -k simulation  # pytest arguments

``oldest`` is the floor of ``flwr`` in pyproject.toml's dependencies, ``newest`` the newest
release below 2 on the package index. ``--torch`` is the torch requirement of every environment
(default ``torch==2.13.0``: the CPU wheel the project's machines hold locally, found through
``PIP_FIND_LINKS``; a looser one makes pip or uv weigh several GB of CUDA wheels). For a Python
without a local torch wheel, add the folder that holds one to ``PIP_FIND_LINKS`` (e.g. the
``WHEELHOUSE`` of scripts/python_matrix.sh), or torch comes from the index as its CUDA build.
The Python is ``python<version>`` on PATH or pyenv's ``versions/<version>*``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RULES = ("fedavg", "elastic", "fedlaw", "fedgma", "fedgma-soft")
APPS = ("quickstart", "flat")


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--flwr",
        nargs="+",
        default=["oldest", "1.39.0", "newest"],
        help="releases: oldest, newest or versions (default: oldest 1.39.0 newest)",
    )
    parser.add_argument(
        "--python", default="3.11", help="Python of the environments (default: 3.11)"
    )
    parser.add_argument(
        "--torch", default="torch==2.13.0", help="torch requirement (default: torch==2.13.0)"
    )
    parser.add_argument("--table", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    return parser.parse_args(argv)


def read_report(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _run_cell(records: list[dict[str, Any]]) -> str:
    if not records:
        return ""
    record = records[-1]
    return f"{'ok' if record['ok'] else 'FAILED'} {record['seconds']:.0f} s"


def _default_cell(record: dict[str, Any] | None, should_complete: bool) -> str:
    if record is None:
        return "not run"
    if record["dependency"] == "none":
        return str(record["status"])
    completed = str(record["status"]).endswith("completed")
    verdict = "as documented" if completed == should_complete else "NOT as documented"
    return f"{record['status']} ({verdict}), {record['seconds']:.0f} s"


def matrix_table(records: list[dict[str, Any]], requested: Sequence[str] = ()) -> str:
    """The runs as Markdown: one row per release x runtime x app, one column per rule; then
    per release its environment and the runs with Flower's default dependency installation.
    A requested release without an environment gets a row saying so."""
    installs = [r for r in records if r["kind"] == "install"]
    installed = {r["requested"] for r in installs}
    missing = [name for name in requested if name not in installed]
    runs = [r for r in records if r["kind"] == "run"]
    defaults = [r for r in records if r["kind"] == "default-install"]
    lines = [
        "| flwr | runtime, app | " + " | ".join(RULES) + " |",
        "|---|---|" + "---|" * len(RULES),
    ]
    for install in installs:
        flwr = install["flwr"]
        label = flwr if install["requested"] == flwr else f"{flwr} ({install['requested']})"
        for runtime in ("simulation", "deployment"):
            for app in APPS:
                mine = [
                    r for r in runs if (r["flwr"], r["runtime"], r["app"]) == (flwr, runtime, app)
                ]
                if mine:
                    cells = [_run_cell([r for r in mine if r["rule"] == rule]) for rule in RULES]
                    lines.append(f"| {label} | {runtime}, {app} | " + " | ".join(cells) + " |")
                    label = ""
    for name in missing:
        lines.append(f"| {name} | no environment: see pytest's output |" + " |" * len(RULES))
    lines += [
        "",
        "| flwr | Python | torch | clean venv + wheel + flwr + torch | default `flwr run`, "
        "`beyond-averaging` | default `flwr run`, `beyond-averaging @ file://...whl` |",
        "|---|---|---|---|---|---|",
    ]
    for install in installs:
        flwr = install["flwr"]
        mine = {r["dependency"]: r for r in defaults if r["flwr"] == flwr}
        plain = mine.get("none", mine.get("plain name"))
        documented = mine.get("none", mine.get("direct reference"))
        lines.append(
            f"| {flwr} | {install['python']} | {install['torch']} | "
            f"{install['seconds']:.0f} s ({install['installer']}) | "
            f"{_default_cell(plain, False)} | {_default_cell(documented, True)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    with tempfile.TemporaryDirectory(prefix="flower-matrix-") as scratch:
        report = Path(scratch) / "report.jsonl"
        env = {
            **os.environ,
            "BA_USERAPP_FLWR": " ".join(arguments.flwr),
            "BA_USERAPP_PYTHON": arguments.python,
            "BA_USERAPP_TORCH": arguments.torch,
            "BA_USERAPP_REPORT": str(report),
        }
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "userapp",
            "tests/test_user_apps.py",
            *arguments.pytest_args,
        ]
        started = time.monotonic()
        returncode = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
        minutes = (time.monotonic() - started) / 60
        records = read_report(report)
    table = matrix_table(records, arguments.flwr)
    footer = (
        f"\n{datetime.now(UTC):%Y-%m-%d}, {os.cpu_count()} CPU cores, {platform.machine()}: "
        f"`scripts/flower_matrix.py --flwr {' '.join(arguments.flwr)} "
        f"--python {arguments.python}`, {minutes:.1f} min in all, "
        f"pytest exit status {returncode}.\n"
    )
    print("\n" + table + footer)
    if arguments.table is not None:
        arguments.table.parent.mkdir(parents=True, exist_ok=True)
        arguments.table.write_text(table + footer, encoding="utf-8")
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
