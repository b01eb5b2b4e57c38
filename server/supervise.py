"""``ba-supernode``: a Flower SuperNode that comes back, as a container's restart policy would.

A SuperNode process ends in two ordinary events of a deployment, and nothing starts it again
when it runs as a plain local process:

- **the SuperLink restarted with its state in memory** (the default of ``flower-superlink``):
  the new SuperLink does not know the node and answers ``Invalid node ID`` (flwr 1.39, gRPC
  Fleet API) or ``401 Unauthorized`` (1.40 and later, HTTP Fleet API). Flower 1.39's SuperNode
  then shuts itself down with exit status 0 ("SuperNode terminated gracefully"), or, when its
  heartbeat thread hit the error first, logs a traceback and stays alive without a connection,
  retrying forever ("Connection attempt failed"): of 3 SuperNodes here, 2 exited 10-20 s after
  the restart and one hung; none came back. Flower 1.42's SuperNodes exited (2 of 2);
- **the SuperNode process itself died** (``kill -9``, the OOM killer).

In containers, compose.yaml's ``restart: unless-stopped`` starts the process again and it
registers anew (a new node id; the partition is the node's ``--node-config``, so the federation
is the same). ``ba-supernode`` is that policy for a local process: it runs ``flower-supernode``
with the given arguments and starts it again whenever it ends, whatever its exit status, until
``ba-supernode`` itself is told to stop (SIGTERM or SIGINT, passed on to the SuperNode). It
passes the SuperNode's output through and watches it for the SuperLink's "this node is unknown"
answers (:data:`FORGOTTEN`): a SuperNode that has not ended ``--exit-grace`` seconds after one is
stopped (its process group: the SuperExec and ClientApps it started go too) and started again.
A SuperNode that ends within ``--healthy-after`` seconds of its start (a refused key, a wrong
address) is started again after a doubling delay, up to ``--max-restart-delay``, so a node that
cannot join does not spin.

    ba-supernode --insecure --superlink 127.0.0.1:9092 \\
        --node-config 'partition-id=0 num-partitions=3'

Options before ``--`` are this wrapper's; everything else goes to ``flower-supernode``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from types import FrameType
from typing import IO

from .flower_release import installed_forgotten_markers

#: What the installed Flower's SuperNode logs when the SuperLink answers that it does not know
#: this node (a SuperLink restarted with its state in memory): the node must register again.
FORGOTTEN = installed_forgotten_markers()


def flower_supernode() -> str:
    """``flower-supernode`` beside this interpreter (its virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / "flower-supernode"
    if beside.is_file():
        return str(beside)
    found = shutil.which("flower-supernode")
    if found is None:
        raise SystemExit(
            "ba-supernode: flower-supernode not found: install flwr (pip install flwr)"
        )
    return found


class Supervisor:
    """Runs ``command`` and starts it again whenever it ends, until :meth:`stop`.

    Parameters
    ----------
    command : sequence of str
        The process to keep running.
    delay : float
        Seconds before a restart after a process that lived at least ``healthy_after``.
    max_delay : float
        Cap of the doubling delay after processes that ended sooner (a crash loop).
    healthy_after : float
        A process that lived this long is taken as having worked; the delay resets.
    exit_grace : float
        Seconds a process may take to end by itself after it logged a :data:`FORGOTTEN` line,
        before it is stopped.
    say : callable
        Where the wrapper's own lines go (standard error by default).
    output : binary stream
        Where the process's output is passed on to (this process's standard output).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        delay: float = 2.0,
        max_delay: float = 60.0,
        healthy_after: float = 30.0,
        exit_grace: float = 20.0,
        say: Callable[[str], None] | None = None,
        output: IO[bytes] | None = None,
    ) -> None:
        self.command = list(command)
        self.delay, self.max_delay, self.healthy_after = delay, max_delay, healthy_after
        self.exit_grace = exit_grace
        self.say = say or (lambda line: print(f"ba-supernode: {line}", file=sys.stderr, flush=True))
        self.output = output if output is not None else sys.stdout.buffer
        self.stopping = threading.Event()
        self.forgotten = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop for good: pass ``signum`` to the running process group and start no other."""
        self.stopping.set()
        self._signal_child(signum)

    def _signal_child(self, signum: int) -> None:
        """Send ``signum`` to the process's group (its own: ``start_new_session``)."""
        child = self.child
        if child is not None:
            # The group outlives its leader while the SuperExec or a ClientApp it started
            # runs (and its id is not reused meanwhile); an empty group is gone (ESRCH).
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signum)

    def _pass_output(self, stream: IO[bytes]) -> None:
        """Copy the process's output through, noting the SuperLink's "unknown node" answers."""
        for line in iter(stream.readline, b""):
            self.output.write(line)
            self.output.flush()
            if any(marker.encode() in line for marker in FORGOTTEN):
                self.forgotten.set()

    def _wait(self, child: subprocess.Popen[bytes]) -> int:
        """Wait for the process; stop it when it outlives ``exit_grace`` after being forgotten."""
        while True:
            with suppress(subprocess.TimeoutExpired):
                return child.wait(timeout=0.5)
            if self.forgotten.is_set() and not self.stopping.is_set():
                with suppress(subprocess.TimeoutExpired):
                    return child.wait(timeout=self.exit_grace)
                self.say(
                    f"flower-supernode (pid {child.pid}) is unknown to the SuperLink and still "
                    f"running {self.exit_grace:g} s later: stopping it to register again"
                )
                self._signal_child(signal.SIGTERM)
                with suppress(subprocess.TimeoutExpired):
                    return child.wait(timeout=10.0)
                self._signal_child(signal.SIGKILL)
                return child.wait()

    def run(self) -> int:
        """Keep the process running; once stopped, return its last exit status (as a shell
        reports it: 128 + the signal's number for a process ended by a signal)."""
        wait = self.delay
        status = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            self.forgotten.clear()
            # Its own process group, so that a restart also ends the SuperExec and ClientApps
            # it started; SIGINT/SIGTERM given to ba-supernode are passed on to that group.
            child = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.child = child
            self.starts += 1
            assert child.stdout is not None
            reader = threading.Thread(target=self._pass_output, args=(child.stdout,), daemon=True)
            reader.start()
            if self.stopping.is_set():  # stop() came between the check and the start
                self._signal_child(signal.SIGTERM)
            status = self._wait(child)
            self._signal_child(signal.SIGKILL)  # what the SuperNode left of its group
            reader.join(timeout=5.0)
            if os.getpid() == 1:  # a container's init: orphans of the SuperNode come here
                reap_orphans()
            if self.stopping.is_set():
                break
            lived = time.monotonic() - started
            wait = self.delay if lived >= self.healthy_after else min(wait * 2, self.max_delay)
            self.say(
                f"flower-supernode (pid {child.pid}) ended with status {status} after "
                f"{lived:.0f} s; starting it again in {wait:g} s"
            )
            self.stopping.wait(wait)
        return 128 - status if status < 0 else status


