"""What differs between the Flower releases a deployment of this app runs on, in one place.

The app deploys on flwr 1.39 (the default) and on every later release below 2. One change
between them reaches the deployment: the **Fleet API**, the link every SuperNode downloads the
global model and uploads its reply over.

=================  =====================================  ====================================
                   flwr 1.39 (``grpc``)                    flwr 1.40 and later (``http``)
=================  =====================================  ====================================
Fleet API          gRPC (grpc-rere) on an address of its  HTTP (protobuf bodies) on the
                   own: ``--fleet-api-address``           SuperLink's one HTTP port, beside
                                                          the Control and Runtime APIs
SuperNode dials    the Fleet port (9092 in the image)     the HTTP port (9093 in the image)
a forgotten node   ``Invalid node ID`` (UNAUTHENTICATED)  ``401 Unauthorized``
=================  =====================================  ====================================

Both releases serve the Control API (``flwr run``) and the Runtime API (ServerApp) on the HTTP
port given by ``--host``/``--port``. So under ``http`` whoever can reach a SuperNode's address
also reaches the Control API: publishing the Fleet API beyond loopback publishes the Control API
with it (docs/deployment.md, "Which Flower, which transport").

Every place that starts a SuperLink or a SuperNode asks this module: the container entry point
(``python -m beyond_averaging.server.deploy.flower_release ...``, below), the deployment tests and
the load benchmark (``tests/deploy_helpers.py``), and ``ba-supernode``. The release is read from the
installed distribution's metadata (no ``flwr`` import: a SuperNode's start stays cheap).

Command line, for shell entry points::

    python -m beyond_averaging.server.deploy.flower_release transport
    python -m beyond_averaging.server.deploy.flower_release superlink-ports --host 0.0.0.0 \\
        --fleet-port 9092 --control-port 9093
    python -m beyond_averaging.server.deploy.flower_release superlink-ports --host 127.0.0.1 \\
        --fleet-host 192.0.2.10      # gRPC Fleet API on a public address, the rest on loopback
    python -m beyond_averaging.server.deploy.flower_release fleet-address --host superlink \\
        --fleet-port 9092 --control-port 9093
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

FleetTransport = Literal["grpc", "http"]
#: How a SuperNode runs its ClientApps: ``warm`` forks each from one pre-imported process
#: (:mod:`server.deploy.warm_executor`, beside ``flower-supernode --isolation process``);
#: ``subprocess`` is Flower's default, a fresh ``flwr-clientapp`` Python per message.
ClientAppExecutor = Literal["warm", "subprocess"]
CLIENTAPP_EXECUTORS: tuple[ClientAppExecutor, ...] = ("warm", "subprocess")
#: The first release whose Fleet API is HTTP (and whose SuperNode speaks nothing else).
HTTP_FLEET_SINCE = (1, 40)
#: The first release with the pieces the warm executor runs on: a SuperNode Runtime API served
#: over HTTP that ``flower-superexec`` polls for tasks (``run_superexec``) and hands to an
#: ``Executor`` (``flwr.supercore.superexec.executor``), and ``run_clientapp(token=...)``.
WARM_EXECUTOR_SINCE = (1, 39)
#: What a SuperNode logs when the SuperLink answers that it does not know the node (a SuperLink
#: restarted with its state in memory): the node must register again. ``grpc``: the Fleet API's
#: "Invalid node ID" (UNAUTHENTICATED) and the heartbeat's "does not recognize this SuperNode";
#: ``http``: the 401 of the Fleet API's node check (seen on the heartbeat and on pulls).
_FORGOTTEN: dict[FleetTransport, tuple[str, ...]] = {
    "grpc": ("Invalid node ID", "does not recognize this SuperNode"),
    "http": ("401 Unauthorized",),
}


def _release_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a Flower release from version {version!r}")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class FlowerRelease:
    """One installed (or named) Flower release and the deployment flags that follow from it.

    Parameters
    ----------
    version : str
        The ``flwr`` version, e.g. ``"1.39.0"`` or ``"1.42.0"``.
    """

    version: str

    @classmethod
    def installed(cls) -> FlowerRelease:
        """The release installed beside this interpreter."""
        return cls(importlib.metadata.version("flwr"))

    @property
    def transport(self) -> FleetTransport:
        """How SuperNodes talk to the SuperLink: ``grpc`` (1.39) or ``http`` (1.40+)."""
        return "http" if _release_tuple(self.version) >= HTTP_FLEET_SINCE else "grpc"

    @property
    def forgotten_markers(self) -> tuple[str, ...]:
        """Log lines of a SuperNode that the SuperLink no longer knows."""
        return _FORGOTTEN[self.transport]

    def superlink_ports(
        self, host: str, fleet_port: int, control_port: int, fleet_host: str | None = None
    ) -> list[str]:
        """The SuperLink's address flags: the HTTP port (Control, Runtime and, under ``http``,
        Fleet API) on ``host:control_port``, and under ``grpc`` the Fleet API on
        ``fleet_host:fleet_port`` (``fleet_host`` defaults to ``host``; a SuperLink serving
        SuperNodes on other hosts binds its Fleet API to a public address and keeps the
        Control API on loopback, docs/multi-host.md). ``fleet_port`` and ``fleet_host`` are
        unused under ``http``, whose one port serves every API."""
        flags = ["--host", host, "--port", str(control_port)]
        if self.transport == "grpc":
            fleet = _host_part(host if fleet_host is None else fleet_host)
            flags += ["--fleet-api-address", f"{fleet}:{fleet_port}"]
        return flags

    def warm_executor_problem(self) -> str | None:
        """Why the warm executor cannot run on this release, or None when it can."""
        if _release_tuple(self.version) < WARM_EXECUTOR_SINCE:
            return (
                f"flwr {self.version} predates the SuperExec executor interface the warm "
                f"executor plugs into (flwr {'.'.join(map(str, WARM_EXECUTOR_SINCE))} and "
                "later): run the SuperNode with --executor subprocess, or upgrade flwr"
            )
        return None

    def default_executor(self) -> ClientAppExecutor:
        """``warm`` where the release supports it, else Flower's ``subprocess``."""
        return "warm" if self.warm_executor_problem() is None else "subprocess"

    def supernode_isolation(self, executor: ClientAppExecutor) -> list[str]:
        """``flower-supernode``'s isolation flags for ``executor``: under ``warm`` the SuperNode
        starts no SuperExec of its own (``process``) and the warm executor polls its Runtime
        API instead."""
        return ["--isolation", "process" if executor == "warm" else "subprocess"]

    def fleet_port(self, fleet_port: int, control_port: int) -> int:
        """The SuperLink port a SuperNode dials."""
        return fleet_port if self.transport == "grpc" else control_port

    def fleet_address(self, host: str, fleet_port: int, control_port: int) -> str:
        """``host:port`` of the SuperLink's Fleet API, as ``flower-supernode --superlink``
        takes it."""
        return f"{_host_part(host)}:{self.fleet_port(fleet_port, control_port)}"


