"""``ba-run``'s console: the run's log lines, a live progress bar on a terminal, and ``log.txt``.

:class:`RunConsole` is given every line the run prints (``flwr run --stream``'s output in the
simulation runtime, Flower's log records in process) and ``ba-run``'s own messages, and

- on a terminal (rich's detection: a TTY, or ``FORCE_COLOR`` / ``TTY_COMPATIBLE=1``) prints them
  above a progress bar: rounds done of the run's total, the time left (:func:`eta_seconds`),
  and the last round's test accuracy, test loss and replies kept (valid of sent), read from the
  run's ``metrics.jsonl`` as the ServerApp appends it. A child process's Python warning (Ray's
  ``FutureWarning`` in round 1) becomes one log line above the bar (:func:`warning_line`), and
  :meth:`RunConsole.finish` leaves the bar's final state above the run's closing lines;
- elsewhere (a pipe, a file, a batch scheduler's log) prints plain lines, ANSI colour codes
  removed;
- and appends every line, without colour codes, to ``<run folder>/log.txt`` (``0600``; a resumed
  run's log goes on below a line that says so). A log that cannot be written (a full disk) stops
  being written, and the run goes on.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TextIO

from beyond_averaging.server.runs.checkpoint import private_file
from beyond_averaging.server.runs.folder import LOG_FILE, METRICS_FILE, read_metrics

from .processes import ANSI_CODES

#: Seconds between two checks of the run's metrics (a ``stat``; read only when they grew). The
#: ServerApp logs a round's line just before it appends the round to ``metrics.jsonl``, so the
#: bar catches up with the log one poll later: at 0.5 s it lagged a round behind at times.
POLL_SECONDS = 0.1
#: A line as Python's ``warnings`` module prints it: ``<file>:<line>: <Category>: <message>``;
#: the line after it echoes the source line that warned, indented.
WARNING_LINE = re.compile(
    r"^(?P<where>\S.*?):(?P<line>\d+): (?P<kind>\w*Warning): (?P<message>.*)$"
)


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colours, cursor moves, hyperlinks)."""
    return ANSI_CODES.sub("", text)


def seconds_text(seconds: float) -> str:
    """``1:02:03`` / ``2:03`` for a duration."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def eta_seconds(
    rounds: Sequence[Mapping[str, Any]], total: int, first_round: int = 1
) -> float | None:
    """Seconds until round ``total``: the mean ``round-seconds`` of the rounds after
    ``first_round`` times the rounds left; None until one such round has ended.

    ``first_round`` (the launch's first round: 1, or the round after a resume's checkpoint) is
    left out because it carries the launch's warm-up (Ray's start and its workers' imports in the
    simulation): in a 5-round run it made the estimate 0:28 at round 4 of a run that ended 3 s
    later.
    """
    timed = [
        float(r["round-seconds"])
        for r in rounds
        if r.get("round", 0) > first_round and isinstance(r.get("round-seconds"), int | float)
    ]
    if not timed:
        return None
    done = int(rounds[-1].get("round", 0))
    return max(0, total - done) * sum(timed) / len(timed)


def warning_line(text: str) -> str | None:
    """A Python warning's first line (``ray/_private/worker.py:2053: FutureWarning: Tip: ...``)
    as one log line, ``WARNING :   FutureWarning: Tip: ... (worker.py:2053)``, in Flower's
    form; None for any other line."""
    match = WARNING_LINE.match(text)
    if match is None:
        return None
    where = f"{Path(match['where']).name}:{match['line']}"
    return f"WARNING :   {match['kind']}: {match['message']} ({where})"


def round_figures(entry: Mapping[str, Any]) -> str:
    """The progress bar's figures of a round: test accuracy and loss, replies kept of sent."""
    parts = []
    for key, label in (("test-accuracy", "acc"), ("test-loss", "loss")):
        value = entry.get(key)
        if isinstance(value, int | float):
            parts.append(f"{label} {value:.4f}")
    valid, sent = entry.get("replies-valid"), entry.get("replies-sent")
    if valid is not None and sent is not None:
        parts.append(f"replies kept {valid}/{sent}")
    return " | ".join(parts)


