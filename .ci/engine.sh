#!/usr/bin/env bash
# CI step before the test suite: make a container engine and the wheelhouse available for the
# container deployment tests (tests/test_deployment_containers.py).
#
# 1. `docker` and `docker compose` already work: nothing to install.
#    Otherwise, as root and with ../shared/container-engine/setup.sh present (the project machine),
#    run it: podman behind `docker` / `docker compose`, and the base image python:3.11-slim-bookworm.
# 2. Fill wheelhouse/cpu (docker/make-wheelhouse.sh, which does nothing when it is up to date),
#    so that the image builds with no registry.
#
# It never fails CI: where no engine can be had it says why and exits 0, and the container tests
# then skip with the reason (tests.deploy_helpers.container_engine_problem).
set -uo pipefail
cd "$(dirname "$0")/.."

say() { echo "ci/engine: $*"; }

engine_ok() { docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; }

if engine_ok; then
  say "container engine present ($(docker --version 2>/dev/null | head -1))"
else
  setup=../shared/container-engine/setup.sh
  if [[ ! -f "$setup" ]]; then
    say "no container engine and no $setup: the container deployment tests will be SKIPPED"
    exit 0
  fi
  if [[ "$(id -u)" != 0 ]]; then
    say "no container engine and not root (setup.sh installs packages): container tests will be SKIPPED"
    exit 0
  fi
  started=$(date +%s)
  if ! bash "$setup"; then
    say "$setup failed (see above): the container deployment tests will be SKIPPED"
    exit 0
  fi
  if ! engine_ok; then
    say "setup.sh ran but \`docker info\` / \`docker compose version\` still fail: container tests will be SKIPPED"
    exit 0
  fi
  say "container engine ready in $(($(date +%s) - started)) s"
fi

# docker/make-wheelhouse.sh fills wheelhouse/cpu, or says it is up to date (its stamp).
started=$(date +%s)
if bash docker/make-wheelhouse.sh --out wheelhouse/cpu; then
  say "wheelhouse/cpu ready in $(($(date +%s) - started)) s"
else
  say "docker/make-wheelhouse.sh failed: the image build will try the package index instead"
fi
exit 0
