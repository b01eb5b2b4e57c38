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
``ba-supernode`` itself is told to stop (SIGTERM or SIGINT, passed on to the SuperNode, whose
process group is killed if it still runs ``--exit-grace`` seconds later). It
passes the SuperNode's output through and watches it for the SuperLink's "this node is unknown"
answers (:data:`FORGOTTEN`): a SuperNode that has not ended ``--exit-grace`` seconds after one is
stopped (its process group: the SuperExec and ClientApps it started go too) and started again.
A SuperNode that ends within ``--healthy-after`` seconds of its start (a refused key, a wrong
address) is started again after a doubling delay, up to ``--max-restart-delay``, so a node that
cannot join does not spin.

**ClientApps from a warm process** (``--executor warm``, the default where the installed Flower
supports it: :meth:`server.deploy.flower_release.FlowerRelease.default_executor`): the SuperNode
runs with ``--isolation process``, and beside it ``ba-supernode`` keeps a second process running,
``ba-warm-executor`` (:mod:`server.deploy.warm_executor`), which imports Flower, torch and the app
once and forks one child per message, so no message pays for a Python start or an import. It is
supervised like the SuperNode: started again whenever it ends (``kill -9`` included), its children
stopped with it. ``--executor subprocess`` is Flower's own: a fresh ``flwr-clientapp`` process per
message.

**A node that pulls soon after a message** (``--pull-every``, 0.2 s by default): the SuperNode
is Flower's ``flower-supernode`` with its idle pull paced (:mod:`server.deploy.pull_pace`), and it
wakes the warm executor through a pipe when it has stored a message; ``--pull-every 3`` runs
``flower-supernode`` unchanged.

    ba-supernode --insecure --superlink 127.0.0.1:9092 \\
        --node-config 'partition-id=0 num-partitions=3'

