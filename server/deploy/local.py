"""``ba-deploy local``: a real Flower deployment on this machine, SuperLink and SuperNodes as
processes on loopback.

Unlike the simulation runtime (``ba-run``), every message of a run crosses the SuperLink's Fleet
API, gRPC under flwr 1.39 and HTTP from 1.40 (:mod:`server.deploy.flower_release`), optionally over
TLS::

    ba-deploy local --nodes 5                 # prints the connection, Ctrl-C stops everything
    FLWR_HOME=.ba-deploy/flwr-home flwr run . ba-deploy --stream --run-config 'num-clients=5'

Each SuperNode runs under ``ba-supernode`` (:mod:`server.deploy.supervise`: started again when it
ends) with its ClientApps forked from a warm process (:mod:`server.deploy.warm_executor`) unless
``--executor subprocess``; SuperNode ``i`` holds partition ``i`` of ``N`` (``--node-config
'partition-id=i num-partitions=N'``, the keys this app and Flower's quickstart read).
``--resources`` prints, when it stops, what each node cost: CPU seconds and peak memory of every
process it started, and the bytes it exchanged with the Fleet API (:mod:`server.deploy.resources`).

:class:`LocalDeployment` is the same launcher as a Python object: the deployment tests and the
deployment and load benchmarks start their federations with it (every process in its own
process group, stopped by PID, never by name).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import math
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from beyond_averaging.server.overrides import LaunchError, run_config_argument
from beyond_averaging.server.runs.checkpoint import private_file
from beyond_averaging.server.runs.folder import LOG_FILE, read_summary
from beyond_averaging.server.runtime.processes import (
    ANSI_CODES,
    LAUNCH_MARKER,
    descendants,
    flower_environment,
    free_port,
    stop_process_tree,
    write_connection,
)
from beyond_averaging.server.runtime.staging import stage_app

from .flower_release import CLIENTAPP_EXECUTORS, ClientAppExecutor, FleetTransport, FlowerRelease
from .resources import FleetRelay, ResourceWatch, end_with_parent, resource_lines

#: The connection ``ba-deploy`` writes into its ``FLWR_HOME/config.toml`` for ``flwr run``.
CONNECTION = "ba-deploy"
#: ``ba-supernode`` (the console script runs this module's main).
SUPERVISOR = "beyond_averaging.server.deploy.supervise"


@dataclass(frozen=True)
class Certificates:
    """The TLS files of a deployment: a CA, the SuperLink's certificate and key, and (written by
    ``docker/make-certs.sh`` only) one key pair per SuperNode for node authentication."""

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


def loopback_certificates(directory: Path, days: int = 30) -> Certificates:
    """A CA and a SuperLink certificate for ``localhost``/``127.0.0.1``/``::1`` (EC P-384, as
    ``docker/make-certs.sh`` makes them), written with ``cryptography`` (a Flower dependency).

    For a deployment on this machine only: the keys are fresh, private (``0600``) and expire
    after ``days``; SuperNodes on other hosts need ``docker/make-certs.sh --host``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def save_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("ba-deploy local CA"))
        .issuer_name(name("ba-deploy local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    server = (
        x509.CertificateBuilder()
        .subject_name(name("localhost"))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    certificates = Certificates(directory)
    certificates.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certificates.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    save_key(server_key, certificates.server_key)
    return certificates


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
    """One running SuperNode (or its ``ba-supernode`` supervisor) and where its log goes."""

    partition_id: int
    process: subprocess.Popen[bytes]
    log_path: Path
    #: The byte-counting relay it reaches the Fleet API through (``start_supernodes(...,
    #: relayed=True)``), or None: it connects directly.
    relay: FleetRelay | None = None

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@dataclass
class LocalDeployment:
    """A SuperLink and SuperNodes as local processes on loopback.

    Parameters
    ----------
    app_dir : Path, optional
        The Flower app :meth:`run` runs (staged into ``workdir`` at :meth:`start`); ``None``:
        the user runs ``flwr run`` themselves.
    workdir : Path
        Logs, ``FLWR_HOME`` and the SuperLink database go here.
    certificates : Certificates, optional
        TLS for the Fleet, Control and Runtime APIs; ``None`` runs insecure.
    supernode_auth : bool
        Start the SuperLink with ``--enable-supernode-auth`` (needs ``certificates``): only
        SuperNodes whose public key was registered may connect.
    file_state : bool
        Keep the SuperLink's state in an SQLite file (as compose.tls.yaml does) rather than in
        memory. Flower waits 5 s for that file's lock; on a loaded machine 10 to 20 SuperNodes
        replying at once exceed it ("database is locked", docs/deployment.md, "Load").
    netns : str, optional
        A Linux network namespace (a host of its own, tests/test_deployment_multihost.py) the
        SuperLink and every ``flwr`` command run in; ``None``: this host.
    fleet_host : str
        The address the gRPC Fleet API binds to (flwr 1.39); under HTTP every API is on
        loopback and a proxy publishes the Fleet routes (docs/multi-host.md).
    executor : {"warm", "subprocess"}, optional
        How supervised SuperNodes run ClientApps (``ba-supernode --executor``); ``None``: the
        installed release's default (:meth:`FlowerRelease.default_executor`).
    task_timeout : float
        ``--executor warm``: seconds a ClientApp may run before it is killed
        (``ba-supernode --task-timeout``).
    pull_every : float, optional
        Supervised SuperNodes' ``ba-supernode --pull-every`` (seconds between pulls right after
        a message, :mod:`server.deploy.pull_pace`); ``None``: its default.
    warm : str, optional
        ``--executor warm``: the app's warm-up, ``MODULE:FUNCTION`` (``ba-supernode --warm``),
        importable on the inherited ``PYTHONPATH``; ``None``: none.
    """

    app_dir: Path | None
    workdir: Path
    certificates: Certificates | None = None
    supernode_auth: bool = False
    file_state: bool = True
    netns: str | None = None
    fleet_host: str = "127.0.0.1"
    executor: ClientAppExecutor | None = None
    task_timeout: float = 600.0
    pull_every: float | None = None
    warm: str | None = None
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
        if self.executor is None:
            self.executor = self.release.default_executor()
        self.control_port = free_port()
        #: Where SuperNodes connect: a port of its own for the gRPC Fleet API (flwr 1.39), the
        #: SuperLink's HTTP port for the HTTP Fleet API (1.40+).
        self.fleet_port = self.release.fleet_port(free_port(), self.control_port)
        self.superlink_log = self.workdir / "superlink.log"

    @property
    def fleet_address(self) -> str:
        host = self.fleet_host if self.release.transport == "grpc" else "127.0.0.1"
        return f"{host}:{self.fleet_port}"

    @property
    def control_address(self) -> str:
        """Where ``flwr run`` reaches the Control API."""
        return f"127.0.0.1:{self.control_port}"

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
                preexec_fn=end_with_parent,
            )

    def start(self) -> LocalDeployment:
        """Start the SuperLink, wait until it answers, write the connection ``ba-deploy``."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.app_dir is not None:
            self.staged_app = stage_app(self.app_dir, self.workdir / "app")
        write_connection(
            self.flwr_home,
            CONNECTION,
            self.control_address,
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
            url = f"{scheme}://{self.control_address}/health"
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

    def start_supernode(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        superlink_address: str | None = None,
        auth_key: Path | None = None,
        node_config: str = "",
        supervised: bool = True,
        netns: str | None = None,
        preload: Sequence[str] = (),
    ) -> SuperNodeProcess:
        """Start a SuperNode for one partition (connecting via ``superlink_address`` if given;
        inside the network namespace ``netns`` if given, a host of its own).

        ``node_config`` adds entries to its ``--node-config``. ``supervised`` (the default)
        starts it as docs/deployment.md does, under ``ba-supernode``, which starts it again
        whenever it ends and runs its ClientApps with this deployment's executor;
        :attr:`SuperNodeProcess.process` is then the supervisor. ``supervised=False`` starts a
        bare ``flower-supernode`` (Flower's subprocess isolation).
        """
        if supervised:
            command = [sys.executable, "-m", SUPERVISOR, "--restart-delay", "1"]
            command += ["--executor", str(self.executor)]
            if self.executor == "warm":
                command += ["--task-timeout", f"{self.task_timeout:g}"]
                command += ["--warm", self.warm] if self.warm else []
            if self.pull_every is not None:
                command += ["--pull-every", f"{self.pull_every:g}"]
            for module in preload:
                command += ["--preload", module]
        else:
            command = ["flower-supernode"]
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
        log_path = self.workdir / f"supernode-{len(self.supernodes)}.log"
        node = SuperNodeProcess(partition_id, self._popen(command, log_path, netns=netns), log_path)
        self.supernodes.append(node)
        return node

    def start_supernodes(
        self,
        count: int,
        *,
        supervised: bool = True,
        relayed: bool = False,
        preload: Sequence[str] = (),
        timeout: float = 120.0,
    ) -> list[SuperNodeProcess]:
        """Start ``count`` SuperNodes, partitions ``0..count-1`` of ``count``, and wait until
        all are online.

        Parameters
        ----------
        count : int
            SuperNodes to start.
        supervised : bool
            Under ``ba-supernode`` (the default), or bare ``flower-supernode`` processes
            (:meth:`start_supernode`).
        relayed : bool
            Connect each through a :class:`FleetRelay` of its own (:attr:`SuperNodeProcess.relay`),
            which counts the bytes it exchanges with the Fleet API.
        preload : sequence of str
            Modules the warm executors import up front.
        timeout : float
            Seconds to wait for them to be online (:meth:`wait_for_nodes`).

        Returns
        -------
        list of SuperNodeProcess
            The nodes started, in partition order.
        """
        started = []
        for partition in range(count):
            relay = FleetRelay(("127.0.0.1", self.fleet_port)) if relayed else None
            address = None if relay is None else relay.address
            node = self.start_supernode(
                partition, count, superlink_address=address, supervised=supervised, preload=preload
            )
            node.relay = relay
            started.append(node)
        self.wait_for_nodes(count, timeout=timeout)
        return started

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
            cwd=self.app_dir or self.workdir,
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
            try:
                if len(self.online_node_ids()) >= count:
                    return
            except subprocess.TimeoutExpired:  # a host busy starting many nodes: ask again
                continue
            time.sleep(1.0)
        logs = "\n".join(f"--- {n.log_path.name}\n{n.log()[-1500:]}" for n in self.supernodes)
        raise LaunchError(f"fewer than {count} SuperNodes online after {timeout} s\n{logs}")

    def run(self, settings: Mapping[str, Any], timeout: float = 300.0) -> Path:
        """Run the staged app with these run-config settings; return its run folder."""
        if self.app_dir is None:
            raise LaunchError("this deployment was started without an app (app_dir=None)")
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
            if node.relay is not None:
                node.relay.close()
        if self.superlink is not None:
            stop_process_tree(self.superlink, marker=self.env[LAUNCH_MARKER])
        shutil.rmtree(self.flwr_home / "apps", ignore_errors=True)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def command_line(pid: int) -> str:
    """A process's command line (empty once it ended)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:  # ended meanwhile
        return ""


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
    keep_stream(run_dir, ANSI_CODES.sub("", completed.stdout + completed.stderr))
    summary = read_summary(run_dir)
    status = summary.get("status", "missing")
    if status != "completed":
        extra = ""
        if diagnostics is not None and diagnostics.is_file():
            extra = f"\n--- {diagnostics.name}\n{diagnostics.read_text(errors='replace')[-3000:]}"
        raise LaunchError(
            f"run {settings['run-name']!r} did not complete (status {status!r}, "
            f"error {summary.get('error')!r}); flwr run exited {completed.returncode}:\n"
            # an error message, printed or logged anywhere: Flower's colour codes left out
            f"{ANSI_CODES.sub('', completed.stdout + completed.stderr)[-3000:]}{extra}"
        )
    return run_dir


def keep_stream(run_dir: Path, text: str) -> None:
    """Keep what ``flwr run --stream`` printed (the ServerApp's log) as the run's ``log.txt``, as
    ``ba-run`` keeps its console's: a deployed run's log is otherwise only on the screen. Left
    alone where the ServerApp wrote none of the folder (its output directory is not this
    machine's) or a ``log.txt`` exists; a folder this process may not write into is skipped.

    The file is created ``0600`` like the run's other files, and given to the folder's owner:
    a container's ServerApp writes the folder as the image's user, and a ``0600`` file left to
    this machine's root would be the one file that user (and the docs' ``tar`` copy run in the
    container) cannot read."""
    path = run_dir / LOG_FILE
    if not run_dir.is_dir() or path.exists():
        return
    with suppress(OSError):
        with private_file(path, "w") as log:
            log.write(text)
        folder = run_dir.stat()
        os.chown(path, folder.st_uid, folder.st_gid)  # PermissionError unless root: already ours


# ------------------------------------------------------------------------------------ ba-deploy
def connection_lines(deployment: LocalDeployment, nodes: int) -> list[str]:
    """What ``ba-deploy local`` prints once the federation is up: where each API is and the
    ``flwr run`` command for it."""
    security = "insecure" if deployment.certificates is None else "TLS"
    release = deployment.release
    lines = [
        f"ba-deploy: SuperLink up (flwr {release.version}, {release.transport} Fleet API on "
        f"{deployment.fleet_address}, Control API on {deployment.control_address}, {security})",
        f"ba-deploy: {nodes} SuperNodes online, partitions 0..{nodes - 1} of {nodes} "
        f"(ClientApps: {deployment.executor} executor); logs in {deployment.workdir}",
        "ba-deploy: run an app on it (from the app's folder, in another terminal):",
        f"  FLWR_HOME={deployment.flwr_home} flwr run . {CONNECTION} --stream "
        f"--run-config 'num-clients={nodes}'",
    ]
    if deployment.certificates is not None:
        lines.append(f"ba-deploy: the connection trusts {deployment.certificates.ca_cert}")
    lines.append("ba-deploy: Ctrl-C (or SIGTERM) stops the SuperLink and every SuperNode")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ba-deploy``."""
    release = FlowerRelease.installed()
    parser = argparse.ArgumentParser(
        prog="ba-deploy",
        description="Start a Flower deployment on this machine: a SuperLink and N SuperNodes "
        "as processes on loopback, until Ctrl-C.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    local = commands.add_parser("local", help="SuperLink and SuperNodes as local processes")
    local.add_argument("--nodes", type=int, default=3, help="SuperNodes (default 3)")
    local.add_argument(
        "--fleet",
        choices=("grpc", "http"),
        help="the Fleet transport to expect: the installed flwr decides it "
        f"(here {release.version}: {release.transport}); a mismatch is refused with the fix",
    )
    local.add_argument("--tls", action="store_true", help="TLS on every API (a fresh local CA)")
    local.add_argument(
        "--executor",
        choices=CLIENTAPP_EXECUTORS,
        default=release.default_executor(),
        help="how SuperNodes run ClientApps: warm (forked from a pre-imported process, the "
        "default) or subprocess (Flower's, a new Python per message)",
    )
    local.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="--executor warm: a module the warm processes import up front (repeatable)",
    )
    local.add_argument(
        "--pull-every",
        type=float,
        metavar="SECONDS",
        help="ba-supernode --pull-every: seconds between a SuperNode's pulls right after a "
        "message (default 0.2; 3 is Flower's fixed pace)",
    )
    local.add_argument(
        "--resources",
        action="store_true",
        help="sample every process from /proc (Linux), relay each SuperNode's Fleet API link "
        "through a byte counter and, on stopping, print each node's CPU seconds, peak memory "
        "(RSS, PSS) and Fleet API bytes, also into WORKDIR/resources.json",
    )
    local.add_argument(
        "--workdir",
        type=Path,
        default=Path(".ba-deploy"),
        help="logs, FLWR_HOME and certificates (default ./.ba-deploy)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes must be 1 or more, got {args.nodes}")
    expected: FleetTransport | None = args.fleet
    if expected is not None and expected != release.transport:
        fix = (
            "flwr 1.40 or later (FLEET=http bash scripts/setup.sh, then .venvs/fleet-http/bin/"
            "ba-deploy)"
            if expected == "http"
            else "flwr 1.39 (bash scripts/setup.sh, then .venv/bin/ba-deploy)"
        )
        parser.error(
            f"--fleet {expected}: the installed flwr {release.version} speaks "
            f"{release.transport} on its Fleet API; run ba-deploy from an environment with {fix}"
        )
    if args.executor == "warm" and (problem := release.warm_executor_problem()) is not None:
        parser.error(problem)
    if args.pull_every is not None and not (0 < args.pull_every < math.inf):
        parser.error(f"--pull-every must be positive seconds, got {args.pull_every:g}")
    if args.resources and not Path("/proc/self/stat").is_file():
        parser.error("--resources reads every process's figures from /proc: Linux only")
    workdir = args.workdir.resolve()
    certificates = loopback_certificates(workdir / "certs") if args.tls else None
    deployment = LocalDeployment(
        None,
        workdir,
        certificates=certificates,
        file_state=False,
        executor=args.executor,
        pull_every=args.pull_every,
    )
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    resources: ResourceWatch | None = None
    try:
        deployment.start()
        deployment.start_supernodes(args.nodes, relayed=args.resources, preload=args.preload)
        for line in connection_lines(deployment, args.nodes):
            print(line, flush=True)
        if args.resources:
            resources = watch_resources(deployment)
        while not stop.wait(1.0):
            if deployment.superlink is not None and deployment.superlink.poll() is not None:
                print(
                    f"ba-deploy: the SuperLink exited ({deployment.superlink.returncode}); see "
                    f"{deployment.superlink_log}; stopping",
                    file=sys.stderr,
                )
                return 1
    except LaunchError as error:
        print(f"ba-deploy: {error}", file=sys.stderr)
        return 1
    finally:
        if resources is not None:
            report_resources(resources, workdir / "resources.json")
        deployment.close()
        print("ba-deploy: stopped", flush=True)
    return 0


#: Seconds between two readings of ``ba-deploy local --resources``.
RESOURCES_INTERVAL = 0.5


def watch_resources(deployment: LocalDeployment) -> ResourceWatch:
    """Sample every process of ``deployment`` from now on: the SuperLink with what it starts,
    and each SuperNode (``node <partition>``) with what it starts and, where it connects through
    a relay, its Fleet API bytes."""
    assert deployment.superlink is not None
    groups = {deployment.superlink.pid: "SuperLink"}
    groups |= {node.process.pid: f"node {node.partition_id}" for node in deployment.supernodes}
    relays = {f"node {n.partition_id}": n.relay for n in deployment.supernodes if n.relay}
    return ResourceWatch(groups, RESOURCES_INTERVAL, relays)


def report_resources(resources: ResourceWatch, path: Path) -> None:
    """Stop ``resources``; print each group's figures and write them to ``path`` (JSON)."""
    seconds = time.monotonic() - resources.started
    usage = resources.stop()
    for line in resource_lines(usage, seconds):
        print(line, flush=True)
    record = {"seconds": round(seconds, 1), "groups": usage}
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
