"""Flower in a clean virtual environment, any release from the library's floor to the newest:
install it beside the library's wheel, start its SuperLink (Flower simulation, or a local
deployment with SuperNodes), run an app with ``flwr run`` and read what happened from the run's
log and ``flwr ls``; never from ``flwr run``'s exit status, which is 0 when a run fails.

Flower's command line changed across the releases the library supports; what a release offers is
read from its own ``--help``, not from a table of version numbers:

- The SuperLink of 1.21 takes one address per API (``--serverappio-api-address``,
  ``--fleet-api-address``, ``--control-api-address``, ``--simulationio-api-address``); later
  releases serve the Control API and the app-facing APIs on one HTTP port (``--host``/``--port``).
- ``flwr run [APP] [FEDERATION]`` (1.21) reads the federation from the app's ``pyproject.toml``
  (``[tool.flwr.federations.<name>]``); ``flwr run [APP] [SUPERLINK]`` (later) reads the connection
  from ``$FLWR_HOME/config.toml`` (``[superlink.<name>]``). Both take the same keys: ``address``,
  ``insecure``, ``options.num-supernodes``, ``options.backend.client-resources.num-cpus``.
- Where the SuperLink installs an app's dependencies at run time (``uv sync``, on by default
  since it exists), it is switched off, except for the test of Flower's defaults.

Every process started here inherits a marker in its environment and is stopped by PID with
everything below it (Ray's daemons included); nothing is stopped by name.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.runtime.processes import LAUNCH_MARKER, free_port, stop_process_tree
from beyond_averaging.server.runtime.watch import strip_ansi

_LOG_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) *: *\t?", re.MULTILINE)


@dataclass(frozen=True)
class RunOutcome:
    """What one ``flwr run`` did, read from its streamed log and ``flwr ls``."""

    run_id: int | None
    status: str
    log: str
    seconds: float

    @property
    def completed(self) -> bool:
        return self.status.endswith("completed")

    def strategy(self) -> str | None:
        """The strategy class Flower's ``Strategy.start`` announced."""
        match = re.search(r"Starting (\w+) strategy", self.log)
        return match.group(1) if match else None

    def final_metrics(self, heading: str) -> dict[int, dict[str, float]]:
        """A per-round metrics table of the ``Final results`` that ``Strategy.start`` logs.

        ``heading`` is one of Flower's ``Aggregated ClientApp-side Train Metrics``,
        ``Aggregated ClientApp-side Evaluate Metrics`` or ``ServerApp-side Evaluate Metrics``.
        """
        _, found, rest = self.log.partition(f"{heading}:\n")
        if not found:
            return {}
        text = rest.split("\n\n", 1)[0]
        text = "".join(line.strip() for line in text.splitlines() if line.strip())
        table = ast.literal_eval(text[: text.rindex("}") + 1])
        return {int(r): {k: float(v) for k, v in m.items()} for r, m in table.items()}

    def tail(self, characters: int = 6000) -> str:
        return (
            f"status {self.status!r}, run {self.run_id}, {self.seconds:.0f} s:\n"
            + (self.log[-characters:])
        )


def clean_log(text: str) -> str:
    """A Flower log without colour codes and ``INFO :`` prefixes; each line as it was logged."""
    return _LOG_PREFIX.sub("", strip_ansi(text)).replace("\r", "")


#: The name of the federation / SuperLink connection the apps are run against.
TARGET = "ba-matrix"
#: Ray failing to start its own processes, before any of the app's code runs: the raylet has a
#: fixed 30 s to register, and the GCS (Ray 2.31, the Ray of flwr 1.21) 20 tries to answer; on a
#: loaded machine either start can fail. Such a run (and only such a run) is started again.
RAY_START_FAILURES = (
    "The current node timed out during startup",
    "Failed to start GCS",
)
RAY_START_ATTEMPTS = 3
#: Flower's simulation engine logs this when it stopped for good; the run then never ends by
#: itself (flwr 1.21 keeps the ServerApp waiting for replies), so waiting on it is stopped here.
ENGINE_CRASHED = "Simulation Engine crashed"
#: How long a local deployment waits for its SuperNodes to connect. On the 2-core machine at load
#: 18 (the tests at nice 10 beside other work) none of 4 had connected in 180 s; at load 5-7 all
#: 4 connected within 70 s, under the same Python (3.13).
SUPERNODE_WAIT_S = 600.0
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


