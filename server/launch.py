"""``ba-run``: run the app in Flower simulation or in process, the environment handled for you.

``--runtime simulation`` (the default) is Flower's simulation, described below. ``--runtime
inprocess`` runs the same ServerApp and ClientApp in this Python process through
:mod:`server.inprocess` (no Ray, no SuperLink; see docs/runtimes.md), with the same run folder and
summary, and the same exit status.

Plain ``flwr run .`` needs several environment variables set by hand, leaves a detached SuperLink
running and exits 0 even when the run failed. This launcher

1. sets a project-local ``FLWR_HOME`` (``.flwr/sim-<port>/``), disables runtime dependency
   installation, telemetry and the update check, and puts this interpreter's
   ``bin/`` first on ``PATH`` (the SuperLink starts ``flower-superexec`` from there);
2. starts its own simulation SuperLink on a free loopback port and registers it as the
   connection ``ba-local`` in ``$FLWR_HOME/config.toml``;
3. runs ``flwr run <app> ba-local --stream`` with the given ``--run-config`` overrides and
   ``num-supernodes = num-clients``;
4. reads ``<output-dir>/<run-name>/summary.json`` and exits non-zero with the run's error when the
   run did not complete, and with ``ALARMS_EXIT_CODE`` (4) when it completed with an alarm; a
   summary still ``running`` after the run's processes ended (a ServerApp killed with SIGKILL) is
   rewritten ``interrupted`` (:func:`server.recorder.mark_interrupted`);
5. always stops the SuperLink it started and every process below it, by PID, never by name.

``--ray-address HOST:PORT`` runs the simulation's ClientApps on an existing Ray cluster (the
address ``ray start --head`` prints) instead of a Ray instance of its own: the SuperLink and the
simulation it starts get ``RAY_ADDRESS``, which ``ray.init`` in Flower's Ray backend connects to
(docs/ray-cluster.md).

``ba-run --status <run folder>`` prints a run's status, checked against its owner lock (a
``running`` summary whose writer is gone is reported, and marked, ``interrupted``); ``ba-run
--resume`` refuses a run whose writer is still alive.

Before anything starts, ``ba-run`` reads ``-c`` (``key=value`` pairs and TOML files, the later
winning), refuses an unknown key naming the closest known one, and refuses a ``run-name`` whose
folder already holds a run (unless ``--resume`` or ``--overwrite``). While the run goes, its
output passes through :class:`server.watch.RunConsole` (a progress bar on a terminal, plain
lines elsewhere, all of it in ``<run folder>/log.txt``). SIGTERM, SIGHUP and SIGINT stop the run
and every process the launch started (:func:`server.cli.stop_signals`); the command line itself
is :mod:`server.cli`. Without ``--ray-address`` the
simulation starts a Ray of its own (``RAY_ADDRESS=local``): Ray's ``ray_current_cluster`` file,
left behind by a ``ray start`` whose cluster is gone, would otherwise make ``ray.init`` connect
to that dead address and the run wait forever. ``ba-run --list`` and ``ba-run --compare`` read
finished runs (:mod:`server.runs`).
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pathspec

if TYPE_CHECKING:
    from .recorder import RunStatus
    from .watch import RunConsole

CONNECTION = "ba-local"
#: Environment entry every process of one launch inherits, so that all of them can be stopped.
LAUNCH_MARKER = "BA_LAUNCH_ID"


class LaunchError(RuntimeError):
    """The run could not be started, or did not complete."""


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def toml_value(value: Any) -> str:
    """A Python value in the TOML syntax of Flower's ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def run_config_argument(settings: Mapping[str, Any]) -> str:
    """One ``--run-config`` value holding every override of ``settings``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in settings.items())


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


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the app's pyproject.toml."""
    pyproject = app_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise LaunchError(f"no pyproject.toml in {app_dir}: pass --app <folder of the Flower app>")
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    try:
        return dict(data["tool"]["flwr"]["app"]["config"])
    except KeyError:
        raise LaunchError(f"{pyproject} has no [tool.flwr.app.config] table") from None


