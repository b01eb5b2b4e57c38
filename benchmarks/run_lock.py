"""One process per run: a lock beside each run's result, so several processes can share a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import IO


def claim_run(lock_path: Path) -> IO[bytes] | None:
    """An exclusive lock on one run, or None while another process holds it.

    Two processes running the same run write into one run folder and interleave their
    ``metrics.jsonl`` lines (or race to write one result); the lock makes the second one leave the
    run to the first, so that several processes started on one sweep share its runs. The
    operating system releases it when the holder exits, crashed or not.

    Parameters
    ----------
    lock_path : Path
        The run's lock file (created with its folder if missing).

    Returns
    -------
    IO[bytes] or None
        The open lock file: close it (or leave the ``with`` block) to release the run.
    """
    import fcntl  # POSIX; the benchmarks run where the app's deployment does

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    stream = lock_path.open("wb")
    try:
        fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        stream.close()
        return None
    return stream
