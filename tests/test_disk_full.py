"""A full disk under the run folder: the run says so (ENOSPC) and continues once there is room.

The run fails with a summary that names ENOSPC, the file, the folder and the bytes free
(``disk-full``), never stays ``running``, leaves no temporary file, and ``metrics.jsonl`` holds
whole lines only, none beyond the checkpoint's round but the one the checkpoint could not follow
(which ``--resume`` reconciles); ``ba-run`` and ``ba-run --status`` name ENOSPC; ``ba-run
--resume`` finishes the run once there is room.

Two disks: a fault-injected one (every file the recorder and the checkpoint write goes through
``server.runs.checkpoint.private_file``, here wrapped so that writes past a byte budget write what
fits and then raise ``OSError(ENOSPC)``), with 0 bytes and a few KB left at a chosen point of a
round; and a real small file system (a tmpfs mounted for the test, which needs root: skipped
with the reason where mounting is not allowed).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from beyond_averaging.server import app as server_app
from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runs import checkpoint, recorder
from beyond_averaging.server.runs.checkpoint import RunCheckpoint
from beyond_averaging.server.runs.folder import CHECKPOINT_FILE
from tests.deploy_helpers import REPO, read_metrics
from tests.test_run_outcomes import LEAN as LEAN_RUN

LEAN = {**LEAN_RUN, "num-server-rounds": 3}


class Disk:
    """A disk with ``left`` bytes free (None: unlimited) for every file the run writes."""

    def __init__(self) -> None:
        self.left: int | None = None

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` bytes fit; uses them up."""
        if self.left is None:
            return wanted
        fits = min(wanted, self.left)
        self.left -= fits
        return fits


