"""Container health check: ask a Flower component's gRPC health service whether it is serving.

The SuperLink and the SuperNodes of compose.yaml start a health service without TLS on loopback
(``--health-server-address 127.0.0.1:<port>``); this exits 0 when it answers SERVING, else 1.

Usage: ``python /app/docker/healthcheck.py 127.0.0.1:9098``
"""

from __future__ import annotations

import sys

import grpc  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

TIMEOUT_SECONDS = 3.0


def serving(address: str) -> bool:
    """Whether the health service at ``address`` reports SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT_SECONDS
            )
        except grpc.RpcError as error:
            print(f"health check of {address} failed: {error.code().name}", file=sys.stderr)
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: healthcheck.py HOST:PORT", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if serving(sys.argv[1]) else 1)
