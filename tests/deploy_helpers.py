"""A real Flower deployment for tests: SuperLink and SuperNodes as processes or containers.

Unlike the simulation runtime (``ba-run``), every message of a run started here crosses the
SuperLink's Fleet API, optionally over TLS with SuperNode authentication: gRPC (grpc-rere) under
flwr 1.39, HTTP under 1.40 and later (:mod:`server.deploy.flower_release` says which, and gives the
flags of each):

- :class:`LocalDeployment` is ``ba-deploy local``'s launcher (:mod:`server.deploy.local`: SuperLink
  and SuperNodes as local processes, each SuperNode under ``ba-supernode`` with the warm
  ClientApp executor unless a test asks otherwise), plus what only tests need: registering
  SuperNode keys made by ``docker/make-certs.sh`` and swapping the staged app's ClientApp;
- :class:`FleetTap` is ``ba-deploy local --resources``' byte-counting relay
  (:class:`server.deploy.resources.FleetRelay`) put between one SuperNode and the Fleet API, which
  also keeps what the SuperNode uploads, so a test can check that replies, extra records included,
  really crossed the connection (and that under TLS nothing of them is readable on it);
- :class:`ComposeStack` drives ``docker compose`` (Docker, or podman through podman-compose) for the
  container tests, with the same connection file and result checks.

The pieces of :mod:`server.deploy.local` (the launcher), :mod:`server.runtime.processes` (free
ports, the Flower environment, stopping a process tree) and :mod:`server.runs.folder` (reading a
run's summary) are reused, not copied.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml  # type: ignore[import-untyped]  # PyYAML comes with flwr; no stubs installed
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.deploy.local import (
    CONNECTION,
    Certificates,
    SuperNodeProcess,
    command_line,
    in_netns,
    online_nodes_from_listing,
    run_app,
)
from beyond_averaging.server.deploy.local import LocalDeployment as Deployment
from beyond_averaging.server.deploy.resources import FleetRelay
from beyond_averaging.server.overrides import LaunchError, run_config_argument
from beyond_averaging.server.runtime.processes import write_connection
from beyond_averaging.server.runtime.staging import stage_app
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
MAKE_CERTS = REPO / "docker" / "make-certs.sh"
__all__ = [
    "CONNECTION",
    "Certificates",
    "SuperNodeProcess",
    "command_line",
    "online_nodes_from_listing",
    "run_app",
    "run_config_argument",
    "stage_app",
    "write_connection",
]


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
class FleetTap(FleetRelay):
    """:class:`FleetRelay` (``ba-deploy local --resources``' byte counter) that also keeps the
    bytes a SuperNode sends towards the Fleet API.

    Point a SuperNode's ``--superlink`` at :attr:`address`; every connection is relayed to
    ``target``. :meth:`take` returns (and clears) the bytes uploaded since the last call, so a
    test attributes them to one run. Under TLS the relay sees only ciphertext, like any
    on-path observer.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._upload = bytearray()
        self._download_bytes = 0
        #: The first bytes (up to 64) of each relayed connection: a TLS or HTTP/2 opening.
        self.openings: list[bytes] = []
        super().__init__(target)

    def relayed(self, chunk: bytes, uploading: bool, first: bool) -> None:
        if uploading:
            if first:
                self.openings.append(chunk[:64])
            self._upload += chunk
        else:
            self._download_bytes += len(chunk)

    def take(self) -> tuple[bytes, int]:
        """``(uploaded bytes, downloaded byte count)`` since the last call."""
        with self._lock:
            upload, download = bytes(self._upload), self._download_bytes
            self._upload.clear()
            self._download_bytes = 0
        return upload, download


# ------------------------------------------------------------------------------ local processes
class LocalDeployment(Deployment):
    """``ba-deploy local``'s launcher with what only the tests need."""

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

    def use_clientapp(self, component: str) -> None:
        """Make the staged app run ``component`` (e.g. ``tests.attacker_app:app``) on every node.

        Only the staged copy changes: the component's module (and its package's
        ``__init__.py``) is copied in and added to the staged ``fab-include``, so the FAB that
        ``flwr run`` builds from it carries the module beside the app's code.
        """
        assert self.app_dir is not None
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


def assert_same_final_model(run_dir: Path, reference: Path, what: str) -> None:
    """The two runs' final models are equal: bit for bit, or within 1e-6 where replies arrived in
    another order (the weighted mean then sums in another order; two uninterrupted deployment
    runs differed by 9.3e-10, docs/deployment.md)."""
    actual = torch.load(run_dir / "final_model.pt", weights_only=True)
    expected = torch.load(reference / "final_model.pt", weights_only=True)
    assert list(actual) == list(expected)
    for key in expected:
        difference = float((actual[key] - expected[key]).abs().max())
        assert difference <= 1e-6, f"{key}: {what} differ by {difference}"


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
