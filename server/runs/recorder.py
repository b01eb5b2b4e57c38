"""Where a run's results land: ``<output-dir>/<run-name>/``.

- ``metrics.jsonl``: one JSON line per round (round 0 is the initial model);
- ``metrics.csv``: the same rounds as a table, one column per key in the order first seen (a
  round's missing keys empty, lists as JSON text), for a spreadsheet or ``pandas.read_csv``; a
  key first logged mid-run rewrites it with the wider header, and a resumed run rewrites it from
  the rounds it keeps, its columns in the order they had;
- ``clients.jsonl``: one JSON line per train reply (:meth:`RunRecorder.log_clients`: node,
  partition, weight, train loss, update norm, trust, kept, clipped or dropped and why);
- ``checkpoint.pt``: everything needed to continue the run, rewritten after every round
  (:mod:`server.runs.checkpoint`);
- ``final_model.pt``: the global model after the last round (a torch state dict);
- ``summary.json``: status (``running``, ``completed``, ``completed-with-alarms`` (every round
  ran, and an alarm of :data:`ALARMS` fired in at least one), ``failed`` or ``interrupted``, with
  the reason), resolved configuration, final metrics, alarms, wall time (added up over the
  sessions of a resumed run), start and end times (UTC), the command line and what the run ran
  on (versions, git commit, host, CPU/GPU: :mod:`server.runs.provenance`), one entry per session;
- ``curves.png``: the run's test accuracy and loss per round, once it ran every round
  (:func:`server.runs.plots.plot_run`; skipped, with a note, without matplotlib);
- ``log.txt``: the console log of a run started with ``ba-run`` (:mod:`server.runtime.watch`);
- ``.owner.lock``: held (``flock``) by the process writing the run, for as long as it lives;
- ``.reserve``: :data:`RESERVE_BYTES` kept allocated while the run is written, released when a
  write meets a full disk so that the final summary still lands (:meth:`RunRecorder.write_summary`).

Every file is replaced atomically (temporary file, then rename), so a crash never leaves one torn;
a write that fails (``ENOSPC``: the disk is full) leaves no temporary file, and a round's line
that cannot be appended whole is cut off again, so ``metrics.jsonl`` never holds a torn line.
A run that fails on a full disk says so (``disk-full`` in ``summary.json``, naming ENOSPC, the
file, the folder and the bytes free, and how to resume).
The folder is created ``0700`` and every file ``0600``: the model, the metrics and the checkpoint
(the whole model and the run's state) are readable by the run's owner only.

**Who owns a run.** ``summary.json`` cannot say that its writer died: after ``kill -9`` (or the OOM
killer, or a lost machine) it keeps ``running``. So the writer holds an exclusive ``flock`` on
``.owner.lock`` from start to final status; the kernel drops it when the process ends, however it
ends. :func:`run_status` reads a ``running`` summary together with that lock: a lock that can be
taken means nobody is running the run, which is then reported ``interrupted`` (and
:func:`mark_interrupted` writes so into ``summary.json``). A second writer (a resume while the
run still runs) is refused by the same lock. The lock works across processes and containers that
share the folder on one machine (a volume, a bind mount); a copy of the folder (``docker cp``)
carries no lock, so ask where the run ran (``ba-run --status``, docs/reliability.md).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Protocol

import torch

from .checkpoint import atomic_torch_save, private_file
from .folder import (
    CLIENTS_FILE,
    FINAL_STATUSES,
    METRICS_CSV_FILE,
    METRICS_FILE,
    MODEL_FILE,
    OWNER_LOCK_FILE,
    SUMMARY_FILE,
    csv_columns,
    csv_rows,
    metrics_csv,
    read_csv_header,
    read_rounds,
    read_summary,
)
from .provenance import command_line, run_environment

try:  # POSIX; elsewhere runs are written unlocked and their status is taken as written
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

PRIVATE_DIR_MODE = 0o700
#: What a round's figures may raise, with the rule (see :func:`server.app.round_alarms`), and
#: ``backdoor-suspected`` (trigger unlearning's dormant-inputs check, raised from the run's
#: ``DORMANT_ALARM_ROUNDS``-th flagged round on:
#: :func:`strategies.defences.trigger_unlearning.backdoor_alarms`).
ALARMS = ("accuracy-at-chance", "loss-exploded", "never-above-chance", "backdoor-suspected")


#: Bytes kept allocated in a run folder (``.reserve``) until its final status: room for the
#: final summary (a few KB) when the disk fills up during the run.
RESERVE_BYTES = 1 << 16
RESERVE_FILE = ".reserve"
#: The errors of a full disk (or a full quota).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: Below this many free bytes, a run whose writer left no final word is said to have met a
#: full disk (``ba-run``, ``ba-run --status``).
LOW_SPACE_BYTES = 1 << 20


def disk_full_error(error: BaseException | None) -> OSError | None:
    """The ``ENOSPC`` / ``EDQUOT`` error in ``error``'s chain of causes, if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            with suppress(OSError):
                return shutil.disk_usage(candidate).free
            return None
    return None


