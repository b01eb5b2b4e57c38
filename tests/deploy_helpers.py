"""A real Flower deployment for tests: SuperLink and SuperNodes as processes or containers.

Unlike the simulation runtime (``ba-run``), every message of a run started here crosses the
SuperLink's Fleet API, optionally over TLS with SuperNode authentication: gRPC (grpc-rere) under
flwr 1.39, HTTP under 1.40 and later (:mod:`server.flower_release` says which, and gives the
flags of each):

- :class:`LocalDeployment` starts ``flower-superlink`` and ``flower-supernode`` as local processes
  on loopback, or each in a network namespace standing for a host of its own (each in its own
  process group, stopped by PID), registers SuperNode keys, and runs the app with
  ``flwr run <app> <connection> --stream``;
- :class:`FleetTap` is a byte-counting TCP relay put between one SuperNode and the Fleet API: it
  records what the SuperNode uploads, so a test can check that replies, extra records included,
  really crossed the connection (and that under TLS nothing of them is readable on it);
- :class:`ComposeStack` drives ``docker compose`` (Docker, or podman through podman-compose) for the
  container tests, with the same connection file and result checks.

The pieces of :mod:`server.launch` (free ports, the Flower environment, stopping a process tree,
reading a run's summary) are reused, not copied.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml  # type: ignore[import-untyped]  # PyYAML comes with flwr; no stubs installed
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.flower_release import FlowerRelease
from beyond_averaging.server.launch import (
    LAUNCH_MARKER,
    LaunchError,
    descendants,
    flower_environment,
    free_port,
    read_summary,
    run_config_argument,
    stage_app,
    stop_process_tree,
)
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    SENSITIVITY_RECORD,
    TRAIN_LOSS_KEY,
)

REPO = Path(__file__).resolve().parents[1]
#: ``ba-supernode`` (the console script runs this module's main).
SUPERVISOR = "beyond_averaging.server.supervise"
MAKE_CERTS = REPO / "docker" / "make-certs.sh"
CONNECTION = "ba-deploy"


def lean_round(num_clients: int) -> dict[str, Any]:
    """Run settings of one lean round: digits, FedLAW's MLP, one local epoch, every one of
    ``num_clients`` nodes trains."""
    return {
        "dataset": "digits",
        "model": "mlp",
        "num-clients": num_clients,
        "num-server-rounds": 1,
        "local-epochs": 1,
        "fraction-train": 1.0,
        "seed": 0,
    }


# ---------------------------------------------------------------------------------------- config


def write_connection(
    flwr_home: Path, name: str, address: str, root_certificates: Path | None
) -> None:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection (the default one)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    security = (
        "insecure = true"
        if root_certificates is None
        else f'root-certificates = "{root_certificates.resolve()}"'
    )
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n'
        f'[superlink.{name}]\naddress = "{address}"\n{security}\n',
        encoding="utf-8",
    )


@dataclass(frozen=True)
class Certificates:
    """The files ``docker/make-certs.sh`` writes (CA, SuperLink certificate, SuperNode keys)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    def supernode_key(self, index: int) -> Path:
        """Private key (OpenSSH EC) of SuperNode ``index``."""
        return self.directory / "supernode-keys" / f"supernode-{index}"

    def supernode_public_key(self, index: int) -> Path:
        """Public key of SuperNode ``index`` (what ``make-certs.sh register`` registers)."""
        return self.directory / "supernode-public-keys" / f"supernode-{index}.pub"


def make_certificates(
    directory: Path, nodes: int, owner: str | None = None, hosts: Sequence[str] = ()
) -> Certificates:
    """Run ``docker/make-certs.sh`` (the script users run) and return its output files.

    ``hosts`` are the SuperLink's further names or addresses (``--host``): the certificate
    names them, so SuperNodes on other hosts that dial one of them can verify it."""
    command = ["bash", str(MAKE_CERTS), "--out", str(directory), "--nodes", str(nodes)]
    if owner is not None:
        command += ["--owner", owner]
    for host in hosts:
        command += ["--host", host]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return Certificates(directory)