def _host_part(host: str) -> str:
    """An IPv6 literal in brackets, as Flower's address parser wants it; else as given."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def installed_forgotten_markers() -> tuple[str, ...]:
    """:attr:`FlowerRelease.forgotten_markers` of the installed release (every release's when
    none is installed, so that a supervisor never misses the line)."""
    try:
        return FlowerRelease.installed().forgotten_markers
    except importlib.metadata.PackageNotFoundError:
        return tuple(marker for markers in _FORGOTTEN.values() for marker in markers)


def main(argv: Sequence[str] | None = None) -> int:
    """Print a flag list or address for shell entry points (docker/entrypoint.sh)."""
    parser = argparse.ArgumentParser(
        prog="python -m beyond_averaging.server.deploy.flower_release",
        description="The deployment flags of the installed Flower release.",
    )
    parser.add_argument(
        "what",
        choices=("transport", "superlink-ports", "fleet-address"),
        help="transport: grpc or http; superlink-ports: flower-superlink's address flags; "
        "fleet-address: the host:port a SuperNode dials",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--fleet-port", type=int, default=9092)
    parser.add_argument(
        "--fleet-host", help="superlink-ports: the gRPC Fleet API's host, if not --host"
    )
    parser.add_argument("--control-port", type=int, default=9093)
    parser.add_argument("--flwr-version", help="a release to describe instead of the installed")
    args = parser.parse_args(argv)
    release = FlowerRelease(args.flwr_version) if args.flwr_version else FlowerRelease.installed()
    if args.what == "transport":
        print(release.transport)
    elif args.what == "superlink-ports":
        flags = release.superlink_ports(
            args.host, args.fleet_port, args.control_port, args.fleet_host
        )
        print(" ".join(flags))
    else:
        print(release.fleet_address(args.host, args.fleet_port, args.control_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
