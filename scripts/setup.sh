#!/usr/bin/env bash
# Create .venv with the project (editable) and every extra: the app, the benchmarks' plots, the dev
# tools. Idempotent: when neither pyproject.toml nor constraints.txt changed since the last
# successful run, it only checks the environment.
#
# pyproject.toml states ranges (the library installs into other people's apps); constraints.txt
# holds the exact versions this project is tested with, so every set-up gets the same environment.
# torch is installed first, at its exact version: on a CPU machine pip would otherwise weigh several
# GB of CUDA packages. GPU users install their CUDA build of the same torch into .venv first
# (docs/install.md, "GPU"); it satisfies the constraint, so pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin=${PYTHON:-}
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
fi
if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
  echo "setup: needs Python 3.11 or newer (found $("$python_bin" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
# mypy's view of the package (the wheel's layout as links to the sources); cheap, so every time.
.venv/bin/python scripts/typing_tree.py
stamp=.venv/.beyond-averaging-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import flwr, torch, beyond_averaging' 2>/dev/null; then
  echo "setup: .venv is up to date"
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt torch
.venv/bin/python -m pip install -q -c constraints.txt -e ".[app,bench,dev]"
echo "$want" > "$stamp"
echo "setup: .venv ready ($(.venv/bin/python -c 'import flwr, torch; print("flwr", flwr.__version__, "torch", torch.__version__)'))"