Options before ``--`` are this wrapper's; everything else goes to ``flower-supernode``.
"""

from __future__ import annotations

import argparse
import math
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

from .flower_release import (
    CLIENTAPP_EXECUTORS,
    ClientAppExecutor,
    FlowerRelease,
    installed_forgotten_markers,
)
from .pull_pace import FLOWER_IDLE_WAIT, PullPace
from .resources import set_process_name

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
    name : str
        What the wrapper's lines call the process.
    forgotten_markers : sequence of str
        Output lines that mean the SuperLink no longer knows this node (:data:`FORGOTTEN` for a
        SuperNode; none for the warm executor, which follows its SuperNode's Runtime API).
    pass_fds : sequence of int
        Descriptors every start of the process inherits (the paced SuperNode's notify pipe and
        the warm executor's end of it), kept open here across restarts.
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
        name: str = "flower-supernode",
        forgotten_markers: Sequence[str] = FORGOTTEN,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.command = list(command)
        self.pass_fds = tuple(pass_fds)
        self.name = name
        self.forgotten_markers = tuple(marker.encode() for marker in forgotten_markers)
        self.delay, self.max_delay, self.healthy_after = delay, max_delay, healthy_after
        self.exit_grace = exit_grace
        self.say = say or (lambda line: print(f"ba-supernode: {line}", file=sys.stderr, flush=True))
        self.output = output if output is not None else sys.stdout.buffer
        self.stopping = threading.Event()
        self.forgotten = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._stopped_at = math.inf

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop for good: pass ``signum`` to the running process group and start no other; a
        group still running ``exit_grace`` seconds later is killed (:meth:`_wait`)."""
        self._stopped_at = time.monotonic()
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
            if any(marker in line for marker in self.forgotten_markers):
                self.forgotten.set()

    def _wait(self, child: subprocess.Popen[bytes]) -> int:
        """Wait for the process; stop it when it outlives ``exit_grace`` after being forgotten."""
        while True:
            with suppress(subprocess.TimeoutExpired):
                return child.wait(timeout=0.5)
            if time.monotonic() - self._stopped_at > self.exit_grace:
                # Told to stop and still running: a SuperNode given SIGTERM while it retries a
                # SuperLink that is gone (ba-deploy killed with SIGKILL, both told at once) was
                # seen to keep retrying, and this process would have waited for it for ever.
                self.say(
                    f"{self.name} (pid {child.pid}) still running {self.exit_grace:g} s after "
                    "it was told to stop: killing it"
                )
                self._signal_child(signal.SIGKILL)
                return child.wait()
            if self.forgotten.is_set() and not self.stopping.is_set():
                with suppress(subprocess.TimeoutExpired):
                    return child.wait(timeout=self.exit_grace)
                self.say(
                    f"{self.name} (pid {child.pid}) is unknown to the SuperLink and still "
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
                pass_fds=self.pass_fds,
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
                f"{self.name} (pid {child.pid}) ended with status {status} after "
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


def take_option(arguments: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` (or ``flag=VALUE``) from ``arguments``; return the last VALUE."""
    value = None
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        if argument == flag and index + 1 < len(arguments):
            value = arguments[index + 1]
            del arguments[index : index + 2]
        elif argument.startswith(flag + "="):
            value = argument.split("=", 1)[1]
            del arguments[index]
        else:
            index += 1
    return value


def option_value(arguments: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``arguments`` (left in place), or None."""
    return take_option(list(arguments), flag)


def runtime_api_dial_address(supernode_arguments: Sequence[str]) -> str:
    """Where the SuperNode's Runtime API answers, from its ``--host``/``--port`` (Flower's
    defaults 127.0.0.1 and 9094); a wildcard host is dialled on loopback."""
    host = option_value(supernode_arguments, "--host") or "127.0.0.1"
    port = option_value(supernode_arguments, "--port") or "9094"
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def supernode_command(
    supernode_arguments: Sequence[str], pull_every: float, notify_fd: int | None = None
) -> list[str]:
    """The SuperNode's command: Flower's ``flower-supernode`` with ``supernode_arguments``, its
    pull loop paced (:mod:`server.deploy.pull_pace`) from ``pull_every`` seconds after each
    message back to Flower's 3 s, or unchanged when ``pull_every`` is Flower's 3 s or more."""
    if pull_every >= FLOWER_IDLE_WAIT:
        return [flower_supernode(), *supernode_arguments]
    command = [sys.executable, "-m", "beyond_averaging.server.deploy.pull_pace"]
    command += ["--fastest", f"{pull_every:g}"]
    if notify_fd is not None:
        command += ["--notify-fd", str(notify_fd)]
    return [*command, "--", flower_supernode(), *supernode_arguments]


def warm_executor_command(
    supernode_arguments: Sequence[str],
    preload: Sequence[str],
    task_timeout: float,
    wake_fd: int | None = None,
    warm: str | None = None,
) -> list[str]:
    """``ba-warm-executor`` for the SuperNode started with ``supernode_arguments``: its Runtime
    API's address, and TLS when the SuperNode serves that API with a certificate
    (``--ssl-ca-certfile`` is the CA to trust)."""
    command = [sys.executable, "-m", "beyond_averaging.server.deploy.warm_executor"]
    command += ["--runtime-api-address", runtime_api_dial_address(supernode_arguments)]
    certificate_authority = option_value(supernode_arguments, "--ssl-ca-certfile")
    if certificate_authority:
        command += ["--root-certificates", certificate_authority]
    else:
        command.append("--insecure")
    for module in preload:
        command += ["--preload", module]
    command += ["--task-timeout", f"{task_timeout:g}", "--parent-pid", str(os.getpid())]
    if wake_fd is not None:
        command += ["--wake-fd", str(wake_fd)]
    if warm is not None:  # the warm-up receives the node's config, as its ClientApps do
        command += ["--warm", warm]
        command += ["--node-config", option_value(supernode_arguments, "--node-config") or ""]
    return command


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ba-supernode``."""
    release = FlowerRelease.installed()
    parser = argparse.ArgumentParser(
        prog="ba-supernode",
        allow_abbrev=False,  # a flower-supernode flag must never be taken for a prefix of ours
        description="Run flower-supernode and start it again whenever it ends (a SuperLink "
        "restarted with its state in memory forgets every node, which then exits), with its "
        "ClientApps forked from a warm process (--executor warm). Arguments not listed here "
        "go to flower-supernode.",
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
    parser.add_argument(
        "--executor",
        choices=CLIENTAPP_EXECUTORS,
        default=release.default_executor(),
        help="how ClientApps run: warm (forked from one process that imported Flower, torch "
        "and the app once; the default) or subprocess (Flower's: a new Python per message)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="--executor warm: a module the warm process imports besides Flower, torch and "
        "this app (repeatable)",
    )
    parser.add_argument(
        "--warm",
        metavar="MODULE:FUNCTION",
        help="--executor warm: call FUNCTION(node_config) once in the warm process before it "
        "forks, so that every ClientApp inherits what it loads and caches",
    )
    parser.add_argument(
        "--task-timeout",
        type=float,
        default=600.0,
        help="--executor warm: seconds a ClientApp may run before it is killed (default 600)",
    )
    parser.add_argument(
        "--pull-every",
        type=float,
        default=PullPace.fastest,
        metavar="SECONDS",
        help="seconds between the SuperNode's pulls right after a message, growing x"
        f"{PullPace.growth:g} per empty pull back to Flower's {FLOWER_IDLE_WAIT:g} s "
        f"(default {PullPace.fastest:g}; {FLOWER_IDLE_WAIT:g} runs Flower's flower-supernode "
        "unchanged)",
    )
    args, rest = parser.parse_known_args(argv)
    if not (math.isfinite(args.pull_every) and args.pull_every > 0):
        parser.error(f"--pull-every must be positive seconds, got {args.pull_every:g}")
    if rest[:1] == ["--"]:
        rest = rest[1:]
    set_process_name("ba-supernode")  # as ps, top and the deployment benchmark see it
    executor: ClientAppExecutor = args.executor
    isolation = take_option(rest, "--isolation")
    if executor == "warm":
        problem = release.warm_executor_problem()
        if problem is not None:
            parser.error(problem)
        if isolation == "subprocess":
            parser.error(
                "--isolation subprocess is Flower's own executor: pass --executor subprocess "
                "instead (or drop --isolation)"
            )
        if args.task_timeout <= 0:
            parser.error(f"--task-timeout must be positive seconds, got {args.task_timeout:g}")
    if args.warm is not None and executor != "warm":
        parser.error("--warm runs in the warm executor: drop it, or use --executor warm")
    # --executor subprocess with --isolation process: the user runs their own executor.
    isolation_flags = (
        ["--isolation", isolation] if isolation else release.supernode_isolation(executor)
    )
    timing = {
        "delay": args.restart_delay,
        "max_delay": args.max_restart_delay,
        "healthy_after": args.healthy_after,
    }
    paced = args.pull_every < FLOWER_IDLE_WAIT
    # The paced SuperNode tells the warm executor of each message it stores down this pipe, so
    # that the ClientApp starts at once rather than at the executor's next ask (1 s apart).
    wake, notify = os.pipe() if paced and executor == "warm" else (None, None)
    supervisors = [
        Supervisor(
            supernode_command([*rest, *isolation_flags], args.pull_every, notify),
            exit_grace=args.exit_grace,
            pass_fds=() if notify is None else (notify,),
            **timing,
        )
    ]
    if executor == "warm":
        supervisors.append(
            Supervisor(
                warm_executor_command(rest, args.preload, args.task_timeout, wake, args.warm),
                name="ba-warm-executor",
                forgotten_markers=(),
                pass_fds=() if wake is None else (wake,),
                **timing,
            )
        )

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        for supervisor in supervisors:
            supervisor.stop(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    helpers = [
        threading.Thread(target=supervisor.run, name=supervisor.name, daemon=True)
        for supervisor in supervisors[1:]
    ]
    for helper in helpers:
        helper.start()
    status = supervisors[0].run()
    for supervisor in supervisors[1:]:
        supervisor.stop()
    for helper in helpers:
        helper.join(timeout=15.0)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