def is_toml_file(entry: str) -> bool:
    """A ``-c`` value that names a TOML file (as Flower tells one: it ends in ``.toml``)."""
    return entry.strip().endswith(".toml") and "=" not in entry


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``-c`` values as one dict, the later winning: Flower's ``--run-config`` syntax
    (``key=value`` pairs, TOML values) and TOML files (flattened as Flower flattens one), so a
    file with pairs after it is the file with those pairs changed.

    Raises
    ------
    LaunchError
        A file that cannot be read or is not TOML, or pairs Flower cannot parse.
    """
    from flwr.common.config import flatten_dict, parse_config_args

    merged: dict[str, Any] = {}
    for entry in overrides:
        if is_toml_file(entry):
            path = Path(entry.strip()).expanduser()
            try:
                merged.update(flatten_dict(tomllib.loads(path.read_text(encoding="utf-8"))))
            except OSError as error:
                raise LaunchError(f"-c {entry}: cannot read the file ({error})") from None
            except (tomllib.TOMLDecodeError, ValueError) as error:
                raise LaunchError(f"-c {entry}: not a TOML file of run options ({error})") from None
            continue
        try:
            merged.update(parse_config_args([entry]))
        except Exception as error:  # click.ClickException: Flower's message for bad syntax
            message = getattr(error, "message", None) or str(error)
            raise LaunchError(f"-c {entry!r}: {message}") from None
    return merged


def check_keys(overrides: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Refuse a key that is not a run option, naming the closest that is.

    Raises
    ------
    LaunchError
        One line per unknown key, with a suggestion where one is close (difflib).
    """
    problems = []
    for key in overrides:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f": did you mean '{close[0]}'?" if close else ""
        problems.append(f"unknown run-config key '{key}'{hint}")
    if problems:
        raise LaunchError(
            "; ".join(problems) + f" (the app's keys are those of {where}; docs/configuration.md)"
        )


def write_connection(flwr_home: Path, port: int) -> None:
    """Register the launcher's SuperLink as connection ``ba-local`` (and make it the default)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n',
        encoding="utf-8",
    )


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
    write_connection(flwr_home, port)
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


def stage_app(app_dir: Path, destination: Path) -> Path:
    """Copy the files a FAB can hold to ``destination``: not git-ignored, not ``.git``, and, where
    ``[tool.flwr.app] fab-include`` lists patterns, only ``pyproject.toml`` and files they match.

    ``flwr run <dir>`` walks every file under ``<dir>``, git-ignored ones included, before it
    filters them; with a virtual environment in the repository that walk takes half a minute
    per run. The FAB built from the staged copy has the same content, because the same
    ``.gitignore`` and Flower's include/exclude rules apply to the same remaining files.
    """
    gitignore = app_dir / ".gitignore"
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.is_file() else []
    ignored = pathspec.GitIgnoreSpec.from_lines([*lines, ".git/"])
    included = fab_include_spec(app_dir / "pyproject.toml")
    for directory, subdirectories, filenames in os.walk(app_dir):
        relative = Path(directory).relative_to(app_dir)
        subdirectories[:] = [
            name
            for name in subdirectories
            if not ignored.match_file(f"{(relative / name).as_posix()}/")
        ]
        for name in filenames:
            source = Path(directory) / name
            path = (relative / name).as_posix()
            if source.is_symlink() or ignored.match_file(path):
                continue
            if included is not None and path != "pyproject.toml" and not included.match_file(path):
                continue
            target = destination / relative / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def fab_include_spec(pyproject: Path) -> pathspec.GitIgnoreSpec | None:
    """The app's ``[tool.flwr.app] fab-include`` patterns (gitignore-style, as Flower reads
    them), or None where the app lists none (Flower then takes every file of its built-in
    kinds)."""
    if not pyproject.is_file():
        return None
    app = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {})
    patterns = app.get("flwr", {}).get("app", {}).get("fab-include")
    return None if patterns is None else pathspec.GitIgnoreSpec.from_lines(patterns)


def read_summary(summary_path: Path) -> dict[str, Any]:
    """The run's summary, or a 'missing' status when the ServerApp never wrote it."""
    if not summary_path.is_file():
        return {"status": "missing"}
    return dict(json.loads(summary_path.read_text(encoding="utf-8")))


