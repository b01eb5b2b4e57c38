"""A Ray cluster of several nodes on this machine, started with ``ray start`` as a user starts one.

Every node is a ``ray start`` of its own (the head, then workers joining its address), with its
CPUs, a custom resource that names it (``ba-node-<name>``: Ray's node table says which node is
which) and its own environment: ``BA_PARTITION_CACHE`` points at a folder of that node, so a
ClientApp that loads a partition on a node leaves the partition's cache file in that node's
folder, as it would on the node's own disk on separate hosts. Each node gets ports of its own
(several raylets share one host here) and 100 MB of object store. The nodes take the machine's
own address, as a driver does when it connects (a driver needs a raylet at its own address).

Every process the nodes start inherits one environment entry, :attr:`RayCluster.marker`, and
:meth:`RayCluster.stop` ends exactly those processes, by PID (``ray stop`` would end every Ray
process of this user on the machine, other people's included).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

from beyond_averaging.server.runtime.processes import (
    descendants,
    free_port,
    processes_with_environment,
)

RAY = str(Path(sys.executable).parent / "ray")
OBJECT_STORE_BYTES = 100_000_000
#: Seconds a ``ray start`` may take on a loaded 2-core machine.
START_TIMEOUT = 300.0
#: Seconds a raylet may take to register with the GCS (Ray's default, 30 s, was missed at load
#: average 16 on the shared 2-core machine: "The node registration may not be complete yet").
RAYLET_REGISTRATION_SECONDS = "180"
#: Tries of each ``ray start``: at load average 40 a raylet crashed while registering (Ray's own
#: start-up, not the app); a failed try's processes are stopped before the next.
START_ATTEMPTS = 3

#: Run in a fresh interpreter connected to the cluster as a driver: Ray's node table (id ->
#: resources) and actor table (class, node, state, job), as JSON. The actor table is read from
#: Ray's GCS (``ray._private.state``): the public ``ray.util.state`` needs the dashboard, which
#: needs ``ray[default]``, which Flower does not install.
_QUERY = """
import json, sys
import ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
actors = [
    {
        "class": actor["ActorClassName"],
        "node": actor["Address"]["NodeID"],
        "state": actor["State"],
        "job": actor["JobID"],
    }
    for actor in state.actors().values()
]
print(json.dumps({"nodes": nodes, "actors": actors}))
ray.shutdown()
"""


class RayCluster:
    """Ray nodes on this machine; use as a context manager (every node is stopped on exit)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ba-ray-"))
        self.marker = f"BA_RAY_CLUSTER={uuid.uuid4().hex}"
        self.address = ""
        self.caches: dict[str, Path] = {}

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _environment(self, name: str, node_marker: str) -> dict[str, str]:
        key, value = self.marker.split("=", 1)
        node_key, node_value = node_marker.split("=", 1)
        cache = self.root / f"cache-{name}"
        self.caches[name] = cache
        return {
            **os.environ,
            key: value,
            node_key: node_value,
            "BA_PARTITION_CACHE": str(cache),
            "RAY_DEDUP_LOGS": "0",
            "RAY_raylet_start_wait_time_s": RAYLET_REGISTRATION_SECONDS,
        }

    def _start(self, name: str, arguments: list[str]) -> str:
        """``ray start`` of one node, tried up to :data:`START_ATTEMPTS` times; its output."""
        failures = []
        for attempt in range(1, START_ATTEMPTS + 1):
            node_marker = f"BA_RAY_NODE={self.marker.split('=', 1)[1]}-{name}-{attempt}"
            try:
                return self._start_once(name, arguments, node_marker)
            except RuntimeError as error:
                failures.append(str(error))
                self.stop(node_marker, remove=False)  # this try's processes only
        raise RuntimeError(f"\n\n{'=' * 20}\n".join(failures))

    def _start_once(self, name: str, arguments: list[str], node_marker: str) -> str:
        ports = {
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--metrics-export-port": free_port(),
            "--runtime-env-agent-port": free_port(),
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
        }
        command = [
            RAY,
            "start",
            *arguments,
            "--num-gpus",
            "0",
            "--resources",
            json.dumps({f"ba-node-{name}": 1}),
            "--object-store-memory",
            str(OBJECT_STORE_BYTES),
            "--disable-usage-stats",
            *[str(part) for pair in ports.items() for part in pair],
        ]
        log = self.root / f"ray-start-{name}.log"
        with log.open("wb") as out:
            try:
                done = subprocess.run(
                    command,
                    env=self._environment(name, node_marker),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=START_TIMEOUT,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                done = None
        output = log.read_text(errors="replace")
        if done is None or done.returncode != 0:
            raylets = sorted(self.root.glob("ray/session_*/logs/raylet*.out"))
            raylet = "".join(
                f"\n--- {path.name} (its last lines but state dumps):\n"
                + "\n".join(
                    line
                    for line in path.read_text(errors="replace").splitlines()
                    if "[state-dump]" not in line
                )[-4000:]
                for path in raylets
            )
            outcome = "did not finish" if done is None else f"exited with {done.returncode}"
            raise RuntimeError(
                f"`ray start` of node {name!r} {outcome} within {START_TIMEOUT:.0f} s:\n"
                f"{output[-3000:]}{raylet}"
            )
        return output

    def start_head(self, name: str, cpus: int) -> str:
        """Start the head node with ``cpus`` CPUs; return its address (``HOST:PORT``)."""
        output = self._start(
            name,
            [
                "--head",
                "--port",
                "0",  # a free one; printed below
                "--num-cpus",
                str(cpus),
                # Sessions, sockets, logs and the cluster's address file in a folder of the
                # test, not in the machine's /tmp/ray (workers take the head's from its GCS; one
                # given its own folder never finished starting here).
                "--temp-dir",
                str(self.root / "ray"),
                "--include-dashboard",
                "false",
                "--dashboard-port",
                str(free_port()),
                "--ray-client-server-port",
                str(free_port()),
            ],
        )
        # `ray start --head` prints how to join: ray start --address='<node ip>:<port>'
        joined = re.search(r"--address='([^']+)'", output)
        if joined is None:
            raise RuntimeError(f"`ray start --head` printed no address to join:\n{output[-3000:]}")
        self.address = joined.group(1)
        return self.address

    def add_worker(self, name: str, cpus: int) -> None:
        """Start a worker node with ``cpus`` CPUs that joins the head."""
        if not self.address:
            raise RuntimeError("start the head first")
        self._start(name, ["--address", self.address, "--num-cpus", str(cpus)])

    def query(self) -> dict[str, Any]:
        """Ray's node table (``nodes``: id -> resources) and actor table (``actors``)."""
        done = subprocess.run(
            [sys.executable, "-c", _QUERY, self.address],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"querying the cluster failed:\n{done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def node_names(self) -> dict[str, str]:
        """Node id -> the name the node was started with (from its ``ba-node-<name>``)."""
        names = {}
        for node, resources in self.query()["nodes"].items():
            tags = [key.removeprefix("ba-node-") for key in resources if key.startswith("ba-node-")]
            names[node] = tags[0] if tags else "?"
        return names

    def processes(self, marker: str | None = None) -> list[int]:
        """PIDs of every process the nodes started (or one try of one node, ``marker``): those
        whose environment holds the marker and everything below them (Ray's Python processes
        rename themselves, ``ray::IDLE``, which can overwrite the environment ``/proc`` shows)."""
        marked = set(processes_with_environment(marker or self.marker))
        below = {child for pid in marked for child in descendants(pid)}
        return sorted((marked | below) - {os.getpid()})

    def stop(self, marker: str | None = None, *, remove: bool = True, grace: float = 15.0) -> None:
        """End every process of the cluster (or of ``marker``) by PID: SIGTERM, then SIGKILL
        after ``grace`` s; ``remove`` deletes the cluster's folder.

        The whole tree is collected before any signal: a process whose parent ended first is
        re-parented away from it.
        """
        pids = set(self.processes(marker))
        for pid in pids:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while (running := alive(pids | set(self.processes(marker)))) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)
        for pid in running:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        # SIGKILL is not instant: a loaded machine was seen to leave one Ray process running just
        # after it, so wait (briefly) until the kernel has ended them all.
        deadline = time.monotonic() + 10.0
        while running and alive(set(running)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def alive(pids: set[int]) -> list[int]:
    """The PIDs of ``pids`` still running (a zombie has ended: its parent only has to reap it)."""
    running = []
    for pid in sorted(pids):
        with suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                running.append(pid)
    return running