class FlowerRuntimeError(RuntimeError):
    """A Flower process of the clean environment did not start or did not answer."""


# ------------------------------------------------------------------------------ environments
def interpreter(python_version: str) -> Path:
    """The ``python<version>`` to build a virtual environment from: on PATH, or pyenv's."""
    name = f"python{python_version}"
    found = shutil.which(name)
    if found is not None and _runs(found):
        return Path(found)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in sorted(
        pyenv_root.glob(f"versions/{python_version}*/bin/{name}"), reverse=True
    ):
        if _runs(str(candidate)):
            return candidate
    raise FlowerRuntimeError(f"no working {name} on PATH or under {pyenv_root}/versions")


def _runs(executable: str) -> bool:
    completed = subprocess.run(
        [executable, "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    return completed.returncode == 0


def find_links() -> list[str]:
    """The local wheel folders pip is told about (``PIP_FIND_LINKS``), for uv as well."""
    return os.environ.get("PIP_FIND_LINKS", "").split()


def install_command(uv: Path | None, python: Path, requirements: Sequence[str]) -> list[str]:
    """uv (seconds from its cache) when there is one, else the venv's pip; no constraints."""
    if uv is not None:
        links = [arg for folder in find_links() for arg in ("--find-links", folder)]
        return [
            str(uv),
            "pip",
            "install",
            "--quiet",
            "--python",
            str(python),
            *links,
            *requirements,
        ]
    return [str(python), "-m", "pip", "install", "-q", *requirements]


def checked(command: Sequence[str], timeout: float, **kwargs: Any) -> str:
    """Run ``command``; its stdout, or an AssertionError with the end of its stderr."""
    completed = subprocess.run(
        list(command), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    if completed.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({completed.returncode}):\n"
            f"{(completed.stdout + completed.stderr)[-4000:]}"
        )
    return str(completed.stdout)


def help_text(executable: Path, *arguments: str) -> str:
    """What ``<executable> [arguments] --help`` prints, on one wide screen."""
    completed = subprocess.run(
        [str(executable), *arguments, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    return completed.stdout + completed.stderr


def help_options(executable: Path) -> frozenset[str]:
    """The ``--options`` a command's ``--help`` lists."""
    return frozenset(_OPTION.findall(help_text(executable)))


@dataclass(frozen=True)
class FlowerInstall:
    """A clean virtual environment holding the library's wheel and one Flower release."""

    requested: str
    version: str
    python_version: str
    root: Path
    install_seconds: float
    superlink_options: frozenset[str]
    #: ``flwr run [APP] [SUPERLINK]`` with connections in ``$FLWR_HOME/config.toml`` (else
    #: ``[APP] [FEDERATION]`` with federations in the app's pyproject.toml).
    run_takes_connection: bool
    #: The Fleet API on the SuperLink's one HTTP port (from 1.40; ``--fleet-api-address`` is
    #: then deprecated), else on an address of its own (gRPC).
    fleet_on_http_port: bool

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin_dir / "python"

    @property
    def installs_app_dependencies(self) -> bool:
        """Whether this Flower's SuperLink runs ``uv sync`` of an app's dependencies."""
        return "--disable-runtime-dependency-installation" in self.superlink_options

    def package_version(self, name: str) -> str:
        """The version of an installed distribution, e.g. ``torch``."""
        return checked(
            [str(self.python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            timeout=120,
        ).strip()

    @classmethod
    def create(
        cls,
        root: Path,
        *,
        requested: str,
        flower_requirement: str,
        wheel: Path,
        extra_requirements: Sequence[str],
        python_version: str,
        uv: Path | None,
    ) -> FlowerInstall:
        """``root`` as a new venv of ``python_version`` with the wheel and Flower installed."""
        started = time.monotonic()
        base = interpreter(python_version)
        if uv is not None:
            checked([str(uv), "venv", "--quiet", "--python", str(base), str(root)], timeout=300)
        else:
            checked([str(base), "-m", "venv", str(root)], timeout=300)
        python = root / "bin" / "python"
        requirements = [str(wheel), flower_requirement, *extra_requirements]
        checked(install_command(uv, python, requirements), timeout=1800)
        seconds = time.monotonic() - started
        superlink_help = help_text(root / "bin" / "flower-superlink")
        fleet_deprecated = re.search(
            r"--fleet-api-address FLEET_API_ADDRESS\s+Deprecated", superlink_help
        )
        versions = checked(
            [
                str(python),
                "-c",
                "import importlib.metadata as m, platform; "
                "print(m.version('flwr'), platform.python_version())",
            ],
            timeout=120,
        ).split()
        return cls(
            requested=requested,
            version=versions[0],
            python_version=versions[1],
            root=root,
            install_seconds=seconds,
            superlink_options=frozenset(_OPTION.findall(superlink_help)),
            run_takes_connection="[SUPERLINK]" in help_text(root / "bin" / "flwr", "run"),
            fleet_on_http_port=fleet_deprecated is not None,
        )


# --------------------------------------------------------------------------------------- runs
def toml_value(value: object) -> str:
    """``value`` as a TOML literal (str, bool, int, float)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


@dataclass
class FlowerLink:
    """A SuperLink of a clean environment on free loopback ports, with its SuperNodes if any.

    Parameters
    ----------
    flower : FlowerInstall
        Whose ``flower-superlink``, ``flower-supernode`` and ``flwr`` run.
    workdir : Path
        ``FLWR_HOME``, logs and the SuperLink's working directory (where a ServerApp writes).
    simulation : bool
        A simulation SuperLink (Flower's simulation runtime, Ray) with ``num_supernodes``
        virtual nodes; else a deployment SuperLink with ``num_supernodes`` SuperNode processes,
        node ``i`` having ``partition-id=i num-partitions=num_supernodes``.
    install_dependencies : bool
        Leave Flower's runtime installation of app dependencies as Flower sets it (on, where it
        exists); by default it is switched off.
    """

    flower: FlowerInstall
    workdir: Path
    simulation: bool
    num_supernodes: int = 4
    install_dependencies: bool = False
    env: dict[str, str] = field(default_factory=dict)
    control_address: str = ""
    fleet_address: str = ""
    superlink: subprocess.Popen[bytes] | None = None
    supernodes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def superlink_log(self) -> Path:
        return self.workdir / "superlink.log"

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for inherited in (
            "PYTHONPATH",
            "VIRTUAL_ENV",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION",
        ):
            env.pop(inherited, None)
        env["FLWR_HOME"] = str(self.workdir / "flwr-home")
        env["FLWR_TELEMETRY_ENABLED"] = "0"
        env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        if not self.install_dependencies:
            env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        links = find_links()
        if links:  # uv sync (runtime installation) finds the local wheels pip is told about;
            # pip's PIP_FIND_LINKS separates folders by spaces, uv's UV_FIND_LINKS by commas
            env.setdefault("UV_FIND_LINKS", ",".join(links))
        env["PATH"] = os.pathsep.join([str(self.flower.bin_dir), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(self.flower.root)
        env["RAY_DEDUP_LOGS"] = "0"
        env[LAUNCH_MARKER] = f"userapp-{uuid.uuid4().hex}"
        return env

    def _popen(self, command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("wb") as log:
            return subprocess.Popen(
                command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )

    def _superlink_command(self) -> list[str]:
        options = self.flower.superlink_options
        command = [str(self.flower.bin_dir / "flower-superlink"), "--insecure"]
        if self.simulation:
            command.append("--simulation")
        if "--port" in options:  # one HTTP port for the Control API and the app-facing APIs
            port = free_port()
            command += ["--host", "127.0.0.1", "--port", str(port)]
            self.control_address = f"127.0.0.1:{port}"
        else:  # one address per API
            self.control_address = f"127.0.0.1:{free_port()}"
            command += ["--control-api-address", self.control_address]
            for api in ("serverappio", "simulationio"):
                if f"--{api}-api-address" in options:
                    command += [f"--{api}-api-address", f"127.0.0.1:{free_port()}"]
        if "--health-server-address" in options and "--port" not in options:
            command += ["--health-server-address", f"127.0.0.1:{free_port()}"]
        if self.flower.fleet_on_http_port:
            self.fleet_address = self.control_address
        else:
            self.fleet_address = f"127.0.0.1:{free_port()}"
            command += ["--fleet-api-address", self.fleet_address]
        if self.flower.installs_app_dependencies and not self.install_dependencies:
            command.append("--disable-runtime-dependency-installation")
        return command

    def start(self) -> FlowerLink:
        """Start the SuperLink, wait until its Control API answers, then the SuperNodes."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = self._environment()
        self.superlink = self._popen(self._superlink_command(), self.superlink_log)
        self._wait_for_control_api(timeout=120.0)
        if self.flower.run_takes_connection:
            self._write_connection()
        if not self.simulation:
            # One `--help` for all nodes: each is a full import of flwr, which, run once per
            # node, held back the later nodes while the earlier ones started.
            options = help_options(self.flower.bin_dir / "flower-supernode")
            for index in range(self.num_supernodes):
                self._start_supernode(index, options)
            # A node that exits fails the wait at once; the limit only bounds a hang.
            self._wait_for_supernodes(timeout=SUPERNODE_WAIT_S)
        return self

    def _wait_for_control_api(self, timeout: float) -> None:
        assert self.superlink is not None
        host, port = self.control_address.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.superlink.poll() is not None:
                raise FlowerRuntimeError(
                    f"flower-superlink {self.flower.version} exited with code "
                    f"{self.superlink.returncode}:\n{self._log_tail(self.superlink_log)}"
                )
            if "--port" in self.flower.superlink_options:
                try:
                    with urllib.request.urlopen(f"http://{self.control_address}/health", timeout=1):
                        return
                except OSError:
                    pass
            else:
                with socket.socket() as probe:
                    probe.settimeout(1.0)
                    if probe.connect_ex((host, int(port))) == 0:
                        time.sleep(1.0)  # gRPC servers of one process start together
                        return
            time.sleep(0.3)
        raise FlowerRuntimeError(f"the SuperLink did not answer in {timeout:.0f} s")

    def _write_connection(self) -> None:
        home = Path(self.env["FLWR_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{TARGET}"\n\n[superlink.{TARGET}]\n{self._target_body()}',
            encoding="utf-8",
        )

    def _target_body(self) -> str:
        """The keys a federation (pyproject) and a connection (config.toml) share."""
        body = f'address = "{self.control_address}"\ninsecure = true\n'
        if self.simulation:
            body += (
                f"options.num-supernodes = {self.num_supernodes}\n"
                "options.backend.client-resources.num-cpus = 1\n"
            )
        return body

    def prepare_app(self, app_dir: Path) -> None:
        """Where ``flwr run`` takes a federation from the app, write it into the app."""
        if self.flower.run_takes_connection:
            return
        pyproject = app_dir / "pyproject.toml"
        text = pyproject.read_text(encoding="utf-8")
        text += (
            f'\n[tool.flwr.federations]\ndefault = "{TARGET}"\n\n'
            f"[tool.flwr.federations.{TARGET}]\n{self._target_body()}"
        )
        pyproject.write_text(text, encoding="utf-8")

    @property
    def supernode_logs(self) -> list[Path]:
        """Each started SuperNode's log."""
        return [self.workdir / f"supernode-{index}.log" for index in range(len(self.supernodes))]

    @property
    def warm(self) -> bool:
        """Whether SuperNodes run under ``ba-supernode`` with the warm ClientApp executor, as
        docs/deployment.md tells a user of their own app to: where the wheel brings
        ``ba-supernode`` and the release has what the executor plugs into (flwr 1.39+)."""
        return (self.flower.bin_dir / "ba-supernode").is_file() and (
            FlowerRelease(self.flower.version).warm_executor_problem() is None
        )

    def _start_supernode(self, index: int, options: frozenset[str]) -> None:
        # The quickstart builds a torch.optim optimizer per message, whose first construction
        # imports torch._dynamo (1.3 CPU-seconds): the warm parent imports it once.
        supernode = [str(self.flower.bin_dir / "flower-supernode")]
        if self.warm:
            supernode = [str(self.flower.bin_dir / "ba-supernode"), "--executor", "warm"]
            supernode += ["--preload", "torch._dynamo"]
        command = [
            *supernode,
            "--insecure",
            "--superlink",
            self.fleet_address,
            "--node-config",
            f"partition-id={index} num-partitions={self.num_supernodes}",
        ]
        if "--port" in options:  # the SuperNode's own API, one per node on this host
            command += ["--port", str(free_port())]
        else:
            command += ["--clientappio-api-address", f"127.0.0.1:{free_port()}"]
        if "--health-server-address" in options and "--port" not in options:
            command += ["--health-server-address", f"127.0.0.1:{free_port()}"]
        self.supernodes.append(self._popen(command, self.workdir / f"supernode-{index}.log"))

    def connected_nodes(self) -> int:
        """SuperNodes the SuperLink has heard from: ``flwr supernode list`` where it exists,
        else the node ids in the SuperLink's log (1.21 logs each node's pulls)."""
        if self.flower.run_takes_connection:
            listing = self.flwr("supernode", "list", TARGET, "--format", "json", timeout=60)
            start = listing.stdout.find("{")
            if listing.returncode == 0 and start >= 0:
                try:
                    nodes = json.loads(listing.stdout[start:]).get("nodes", [])
                except json.JSONDecodeError:
                    return 0
                return sum(1 for node in nodes if node.get("status") == "online")
        log = self.superlink_log.read_text(errors="replace")
        return len(set(re.findall(r"node_id=(\d+)", log)))

    def _wait_for_supernodes(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, node in enumerate(self.supernodes):
                if node.poll() is not None:
                    raise FlowerRuntimeError(
                        f"flower-supernode {index} exited with code {node.returncode}:\n"
                        f"{self._log_tail(self.workdir / f'supernode-{index}.log')}"
                    )
            if self.connected_nodes() >= self.num_supernodes:
                return
            time.sleep(1.0)
        logs = "\n".join(
            f"--- supernode-{i}.log\n{self._log_tail(self.workdir / f'supernode-{i}.log', 1500)}"
            for i in range(len(self.supernodes))
        )
        load = " ".join(f"{value:.1f}" for value in os.getloadavg())
        raise FlowerRuntimeError(
            f"{self.connected_nodes()} of {self.num_supernodes} SuperNodes connected in "
            f"{timeout:.0f} s (load average {load} on {os.cpu_count()} CPUs)\n{logs}"
        )

    @staticmethod
    def _log_tail(path: Path, characters: int = 3000) -> str:
        return path.read_text(errors="replace")[-characters:] if path.is_file() else "(no log)"

    def flwr(
        self, *arguments: str, timeout: float, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``flwr <arguments>`` of this environment, against this SuperLink."""
        return subprocess.run(
            [str(self.flower.bin_dir / "flwr"), *arguments],
            env={**self.env, "COLUMNS": "200"},
            cwd=cwd or self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _target_arguments(self, app_dir: Path) -> list[str]:
        return [TARGET] if self.flower.run_takes_connection else [str(app_dir), TARGET]

    def run(self, app_dir: Path, run_config: Mapping[str, object], timeout: float) -> RunOutcome:
        """``flwr run <app> --stream`` with ``run_config``; its log and its status.

        A run whose simulation engine crashed is stopped at once rather than waited on until
        ``timeout``; one that crashed because Ray did not start is started again, up to
        ``RAY_START_ATTEMPTS`` times, and its log keeps every attempt.
        """
        self.prepare_app(app_dir)
        config = " ".join(f"{key}={toml_value(value)}" for key, value in run_config.items())
        command = ["run", str(app_dir), TARGET, "--stream", "--run-config", config]
        started = time.monotonic()
        attempts: list[str] = []
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            log = self._watch_run(command, app_dir, timeout)
            run_id = _run_id(log)
            attempts.append(log)
            if not ray_failed_to_start(log):
                break
            if attempt < RAY_START_ATTEMPTS:
                attempts.append(
                    f"(Ray did not start; attempt {attempt + 1} of {RAY_START_ATTEMPTS})"
                )
        log = "\n".join(attempts)
        status = self.status(app_dir, run_id) if run_id is not None else "not started"
        outcome = RunOutcome(run_id, status, log, time.monotonic() - started)
        saved = self.workdir / f"run-{app_dir.name}.log"
        saved.write_text(f"{outcome.tail(len(log))}\n", encoding="utf-8")
        return outcome

    def _watch_run(self, command: list[str], app_dir: Path, timeout: float) -> str:
        """Run ``flwr <command>``, reading its log as it streams; stop the run when it has not
        ended in ``timeout`` s or its simulation engine crashed. Returns the cleaned log."""
        log_path = self.workdir / f"flwr-run-{uuid.uuid4().hex[:8]}.log"
        with log_path.open("wb") as sink:
            process = subprocess.Popen(
                [str(self.flower.bin_dir / "flwr"), *command],
                env={**self.env, "COLUMNS": "200"},
                cwd=app_dir.parent,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        ending = ""
        while process.poll() is None:
            if time.monotonic() > deadline:
                ending = f"(flwr run did not end in {timeout:.0f} s)"
            elif ENGINE_CRASHED in log_path.read_text(errors="replace"):
                ending = "(the simulation engine crashed; the run was stopped)"
            if ending:
                stop_process_tree(process)
                break
            time.sleep(1.0)
        log = clean_log(log_path.read_text(errors="replace"))
        run_id = _run_id(log)
        if ending and run_id is not None:
            self.flwr("stop", str(run_id), *self._target_arguments(app_dir), timeout=60)
        return f"{log}\n{ending}" if ending else log

    def status(self, app_dir: Path, run_id: int) -> str:
        """The run's status from ``flwr ls --run-id`` (``finished:completed`` when it went well)."""
        listing = self.flwr(
            "ls",
            *self._target_arguments(app_dir),
            "--run-id",
            str(run_id),
            "--format",
            "json",
            timeout=120,
            cwd=app_dir.parent,
        )
        try:
            runs = json.loads(listing.stdout).get("runs", [])
        except json.JSONDecodeError:
            return f"unreadable: {(listing.stdout + listing.stderr)[-500:]}"
        return str(runs[0].get("status", "")) if runs else "unknown run"

    def stop(self) -> None:
        """Stop the SuperNodes and the SuperLink with every process below them, by PID."""
        marker = self.env.get(LAUNCH_MARKER)
        for node in self.supernodes:
            stop_process_tree(node, marker=None)
        if self.superlink is not None:
            stop_process_tree(self.superlink, marker=marker)

    def __enter__(self) -> FlowerLink:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def ray_failed_to_start(log: str) -> bool:
    """Whether a run's log says Ray failed to start its own processes (see RAY_START_FAILURES)."""
    return any(failure in log for failure in RAY_START_FAILURES)


def _run_id(log: str) -> int | None:
    match = re.search(r"started run (\d+)", log)
    return int(match.group(1)) if match else None