def run_settings(app_dir: Path, overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The fused settings of a launch and the overrides it adds: a run name and an absolute
    output folder when the configuration gives none, so the launcher knows where the summary
    will be."""
    defaults = app_defaults(app_dir)
    given = parse_overrides(overrides)
    check_keys(given, list(defaults), f"[tool.flwr.app.config] in {app_dir / 'pyproject.toml'}")
    settings = defaults | given
    extra: list[str] = []
    run_name = str(settings.get("run-name") or "")
    if not run_name:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        run_name = f"{settings.get('strategy', 'run')}-{settings.get('dataset', 'data')}-{stamp}"
        extra.append(f'run-name="{run_name}"')
    output_dir = Path(str(settings.get("output-dir") or "runs")).expanduser()
    if not output_dir.is_absolute():
        output_dir = app_dir / output_dir
        extra.append(f'output-dir="{output_dir}"')
    num_clients = settings.get("num-clients")
    if not isinstance(num_clients, int) or num_clients < 1:
        raise LaunchError(f"num-clients = {num_clients!r}: allowed is an integer >= 1")
    settings.update(parse_overrides(extra))
    return settings, extra


def resume_overrides(run_dir: Path) -> list[str]:
    """Overrides that continue ``run_dir`` from its checkpoint: the run's own configuration
    (from its ``summary.json``), ``resume-from`` and the folder's name and parent.

    A run whose writer is still alive is refused (two writers would interleave rounds).
    """
    from .recorder import run_status  # imports torch: only where a run folder is read

    run_dir = run_dir.expanduser().resolve()
    if run_status(run_dir).status == "running":
        owner = read_summary(run_dir / "summary.json").get("owner") or {}
        raise LaunchError(
            f"--resume {run_dir}: the run is still running (pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')} holds its owner lock); stop it first, or wait for it"
        )
    summary = read_summary(run_dir / "summary.json")
    config = summary.get("config")
    if not isinstance(config, dict):
        raise LaunchError(
            f"--resume {run_dir}: no summary.json with the run's configuration there; pass the "
            "folder of a run this app started (runs/<run-name>)"
        )
    settings = {
        **config,
        "resume-from": str(run_dir),
        "run-name": run_dir.name,
        "output-dir": str(run_dir.parent),
    }
    return [run_config_argument(settings)]


def completed_run(settings: Mapping[str, Any], failure: str) -> Path:
    """The run folder when its summary says it ran every round (``completed``, or
    ``completed-with-alarms``); otherwise :class:`LaunchError`.

    Called once every process of the run has ended: a summary that still says ``running`` was
    left by a ServerApp that died without a final status, and is marked ``interrupted``.
    """
    from .recorder import (  # imports torch: only where a run is read
        FINISHED_STATUSES,
        low_space_note,
        mark_interrupted,
    )

    run_name = str(settings["run-name"])
    summary_path = Path(str(settings["output-dir"])).expanduser() / run_name / "summary.json"
    status = mark_interrupted(summary_path.parent)
    summary = read_summary(summary_path)
    if summary.get("status") not in FINISHED_STATUSES:
        reason = summary.get("error") or (status.reason if status.status == "interrupted" else "")
        if not reason:
            reason = f"{failure} and the ServerApp wrote no summary at {summary_path}; " + (
                low_space_note(summary_path.parent).strip()
                or "the run failed before round 1 (see the log above, e.g. an invalid run "
                "configuration)"
            )
        raise LaunchError(f"run '{run_name}' did not complete: {reason}")
    return summary_path.parent


def launch(
    app_dir: Path,
    overrides: Sequence[str],
    *,
    timeout: float | None = None,
    client_cpus: int | None = None,
    ray_address: str | None = None,
    console: RunConsole | None = None,
) -> Path:
    """Run the app in simulation; return the run folder, or raise :class:`LaunchError`.

    ``ray_address``: the ``HOST:PORT`` of an existing Ray cluster's head to run the ClientApps
    on (each Ray actor takes ``client_cpus`` of a node's CPUs); None starts Ray on this machine.
    ``console``: where ``flwr run``'s output goes, line by line (None: straight to this
    process's standard output).
    """
    app_dir = app_dir.resolve()
    settings, extra = run_settings(app_dir, overrides)
    federation = [f"num-supernodes={settings['num-clients']}"]
    if client_cpus is not None:
        federation.append(f"client-resources-num-cpus={client_cpus}")
    with simulation_superlink(app_dir, ray_address) as env:
        staged = stage_app(app_dir, Path(env["FLWR_HOME"]) / "app")
        command = ["flwr", "run", str(staged), CONNECTION, "--stream"]
        # One resolved set: TOML files and pairs merged (Flower takes a file alone only).
        command += ["--run-config", run_config_argument(parse_overrides([*overrides, *extra]))]
        for entry in federation:
            command += ["--federation-config", entry]
        code = run_command(command, env, app_dir, timeout, console)
    return completed_run(settings, f"`flwr run` exited with code {code}")


def run_command(
    command: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float | None,
    console: RunConsole | None,
) -> int:
    """Run ``command`` to its end (its output through ``console`` when given); its exit code.

    Raises
    ------
    LaunchError
        It ran past ``timeout`` seconds (it is killed).
    """
    if console is None:
        try:
            return subprocess.run(
                list(command), env=dict(env), cwd=cwd, timeout=timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            raise LaunchError(f"the run did not finish within {timeout} s") from None
    process = subprocess.Popen(
        list(command),
        env={**env, "PYTHONUNBUFFERED": "1"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    relay = threading.Thread(target=console.lines, args=(process.stdout,), daemon=True)
    relay.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"the run did not finish within {timeout} s") from None
    finally:  # also on a stop signal: `flwr run` goes with the rest of the launch
        if process.poll() is None:
            process.kill()
            process.wait()
        relay.join(timeout=5.0)
        process.stdout.close()
    return process.returncode


def launch_inprocess(
    app_dir: Path,
    overrides: Sequence[str],
    *,
    threads: int | None = 1,
    console: RunConsole | None = None,
) -> Path:
    """Run the app in this process (:func:`server.inprocess.run_inprocess`); return the run
    folder, or raise :class:`LaunchError`.

    ``threads`` sets torch's intra-op threads (None leaves torch's default). The default 1 is
    what each simulated client gets from Ray with ``--client-cpus 1``; on a small shared CPU
    more threads make the small models here slower, not faster. ``console``: where Flower's
    log records go while the run lasts (None: Flower's own console handler).
    """
    app_dir = app_dir.resolve()
    settings, extra = run_settings(app_dir, overrides)
    for key, value in flower_environment(app_dir / ".flwr" / "inprocess").items():
        if key.startswith("FLWR_"):
            os.environ[key] = value  # no telemetry or update check from this process either
    import torch

    from .inprocess import run_inprocess
    from .watch import flower_logs_to

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with flower_logs_to(console) if console is not None else nullcontext():
            run_inprocess(app_dir, parse_overrides([*overrides, *extra]))
    except Exception as error:  # the ServerApp has written a failed summary when it got that far
        return completed_run(settings, f"the run raised {type(error).__name__}: {error}")
    return completed_run(settings, "the run returned")


#: ``ba-run --runtime`` choices; the first is the default.
RUNTIMES = ("simulation", "inprocess")


def launch_runtime(
    runtime: str,
    app_dir: Path,
    overrides: Sequence[str],
    *,
    timeout: float | None = None,
    client_cpus: int | None = 1,
    ray_address: str | None = None,
    console: RunConsole | None = None,
) -> Path:
    """One run in the chosen runtime: :func:`launch` (simulation) or :func:`launch_inprocess`.

    In process, ``client_cpus`` is torch's thread count (the one client running at a time gets
    them) and ``timeout`` is not enforced (a run cannot be abandoned half-way in its own process);
    ``ray_address`` (a Ray cluster for the simulation) is refused there.
    """
    if runtime == "simulation":
        return launch(
            app_dir,
            overrides,
            timeout=timeout,
            client_cpus=client_cpus,
            ray_address=ray_address,
            console=console,
        )
    if ray_address is not None:
        raise LaunchError(
            f"--ray-address = {ray_address!r} runs Flower's simulation on a Ray cluster; the "
            f"{runtime!r} runtime uses no Ray: drop --ray-address or use --runtime simulation"
        )
    if runtime == "inprocess":
        return launch_inprocess(app_dir, overrides, threads=client_cpus, console=console)
    raise LaunchError(f"runtime = {runtime!r}: choose one of {', '.join(RUNTIMES)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ba-run`` (its command line: :mod:`server.cli`)."""
    from .cli import main as cli_main

    return cli_main(argv)


#: ``ba-run``'s exit code for a run that ran every round but raised an alarm.
ALARMS_EXIT_CODE = 4
#: ``ba-run`` and ``ba-run --status`` exit codes (any other status: 1).
STATUS_EXIT_CODES = {"completed": 0, "completed-with-alarms": ALARMS_EXIT_CODE, "running": 3}


def print_alarms(summary: Mapping[str, Any], emit: Callable[[str], None] | None = None) -> None:
    """One warning line per alarm kind a run raised (see server.app.round_alarms), to standard
    error or to ``emit``."""
    for kind, alarm in (summary.get("alarms") or {}).items():
        text = (
            f"ba-run: warning: {kind} in {alarm.get('rounds')} round(s), rounds "
            f"{alarm.get('first-round')}-{alarm.get('last-round')}: {alarm.get('message', '')}"
        )
        if emit is None:
            print(text, file=sys.stderr)
        else:
            emit(text)


def print_status(run_dir: Path) -> int:
    """``ba-run --status``: the run's status, checked against its owner; the exit code says it.

    A ``running`` summary whose writer is gone is reported and marked ``interrupted``.
    """
    from .recorder import mark_interrupted, run_status  # imports torch

    status: RunStatus = run_status(run_dir)
    if status.status == "missing" and any(Path(run_dir).glob("*/summary.json")):
        from .runs import list_command

        print(f"ba-run: {run_dir} is a folder of runs, not a run; its runs (ba-run --list):")
        return list_command(Path(run_dir), "text")
    if status.status == "interrupted":
        status = mark_interrupted(run_dir)
    summary = status.summary
    final = summary.get("final") or {}
    line = f"ba-run: {run_dir}: {status.status}"
    if summary:
        line += (
            f", {summary.get('rounds-completed', 0)} of "
            f"{(summary.get('config') or {}).get('num-server-rounds', '?')} rounds, test accuracy "
            f"{final.get('test-accuracy')}, updated {summary.get('updated-at', '?')}"
        )
    print(line)
    if status.reason:
        print(f"ba-run: {status.reason}")
    print_alarms(summary)
    return STATUS_EXIT_CODES.get(status.status, 1)


if __name__ == "__main__":
    raise SystemExit(main())
