#!/usr/bin/env bash
# The default test suite under each Python the package declares, one environment per version, and
# the table docs/install.md ("Python versions") publishes.
#
#   bash scripts/python_matrix.sh              # 3.12 and 3.13 (3.11 is .venv, the everyday leg)
#   bash scripts/python_matrix.sh 3.11 3.13    # any versions; pyenv's are found without `pyenv global`
#
# Each version gets .venvs/py<version> (git-ignored) from scripts/setup.sh, with the exact versions
# of constraints.txt. torch for a Python without a local wheel comes from the registry as its CUDA
# build (about 1.3 GB to download, 5.8 GB installed): it is downloaded once into WHEELHOUSE
# (default ~/.cache/beyond-averaging/wheels, outside the repository) and installed from there.
# A set-up is skipped when nothing changed (setup.sh's stamp), so a second run only tests.
#
# Writes build/python-matrix/py<version>.xml (JUnit) and build/python-matrix/table.md; prints the
# table. Extra pytest arguments: PYTEST_ARGS="-k packaging". Exits non-zero if any leg failed.
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.12 3.13)
export WHEELHOUSE=${WHEELHOUSE:-$HOME/.cache/beyond-averaging/wheels}
out=build/python-matrix
mkdir -p "$out"

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
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words on purpose
  nice -n 10 "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml "$out/py$version.xml" \
    ${PYTEST_ARGS:-} || failed=1
  tested=$(($(date +%s) - started))
  rows+=("$("$venv/bin/python" - "$out/py$version.xml" "$set_up" "$tested" <<'EOF'
import platform, sys, xml.etree.ElementTree as ElementTree
import torch
suite = ElementTree.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
count = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
set_up, tested = int(sys.argv[2]), int(sys.argv[3])
print(
    f"| {platform.python_version()} | default | {passed} | {count['failures'] + count['errors']} "
    f"| {count['skipped']} | {tested / 60:.1f} min (set-up {set_up} s) | {torch.__version__} |"
)
EOF
)")
done

{
  echo "| Python | suite | passed | failed | skipped | time | torch |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$out/table.md"
exit "$failed"
