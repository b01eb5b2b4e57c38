"""``ba-run``: run the app in Flower simulation or in process, the environment handled for you;
list, compare and check runs.

:func:`main` reads the arguments (:func:`build_parser`). A run is checked before anything starts:
``-c`` read (``key=value`` pairs and TOML files, the later winning), an unknown key refused
naming the closest known one (:mod:`beyond_averaging.server.overrides`), and a ``run-name`` whose
folder already holds a run refused (unless ``--resume`` or ``--overwrite``). It is then launched
by :func:`beyond_averaging.server.runtime.launch.launch_runtime` (``--runtime simulation``, the
default, or ``inprocess``; docs/runtimes.md) under a
:class:`beyond_averaging.server.runtime.watch.RunConsole` (a progress bar on a terminal, plain
lines elsewhere, all of it in ``<run folder>/log.txt``), and reported: the exit code is non-zero
when the run did not complete, and ``ALARMS_EXIT_CODE`` (4) when it completed with an alarm
(:mod:`beyond_averaging.server.cli.status`).

SIGTERM, SIGHUP and SIGINT stop the run and every process the launch started
(:func:`stop_signals`): the signal unwinds the launch, whose clean-up stops every process it
started. ``ba-run --resume`` continues a run from its checkpoint (:func:`resume_overrides`) and
refuses a run whose writer is still alive.

``ba-run --status <run folder>`` prints a run's status, checked against its owner lock (a
``running`` summary whose writer is gone is reported, and marked, ``interrupted``;
:func:`beyond_averaging.server.cli.status.print_status`). ``ba-run --list`` and ``ba-run
--compare`` read finished runs (:mod:`beyond_averaging.server.runs.listing`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beyond_averaging.server.overrides import (
    CONFIG_EXIT_CODE,
    LaunchError,
    OptionsError,
    app_defaults,
    parse_overrides,
    run_config_argument,
    run_settings,
)
from beyond_averaging.server.runs.folder import SUMMARY_FILE, read_summary
from beyond_averaging.server.runs.provenance import COMMAND_LINE_ENV
from beyond_averaging.server.runtime.launch import RUNTIMES, check_runtime, launch_runtime

from .status import STATUS_EXIT_CODES, print_alarms, print_status

if TYPE_CHECKING:
    from beyond_averaging.server.runtime.watch import RunConsole


def build_parser() -> argparse.ArgumentParser:
    """``ba-run``'s command line."""
    parser = argparse.ArgumentParser(
        prog="ba-run",
        description="Run the beyond-averaging Flower app in simulation (or in process); list, "
        "compare and check runs.",
    )
    parser.add_argument("--app", type=Path, default=Path.cwd(), help="Flower app folder")
    parser.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="overrides, e.g. -c 'strategy=\"elastic\" num-server-rounds=20', or a TOML file "
        "of them (-c my-run.toml); repeatable, the later winning: -c my-run.toml -c seed=3",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    parser.add_argument(
        "--client-cpus",
        type=int,
        default=1,
        help="CPUs Ray reserves per simulated client (default 1: as many clients train at once "
        "as there are cores; Flower's own default of 2 runs one at a time on a 2-core machine)",
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default=RUNTIMES[0],
        help="simulation: Flower's simulation (Ray, a local SuperLink); inprocess: ServerApp and "
        "ClientApp in this process, no Ray (fast; no --timeout; --client-cpus sets torch "
        "threads). See docs/runtimes.md",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="simulation only: run the ClientApps on the existing Ray cluster whose head is at "
        "HOST:PORT (what `ray start --head` prints) instead of starting Ray here; see "
        "docs/ray-cluster.md",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue runs/<name> from its checkpoint with its configuration (-c may raise "
        "num-server-rounds; any other change is refused)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="let the run replace a run of the same run-name (its folder is deleted first); "
        "without it such a run is refused",
    )
    parser.add_argument(
        "--status",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="print the status of runs/<name> and exit: 0 completed, 4 completed with alarms, "
        "3 running (its process is alive), 1 failed, interrupted (its process died: marked so in "
        f"{SUMMARY_FILE}) or unknown",
    )
    parser.add_argument(
        "--list",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="list the runs in DIR (default: the app's output-dir, runs/) and exit",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="RUN",
        help="compare runs (folders, or names under the app's output-dir): a table, and one "
        "PNG of their accuracy curves (--plot)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="--compare: the test accuracy whose first round is counted (default: the lowest of "
        "the runs' best accuracies, which every run reaches)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="--compare: where the figure goes (default: compare-<runs>.png beside the first "
        "run's folder)",
    )
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="--list and --compare: a text table (default) or JSON",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ba-run``."""
    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    if args.status is not None:
        return print_status(args.status)
    if args.list is not None or args.compare is not None:
        from beyond_averaging.server.runs.listing import compare_command, list_command

        runs_dir = default_runs_dir(args.app.resolve())
        if args.compare is not None:
            return compare_command(args.compare, runs_dir, args.target, args.plot, args.format)
        return list_command(Path(args.list) if args.list else runs_dir, args.format)
    if args.overwrite and args.resume is not None:
        parser.error("--overwrite starts the run afresh and --resume continues it: choose one")
    with stop_signals(), environment_entry(COMMAND_LINE_ENV, shlex.join(["ba-run", *arguments])):
        try:
            return run_and_report(args)
        except StopSignal as stop:
            print(f"ba-run: stopped by {stop}", file=sys.stderr, flush=True)
            return 128 + stop.signum


def default_runs_dir(app_dir: Path) -> Path:
    """The app's ``output-dir`` (relative ones under the app's folder): where its runs land."""
    try:
        output = str(app_defaults(app_dir).get("output-dir") or "runs")
    except LaunchError:
        output = "runs"
    path = Path(output).expanduser()
    return path if path.is_absolute() else app_dir / path


def run_folder(settings: Mapping[str, Any]) -> Path:
    """The folder the run of ``settings`` writes: ``resume-from``, else
    ``<output-dir>/<run-name>``."""
    if settings.get("resume-from"):
        return Path(str(settings["resume-from"])).expanduser().resolve()
    return Path(str(settings["output-dir"])).expanduser().resolve() / str(settings["run-name"])


def claim_run_folder(folder: Path, overwrite: bool) -> None:
    """Refuse a new run into a folder that holds a run
    (:func:`beyond_averaging.server.runs.listing.existing_run_problem`) unless ``overwrite``,
    which deletes that run first (never one that is running).

    Raises
    ------
    LaunchError
        The folder holds a run, and ``overwrite`` is not given or the run is alive.
    """
    # imports torch: only where a folder is checked
    from beyond_averaging.server.runs.listing import existing_run_problem

    problem = existing_run_problem(folder)
    if problem is None:
        return
    status, message = problem
    if not overwrite or status == "running":
        raise LaunchError(message)
    shutil.rmtree(folder)
    print(f"ba-run: --overwrite: deleted the earlier run {folder}", file=sys.stderr)


def resume_overrides(run_dir: Path) -> list[str]:
    """Overrides that continue ``run_dir`` from its checkpoint: the run's own configuration
    (from its ``summary.json``), ``resume-from`` and the folder's name and parent.

    A run whose writer is still alive is refused (two writers would interleave rounds).
    """
    # imports torch: only where a run folder is read
    from beyond_averaging.server.runs.recorder import run_status

    run_dir = run_dir.expanduser().resolve()
    if run_status(run_dir).status == "running":
        owner = read_summary(run_dir).get("owner") or {}
        raise LaunchError(
            f"--resume {run_dir}: the run is still running (pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')} holds its owner lock); stop it first, or wait for it"
        )
    summary = read_summary(run_dir)
    config = summary.get("config")
    if not isinstance(config, dict):
        raise LaunchError(
            f"--resume {run_dir}: no {SUMMARY_FILE} with the run's configuration there; pass the "
            "folder of a run this app started (runs/<run-name>)"
        )
    settings = {
        **config,
        "resume-from": str(run_dir),
        "run-name": run_dir.name,
        "output-dir": str(run_dir.parent),
    }
    return [run_config_argument(settings)]


def run_and_report(args: argparse.Namespace) -> int:
    """One run from the command line: check it, run it under a :class:`RunConsole`, report it."""
    try:
        overrides = list(args.run_config)
        if args.resume is not None:
            overrides = [*resume_overrides(args.resume), *overrides]
        app_dir = args.app.resolve()
        check_runtime(args.runtime, args.ray_address)
        settings, extra = run_settings(app_dir, overrides)
        overrides = [run_config_argument(parse_overrides([*overrides, *extra]))]
        folder = run_folder(settings)
        if not settings.get("resume-from"):
            claim_run_folder(folder, args.overwrite)
    except LaunchError as error:  # nothing has started, nothing is written, no run folder
        print(f"ba-run: error: {error}", file=sys.stderr)
        return CONFIG_EXIT_CODE if isinstance(error, OptionsError) else 1
    total = int(settings["num-server-rounds"])  # checked by run_settings: the bar's total
    # imports torch (seconds): only once the options are checked, so a refusal comes at once
    from beyond_averaging.server.runtime.watch import RunConsole

    with RunConsole(folder, total, resumed=bool(settings.get("resume-from"))) as console:
        try:
            run_dir = launch_runtime(
                args.runtime,
                app_dir,
                overrides,
                timeout=args.timeout,
                client_cpus=args.client_cpus,
                ray_address=args.ray_address,
                console=console,
            )
        except LaunchError as error:
            console.line(f"ba-run: error: {error}", error=True)
            return 1
        except StopSignal as stop:
            console.line(f"ba-run: stopped by {stop}; {stopped_run(folder)}", error=True)
            return 128 + stop.signum
        return report(run_dir, console)


def report(run_dir: Path, console: RunConsole) -> int:
    """The last lines of a run that ran every round; its exit code."""
    console.finish()  # the bar's final state above the closing lines, not below them
    summary = read_summary(run_dir)
    final = summary.get("final") or {}
    status = str(summary.get("status"))
    console.line(f"ba-run: run {status.replace('-', ' ')}: {run_dir}")
    accuracy = final.get("test-accuracy")
    shown = f"{accuracy:.4f}" if isinstance(accuracy, int | float) else str(accuracy)
    console.line(f"ba-run: final test accuracy {shown} after round {final.get('round')}")
    kept = run_files(run_dir)
    if kept:
        console.line(f"ba-run: in the run folder: {', '.join(kept)}")
    tracker = summary.get("tracker")
    if isinstance(tracker, dict) and tracker.get("where"):
        console.line(f"ba-run: tracker {tracker.get('name')}: {tracker['where']}")
    print_alarms(summary, lambda text: console.line(text, error=True))
    if status == "completed-with-alarms":
        console.line(
            f"ba-run: error: run '{run_dir.name}' ran every round but raised alarms (above): its "
            "model is not to be trusted; see docs/reliability.md, Runs",
            error=True,
        )
    return STATUS_EXIT_CODES.get(status, 1)


def run_files(run_dir: Path) -> list[str]:
    """What the run folder holds, by name, folders (a tracker's ``tensorboard/``, ``wandb/``)
    marked with a trailing ``/``; the hidden owner lock left out. Read from the folder, not
    from a list of the files a run may write, so that a new file or tracker is never missed."""
    try:
        entries = sorted(Path(run_dir).iterdir(), key=lambda entry: entry.name)
    except OSError:
        return []
    return [
        entry.name + ("/" if entry.is_dir() else "")
        for entry in entries
        if not entry.name.startswith(".")
    ]


def stopped_run(folder: Path) -> str:
    """What became of a run whose launch was stopped by a signal, and how it continues."""
    from beyond_averaging.server.runs.recorder import mark_interrupted  # imports torch

    status = mark_interrupted(folder) if (folder / SUMMARY_FILE).is_file() else None
    if status is None:
        return "the run had not begun; every process ba-run started is stopped"
    rounds = status.summary.get("rounds-completed", "?")
    return (
        f"every process ba-run started is stopped; run '{folder.name}' is {status.status} after "
        f"round {rounds}: continue it with ba-run --resume {folder}"
    )


class StopSignal(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGINT reached ``ba-run``: the launch unwinds, stopping what it
    started (a KeyboardInterrupt, so that the in-process ServerApp records ``interrupted``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name}, sent to ba-run")


#: The signals that stop a launch (what `timeout`, batch schedulers, a closed terminal and
#: Ctrl-C send).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextmanager
def stop_signals() -> Iterator[None]:
    """While inside, the first stop signal raises :class:`StopSignal` in the main thread, where
    the launch's ``finally`` clauses stop the SuperLink and every process below it (Python's
    default for SIGTERM and SIGHUP ends the process at once, leaving them running); later
    signals are ignored while that clean-up runs. Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if received:
            return
        received.append(signum)
        raise StopSignal(signum)

    previous = {stop: signal.signal(stop, handler) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, before in previous.items():
            signal.signal(stop, before)


@contextmanager
def environment_entry(key: str, value: str) -> Iterator[None]:
    """``os.environ[key] = value`` while inside (every process started meanwhile inherits it)."""
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


if __name__ == "__main__":
    raise SystemExit(main())