class RunConsole:
    """The console of one launch (see the module docstring); use as a context manager.

    Parameters
    ----------
    run_dir : Path
        The run's folder (made ``0700`` if missing): ``log.txt`` goes there and the progress is
        read from its ``metrics.jsonl``.
    total_rounds : int
        ``num-server-rounds``.
    stream : TextIO, optional
        Where lines go (default: ``sys.stdout`` when entered).
    terminal : bool, optional
        Force the live display on or off (default: rich's detection on ``stream``).
    resumed : bool
        The run continues from a checkpoint: ``log.txt`` is appended to, below a marker line.
    """

    def __init__(
        self,
        run_dir: Path,
        total_rounds: int,
        *,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        resumed: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.total_rounds = total_rounds
        self.stream = stream
        self.terminal = terminal
        self.resumed = resumed
        self.log_path = self.run_dir / LOG_FILE
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._metrics_size = -1
        self._after_warning = False
        self._first_round = 1

    # --- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> RunConsole:
        from rich.console import Console

        stream = self.stream or sys.stdout
        self.console = Console(
            file=stream, highlight=False, markup=False, emoji=False, soft_wrap=True
        )
        if self.terminal is None:
            self.terminal = self.console.is_terminal and self.console.is_interactive
        self._open_log()
        if self.resumed:  # the launch's own first round carries its warm-up
            with suppress(Exception):
                done = read_metrics(self.run_dir)
                self._first_round = int(done[-1].get("round", 0)) + 1 if done else 1
        if self.terminal:
            self._start_progress()
        self._poller = threading.Thread(target=self._poll, name="ba-run-progress", daemon=True)
        self._poller.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()
        self.close_log()

    def finish(self) -> None:
        """Stop reading the metrics and leave the bar in its final state (idempotent): called
        before the run's closing lines, so that they print below the bar, not above it."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5.0)
            self._poller = None
        self._metrics_size = -1  # read once more: the last round may be newer than the last poll
        with suppress(Exception):
            self.refresh()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _open_log(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._log = private_file(self.log_path, "ab")
        except OSError as error:
            self._log = None
            print(f"ba-run: note: no {self.log_path} ({error})", file=sys.stderr)
            return
        if self.resumed and self.log_path.stat().st_size:
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            self._write_log(f"---- resumed at {stamp} ----")

    def close_log(self) -> None:
        """Close ``log.txt`` (idempotent)."""
        with self._lock:
            if self._log is not None:
                with suppress(OSError):
                    self._log.close()
                self._log = None

    def _write_log(self, text: str) -> None:
        if self._log is None:
            return
        try:
            self._log.write((text + "\n").encode("utf-8"))
            self._log.flush()
        except OSError:  # a full disk: the run matters more than its log
            with suppress(OSError):
                self._log.close()
            self._log = None

    # --- output ----------------------------------------------------------------------------
    def line(self, text: str, *, error: bool = False) -> None:
        """Print one line of the run (colour codes kept on a terminal only) and log it.

        ``error``: a line of ``ba-run``'s own for standard error (printed there, plain).
        """
        text = text.rstrip("\r\n")
        # A carriage return (a child's progress meter) redraws its line on a terminal: only the
        # last part shows, and printed whole it would move the cursor under the live bar.
        text = text.rsplit("\r", 1)[-1]
        plain = strip_ansi(text)
        with self._lock:
            if not error:
                if self._after_warning and plain[:1].isspace():
                    # The warned source line (`  warnings.warn(`) that Python prints under a
                    # warning: the third party's code, not the run's news.
                    self._after_warning = False
                    return
                condensed = warning_line(plain)
                self._after_warning = condensed is not None
                if condensed is not None:
                    text = plain = condensed
            self._write_log(plain)
            try:
                if error:
                    self._print_error(plain)
                elif self.terminal:
                    from rich.text import Text

                    self.console.print(Text.from_ansi(text), soft_wrap=True)
                else:
                    stream = self.console.file
                    stream.write(plain + "\n")
                    stream.flush()
            except OSError:  # a closed pipe (`ba-run | head`): the run and its log go on
                pass
        with suppress(Exception):  # a round's line: show its figures now (the display only)
            self.refresh()

    def _print_error(self, plain: str) -> None:
        if self._progress is not None:
            self._progress.console.print(plain, soft_wrap=True, style="bold red")
            return
        print(plain, file=sys.stderr, flush=True)

    def lines(self, stream: IO[bytes]) -> None:
        """Relay every line of a subprocess's output until it closes."""
        for raw in iter(stream.readline, b""):
            self.line(raw.decode("utf-8", errors="replace"))

    # --- progress ---------------------------------------------------------------------------
    def _start_progress(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rounds | ETA {task.fields[eta]} | {task.fields[figures]}"),
            console=self.console,
            transient=False,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self._task = self._progress.add_task(
            self.run_dir.name,
            total=self.total_rounds or None,  # unknown: a pulsing bar
            eta="-:--",
            figures="waiting for round 0",
        )
        self._progress.start()

    def refresh(self) -> None:
        """Read the run's metrics again and update the bar (nothing when they did not change)."""
        path = self.run_dir / METRICS_FILE
        try:
            size = path.stat().st_size
        except OSError:
            return
        if size == self._metrics_size or self._progress is None:
            return
        self._metrics_size = size
        try:
            rounds = read_metrics(self.run_dir)
        except (OSError, FileNotFoundError):
            return
        if not rounds:
            return
        eta = eta_seconds(rounds, self.total_rounds, self._first_round)
        self._progress.update(
            self._task,
            completed=int(rounds[-1].get("round", 0)),
            eta="-:--" if eta is None else seconds_text(eta),
            figures=round_figures(rounds[-1]),
        )

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            with suppress(Exception):  # the display must never stop the run
                self.refresh()


class _FlowerRecords(logging.Handler):
    """Flower's log records, formatted as Flower's console formats them, into a RunConsole."""

    def __init__(self, console: RunConsole, formatter: logging.Handler | None) -> None:
        super().__init__(logging.INFO if formatter is None else formatter.level)
        self.console = console
        self.formatter_handler = formatter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = (
                self.formatter_handler.format(record)
                if self.formatter_handler is not None
                else self.format(record)
            )
            self.console.line(text)
        except Exception:  # as logging.Handler: a record that cannot be shown is not fatal
            self.handleError(record)


@contextmanager
def flower_logs_to(console: RunConsole) -> Iterator[None]:
    """Send the ``flwr`` logger's console output through ``console`` while inside (the
    in-process runtime); Flower's own console handler is restored afterwards. Off a terminal,
    its colour codes are left out."""
    from flwr.supercore.logger import FLOWER_LOGGER, ConsoleHandler

    originals = [h for h in FLOWER_LOGGER.handlers if isinstance(h, ConsoleHandler)]
    template = None
    if originals:
        template = ConsoleHandler(
            timestamps=originals[0].timestamps,
            json=originals[0].json,
            colored=bool(console.terminal),
        )
        template.setLevel(originals[0].level)
    handler = _FlowerRecords(console, template)
    for original in originals:
        FLOWER_LOGGER.removeHandler(original)
    FLOWER_LOGGER.addHandler(handler)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeHandler(handler)
        for original in originals:
            FLOWER_LOGGER.addHandler(original)