def reap_orphans() -> None:
    """Collect ended processes re-parented to this one, as a container's PID 1 inherits the
    SuperExec and ClientApps of a SuperNode that ended (its own child is waited for already;
    elsewhere, ``waitpid(-1)`` would take other children's statuses, so only PID 1 calls it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left
            return
        if pid == 0:  # children left, none ended
            return


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ba-supernode``."""
    parser = argparse.ArgumentParser(
        prog="ba-supernode",
        allow_abbrev=False,  # a flower-supernode flag must never be taken for a prefix of ours
        description="Run flower-supernode and start it again whenever it ends (a SuperLink "
        "restarted with its state in memory forgets every node, which then exits). Arguments "
        "not listed here go to flower-supernode.",
    )
    parser.add_argument("--restart-delay", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument(
        "--max-restart-delay", type=float, default=60.0, help="cap of the doubling delay (60)"
    )
    parser.add_argument(
        "--healthy-after",
        type=float,
        default=30.0,
        help="a SuperNode that lived this long resets the delay (default 30 s)",
    )
    parser.add_argument(
        "--exit-grace",
        type=float,
        default=20.0,
        help="seconds a SuperNode the SuperLink no longer knows may take to end by itself "
        "before it is stopped and started again (default 20)",
    )
    args, rest = parser.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    supervisor = Supervisor(
        [flower_supernode(), *rest],
        delay=args.restart_delay,
        max_delay=args.max_restart_delay,
        healthy_after=args.healthy_after,
        exit_grace=args.exit_grace,
    )

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        supervisor.stop(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return supervisor.run()


if __name__ == "__main__":
    raise SystemExit(main())
