#!/usr/bin/env bash
# TLS material and SuperNode authentication keys for a Flower deployment of this project.
#
#   docker/make-certs.sh [generate] [--out DIR] [--nodes N] [--host NAME]... [--owner UID[:GID]]
#       Creates, in DIR (default docker/certs, git-ignored):
#         ca.crt, ca.key                  a self-signed CA (the SuperNodes and `flwr` trust it)
#         server.pem, server.key          the SuperLink certificate, signed by the CA, with SANs
#                                         DNS:superlink, DNS:localhost, IP:127.0.0.1 and every
#                                         --host (a DNS name or an IPv4 address)
#         supernode-keys/supernode-<i>    OpenSSH EC P-384 private key of SuperNode i (0..N-1):
#                                         mount it into that SuperNode only
#         supernode-public-keys/supernode-<i>.pub   its public key, registered with the SuperLink
#       Existing files are kept (a second run adds only what is missing, e.g. more nodes), so
#       keys already registered stay valid. --owner chowns the output (when run as root) to the
#       user the containers run as (the image's APP_UID, 1000 by default).
#
#   docker/make-certs.sh register --connection NAME [--out DIR] [--nodes N]
#       Registers the public keys of SuperNodes 0..N-1 with a running SuperLink that was started
#       with --enable-supernode-auth, through `flwr supernode register <key> NAME` (NAME is a
#       connection in $FLWR_HOME/config.toml). Keys the SuperLink reports as already in use are
#       counted as registered, so it is safe to run again. The SuperLink refuses any SuperNode
#       whose key was not registered.
#
# Needs: openssl and ssh-keygen (generate), flwr (register).
set -euo pipefail

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

mode=generate
case "${1:-}" in
  generate | register) mode=$1; shift ;;
  -h | --help) usage 0 ;;
esac

out=docker/certs
nodes=3
owner=""
connection=""
extra_hosts=()
while (($#)); do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --host) extra_hosts+=("$2"); shift 2 ;;
    --owner) owner=$2; shift 2 ;;
    --connection) connection=$2; shift 2 ;;
    -h | --help) usage 0 ;;
    *) echo "make-certs.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$nodes" =~ ^[0-9]+$ ]] || ((nodes < 1)); then
  echo "make-certs.sh: --nodes '$nodes' must be an integer >= 1" >&2
  exit 2
fi
keys="$out/supernode-keys"
public_keys="$out/supernode-public-keys"

generate() {
  for tool in openssl ssh-keygen; do
    command -v "$tool" >/dev/null || {
      echo "make-certs.sh: '$tool' not found; install it (Debian: apt-get install openssl openssh-client)" >&2
      exit 1
    }
  done
  mkdir -p "$out" "$keys" "$public_keys"
  if [[ ! -s "$out/ca.crt" || ! -s "$out/ca.key" ]]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -sha256 -days 3650 \
      -keyout "$out/ca.key" -out "$out/ca.crt" -subj "/CN=beyond-averaging deployment CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      2>/dev/null
    rm -f "$out/server.pem"  # a new CA invalidates the old server certificate
    echo "make-certs.sh: created CA $out/ca.crt"
  fi
  if [[ ! -s "$out/server.pem" || ! -s "$out/server.key" ]]; then
    local san="DNS:superlink,DNS:localhost,IP:127.0.0.1" host
    for host in "${extra_hosts[@]}"; do
      if [[ "$host" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then san+=",IP:$host"; else san+=",DNS:$host"; fi
    done
    local csr
    csr=$(mktemp)
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -sha256 -keyout "$out/server.key" -out "$csr" \
      -subj "/CN=superlink" 2>/dev/null
    openssl x509 -req -in "$csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
      -out "$out/server.pem" -days 825 -sha256 \
      -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n' "$san") \
      2>/dev/null
    rm -f "$csr" "$out/ca.srl"
    echo "make-certs.sh: created SuperLink certificate $out/server.pem (SAN $san)"
  fi
  local i created=0
  for ((i = 0; i < nodes; i++)); do
    if [[ ! -s "$keys/supernode-$i" ]]; then
      ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$keys/supernode-$i"
      mv "$keys/supernode-$i.pub" "$public_keys/supernode-$i.pub"
      created=$((created + 1))
    fi
  done
  echo "make-certs.sh: $created new SuperNode key pair(s) in $keys and $public_keys ($nodes wanted)"
  chmod 600 "$out/ca.key" "$out/server.key" "$keys"/supernode-*
  chmod 644 "$out/ca.crt" "$out/server.pem" "$public_keys"/*.pub
  if [[ -n "$owner" ]]; then
    chown -R "$owner" "$out"
  fi
}

register() {
  if [[ -z "$connection" ]]; then
    echo "make-certs.sh register: --connection NAME is required (a [superlink.NAME] entry of \$FLWR_HOME/config.toml)" >&2
    exit 2
  fi
  command -v flwr >/dev/null || { echo "make-certs.sh register: 'flwr' not found on PATH" >&2; exit 1; }
  local i key registered=0 skipped=0 output
  for ((i = 0; i < nodes; i++)); do
    key="$public_keys/supernode-$i.pub"
    [[ -s "$key" ]] || { echo "make-certs.sh register: $key is missing: run 'make-certs.sh --nodes $nodes' first" >&2; exit 1; }
    if output=$(flwr supernode register "$key" "$connection" --name "supernode-$i" 2>&1); then
      registered=$((registered + 1))
    elif grep -qi "already in use" <<<"$output"; then
      # The SuperLink refuses a key registered before (e.g. kept in its persistent state):
      # that node is registered, which is what this step is for.
      skipped=$((skipped + 1))
    else
      echo "make-certs.sh register: registering $key failed:" >&2
      echo "$output" >&2
      exit 1
    fi
  done
  echo "make-certs.sh: registered $registered SuperNode key(s), $skipped already registered"
}

"$mode"
