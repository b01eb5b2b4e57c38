"""The Flower processes a launch starts: their environment, their connection file, and how they
are stopped.

- :func:`flower_environment`: what every Flower process of this project needs (a project-local
  ``FLWR_HOME``, no runtime dependency installation, no telemetry, no update check, this
  interpreter's ``bin/`` first on ``PATH``);
- :func:`write_connection`: ``$FLWR_HOME/config.toml`` naming one SuperLink, the default (the
  simulation's ``ba-local``, the local deployment's ``ba-deploy``);
- :func:`stop_process_tree`: a process and every process below it stopped by PID, never by name
  (:func:`descendants` from ``ps``; :data:`LAUNCH_MARKER` finds those re-parented away);
- :data:`ANSI_CODES`: the terminal codes their output carries, for what is shown off a terminal.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path

#: Colour and cursor codes (CSI sequences) and OSC sequences (e.g. hyperlinks): Flower colours
#: its log always, and rich its bars; the consoles leave them out off a terminal.
ANSI_CODES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
#: Environment entry every process of one launch inherits, so that all of them can be stopped.
LAUNCH_MARKER = "BA_LAUNCH_ID"


def write_connection(
    flwr_home: Path, name: str, address: str, root_certificates: Path | None = None
) -> None:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection, ``name`` at ``address``
    (the default one): over TLS with ``root_certificates``, else insecure."""
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


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def flower_environment(flwr_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every Flower process of this project needs."""
    env = dict(os.environ if base is None else base)
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (children first seen, grandchildren after), from ps."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=False
    ).stdout
    children: dict[int, list[int]] = {}
    for line in listing.splitlines():
        child, parent = (int(field) for field in line.split())
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found.extend(frontier)
    return found


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def processes_with_environment(marker: str) -> list[int]:
    """PIDs whose environment holds ``marker`` (Linux ``/proc``; empty elsewhere)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with suppress(OSError):  # ended meanwhile, or not ours to read
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
    return found


def stop_process_tree(
    process: subprocess.Popen[bytes], grace: float = 10.0, marker: str | None = None
) -> None:
    """Stop a process and every descendant, by PID.

    Ray's daemons (gcs_server, raylet) start in sessions of their own under the simulation
    process, so killing the SuperLink's process group alone would orphan them: the whole tree is
    collected first, then sent SIGTERM, and whatever survives ``grace`` seconds gets SIGKILL.
    Processes re-parented away from the tree are found by ``marker``, an environment entry that
    everything the launcher started inherits.
    """
    tree = [process.pid, *descendants(process.pid)]
    if marker is not None:
        tree = sorted({*tree, *processes_with_environment(marker)} - {os.getpid()})
    _signal_all(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(tree) and time.monotonic() < deadline:
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)
    if marker is not None:
        tree = sorted({*tree, *processes_with_environment(marker)} - {os.getpid()})
    _signal_all(_alive(tree), signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5.0)
