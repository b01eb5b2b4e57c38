"""One run, start to outcome, in Flower's simulation or in this process; the environment handled.

``launch_runtime`` runs the chosen runtime: ``simulation`` (the default, :func:`launch`) or
``inprocess`` (:func:`launch_inprocess`: the same ServerApp and ClientApp in this Python process
through :mod:`beyond_averaging.server.runtime.inprocess`, no Ray, no SuperLink; see
docs/runtimes.md), with the same run folder and summary.

Plain ``flwr run .`` needs several environment variables set by hand, leaves a detached SuperLink
running and exits 0 even when the run failed. :func:`launch`

1. sets a project-local ``FLWR_HOME`` (``.flwr/sim-<port>/``), disables runtime dependency
   installation, telemetry and the update check, and puts this interpreter's
   ``bin/`` first on ``PATH`` (the SuperLink starts ``flower-superexec`` from there;
   :func:`~beyond_averaging.server.runtime.processes.flower_environment`);
2. starts its own simulation SuperLink on a free loopback port and registers it as the
   connection ``ba-local`` in ``$FLWR_HOME/config.toml``
   (:func:`~beyond_averaging.server.runtime.simulation.simulation_superlink`);
3. runs ``flwr run <app> ba-local --stream`` with the given ``--run-config`` overrides and
   ``num-supernodes = num-clients``, from a staged copy of the app
   (:mod:`beyond_averaging.server.runtime.staging`);
4. reads ``<output-dir>/<run-name>/summary.json`` (:func:`completed_run`) and raises
   :class:`~beyond_averaging.server.overrides.LaunchError` with the run's error when the run did
   not complete; a summary still ``running`` after the run's processes ended (a ServerApp killed
   with SIGKILL) is rewritten ``interrupted``
   (:func:`beyond_averaging.server.runs.recorder.mark_interrupted`);
5. always stops the SuperLink it started and every process below it, by PID, never by name.

``ba-run`` (:mod:`beyond_averaging.server.cli.main`) is the command line around it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from beyond_averaging.server.overrides import (
    LaunchError,
    parse_overrides,
    run_config_argument,
    run_settings,
)
from beyond_averaging.server.runs.folder import FINISHED_STATUSES, SUMMARY_FILE, read_summary

from .processes import ANSI_CODES, flower_environment
from .simulation import CONNECTION, simulation_superlink
from .staging import stage_app

if TYPE_CHECKING:
    from .watch import RunConsole


def completed_run(settings: Mapping[str, Any], failure: str) -> Path:
    """The run folder when its summary says it ran every round (``completed``, or
    ``completed-with-alarms``); otherwise :class:`LaunchError`.

    Called once every process of the run has ended: a summary that still says ``running`` was
    left by a ServerApp that died without a final status, and is marked ``interrupted``.
    """
    # imports torch: only where a run is read
    from beyond_averaging.server.runs.recorder import low_space_note, mark_interrupted

    run_name = str(settings["run-name"])
    summary_path = Path(str(settings["output-dir"])).expanduser() / run_name / SUMMARY_FILE
    status = mark_interrupted(summary_path.parent)
    summary = read_summary(summary_path.parent)
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
    """Run ``command`` to its end (its output through ``console`` when given, else to standard
    output, without colour codes off a terminal); its exit code.

    Raises
    ------
    LaunchError
        It ran past ``timeout`` seconds (it is killed).
    """
    if console is None and is_terminal(sys.stdout):
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
    # Off a terminal (ba-sweep's log in a file), Flower's colour codes are left out.
    target = console.lines if console is not None else _plain_lines
    relay = threading.Thread(target=target, args=(process.stdout,), daemon=True)
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
    """Run the app in this process (:func:`.inprocess.run_inprocess`); return the run
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
        with flower_logs_to(console) if console is not None else plain_flower_logs():
            run_inprocess(app_dir, parse_overrides([*overrides, *extra]))
    except Exception as error:  # the ServerApp has written a failed summary when it got that far
        return completed_run(settings, f"the run raised {type(error).__name__}: {error}")
    return completed_run(settings, "the run returned")


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal as rich decides it (``FORCE_COLOR``, ``TTY_COMPATIBLE``
    honoured), the one test every console of the app uses."""
    from rich.console import Console

    return Console(file=stream).is_terminal


def _plain_lines(stream: IO[bytes]) -> None:
    """Copy a child's output to this process's standard output without colour codes."""
    for raw in stream:
        text = raw.decode("utf-8", errors="replace")
        sys.stdout.write(ANSI_CODES.sub("", text))
        sys.stdout.flush()


@contextmanager
def plain_flower_logs() -> Iterator[None]:
    """Inside, Flower's console handlers write no colour codes to a stream that is not a
    terminal (Flower colours its log always); their setting is restored afterwards."""
    from flwr.supercore.logger import FLOWER_LOGGER, ConsoleHandler

    plain = [
        handler
        for handler in FLOWER_LOGGER.handlers
        if isinstance(handler, ConsoleHandler) and handler.colored
        if not is_terminal(handler.stream)
    ]
    for handler in plain:
        handler.colored = False
    try:
        yield
    finally:
        for handler in plain:
            handler.colored = True


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
    check_runtime(runtime, ray_address)
    return launch_inprocess(app_dir, overrides, threads=client_cpus, console=console)


def check_runtime(runtime: str, ray_address: str | None) -> None:
    """Refuse a runtime that is not one, or ``ray_address`` with a runtime that uses no Ray;
    ``ba-run`` calls it before it makes the run's folder, so a refused launch leaves none.

    Raises
    ------
    LaunchError
        The runtime is unknown, or given a Ray address it cannot use.
    """
    if runtime not in RUNTIMES:
        raise LaunchError(f"runtime = {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    if ray_address is not None and runtime != "simulation":
        raise LaunchError(
            f"--ray-address = {ray_address!r} runs Flower's simulation on a Ray cluster; the "
            f"{runtime!r} runtime uses no Ray: drop --ray-address or use --runtime simulation"
        )
