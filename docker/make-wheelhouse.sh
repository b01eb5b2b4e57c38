#!/usr/bin/env bash
# Fill a wheelhouse with every wheel the deployment images install, so that `docker build` (and
# `docker compose build`) works on a machine with no package registry: when the build finds
# wheels in the wheelhouse, it installs from there only (pip --no-index).
#
#   docker/make-wheelhouse.sh [--out DIR] [--torch SPEC] [--index-url URL] [--python PY]
#
#   --out DIR         where the wheels go (default wheelhouse/cpu; the CUDA build reads
#                     wheelhouse/cuda, see compose.gpu.yaml); wheelhouse/ is git-ignored
#   --torch SPEC      the torch requirement (default: the constraints', torch==2.13.0)
#   --index-url URL   extra index holding that torch build, e.g.
#                     https://download.pytorch.org/whl/cu128 for a CUDA wheelhouse
#   --python PY       the interpreter whose pip downloads (default: .venv/bin/python, else
#                     python3); it must be CPython 3.11 on Linux of the image's architecture,
#                     since the wheels must fit the image. On another system run this script
#                     inside the base image instead:
#                       docker run --rm -v "$PWD":/src -w /src python:3.11-slim-bookworm \
#                         bash docker/make-wheelhouse.sh --python python3
#                     For an arm64 image, so on an amd64 machine under emulation (pip must
#                     evaluate the requirements' markers on the image's architecture):
#                       docker run --rm --platform linux/arm64 -v "$PWD":/src -w /src \
#                         python:3.11-slim-bookworm bash docker/make-wheelhouse.sh \
#                         --python python3 --out wheelhouse/cpu-arm64 --torch torch==2.9.1
#                     (PyPI's torch 2.13.0 for aarch64 is a CUDA build; 2.9.1 is a CPU one, or
#                     use PyTorch's CPU index with --index-url)
#
# The requirements come from pyproject.toml (docker/requirements.py: the library and the node
# extra, flwr without the simulation extra, plus the build backend), at the exact versions of
# constraints.txt (FLEET=grpc, flwr 1.39) and of constraints-http.txt (FLEET=http, the newest
# flwr), both in the one wheelhouse, so the images run the versions the test suites ran; plus
# scikit-learn's wheel alone, from which the image copies the digits table. pip wheel also
# builds a wheel for any dependency published only as a source archive. Run again, it does
# nothing while the requirements, the constraints, this script and its arguments are unchanged
# (the stamp DIR/.requirements).
set -euo pipefail
cd "$(dirname "$0")/.."

out=wheelhouse/cpu
torch_spec=""
index_url=""
python=""
while (($#)); do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --torch) torch_spec=$2; shift 2 ;;
    --index-url) index_url=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    -h | --help) sed -n '2,34p' docker/make-wheelhouse.sh | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "make-wheelhouse.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

running=$("$python" -c 'import platform, sys; print(sys.implementation.name, "%d.%d" % sys.version_info[:2], platform.system())')
if [[ "$running" != "cpython 3.11 Linux" ]]; then
  echo "make-wheelhouse.sh: $python is '$running', the images need wheels for CPython 3.11 on Linux." >&2
  echo "Run it inside the base image (see --help)." >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" docker/requirements.py --build ${torch_spec:+--torch "$torch_spec"} >"$work/requirements.txt"
# Up to date when the requirements, both constraints, this script and its arguments are those of
# the last fill (the stamp $out/.requirements): then nothing is downloaded again.
stamp="$out/.requirements"
want=$({ cat "$work/requirements.txt" constraints.txt constraints-http.txt docker/make-wheelhouse.sh
  echo "torch=$torch_spec index=$index_url"; } | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && ls "$out"/*.whl >/dev/null 2>&1; then
  echo "make-wheelhouse.sh: $out is up to date ($(ls "$out"/*.whl | wc -l) wheels)"
  exit 0
fi
mkdir -p "$out"
for constraints in constraints.txt constraints-http.txt; do
  # The project's exact versions, minus torch when --torch decides it.
  if [[ -n "$torch_spec" ]]; then
    grep -v -E '^torch==' "$constraints" >"$work/constraints.txt"
  else
    cp "$constraints" "$work/constraints.txt"
  fi
  echo "make-wheelhouse.sh: collecting wheels into $out for $constraints ($(wc -l <"$work/requirements.txt") requirements)"
  # (The grep drops pip's notes about configured find-links folders that do not exist.)
  "$python" -m pip wheel --quiet --wheel-dir "$out" \
    -r "$work/requirements.txt" -c "$work/constraints.txt" \
    ${index_url:+--extra-index-url "$index_url"} \
    2> >(grep -v -F "is ignored: it is neither a file nor a directory" >&2)
  # scikit-learn's wheel alone (no SciPy): the image copies its digits table out of it.
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$out" \
    -c "$work/constraints.txt" scikit-learn \
    2> >(grep -v -F "is ignored: it is neither a file nor a directory" >&2)
done
echo "$want" >"$stamp"
echo "make-wheelhouse.sh: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
