"""``ba-sweep``: run a spec's runs that are not done yet, then write its report (a table of mean
± sd over seeds and a plot), to compare rules across settings and seeds.

Each run is the real app (:func:`beyond_averaging.server.runtime.launch.launch_runtime`) or the
spec's function ``runtime``; finished runs are skipped, resumable ones continued, a conflict stops
the sweep, and a lock per run lets several processes share one sweep. docs/benchmarks.md ("The
runner") says more::

    ba-sweep my-comparison.toml --dry-run
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from importlib import import_module
from multiprocessing import get_context
from pathlib import Path
from typing import IO, Any

from beyond_averaging.server.config import SERVER_LR_DEFAULTS, parse_run_config
from beyond_averaging.server.overrides import parse_overrides, run_config_argument
from beyond_averaging.server.runs.checkpoint import RESUME_FREE_KEYS
from beyond_averaging.server.runs.folder import CHECKPOINT_FILE, FINISHED_STATUSES, read_summary
from beyond_averaging.server.runs.provenance import hardware_line
from beyond_averaging.server.runtime.launch import RUNTIMES, launch_runtime

from .report import HOST_FILE, RunData, read_run, write_report
from .spec import Layout, Run, Spec, SpecError, load_spec

ROUNDS_KEY, SERVER_LR_KEY = "num-server-rounds", "server-lr"


def claim(run: Run) -> IO[bytes] | None:
    """An exclusive lock on a run (``<runs>/<name>.lock``), or None while another process holds
    it. Two processes in one run folder would interleave its ``metrics.jsonl``."""
    lock_path = run.folder.with_name(f"{run.name}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    stream = lock_path.open("wb")
    try:
        fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        stream.close()
        return None
    return stream


NEWER_BOUNDS = ("update-clip-factor", "direction-outlier-factor", "max-claim-factor")
BEFORE_OPTION: dict[str, Any] = dict.fromkeys(NEWER_BOUNDS, 0.0)  # runs before 0.2.0: off


def differences(run: Run) -> dict[str, tuple[Any, Any]]:
    """Settings (saved -> wanted) in which the run folder's run differs from the spec's run.

    A key the saved run does not know ran as it did before the option existed: ``BEFORE_OPTION``
    where that was not today's default (the reply bounds of 0.2.0 were off), else the default.
    """
    saved = dict(read_summary(run.folder).get("config") or {})
    saved = parse_run_config({}).to_run_config() | BEFORE_OPTION | saved
    config = parse_run_config(run.settings)
    wanted = config.to_run_config()
    # "auto" and the step it stands for are one setting: runs saved before the option had
    # "auto" (server-lr 1.0 with SGD) are the runs a spec asks for today.
    wanted[SERVER_LR_KEY] = config.resolved_server_lr
    if saved.get(SERVER_LR_KEY) == "auto":
        saved[SERVER_LR_KEY] = SERVER_LR_DEFAULTS[saved.get("server-optimizer", "sgd")]
    return {
        key: (saved.get(key), value)
        for key, value in wanted.items()
        if key not in RESUME_FREE_KEYS and saved.get(key) != value
    }


def state(run: Run) -> str:
    """``finished``, ``resumable``, ``conflict`` or ``new`` (see the module docstring)."""
    summary = read_summary(run.folder)
    if not summary:
        return "new"
    rounds = summary.get("rounds-completed", (summary.get("final") or {}).get("round", -1))
    wanted = run.settings.get(ROUNDS_KEY, parse_run_config(run.settings).num_server_rounds)
    finished = summary["status"] in FINISHED_STATUSES
    if differences(run):
        return "conflict" if finished else "new"
    if finished and rounds == wanted:
        return "finished"
    if (run.folder / CHECKPOINT_FILE).is_file() and rounds < wanted:
        return "resumable"
    return "conflict" if finished else "new"


def execute(run: Run, runtime: str, threads: int, app_dir: Path) -> str:
    """Run (or continue) one run unless another process holds it; a line saying what happened."""
    lock = claim(run)
    if lock is None:
        return f"{run.name}: another process is running it, left to it"
    with lock:  # checked again under the lock: another process may have just finished it
        now = state(run)
        if now in ("finished", "conflict"):
            return f"{run.name}: {now}"
        failure = ""
        # A checkpoint the app refuses (written by an older version) leaves a fresh run.
        attempts = [{"resume-from": str(run.folder)}] if now == "resumable" else []
        for extra in [*attempts, {}]:
            settings = {**run.settings, **extra}
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                if runtime in RUNTIMES:
                    overrides = [run_config_argument(settings)]
                    launch_runtime(runtime, app_dir, overrides, client_cpus=threads)
                else:
                    module, function = runtime.split(":")
                    getattr(import_module(module), function)({**settings, **run.extra})
            except Exception as error:  # one run failing is reported; the sweep goes on
                failure = f"{run.name}: failed: {error}"
                print(failure, file=sys.stderr, flush=True)
                continue
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            host = {"hardware": hardware_line(), "runtime": runtime, "threads": threads}
            host |= {"wall-seconds": wall, "cpu-seconds": cpu}
            (run.folder / HOST_FILE).write_text(json.dumps(host, indent=1), encoding="utf-8")
            return f"{run.name}: completed in {wall:.0f} s"
        return failure


def run_spec(spec: Spec, *, jobs: int = 1, threads: int = 1) -> list[str]:
    """Run every run not finished; the lines saying what happened to each.

    Raises
    ------
    SpecError
        A run configuration the app refuses, or completed runs with other settings (conflict),
        before any run starts.
    """
    runs = spec.runs()  # validates every run's configuration
    conflicts = [r for r in runs if state(r) == "conflict"]
    if conflicts:
        listed = "; ".join(f"{r.folder}: {differences(r) or 'other rounds'}" for r in conflicts)
        raise spec.fail(
            f"completed runs with other settings (saved -> wanted): {listed}. Delete those "
            "folders to redo them, or pass --runs DIR to keep this sweep apart"
        )
    todo = [r for r in runs if state(r) != "finished"]
    print(f"[runner] {len(runs)} runs, {len(runs) - len(todo)} finished earlier", flush=True)
    started, lines = time.monotonic(), []
    with ExitStack() as stack:
        outcomes: Iterable[str] = (execute(r, spec.runtime, threads, spec.app_dir) for r in todo)
        if jobs > 1:  # each run in a fresh process of its own (memory, torch threads)
            pool = ProcessPoolExecutor(jobs, get_context("spawn"), max_tasks_per_child=1)
            stack.enter_context(pool)
            futures = [pool.submit(execute, r, spec.runtime, threads, spec.app_dir) for r in todo]
            outcomes = (future.result() for future in as_completed(futures))
        for done, line in enumerate(outcomes, 1):
            lines.append(line)
            minutes = (time.monotonic() - started) / 60
            left = f"~{minutes / done * (len(todo) - done):.1f} min left"
            print(f"[runner] {done}/{len(todo)} | {minutes:.1f} min, {left} | {line}", flush=True)
    return lines


def report(spec: Spec, destination: Path, command: str) -> list[Path]:
    """Write the spec's page and plot from its completed runs."""
    runs = spec.runs()
    found = [(run, read_run(run)) for run in runs]
    done: list[RunData] = [data for _, data in found if data is not None]
    missing = [run.name for run, data in found if data is None]
    if not done:
        raise spec.fail(f"no completed run in {spec.runs_dir}: run the spec first")
    return write_report(spec, done, missing, destination, command)


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = "ba-sweep",
    layout: Layout | None = None,
    typed: Callable[[list[str]], str] | None = None,
) -> int:
    """Console entry point ``ba-sweep``: run a spec, then write its report.

    ``layout`` (default: under ``--app``) places the runs and pages of specs that name none, and
    ``typed`` writes the page's command from the arguments (default: ``ba-sweep ARGS``): the
    repository's benchmarks (``python -m benchmarks.runner``) pass their own.
    """
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="a spec file (docs/benchmarks.md, 'The spec file')")
    parser.add_argument("--app", type=Path, help="the Flower app folder (default: here)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in a process")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--seeds", type=int, nargs="+", help="only these seeds")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="settings")
    parser.add_argument("--runs", type=Path, help="run folders here instead of the spec's")
    parser.add_argument("--report-only", action="store_true", help="run nothing, only report")
    parser.add_argument("--dry-run", action="store_true", help="list each run and its state")
    parser.add_argument("--publish", action="store_true", help="report to the spec's own page")
    args = parser.parse_args(argv)
    layout = layout or Layout(Path.cwd())
    if args.app is not None:
        layout = Layout(args.app.resolve(), layout.runs, layout.report)
    try:
        spec = load_spec(args.spec, runs_dir=args.runs, layout=layout)
        spec.settings.update(parse_overrides(args.set))
        spec.seeds = args.seeds or spec.seeds
        if args.dry_run:
            for run in spec.runs():
                print(f"{run.name}: {state(run)}")
            return 0
        lines = [] if args.report_only else run_spec(spec, jobs=args.jobs, threads=args.threads)
        spec_path, root = args.spec.resolve(), layout.root
        shown = spec_path.relative_to(root) if spec_path.is_relative_to(root) else spec_path
        given = sys.argv[1:] if argv is None else list(argv)
        arguments = [a for a in given if a != "--report-only"]
        arguments[arguments.index(str(args.spec))] = str(shown)
        beside = spec.runs_dir.parent / spec.report_path.name
        destination = spec.report_path if args.publish else beside
        page_command = typed(arguments) if typed else shlex.join([prog, *arguments])
        for path in report(spec, destination, page_command):
            print(f"wrote {path}")
    except SpecError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    failed = [line for line in lines if ": failed:" in line]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
