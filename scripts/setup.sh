#!/usr/bin/env bash
# Create .venv with the project (editable) and every extra: the app, the benchmarks' plots, the dev
# tools, the experiment trackers (TensorBoard, MLflow, W&B; CI's tests read what they write). Idempotent: when neither pyproject.toml nor constraints.txt changed since the last
# successful run, it only checks the environment.
#
# pyproject.toml states ranges (the library installs into other people's apps); constraints.txt
# holds the exact versions this project is tested with, so every set-up gets the same environment.
# torch is installed first, at its exact version: on a CPU machine pip would otherwise weigh several
# GB of CUDA packages. GPU users install their CUDA build of the same torch into .venv first
# (docs/install.md, "GPU"); it satisfies the constraint, so pip keeps it.
#
# Another Python, in another folder (scripts/python_matrix.sh does this per version):
#   PYTHON=3.12 VENV=.venvs/py3.12 WHEELHOUSE=~/.cache/beyond-averaging/wheels bash scripts/setup.sh
# PYTHON is a command, a path or a version; VENV defaults to .venv; WHEELHOUSE (optional) keeps
# the torch download for the next set-up.
#
# The newest Flower, whose Fleet API (SuperNode <-> SuperLink) is HTTP, instead of flwr 1.39
# (gRPC Fleet API), in its own folder .venvs/fleet-http, from constraints-http.txt
# (docs/deployment.md, "Which Flower, which transport"):
#   FLEET=http bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

case ${FLEET:-grpc} in
  grpc) constraints=constraints.txt default_venv=.venv ;;
  http) constraints=constraints-http.txt default_venv=.venvs/fleet-http ;;
  *)
    echo "setup: FLEET=${FLEET} is not a Fleet transport: use grpc (flwr 1.39, the default) or http (the newest flwr)" >&2
    exit 1
    ;;
esac

# Echo a runnable interpreter for $1 (a command, a path, or a version such as 3.12).
find_python() {
  local want=$1 candidate found=""
  case $want in [0-9]*) want=python$want ;; esac
  if "$want" -c '' >/dev/null 2>&1; then
    echo "$want"
    return 0
  fi
  # pyenv's shims answer only for the versions `pyenv global` names; the others are installed
  # beside them, one folder each.
  if command -v pyenv >/dev/null 2>&1; then
    for candidate in "$(pyenv root)"/versions/"${want#python}"*/bin/"$want"; do
      [ -x "$candidate" ] && found=$candidate
    done
  fi
  [ -n "$found" ] && echo "$found"
}

venv=${VENV:-$default_venv}
if [ -n "${PYTHON:-}" ]; then
  python_bin=$(find_python "$PYTHON") || {
    echo "setup: no Python found for PYTHON=$PYTHON (a command, a path, or a version such as 3.12)" >&2
    exit 1
  }
else
  python_bin=$(find_python 3.11) || python_bin=python3
fi
if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
  echo "setup: needs Python 3.11 or newer (found $("$python_bin" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
python_version=$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

if [ -x "$venv/bin/python" ]; then
  have=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -n "${PYTHON:-}" ] && [ "$have" != "$python_version" ]; then
    echo "setup: $venv has Python $have, PYTHON=$PYTHON is $python_version; remove $venv or set VENV=another/folder" >&2
    exit 1
  fi
else
  mkdir -p "$(dirname "$venv")"
  "$python_bin" -m venv "$venv"
fi
# mypy's view of the package (the wheel's layout as links to the sources); cheap, so every time.
"$venv/bin/python" scripts/typing_tree.py
stamp=$venv/.beyond-averaging-setup
want=$({ cat pyproject.toml "$constraints"; "$venv/bin/python" --version; } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c 'import flwr, torch, beyond_averaging' 2>/dev/null; then
  echo "setup: $venv is up to date"
  exit 0
fi
"$venv/bin/python" -m pip install -q --upgrade pip
if [ -n "${WHEELHOUSE:-}" ]; then
  # torch with its CUDA libraries is GBs from the registry where no local wheel fits this Python:
  # fetched once into WHEELHOUSE (a folder outside the repository; pip's own cache keeps nothing
  # the registry sends without caching headers), installed from there on every later set-up.
  mkdir -p "$WHEELHOUSE"
  "$venv/bin/python" -m pip download -q -c "$constraints" -d "$WHEELHOUSE" torch
  "$venv/bin/python" -m pip install -q --no-index --find-links "$WHEELHOUSE" -c "$constraints" torch
else
  "$venv/bin/python" -m pip install -q -c "$constraints" torch
fi
"$venv/bin/python" -m pip install -q -c "$constraints" -e ".[app,bench,dev,tensorboard,mlflow,mlflow-ui,wandb]"
echo "$want" > "$stamp"
echo "setup: $venv ready ($("$venv/bin/python" -c 'import sys, flwr, torch; print("Python", sys.version.split()[0], "flwr", flwr.__version__, "torch", torch.__version__)'))"
