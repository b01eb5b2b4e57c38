#!/bin/sh
# Entry point of the beyond-averaging image: starts one Flower component with the flags of this
# project's deployment, configured by environment variables (compose.yaml sets them). The flags
# that differ between Flower releases come from server/deploy/flower_release.py (the image holds
# flwr 1.39 with the gRPC Fleet API, or with FLEET=http the newest flwr with the HTTP Fleet API).
#
#   superlink             flower-superlink: its HTTP API (Control API for `flwr run`, Runtime API,
#                         and under the HTTP Fleet API also the Fleet API) on 0.0.0.0:9093, the
#                         gRPC Fleet API (flwr 1.39) on 0.0.0.0:9092; state in memory (or in the
#                         SQLite file BA_SUPERLINK_DATABASE when set, e.g.
#                         /app/state/superlink.db); ServerApps started as subprocesses
#   supernode             flower-supernode for partition BA_PARTITION_ID of BA_NUM_PARTITIONS,
#                         connecting to BA_SUPERLINK (host:port; default: the SuperLink host
#                         BA_SUPERLINK_HOST, "superlink" by default, at the Fleet API's port of
#                         this image's Flower: 9092 gRPC, 9093 HTTP); ClientApps are forked
#                         from a warm process that imported Flower, torch and the app once
#                         (BA_EXECUTOR=warm, the default; BA_EXECUTOR=subprocess: Flower's
#                         fresh Python per message). It runs under ba-supernode
#                         (server/deploy/supervise.py), which
#                         starts it again when the SuperLink forgot it: Flower's SuperNode then
#                         exits, which the restart policy covers, or hangs retrying, which it
#                         does not (docs/deployment.md, "When a process dies")
#   register-supernodes   registers the public keys /app/keys-root/supernode-public-keys/
#                         supernode-<i>.pub (i < BA_NUM_PARTITIONS) with the SuperLink at
#                         BA_CONTROL (default superlink:9093), waiting for it first; for
#                         SuperNode authentication
#   flwr-cli              the Flower CLI (`flwr` with the remaining arguments) once the SuperLink's
#                         Control API at BA_CONTROL (default superlink:9093) answers; compose's
#                         `flwr` service, whose connections are docker/flwr-config.toml
#   <anything else>       executed as given (e.g. `bash`, `flwr ls`)
#
# BA_ROLE (superlink or supernode), when set, is the role, and the container's arguments are
# dropped with a notice: Flower's Helm charts start Flower's images, whose entry point is the
# component itself, with that component's flags as arguments; this image makes its own flags
# from BA_* and the installed Flower (docs/multi-host.md, "Kubernetes").
#
# TLS: with BA_TLS=1 the SuperLink serves /app/certs/server.pem (key server.key, CA ca.crt) and
# SuperNodes and the registration trust /app/certs/ca.crt; otherwise everything runs insecure.
# SuperNode authentication: BA_SUPERNODE_AUTH=1 makes the SuperLink accept registered keys only;
# a SuperNode authenticates with its private key at /app/keys/supernode.key when that file exists.
# Extra arguments after the role are appended to the Flower command.
set -eu

if [ -n "${BA_ROLE:-}" ]; then
  [ "$#" -gt 0 ] && echo "entrypoint: BA_ROLE=${BA_ROLE}: ignoring the arguments: $*" >&2
  set -- "$BA_ROLE"
fi
role="${1:-superlink}"
[ "$#" -gt 0 ] && shift

tls_server() {
  if [ "${BA_TLS:-0}" = "1" ]; then
    echo --ssl-certfile /app/certs/server.pem --ssl-keyfile /app/certs/server.key \
      --ssl-ca-certfile /app/certs/ca.crt
  else
    echo --insecure
  fi
}

