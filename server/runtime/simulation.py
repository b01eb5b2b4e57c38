"""The simulation's SuperLink and Ray: :func:`simulation_superlink` starts a SuperLink with
``--simulation`` on a free loopback port, registered as the connection ``ba-local`` in a
project-local ``FLWR_HOME`` (``.flwr/sim-<port>/``), and stops it, with every process below it,
on exit.

Without ``--ray-address`` the simulation starts a Ray of its own (``RAY_ADDRESS=local``,
:func:`local_ray`): Ray's ``ray_current_cluster`` file, left behind by a ``ray start`` whose
cluster is gone, would otherwise make ``ray.init`` connect to that dead address and the run wait
forever. ``--ray-address HOST:PORT`` runs the simulation's ClientApps on an existing Ray cluster
(the address ``ray start --head`` prints): the SuperLink and the simulation it starts get
``RAY_ADDRESS``, which ``ray.init`` in Flower's Ray backend connects to (docs/ray-cluster.md).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from beyond_averaging.server.overrides import LaunchError

from .processes import (
    LAUNCH_MARKER,
    flower_environment,
    free_port,
    stop_process_tree,
    write_connection,
)

#: The connection ``ba-run`` writes into its ``FLWR_HOME/config.toml`` for ``flwr run``.
CONNECTION = "ba-local"


def _wait_healthy(port: int, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise LaunchError(f"the SuperLink exited with code {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0):
                return
        except OSError:
            time.sleep(0.3)
    raise LaunchError(f"the SuperLink did not become healthy in 60 s (log: {log_path})")


def check_ray_address(address: str, timeout: float = 5.0) -> str:
    """``address`` if it is a ``HOST:PORT`` that accepts a connection (a Ray head's GCS);
    otherwise :class:`LaunchError` naming the value and how to start a head there."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(
            f"--ray-address = {address!r} is not HOST:PORT: pass the address `ray start --head` "
            "prints (e.g. 10.0.0.5:6379)"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return address
    except OSError as error:
        raise LaunchError(
            f"--ray-address = {address!r}: nothing answers there ({error}); start the cluster's "
            f"head first (`ray start --head --port {port}` on {host}) and check the firewall"
        ) from None


#: ``RAY_ADDRESS`` that makes ``ray.init()`` start a Ray instance of its own.
LOCAL_RAY = "local"


def local_ray(inherited: str | None) -> str:
    """``RAY_ADDRESS`` for a simulation that starts its own Ray: :data:`LOCAL_RAY`.

    With ``RAY_ADDRESS`` unset, Ray 2's ``ray.init()`` connects to the address in
    ``$RAY_TMPDIR/ray/ray_current_cluster`` (default ``/tmp/ray/``), which ``ray start`` writes
    and only ``ray stop`` removes (``ray._private.services.get_ray_address_from_environment``):
    after a cluster died without ``ray stop`` the simulation waited for it forever. ``"local"``
    is the value ``canonicalize_bootstrap_address`` turns into "start a new instance". An
    inherited ``RAY_ADDRESS`` is overridden too, with a note (``--ray-address`` chooses a
    cluster).
    """
    if inherited and inherited != LOCAL_RAY:
        print(
            f"ba-run: note: RAY_ADDRESS={inherited} in the environment is not used: the "
            "simulation starts a Ray of its own; pass --ray-address HOST:PORT to run on a cluster",
            file=sys.stderr,
        )
    return LOCAL_RAY


@contextmanager
def simulation_superlink(app_dir: Path, ray_address: str | None = None) -> Iterator[dict[str, str]]:
    """A simulation SuperLink on a free port, stopped (with its children) on exit.

    Yields the environment for ``flwr`` commands that talk to it. Each launch gets its own
    ``FLWR_HOME`` under the project's ``.flwr/`` so that concurrent launches never read each
    other's connection file; it is removed after a clean stop. With ``ray_address`` the
    simulation connects to that Ray cluster (``RAY_ADDRESS``) instead of starting its own Ray.
    """
    port = free_port()
    flwr_home = app_dir / ".flwr" / f"sim-{port}"
    env = flower_environment(flwr_home)
    if ray_address is not None:
        env["RAY_ADDRESS"] = check_ray_address(ray_address)
    else:
        env["RAY_ADDRESS"] = local_ray(env.get("RAY_ADDRESS"))
    env[LAUNCH_MARKER] = f"{port}-{uuid.uuid4().hex}"
    write_connection(flwr_home, CONNECTION, f"127.0.0.1:{port}")
    log_path = flwr_home / f"superlink-{port}.log"
    command = [
        "flower-superlink",
        "--insecure",
        "--simulation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            env=dict(env),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=app_dir,
            start_new_session=True,
        )
    try:
        _wait_healthy(port, process, log_path)
        yield env
    finally:
        stop_process_tree(process, marker=env[LAUNCH_MARKER])
    for leftover in ("apps", "app"):  # installed and staged copies of the app
        shutil.rmtree(flwr_home / leftover, ignore_errors=True)