# ------------------------------------------------------------------------------------ wire tap
class FleetTap:
    """A TCP relay that records the bytes a SuperNode sends towards the Fleet API.

    Point a SuperNode's ``--superlink`` at :attr:`address`; every connection is relayed to
    ``target``. :meth:`take` returns (and clears) the bytes uploaded since the last call, so a
    test attributes them to one run. Under TLS the relay sees only ciphertext, like any
    on-path observer.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._upload = bytearray()
        self._download_bytes = 0
        self._closed = False
        self._sockets: list[socket.socket] = []
        #: The first bytes (up to 64) of each relayed connection: a TLS or HTTP/2 opening.
        self.openings: list[bytes] = []
        threading.Thread(target=self._accept, name=f"fleet-tap-{self.port}", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def take(self) -> tuple[bytes, int]:
        """``(uploaded bytes, downloaded byte count)`` since the last call."""
        with self._lock:
            upload, download = bytes(self._upload), self._download_bytes
            self._upload.clear()
            self._download_bytes = 0
        return upload, download

    def close(self) -> None:
        self._closed = True
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target, timeout=10.0)
            except OSError:
                if self._closed:
                    return
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, uploading: bool) -> None:
        first = True
        try:
            while chunk := source.recv(1 << 16):
                with self._lock:
                    if uploading:
                        if first:
                            self.openings.append(chunk[:64])
                        self._upload += chunk
                    else:
                        self._download_bytes += len(chunk)
                sink.sendall(chunk)
                first = False
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


# ------------------------------------------------------------------------------ local processes
def in_netns(netns: str | None, command: Sequence[str]) -> list[str]:
    """``command`` run inside the Linux network namespace ``netns`` (``ip netns exec``, which
    executes it in place: the process keeps its PID), or as it is when ``netns`` is None."""
    return [*(["ip", "netns", "exec", netns] if netns else []), *command]


#: Asks a SuperLink's /health inside a network namespace (argv: url, CA file or "").
_HEALTH_PROBE = (
    "import ssl, sys, urllib.request\n"
    "context = ssl.create_default_context(cafile=sys.argv[2]) if sys.argv[2] else None\n"
    "urllib.request.urlopen(sys.argv[1], timeout=1.0, context=context)\n"
)


@dataclass
class SuperNodeProcess:
    """One running ``flower-supernode`` and where its log goes."""

    partition_id: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@dataclass
class LocalDeployment:
    """A SuperLink and SuperNodes as local processes on loopback.

    Parameters
    ----------
    app_dir : Path
        The Flower app (this repository).
    workdir : Path
        Logs, ``FLWR_HOME`` and the SuperLink database go here.
    certificates : Certificates, optional
        TLS for the Fleet, Control and Runtime APIs; ``None`` runs insecure.
    supernode_auth : bool
        Start the SuperLink with ``--enable-supernode-auth`` (needs ``certificates``): only
        SuperNodes whose public key was registered may connect.
    netns : str, optional
        A Linux network namespace (a host of its own, tests/test_deployment_multihost.py) the
        SuperLink and every ``flwr`` command run in; its Control API stays on that host's
        loopback. ``None``: this host.
    fleet_host : str
        The address the gRPC Fleet API binds to (flwr 1.39); under HTTP every API is on
        loopback and a proxy publishes the Fleet routes (docs/multi-host.md).
    """

    app_dir: Path
    workdir: Path
    certificates: Certificates | None = None
    supernode_auth: bool = False
    #: Keep the SuperLink's state in an SQLite file (as compose.tls.yaml does; compose.yaml keeps
    #: it in memory) rather than in memory. Flower waits 5 s for that file's lock
    #: (busy_timeout); on a loaded machine 10 to 20 SuperNodes replying at once exceed it and
    #: their replies fail ("database is locked", see docs/deployment.md, "Load").
    file_state: bool = True
    netns: str | None = None
    fleet_host: str = "127.0.0.1"
    supernodes: list[SuperNodeProcess] = field(default_factory=list)
    superlink: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if self.supernode_auth and self.certificates is None:
            raise ValueError("supernode_auth=True needs certificates: the SuperLink requires TLS")
        self.flwr_home = self.workdir / "flwr-home"
        self.env = flower_environment(self.flwr_home)
        # Inherited by everything this deployment starts: close() finds a ServerApp or ClientApp
        # that was re-parented away from the SuperLink's or a SuperNode's tree.
        self.env[LAUNCH_MARKER] = f"deploy-{uuid.uuid4().hex}"
        self.release = FlowerRelease.installed()
        self.control_port = free_port()
        #: Where SuperNodes connect: a port of its own for the gRPC Fleet API (flwr 1.39), the
        #: SuperLink's HTTP port for the HTTP Fleet API (1.40+).
        self.fleet_port = self.release.fleet_port(free_port(), self.control_port)
        self.superlink_log = self.workdir / "superlink.log"

    @property
    def fleet_address(self) -> str:
        host = self.fleet_host if self.release.transport == "grpc" else "127.0.0.1"
        return f"{host}:{self.fleet_port}"

    def _tls_arguments(self) -> list[str]:
        if self.certificates is None:
            return ["--insecure"]
        return [
            "--ssl-certfile",
            str(self.certificates.server_cert),
            "--ssl-keyfile",
            str(self.certificates.server_key),
            "--ssl-ca-certfile",
            str(self.certificates.ca_cert),
        ]

    def _popen(
        self,
        command: list[str],
        log_path: Path,
        append: bool = False,
        netns: str | None = None,
    ) -> subprocess.Popen[bytes]:
        with log_path.open("ab" if append else "wb") as log_file:
            return subprocess.Popen(
                in_netns(netns, command),
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,  # its own process group: stopped with its children
            )

    def start(self) -> LocalDeployment:
        """Start the SuperLink, wait until it answers, write the connection ``ba-deploy``."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.staged_app = stage_app(self.app_dir, self.workdir / "app")
        write_connection(
            self.flwr_home,
            CONNECTION,
            f"127.0.0.1:{self.control_port}",
            None if self.certificates is None else self.certificates.ca_cert,
        )
        return self.start_superlink()

    def start_superlink(self) -> LocalDeployment:
        """Start (or, after it died, start again) the SuperLink on this deployment's ports.

        The staged app is left as it is, so a run resumed after a restart runs the same code.
        """
        if self.superlink is not None and self.superlink.poll() is None:
            raise LaunchError(f"the SuperLink (pid {self.superlink.pid}) is still running")
        command = [
            "flower-superlink",
            *self._tls_arguments(),
            *self.release.superlink_ports(
                "127.0.0.1", self.fleet_port, self.control_port, fleet_host=self.fleet_host
            ),
            "--disable-runtime-dependency-installation",
        ]
        if self.file_state:
            command += ["--database", str(self.workdir / "superlink-state.db")]
        if self.supernode_auth:
            command.append("--enable-supernode-auth")
        # Appended to, so that a restarted SuperLink's log follows the first one's.
        self.superlink = self._popen(command, self.superlink_log, append=True, netns=self.netns)
        self._wait_superlink_healthy(timeout=60.0)
        return self

    def _wait_superlink_healthy(self, timeout: float) -> None:
        assert self.superlink is not None
        scheme = "http" if self.certificates is None else "https"
        context = (
            None
            if self.certificates is None
            else ssl.create_default_context(cafile=str(self.certificates.ca_cert))
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.superlink.poll() is not None:
                raise LaunchError(
                    f"the SuperLink exited with code {self.superlink.returncode}:\n"
                    f"{self.superlink_log.read_text(errors='replace')[-3000:]}"
                )
            url = f"{scheme}://127.0.0.1:{self.control_port}/health"
            if self.netns is not None:  # that host's loopback: ask from inside it
                cafile = "" if self.certificates is None else str(self.certificates.ca_cert)
                probe = [sys.executable, "-c", _HEALTH_PROBE, url, cafile]
                answered = subprocess.run(
                    in_netns(self.netns, probe), capture_output=True, timeout=30, check=False
                )
                if answered.returncode == 0:
                    return
                time.sleep(0.3)
                continue
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context):
                    return
            except OSError:
                time.sleep(0.3)
        raise LaunchError(f"the SuperLink was not healthy after {timeout} s ({self.superlink_log})")

    def register_supernodes(self, count: int) -> str:
        """Register the public keys of SuperNodes ``0..count-1`` with ``make-certs.sh register``."""
        assert self.certificates is not None
        completed = subprocess.run(
            in_netns(
                self.netns,
                [
                    "bash",
                    str(MAKE_CERTS),
                    "register",
                    "--out",
                    str(self.certificates.directory),
                    "--nodes",
                    str(count),
                    "--connection",
                    CONNECTION,
                ],
            ),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if completed.returncode != 0:
            raise LaunchError(f"make-certs.sh register failed:\n{completed.stderr}")
        return completed.stdout

    def start_supernode(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        superlink_address: str | None = None,
        auth_key: Path | None = None,
        node_config: str = "",
        supervised: bool = False,
        netns: str | None = None,
    ) -> SuperNodeProcess:
        """Start a SuperNode for one partition (connecting via ``superlink_address`` if given;
        inside the network namespace ``netns`` if given, a host of its own).

        ``node_config`` adds entries to its ``--node-config`` (e.g. ``attack-kinds="..."`` for
        :mod:`tests.attacker_app`). ``supervised`` starts it as docs/deployment.md does for
        local processes, under ``ba-supernode`` (:mod:`server.supervise`), which starts the
        SuperNode again whenever it ends; :attr:`SuperNodeProcess.process` is then the
        supervisor.
        """
        command = ["flower-supernode"]
        if supervised:
            command = [sys.executable, "-m", SUPERVISOR, "--restart-delay", "1"]
        if self.certificates is None:
            command.append("--insecure")
        else:
            command += ["--root-certificates", str(self.certificates.ca_cert)]
        if auth_key is not None:
            command += ["--auth-supernode-private-key", str(auth_key)]
        command += [
            "--superlink",
            superlink_address or self.fleet_address,
            "--port",
            str(free_port()),  # each SuperNode's own Runtime API, distinct on one host
            "--node-config",
            f"partition-id={partition_id} num-partitions={num_partitions} {node_config}".strip(),
        ]
        index = len(self.supernodes)
        node = SuperNodeProcess(
            partition_id,
            self._popen(command, self.workdir / f"supernode-{index}.log", netns=netns),
            self.workdir / f"supernode-{index}.log",
        )
        self.supernodes.append(node)
        return node

    def stop_supernode(self, node: SuperNodeProcess, timeout: float = 120.0) -> None:
        """Stop one SuperNode (by its process group) and wait until the SuperLink has
        forgotten it, so that the next run does not sample it."""
        online_before = len(self.online_node_ids())
        stop_process_tree(node.process)
        self.supernodes.remove(node)
        deadline = time.monotonic() + timeout
        while len(self.online_node_ids()) >= online_before:
            if time.monotonic() > deadline:
                raise LaunchError(f"a stopped SuperNode was still online after {timeout} s")
            time.sleep(1.0)

    def use_clientapp(self, component: str) -> None:
        """Make the staged app run ``component`` (e.g. ``tests.attacker_app:app``) on every node.

        Only the staged copy changes: the component's module (and its package's
        ``__init__.py``) is copied in and added to the staged ``fab-include``, so the FAB that
        ``flwr run`` builds from it carries the module beside the app's code.
        """
        pyproject = self.staged_app / "pyproject.toml"
        text = pyproject.read_text(encoding="utf-8")
        default = 'clientapp = "beyond_averaging.client.app:app"'
        if default not in text:
            raise LaunchError(f"{pyproject} does not name the default ClientApp ({default})")
        module = Path(*component.split(":", 1)[0].split("."))
        shipped = [module.with_suffix(".py"), module.parent / "__init__.py"]
        for relative in shipped:
            (self.staged_app / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.app_dir / relative, self.staged_app / relative)
        include = "fab-include = ["
        if include not in text:
            raise LaunchError(f"{pyproject} lists no fab-include patterns")
        listed = "".join(f'"{relative.as_posix()}", ' for relative in shipped)
        text = text.replace(default, f'clientapp = "{component}"').replace(
            include, include + listed, 1
        )
        pyproject.write_text(text, encoding="utf-8")

    def serverapp_pids(self) -> list[int]:
        """PIDs of the ServerApp processes the SuperLink started (``flwr-serverapp``)."""
        assert self.superlink is not None
        return [
            pid for pid in descendants(self.superlink.pid) if "flwr-serverapp" in command_line(pid)
        ]

    def flwr(self, *arguments: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a ``flwr`` CLI command against this deployment."""
        return subprocess.run(
            in_netns(self.netns, ["flwr", *arguments]),
            env=self.env,
            cwd=self.app_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def online_node_ids(self) -> list[int]:
        """IDs of the SuperNodes the SuperLink reports online (``flwr supernode list``)."""
        completed = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        return online_nodes_from_listing(completed.stdout)

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Block until ``count`` SuperNodes are online, or raise with their logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.online_node_ids()) >= count:
                return
            time.sleep(1.0)
        logs = "\n".join(f"--- {n.log_path.name}\n{n.log()[-1500:]}" for n in self.supernodes)
        raise LaunchError(f"fewer than {count} SuperNodes online after {timeout} s\n{logs}")

    def run(self, settings: Mapping[str, Any], timeout: float = 300.0) -> Path:
        """Run the app with these run-config settings; return its run folder (see run_app)."""
        return run_app(
            self.staged_app,
            self.env,
            CONNECTION,
            settings,
            Path(settings["output-dir"]),
            timeout=timeout,
            diagnostics=self.superlink_log,
            netns=self.netns,
        )

    def close(self) -> None:
        """Stop every SuperNode, then the SuperLink (each by its process group)."""
        for node in self.supernodes:
            stop_process_tree(node.process)
        if self.superlink is not None:
            stop_process_tree(self.superlink, marker=self.env[LAUNCH_MARKER])
        shutil.rmtree(self.flwr_home / "apps", ignore_errors=True)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:  # ended meanwhile
        return ""


def peak_rss_bytes(pid: int) -> int:
    """The peak resident memory of a live process so far (Linux ``VmHWM``), 0 once it ended."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text(encoding="utf-8")
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Samples the peak RSS of the processes ``pids()`` returns, every ``interval`` seconds,
    in a background thread; :attr:`peak` is the largest seen (each process's own VmHWM)."""

    def __init__(self, pids: Callable[[], list[int]], interval: float = 0.2) -> None:
        self.pids, self.interval = pids, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for pid in self.pids():
                self.peak = max(self.peak, peak_rss_bytes(pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def online_nodes_from_listing(listing: str) -> list[int]:
    """Online node IDs from ``flwr supernode list --format json`` output (empty if unreadable)."""
    start = listing.find("{")
    if start < 0:
        return []
    try:
        nodes = json.loads(listing[start:]).get("nodes", [])
    except json.JSONDecodeError:
        return []
    return [int(node["node-id"]) for node in nodes if node.get("status") == "online"]


def run_app(
    app_dir: Path,
    env: Mapping[str, str],
    connection: str,
    settings: Mapping[str, Any],
    output_dir: Path,
    *,
    timeout: float,
    diagnostics: Path | None = None,
    netns: str | None = None,
) -> Path:
    """``flwr run <app> <connection> --stream`` with ``settings``; the run folder when completed.

    ``output_dir`` is where this machine sees the ServerApp's ``output-dir`` (the same path for
    processes, a bind mount for containers). ``netns``: run ``flwr`` in that network namespace
    (where the connection's address is). Raises :class:`LaunchError` with the run's error,
    or the tail of the ``flwr run`` output, when the run did not complete.
    """
    run_dir = output_dir / str(settings["run-name"])
    command = ["flwr", "run", str(app_dir), connection, "--stream"]
    command += ["--run-config", run_config_argument(settings)]
    command = in_netns(netns, command)
    try:
        completed = subprocess.run(
            command,
            env=dict(env),
            cwd=app_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"run {settings['run-name']!r} did not finish within {timeout} s"
        ) from None
    summary = read_summary(run_dir / "summary.json")
    if summary.get("status") != "completed":
        extra = ""
        if diagnostics is not None and diagnostics.is_file():
            extra = f"\n--- {diagnostics.name}\n{diagnostics.read_text(errors='replace')[-3000:]}"
        raise LaunchError(
            f"run {settings['run-name']!r} did not complete (status {summary.get('status')!r}, "
            f"error {summary.get('error')!r}); flwr run exited {completed.returncode}:\n"
            f"{(completed.stdout + completed.stderr)[-3000:]}{extra}"
        )
    return run_dir


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rounds of a run's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# ------------------------------------------------------------------------- serialized records
def serialized_size(record: Any) -> int:
    """Bytes of a Flower record as the Fleet API carries it: its object tree, each deflated once.

    Flower 1.39 sends a message as content-addressed objects (message, record dict, records,
    arrays, array chunks); this sums their serialized sizes, the payload before gRPC framing.
    """
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(record).values())


def _built_strategy(strategy: str, settings: Mapping[str, Any]) -> tuple[Any, torch.nn.Module]:
    """The strategy a run would build, with the run's model (on the run's data shapes)."""
    config = parse_run_config({**settings, "strategy": strategy})
    test_set, proxy_set = load_server_splits(data_spec(config))  # as the ServerApp does
    model = build_model(config.model, test_set.input_shape, test_set.num_classes, seed=config.seed)
    resources = ServerResources(model, proxy_set, torch.device("cpu"))
    return build_strategy(config, resources), model


def required_records(strategy: str, settings: Mapping[str, Any]) -> list[str]:
    """The extra records the configured strategy requests from every client (its contract)."""
    built, _ = _built_strategy(strategy, settings)
    return list(built.required_records)


def available_strategies(candidates: Sequence[str], settings: Mapping[str, Any]) -> dict[str, str]:
    """Each candidate strategy mapped to '' when this build has it, else the reason it has not."""
    status: dict[str, str] = {}
    for name in candidates:
        try:
            _built_strategy(name, settings)
            status[name] = ""
        except (ValueError, ImportError) as error:
            status[name] = f"{type(error).__name__}: {error}"
    return status


def reply_record_sizes(strategy: str, settings: Mapping[str, Any]) -> dict[str, int]:
    """Serialized bytes of each record of one client's train reply under ``strategy``.

    The records are rebuilt with the keys, shapes and dtypes the ClientApp sends for the run's
    model: ``arrays`` is the state dict; ``sensitivity`` and ``gradient`` hold one array per
    trainable parameter (sensitivity in the configured dtype). Raw array bytes do not depend on
    the values, so these are the sizes of the real replies.
    """
    built, model = _built_strategy(strategy, settings)
    config = parse_run_config({**settings, "strategy": strategy})
    state = {key: value.detach().cpu().numpy() for key, value in model.state_dict().items()}
    parameters = [name for name, p in model.named_parameters() if p.requires_grad]
    sizes = {
        ARRAYS_RECORD: serialized_size(ArrayRecord({k: Array(v) for k, v in state.items()})),
        METRICS_RECORD: serialized_size(
            MetricRecord({NUM_EXAMPLES_KEY: 1000, TRAIN_LOSS_KEY: 0.5})
        ),
    }
    if SENSITIVITY_RECORD in built.required_records:
        dtype = np.dtype(config.sensitivity_dtype)
        sizes[SENSITIVITY_RECORD] = serialized_size(
            ArrayRecord({k: Array(state[k].astype(dtype)) for k in parameters})
        )
    if GRADIENT_RECORD in built.required_records:
        sizes[GRADIENT_RECORD] = serialized_size(
            ArrayRecord({k: Array(state[k]) for k in parameters})
        )
    return sizes


# ------------------------------------------------------------------------------ compose files
_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<colon>:?)-(?P<default>[^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR-default}`` in every string."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match["name"], match["default"]
            if name in env and (env[name] or not match["colon"]):
                return env[name]
            return default or ""

        return _VARIABLE.sub(substitute, value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    return value


def merge_compose(base: Any, overlay: Any) -> Any:
    """Merge an overlay file into a base as ``docker compose -f base -f overlay`` does.

    Mappings merge key by key, sequences (ports, volumes) are concatenated without duplicates,
    scalars are replaced. (This project's files use no ``!override`` / ``!reset`` tag.)
    """
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {
            **base,
            **{key: merge_compose(base.get(key), value) for key, value in overlay.items()},
        }
    if isinstance(base, list) and isinstance(overlay, list):
        return base + [item for item in overlay if item not in base]
    return overlay


def published_ports(
    files: Sequence[Path], env: Mapping[str, str], service: str
) -> list[tuple[str, str, str]]:
    """``(host address, host port, container port)`` of each port a service publishes.

    ``files`` are merged in order and interpolated with ``env`` only (not this process's
    environment), so the result is what Compose does with exactly these settings. A port
    without a host address is published on every interface (``0.0.0.0``).
    """
    merged: Any = {}
    for path in files:
        merged = merge_compose(merged, yaml.safe_load(path.read_text(encoding="utf-8")))
    ports = interpolate(merged["services"][service].get("ports", []), env)
    published = []
    for entry in ports:
        parts = str(entry).rsplit(":", 2)
        address, host, container = parts if len(parts) == 3 else ["0.0.0.0", *parts]
        published.append((address, host, container))
    return published


# --------------------------------------------------------------------------- container engine
def container_engine_problem() -> str | None:
    """Why containers cannot run here, or ``None`` when ``docker`` and ``docker compose`` work."""
    if shutil.which("docker") is None:
        return (
            "no `docker` command: install Docker (or run `bash ../shared/container-engine/"
            "setup.sh` as root on the project machine, which provides podman behind `docker`)"
        )
    for probe in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            completed = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"`{' '.join(probe)}` failed: {error}"
        if completed.returncode != 0:
            return f"`{' '.join(probe)}` failed: {(completed.stderr or completed.stdout)[-400:]}"
    return None


@dataclass
class ComposeStack:
    """``docker compose`` with this repository's compose files, one project name per stack."""

    project: str
    files: Sequence[Path]
    env: dict[str, str]

    def command(self, *arguments: str) -> list[str]:
        files = [part for path in self.files for part in ("-f", str(path))]
        return ["docker", "compose", "-p", self.project, *files, *arguments]

    def __call__(
        self, *arguments: str, timeout: float = 600.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        completed = subprocess.run(
            self.command(*arguments),
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and completed.returncode != 0:
            raise LaunchError(
                f"`{' '.join(self.command(*arguments))}` exited {completed.returncode}:\n"
                f"{(completed.stdout + completed.stderr)[-3000:]}"
            )
        return completed

    def container(self, service: str) -> str:
        """The container name of a service (compose's ``<project>_<service>_1`` or ``-1``)."""
        listing = subprocess.run(
            ["docker", "ps", "-a", "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        for name in listing:
            if name in (f"{self.project}_{service}_1", f"{self.project}-{service}-1"):
                return name
        raise LaunchError(f"no container for service {service!r} of project {self.project!r}")

    def logs(self, service: str) -> str:
        completed = subprocess.run(
            ["docker", "logs", self.container(service)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return completed.stdout + completed.stderr

    @contextlib.contextmanager
    def up(self, *services: str, timeout: float = 600.0) -> Iterator[ComposeStack]:
        """``up -d`` the services; always ``down -v`` afterwards (containers and volumes)."""
        try:
            self("up", "-d", *services, timeout=timeout)
            yield self
        finally:
            self("down", "-v", "-t", "5", timeout=300.0, check=False)