# Wait (up to 120 s) until the SuperLink's Control API at $1 (host:port) answers its /health,
# over TLS trusting /app/certs/ca.crt when BA_TLS=1.
wait_for_control_api() {
  scheme=http
  [ "${BA_TLS:-0}" = "1" ] && scheme=https
  tries=0
  until python - "$scheme://$1/health" 2>/dev/null <<'PY'
import ssl, sys, urllib.request
context = ssl.create_default_context(cafile="/app/certs/ca.crt") if sys.argv[1].startswith("https") else None
urllib.request.urlopen(sys.argv[1], timeout=3, context=context)
PY
  do
    tries=$((tries + 1))
    if [ "$tries" -ge 60 ]; then
      echo "entrypoint: the SuperLink at $1 did not answer in 120 s (is the stack up?" \
        "docker compose up -d)" >&2
      exit 1
    fi
    sleep 2
  done
}

case "$role" in
  superlink)
    auth=""
    [ "${BA_SUPERNODE_AUTH:-0}" = "1" ] && auth="--enable-supernode-auth"
    # State in memory unless BA_SUPERLINK_DATABASE names a file: Flower 1.39's SQLite state
    # queues every write of every SuperNode on one file lock and gives up after 5 s
    # ("database is locked"): replies were lost with 10 SuperNodes and runs failed with 20 on a
    # loaded host (docs/deployment.md, "Load"). A restarted SuperLink then forgets runs and nodes.
    database=""
    [ -n "${BA_SUPERLINK_DATABASE:-}" ] && database="--database ${BA_SUPERLINK_DATABASE}"
    ports=$(python -m beyond_averaging.server.deploy.flower_release superlink-ports \
      --host 0.0.0.0 --fleet-port 9092 --control-port 9093)
    # shellcheck disable=SC2046,SC2086  # word splitting of the flag lists is intended
    exec flower-superlink $(tls_server) $auth $database $ports \
      --isolation subprocess \
      --health-server-address 127.0.0.1:9098 \
      --disable-runtime-dependency-installation \
      "$@"
    ;;
  supernode)
    if [ -z "${BA_PARTITION_ID:-}" ] || [ -z "${BA_NUM_PARTITIONS:-}" ]; then
      echo "entrypoint: a SuperNode needs BA_PARTITION_ID and BA_NUM_PARTITIONS" \
        "(its data partition and the number of partitions)" >&2
      exit 2
    fi
    security="--insecure"
    [ "${BA_TLS:-0}" = "1" ] && security="--root-certificates /app/certs/ca.crt"
    auth=""
    [ -f /app/keys/supernode.key ] && auth="--auth-supernode-private-key /app/keys/supernode.key"
    superlink=${BA_SUPERLINK:-$(python -m beyond_averaging.server.deploy.flower_release fleet-address \
      --host "${BA_SUPERLINK_HOST:-superlink}" --fleet-port 9092 --control-port 9093)}
    # shellcheck disable=SC2086
    exec ba-supernode $security $auth \
      --superlink "$superlink" \
      --executor "${BA_EXECUTOR:-warm}" \
      --node-config "partition-id=${BA_PARTITION_ID} num-partitions=${BA_NUM_PARTITIONS}" \
      --health-server-address 127.0.0.1:9099 \
      "$@"
    ;;
  register-supernodes)
    control="${BA_CONTROL:-superlink:9093}"
    mkdir -p "$FLWR_HOME"
    if [ "${BA_TLS:-0}" = "1" ]; then
      security='root-certificates = "/app/certs/ca.crt"'
    else
      security='insecure = true'
    fi
    printf '[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\naddress = "%s"\n%s\n' \
      "$control" "$security" >"$FLWR_HOME/config.toml"
    wait_for_control_api "$control"
    exec /app/docker/make-certs.sh register --out /app/keys-root \
      --nodes "${BA_NUM_PARTITIONS:?set BA_NUM_PARTITIONS}" --connection deployment
    ;;
  flwr-cli)
    wait_for_control_api "${BA_CONTROL:-superlink:9093}"
    exec flwr "$@"
    ;;
  *)
    exec "$role" "$@"
    ;;
esac
