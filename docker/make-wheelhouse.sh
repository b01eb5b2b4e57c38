#!/usr/bin/env bash
# Fill a wheelhouse with every wheel the deployment images install, so that `docker build` (and
# `docker compose build`) works on a machine with no package registry: when the build finds
# wheels in the wheelhouse, it installs from there only (pip --no-index).
#
#   docker/make-wheelhouse.sh [--out DIR] [--torch SPEC] [--index-url URL] [--python PY]
#
#   --out DIR         where the wheels go (default wheelhouse/cpu; the CUDA build reads
#                     wheelhouse/cuda, see compose.gpu.yaml); wheelhouse/ is git-ignored
#   --torch SPEC      the torch requirement (default: constraints.txt's, torch==2.13.0)
#   --index-url URL   extra index holding that torch build, e.g.
#                     https://download.pytorch.org/whl/cu128 for a CUDA wheelhouse
#   --python PY       the interpreter whose pip downloads (default: .venv/bin/python, else
#                     python3); it must be CPython 3.11 on Linux of the image's architecture,
#                     since the wheels must fit the image. On another system run this script
#                     inside the base image instead:
#                       docker run --rm -v "$PWD":/src -w /src python:3.11-slim-bookworm \
#                         bash docker/make-wheelhouse.sh --python python3
#
# The requirements come from pyproject.toml (docker/requirements.py: flwr without the
# simulation extra, plus the build backend), at the exact versions of constraints.txt, so the
# images run the versions the test suite ran. pip wheel also builds a
# wheel for any dependency published only as a source archive.
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
    -h | --help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "make-wheelhouse.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

platform=$("$python" -c 'import platform, sys; print(sys.implementation.name, "%d.%d" % sys.version_info[:2], platform.system())')
if [[ "$platform" != "cpython 3.11 Linux" ]]; then
  echo "make-wheelhouse.sh: $python is '$platform', the images need wheels for CPython 3.11 on Linux." >&2
  echo "Run it inside the base image (see --help)." >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" docker/requirements.py --build ${torch_spec:+--torch "$torch_spec"} >"$work/requirements.txt"
# The project's exact versions (constraints.txt), minus torch when --torch decides it.
if [[ -n "$torch_spec" ]]; then
  grep -v -E '^torch==' constraints.txt >"$work/constraints.txt"
else
  cp constraints.txt "$work/constraints.txt"
fi

mkdir -p "$out"
echo "make-wheelhouse.sh: collecting wheels into $out ($(wc -l <"$work/requirements.txt") requirements, $(wc -l <"$work/constraints.txt") constraints)"
# (The grep drops pip's notes about configured find-links folders that do not exist.)
"$python" -m pip wheel --quiet --wheel-dir "$out" \
  -r "$work/requirements.txt" -c "$work/constraints.txt" \
  ${index_url:+--extra-index-url "$index_url"} \
  2> >(grep -v -F "is ignored: it is neither a file nor a directory" >&2)
echo "make-wheelhouse.sh: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