def disk_full_message(directory: Path, error: OSError) -> str:
    """What a run that met a full disk tells its reader, and how to continue it."""
    where = f" writing {Path(error.filename).name}" if error.filename else ""
    free = free_bytes(directory)
    return (
        f"the disk is full ({errno.errorcode.get(error.errno or 0, 'ENOSPC')}){where} in "
        f"{directory} ({'?' if free is None else free} bytes free): free space there, then "
        f"continue the run with `ba-run --resume {directory}` (the last checkpoint is whole)"
    )


def low_space_note(directory: Path) -> str:
    """A sentence naming a full disk under ``directory``, or "" when there is room."""
    free = free_bytes(directory)
    if free is None or free >= LOW_SPACE_BYTES:
        return ""
    return (
        f" The disk holding {directory} has {free} bytes free: the run may have stopped on a "
        "full disk (ENOSPC); free space there before resuming it."
    )


class RunInUseError(RuntimeError):
    """Another live process is writing this run folder (it holds the owner lock)."""


class RunObserver(Protocol):
    """Told what the recorder records (an experiment tracker, :mod:`server.runs.tracking`)."""

    def on_round(self, entry: Mapping[str, Any]) -> None:
        """A round's line of ``metrics.jsonl``, just appended."""

    def on_end(self, directory: Path, status: str) -> None:
        """The run's final status, just written to ``summary.json`` in ``directory``."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _try_lock(path: Path) -> IO[bytes] | None:
    """The owner lock of a run folder, taken (the open file holds it), or None when held."""
    stream = private_file(path, "ab")  # created 0600; never truncated, never written
    if fcntl is None:  # pragma: no cover - no flock: every caller is taken as the owner
        return stream
    try:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        stream.close()
        return None
    return stream


def _make_private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    # A resumed run's folder may predate private folders; one of another owner stays as it is.
    with suppress(PermissionError):
        directory.chmod(PRIVATE_DIR_MODE)


class RunRecorder:
    """Writes one run's metrics, checkpoints and summary, as the run's single owner."""

    def __init__(
        self,
        output_dir: str | Path,
        run_name: str,
        config: Mapping[str, Any],
        resume_round: int | None = None,
    ) -> None:
        """Start a run folder, or, with ``resume_round``, continue one after that round.

        A resumed run keeps the metrics of rounds up to ``resume_round`` and forgets later ones
        (rounds the crashed run began, or finished without checkpointing, are run again).

        Raises
        ------
        RunInUseError
            A live process still writes this folder (it holds the owner lock): two writers
            would interleave their rounds. Nothing has been written then.
        """
        self.directory = Path(output_dir).expanduser().resolve() / run_name
        _make_private_dir(self.directory)
        self._lock: IO[bytes] | None = _acquire_owner_lock(self.directory)
        self._reserve = _reserve_space(self.directory)
        #: Set when the run met a full disk: summary.json's ``disk-full``.
        self.disk_full: str | None = None
        self.metrics_path = self.directory / METRICS_FILE
        self.config = dict(config)
        self.started = time.time()
        self.rounds: list[dict[str, Any]] = []
        self.resumed_from = resume_round
        self.provenance = RunProvenance.start(
            read_summary(self.directory) if resume_round is not None else {}
        )
        if resume_round is not None and self.metrics_path.is_file():
            rounds = read_rounds(self.metrics_path)
            self.rounds = [entry for entry in rounds if entry.get("round", 0) <= resume_round]
        self.alarm_details: dict[str, str] = {}
        #: The final status once written (:data:`FINAL_STATUSES`); the recorder writes nothing
        #: after it, so a process stopped meanwhile cannot overwrite a resumed run's folder.
        self.final_status: str | None = None
        self.final_error: str | None = None
        _atomic_write_text(
            self.metrics_path,
            "".join(json.dumps(entry, sort_keys=True) + "\n" for entry in self.rounds),
        )
        self.csv_path = self.directory / METRICS_CSV_FILE
        # A resumed run's table keeps its columns' order (the JSON lines hold keys sorted, not
        # in the order the run first logged them); columns no kept round has are dropped.
        kept = csv_columns(self.rounds)
        earlier = read_csv_header(self.csv_path) if resume_round is not None else []
        #: ``metrics.csv``'s header: every key of the rounds so far, in the order first seen.
        self.csv_columns = csv_columns(self.rounds, [key for key in earlier if key in kept])
        self._write_csv()
        self.clients_path = self.directory / CLIENTS_FILE
        _keep_rounds(self.clients_path, resume_round)
        #: Told of every round and of the final status (:class:`RunObserver`).
        self.observers: list[RunObserver] = []
        #: Where the run's experiment tracker writes (its name and place, as the tracker says),
        #: for ``summary.json`` and ba-run's closing lines: an MLflow store sits outside the
        #: run folder, so listing the folder alone would not name it.
        self.tracker: dict[str, str] | None = None
        self.write_summary("running")

    def log_round(self, entry: Mapping[str, Any], alarms: Mapping[str, str] | None = None) -> None:
        """Append one round's metrics as a JSON line.

        ``alarms`` (kind -> message) are recorded as ``alarm-<kind> = 1`` in the round's line and
        summed up in ``summary.json``.
        """
        if self.final_status is not None:
            return
        record = _jsonable({**entry, **{f"alarm-{kind}": 1 for kind in alarms or {}}})
        _append_whole(self.metrics_path, (json.dumps(record, sort_keys=True) + "\n").encode())
        self.alarm_details.update(alarms or {})
        self.rounds.append(record)
        columns = csv_columns([record], self.csv_columns)
        if columns == self.csv_columns:
            _append_whole(self.csv_path, csv_rows([record], columns).encode())
        else:  # a new key: the header must name it, so the table is written again, wider
            self.csv_columns = columns
            self._write_csv()
        self.write_summary("running")  # the summary's final metrics and alarms follow the rounds
        for observer in self.observers:
            observer.on_round(record)

    def _write_csv(self) -> None:
        """Replace ``metrics.csv`` with every round so far under :attr:`csv_columns` (empty
        before the first round)."""
        text = metrics_csv(self.rounds, self.csv_columns) if self.csv_columns else ""
        _atomic_write_text(self.csv_path, text)

    def log_clients(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append one JSON line per train reply of a round to ``clients.jsonl``."""
        if self.final_status is not None or not records:
            return
        lines = "".join(json.dumps(_jsonable(r), sort_keys=True) + "\n" for r in records)
        _append_whole(self.clients_path, lines.encode())

    def save_model(self, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """Save the final global model (a torch state dict) as ``final_model.pt``."""
        if self.final_status is not None:
            raise RuntimeError(f"run {self.directory} already ended {self.final_status}")
        state = {key: value.detach().cpu() for key, value in state_dict.items()}
        return atomic_torch_save(state, self.directory / MODEL_FILE)

    def alarm_summary(self) -> dict[str, dict[str, Any]]:
        """Per alarm kind: the rounds that raised it (count, first, last) and its last message."""
        summary: dict[str, dict[str, Any]] = {}
        for kind in ALARMS:
            rounds = [int(r.get("round", 0)) for r in self.rounds if r.get(f"alarm-{kind}")]
            if rounds:
                summary[kind] = {
                    "rounds": len(rounds),
                    "first-round": rounds[0],
                    "last-round": rounds[-1],
                    "last-round-alarmed": rounds[-1] == int(self.rounds[-1].get("round", 0)),
                    "message": self.alarm_details.get(kind, ""),
                }
        return summary

    def failure(self, error: BaseException) -> str:
        """The ``error`` text of a run that failed with ``error``; on a full disk it names
        ENOSPC, the folder and the bytes free (and sets :attr:`disk_full`)."""
        text = f"{type(error).__name__}: {error}"
        full = disk_full_error(error)
        if full is None:
            return text
        self.disk_full = disk_full_message(self.directory, full)
        return f"{self.disk_full} ({text})"

    def write_summary(self, status: str, error: str | None = None) -> Path:
        """Write ``summary.json``; a final status (:data:`FINAL_STATUSES`) gives up ownership.

        Once a final status is written, later calls write nothing (the first final word holds:
        e.g. Flower's exit handler wrote ``interrupted`` before the run's SystemExit arrived). A
        final summary that meets a full disk releases the run's reserve and is written again.
        """
        path = self.directory / SUMMARY_FILE
        if self.final_status is not None:
            return path
        summary: dict[str, Any] = {
            "status": status,
            "config": self.config,
            **self.provenance.fields(time.time() - self.started, final=status in FINAL_STATUSES),
            "rounds-completed": max((r.get("round", 0) for r in self.rounds), default=0),
            "final": self.rounds[-1] if self.rounds else None,
            "updated-at": _now(),
            "owner": {"host": socket.gethostname(), "pid": os.getpid()},
        }
        alarms = self.alarm_summary()
        if alarms:
            summary["alarms"] = alarms
        if self.tracker is not None:
            summary["tracker"] = self.tracker
        if self.resumed_from is not None:
            summary["resumed-from-round"] = self.resumed_from
        if error is not None:
            summary["error"] = error
        if self.disk_full is not None:
            summary["disk-full"] = self.disk_full
        text = json.dumps(_jsonable(summary), indent=2, sort_keys=True)
        try:
            _atomic_write_text(path, text)
        except OSError as failure:
            final = status in FINAL_STATUSES and disk_full_error(failure) is not None
            if not (final and self._release_reserve()):
                raise
            _atomic_write_text(path, text)
        if status in FINAL_STATUSES:
            self.final_status, self.final_error = status, error
            self.close()
            for observer in self.observers:
                observer.on_end(self.directory, status)
        return path

    def _release_reserve(self) -> bool:
        """Free the run's reserved bytes for its final word; False when there were none."""
        if self._reserve is None:
            return False
        self._reserve = None
        return release_reserve(self.directory)

    def close(self) -> None:
        """Give up the owner lock and the reserve (a final summary does; idempotent)."""
        if self._reserve is not None:
            self._reserve = None
            release_reserve(self.directory)
        if self._lock is not None:
            self._lock.close()
            self._lock = None


@dataclass
class RunProvenance:
    """What ``summary.json`` keeps of where and when a run ran, over all its sessions (a resumed
    run is one more session: ``wall-seconds`` adds up, ``started-at`` stays the first)."""

    started_at: str
    #: The earlier sessions' records (a resumed run), then this one's is added.
    earlier: list[dict[str, Any]]
    earlier_wall: float
    session: dict[str, Any]

    @classmethod
    def start(cls, previous: Mapping[str, Any]) -> RunProvenance:
        """This session's record; ``previous``: the summary of the run it resumes ({} if none)."""
        now = _now()
        earlier = [dict(entry) for entry in previous.get("sessions") or []]
        if previous and not earlier:  # a run written before sessions were recorded
            earlier = [{"wall-seconds": previous.get("wall-seconds", 0.0)}]
        environment = run_environment()
        return cls(
            started_at=str(previous.get("started-at") or now),
            earlier=earlier,
            earlier_wall=float(previous.get("wall-seconds") or 0.0),
            session={
                "started-at": now,
                "command-line": command_line(),
                "host": environment["host"],
                "environment": environment,
            },
        )

    def fields(self, seconds: float, *, final: bool) -> dict[str, Any]:
        """The summary's entries after ``seconds`` of this session (``final``: it ends now)."""
        session = {**self.session, "wall-seconds": round(seconds, 3)}
        if final:
            session["ended-at"] = _now()
        entries = {
            "wall-seconds": round(self.earlier_wall + seconds, 3),
            "started-at": self.started_at,
            "command-line": session["command-line"],
            "environment": session["environment"],
            "sessions": [
                *self.earlier,
                {k: v for k, v in session.items() if k != "environment"},
            ],
        }
        if final:
            entries["ended-at"] = session["ended-at"]
        return entries


def _reserve_space(directory: Path) -> Path | None:
    """Allocate ``RESERVE_BYTES`` in ``directory/.reserve``; None where it cannot be allocated
    (a file system without ``posix_fallocate``, or one already full: then the run's first write
    meets the full disk and says so)."""
    path = directory / RESERVE_FILE
    try:
        with private_file(path, "wb") as stream:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(stream.fileno(), 0, RESERVE_BYTES)
            else:  # pragma: no cover - not POSIX
                stream.write(bytes(RESERVE_BYTES))
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return path


def release_reserve(directory: Path) -> bool:
    """Delete ``directory/.reserve``; True when there was one to free."""
    path = directory / RESERVE_FILE
    existed = path.is_file()
    path.unlink(missing_ok=True)
    return existed


def _append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path``, or nothing: a write that fails part-way (a full disk) is cut
    off again (truncating needs no space), so a reader never finds a torn line."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with private_file(path, "ab") as stream:
            stream.write(data)
    except OSError:
        with suppress(OSError):
            os.truncate(path, size)
        raise


def _keep_rounds(path: Path, last_round: int | None) -> None:
    """A new run's ``path`` (a JSON-lines file of rounds) emptied; a resumed run's cut back to
    the lines of rounds up to ``last_round``."""
    kept = read_rounds(path) if last_round is not None and path.is_file() else []
    if kept or path.exists():
        text = "".join(
            json.dumps(entry, sort_keys=True) + "\n"
            for entry in kept
            if int(entry.get("round", 0)) <= (last_round or 0)
        )
        _atomic_write_text(path, text)


def _acquire_owner_lock(directory: Path, attempts: int = 20) -> IO[bytes]:
    # A reader (run_status) holds the lock for an instant while it checks a folder: retry for a
    # second before concluding that a live writer holds it.
    for _ in range(attempts):
        lock = _try_lock(directory / OWNER_LOCK_FILE)
        if lock is not None:
            return lock
        time.sleep(0.05)
    owner = read_summary(directory).get("owner") or {}
    raise RunInUseError(
        f"run folder {directory} is in use: a live process (pid {owner.get('pid', '?')} on "
        f"{owner.get('host', '?')}, from its summary) is still writing it. Stop that run first "
        "(or wait for it), or choose another run-name"
    )


@dataclass(frozen=True)
class RunStatus:
    """What a run folder says, checked against its owner lock (see the module docstring)."""

    #: ``completed``, ``completed-with-alarms``, ``failed``, ``interrupted``, ``running`` (its
    #: writer is alive), ``missing`` (no summary) or ``unknown`` (``running`` without an owner
    #: lock to check: an older run).
    status: str
    reason: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


def run_status(run_dir: Path) -> RunStatus:
    """The status of a run folder, with ``running`` only while its writer is alive."""
    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    if not summary:
        return RunStatus("missing", f"no readable {SUMMARY_FILE} in {run_dir}")
    status = str(summary.get("status", "unknown"))
    if status != "running":
        return RunStatus(status, str(summary.get("error", "")), summary)
    lock_path = run_dir / OWNER_LOCK_FILE
    if not lock_path.is_file() or fcntl is None:
        return RunStatus(
            "unknown",
            "the summary says running, but the folder has no owner lock to check (written by "
            "an older version, or copied): whether its process lives cannot be told from here",
            summary,
        )
    lock = _try_lock(lock_path)
    if lock is None:
        return RunStatus("running", "", summary)
    lock.close()
    return RunStatus("interrupted", interruption_reason(summary, run_dir), summary)


def interruption_reason(summary: Mapping[str, Any], directory: Path) -> str:
    """Why a run whose writer is gone is ``interrupted``, and how to continue it."""
    owner = summary.get("owner") or {}
    return (
        f"the process that ran it (pid {owner.get('pid', '?')} on {owner.get('host', '?')}) "
        f"ended without a final status after round {summary.get('rounds-completed', '?')} "
        f"(last update {summary.get('updated-at', '?')}): killed (kill -9, the OOM killer), or "
        "its machine or container stopped. Continue it with `ba-run --resume <run folder>` or "
        'run-config resume-from = "<run folder>".' + low_space_note(directory)
    )


def mark_interrupted(run_dir: Path) -> RunStatus:
    """Write ``interrupted`` into the summary of a run whose writer is gone; return its status.

    Holds the owner lock while it rewrites, so a run resumed meanwhile is never overwritten.
    """
    run_dir = Path(run_dir)
    lock_path = run_dir / OWNER_LOCK_FILE
    if not lock_path.is_file() or fcntl is None:
        return run_status(run_dir)
    lock = _try_lock(lock_path)
    if lock is None:
        return run_status(run_dir)
    try:
        summary = read_summary(run_dir)
        if summary.get("status") != "running":
            return RunStatus(str(summary.get("status", "missing")), "", summary)
        reason = interruption_reason(summary, run_dir)
        summary.update({"status": "interrupted", "error": reason, "updated-at": _now()})
        text = json.dumps(summary, indent=2, sort_keys=True)
        try:
            _atomic_write_text(run_dir / SUMMARY_FILE, text)
        except OSError as failure:  # a full disk: the run's reserve makes room for this word
            if disk_full_error(failure) is None or not release_reserve(run_dir):
                return RunStatus(
                    "interrupted", f"{reason} ({SUMMARY_FILE} not rewritten: {failure})", summary
                )
            _atomic_write_text(run_dir / SUMMARY_FILE, text)
        return RunStatus("interrupted", reason, summary)
    finally:
        lock.close()


def _atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with private_file(temporary, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    finally:  # a failed write (a full disk) leaves no temporary file behind
        temporary.unlink(missing_ok=True)
