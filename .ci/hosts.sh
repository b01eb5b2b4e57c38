#!/usr/bin/env bash
# CI step before the deployment tests: the tools tests/test_deployment_multihost.py needs to make
# hosts of Linux network namespaces (iproute2's `ip`, nftables for the SuperLink host's firewall)
# and, under the HTTP Fleet API, nginx for the proxy that publishes only /v1/fleet/
# (docs/multi-host.md). Installed from Debian's packages where missing, as root.
#
# It never fails CI: where they cannot be had it says why and exits 0, and the test skips with
# its reason.
set -uo pipefail

say() { echo "ci/hosts: $*"; }

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v nginx >/dev/null 2>&1 || missing+=(nginx-light)
if ((${#missing[@]} == 0)); then
  say "ip, nft and nginx present"
  exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  say "missing ${missing[*]} and cannot install them (not root, or no apt-get): the multi-host test will be SKIPPED"
  exit 0
fi
# Debian's policy-rc.d keeps nginx from starting as a service: the test starts its own, by PID.
if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
  say "installed ${missing[*]}"
else
  say "apt-get install ${missing[*]} failed: the multi-host test may be SKIPPED"
fi
exit 0
