#!/usr/bin/env bash
# The default test suite under each Python the package declares, one environment per version, and
# the table docs/install.md ("Python versions") publishes.
#
#   bash scripts/python_matrix.sh              # 3.12 and 3.13 (3.11 is .venv, the everyday leg)
#   bash scripts/python_matrix.sh 3.11 3.13    # any versions; pyenv's are found without `pyenv global`
#   bash scripts/python_matrix.sh --userapp 3.12 3.13   # also the user-app tests, newest flwr
#
# Each version gets .venvs/py<version> (git-ignored) from scripts/setup.sh, with the exact versions
# of constraints.txt. torch for a Python without a local wheel comes from the registry as its CUDA
# build (2.6 GB of wheels, 5.8 GB installed): it is downloaded once into WHEELHOUSE (default
# ~/.cache/beyond-averaging/wheels, outside the repository) and installed from there. A set-up is
# skipped when nothing changed (setup.sh's stamp), so a second run only tests.
#
# --userapp: after the suite, the user-app tests (tests/test_user_apps.py through
# scripts/flower_matrix.py: the wheel in a clean venv of that Python with the newest flwr, both test
# apps x every rule in Flower simulation), torch found in WHEELHOUSE.
#
# Writes build/python-matrix/py<version>.xml (JUnit; userapp-py<version>.xml/.md for --userapp) and
# build/python-matrix/table.md, and prints the table. More pytest arguments: PYTEST_ARGS for the
# default suite (PYTEST_ARGS="-k packaging"), USERAPP_ARGS for the user-app tests. Exits non-zero if
# any leg failed.
set -euo pipefail
cd "$(dirname "$0")/.."

userapp=0
if [ "${1:-}" = "--userapp" ]; then
  userapp=1
  shift
fi
if [ "$userapp" = 1 ] && [ ! -f scripts/flower_matrix.py ]; then
  echo "python_matrix: --userapp runs scripts/flower_matrix.py, which this checkout lacks" >&2
  exit 1
fi
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.12 3.13)
export WHEELHOUSE=${WHEELHOUSE:-$HOME/.cache/beyond-averaging/wheels}
out=build/python-matrix
mkdir -p "$out"

# One table row from a JUnit file: $1 python, $2 suite name, $3 xml, $4 set-up s, $5 test s.
row() {
  "$1" - "$2" "$3" "$4" "$5" <<'EOF'
import platform, sys, xml.etree.ElementTree as ElementTree
import torch
name, path, set_up, tested = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
time = f"{tested / 60:.1f} min" + (f" (set-up {set_up} s)" if set_up else "")
try:
    suite = ElementTree.parse(path).getroot()
except (OSError, ElementTree.ParseError):
    print(f"| {platform.python_version()} | {name} | no result | | | {time} | {torch.__version__} |")
    raise SystemExit(0)
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
count = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
print(
    f"| {platform.python_version()} | {name} | {passed} | {count['failures'] + count['errors']} "
    f"| {count['skipped']} | {time} | {torch.__version__} |"
)
EOF
}

rows=()
failed=0
for version in "${versions[@]}"; do
  venv=.venvs/py$version
  started=$(date +%s)
  if ! PYTHON=$version VENV=$venv bash scripts/setup.sh; then
    rows+=("| $version | default | set-up failed | | | $(($(date +%s) - started)) s | |")
    failed=1
    continue
  fi
  set_up=$(($(date +%s) - started))
  started=$(date +%s)
  # shellcheck disable=SC2086  # PYTEST_ARGS and USERAPP_ARGS are lists of words on purpose
  nice -n 10 "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml "$out/py$version.xml" \
    ${PYTEST_ARGS:-} || failed=1
  rows+=("$(row "$venv/bin/python" default "$out/py$version.xml" "$set_up" $(($(date +%s) - started)))")
  if [ "$userapp" = 1 ]; then
    started=$(date +%s)
    PIP_FIND_LINKS="${PIP_FIND_LINKS:-} $WHEELHOUSE" nice -n 10 "$venv/bin/python" \
      scripts/flower_matrix.py --flwr newest --python "$version" \
      --table "$out/userapp-py$version.md" -- -p no:cacheprovider \
      --junitxml "$out/userapp-py$version.xml" ${USERAPP_ARGS:-} || failed=1
    rows+=("$(row "$venv/bin/python" "user apps, newest flwr" "$out/userapp-py$version.xml" 0 \
      $(($(date +%s) - started)))")
  fi
done

{
  echo "| Python | suite | passed | failed | skipped | time | torch |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$out/table.md"
exit "$failed"