class BudgetedStream:
    """A file stream that writes what fits on ``disk``, then raises ENOSPC (a partial write)."""

    def __init__(self, stream: IO[Any], disk: Disk, path: Path) -> None:
        self.stream, self.disk, self.path = stream, disk, path

    def write(self, data: Any) -> int:
        size = len(data.encode() if isinstance(data, str) else data)
        fits = self.disk.take(size)
        if fits < size:
            self.stream.write(data[:fits])
            self.stream.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return int(self.stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def __enter__(self) -> BudgetedStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stream.close()


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    """The fault-injected disk under every file a run writes; freeing the run's reserve frees
    its bytes."""
    fake = Disk()
    honest_open = checkpoint.private_file

    def private_file(path: Path, mode: str) -> Any:
        return BudgetedStream(honest_open(path, mode), fake, path)

    honest_release = recorder.release_reserve

    def release_reserve(directory: Path) -> bool:
        released = honest_release(directory)
        if released and fake.left is not None:
            fake.left += recorder.RESERVE_BYTES
        return released

    monkeypatch.setattr(checkpoint, "private_file", private_file)
    monkeypatch.setattr(recorder, "private_file", private_file)
    monkeypatch.setattr(recorder, "release_reserve", release_reserve)
    return fake


def fill_disk_at(
    monkeypatch: pytest.MonkeyPatch, disk: Disk, server_round: int, before: bool, left: int
) -> None:
    """Leave ``left`` bytes free just before (or after) the server's evaluation of a round: its
    metrics line and summary (before), or its checkpoint (after) meet the full disk."""
    honest: Callable[..., Any] = server_app.CentralEvaluation.__call__
    filled: list[bool] = []  # once: the resumed run finds room

    def evaluation(self: Any, current: int, *args: Any, **kwargs: Any) -> Any:
        fill = current == server_round and not filled
        if fill:
            filled.append(True)
        if fill and before:
            disk.left = left
        result = honest(self, current, *args, **kwargs)
        if fill and not before:
            disk.left = left
        return result

    monkeypatch.setattr(server_app.CentralEvaluation, "__call__", evaluation)


def ba_run_inprocess(settings: dict[str, Any]) -> int:
    return ba_run(
        ["--app", str(REPO), "--runtime", "inprocess", "-c", run_config_argument(settings)]
    )


def assert_failed_on_a_full_disk(run_dir: Path) -> dict[str, Any]:
    """The run's summary says failed, names ENOSPC, and the folder holds no torn file."""
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"  # never left running
    assert "ENOSPC" in summary["error"]
    assert "ENOSPC" in summary["disk-full"]
    assert str(run_dir) in summary["disk-full"]
    assert "bytes free" in summary["disk-full"]
    assert "--resume" in summary["disk-full"]
    assert not [path.name for path in run_dir.iterdir() if path.name.endswith(".tmp")]
    rounds = [entry["round"] for entry in read_metrics(run_dir)]  # every line parses
    saved = RunCheckpoint.load(run_dir, summary["config"]).round
    # Whole lines only; at most the one round the checkpoint could not follow (resume forgets it).
    assert rounds == list(range(len(rounds)))
    assert saved in (rounds[-1], rounds[-1] - 1)
    return summary


@pytest.mark.parametrize(
    ("server_round", "before", "left"),
    [
        (2, False, 0),  # 0 bytes left when round 2's checkpoint is written
        (2, False, 4096),  # a few KB: the checkpoint is written part-way
        (2, True, 300),  # a few hundred bytes: round 2's metrics line is written part-way
    ],
    ids=["checkpoint-0-bytes", "checkpoint-4kb", "metrics-line-300-bytes"],
)
def test_a_full_disk_fails_the_run_naming_enospc_and_resume_finishes_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    disk: Disk,
    server_round: int,
    before: bool,
    left: int,
) -> None:
    fill_disk_at(monkeypatch, disk, server_round, before, left)
    settings = {**LEAN, "run-name": "full", "output-dir": str(tmp_path)}
    assert ba_run_inprocess(settings) == 1
    assert "ENOSPC" in capsys.readouterr().err  # ba-run's message
    run_dir = tmp_path / "full"
    summary = assert_failed_on_a_full_disk(run_dir)
    assert summary["rounds-completed"] == (server_round - 1 if before else server_round)
    assert ba_run(["--status", str(run_dir)]) == 1
    assert "ENOSPC" in capsys.readouterr().out
    disk.left = None  # space freed
    assert ba_run(["--resume", str(run_dir), "--runtime", "inprocess"]) == 0
    rounds = [entry["round"] for entry in read_metrics(run_dir)]
    assert rounds == [0, 1, 2, 3]
    resumed = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert resumed["status"] == "completed"
    assert (run_dir / CHECKPOINT_FILE).is_file()
    assert not (run_dir / recorder.RESERVE_FILE).exists()


def test_a_summary_write_on_a_full_disk_leaves_no_temporary_file(
    tmp_path: Path, disk: Disk
) -> None:
    writer = recorder.RunRecorder(tmp_path, "run", {"seed": 0})
    disk.left = 100  # a running summary no longer fits
    with pytest.raises(OSError, match="No space left") as raised:
        writer.write_summary("running")
    assert raised.value.errno == errno.ENOSPC
    assert not list((tmp_path / "run").glob(".*.tmp"))
    # The final word still lands: the reserve is released for it.
    writer.write_summary("failed", error=writer.failure(raised.value))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert "ENOSPC" in summary["disk-full"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 400 KiB tmpfs: room for the run's reserve, summary, metrics and one checkpoint of the
    digits mlp (about 230 KB), not for the next checkpoint beside it."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=400k,mode=0700", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as error:
        pytest.skip(f"cannot mount a small file system here: {error}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here (needs root): {mounted.stderr}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_real_full_file_system_fails_the_run_naming_enospc_and_resume_finishes_it(
    small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = {**LEAN, "run-name": "full", "output-dir": str(small_disk)}
    assert ba_run_inprocess(settings) == 1
    assert "ENOSPC" in capsys.readouterr().err
    run_dir = small_disk / "full"
    assert_failed_on_a_full_disk(run_dir)
    assert ba_run(["--status", str(run_dir)]) == 1
    assert "ENOSPC" in capsys.readouterr().out
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    assert ba_run(["--resume", str(run_dir), "--runtime", "inprocess"]) == 0
    assert [entry["round"] for entry in read_metrics(run_dir)] == [0, 1, 2, 3]
