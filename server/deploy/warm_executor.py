"""``ba-warm-executor``: a SuperNode's ClientApps forked from one warm, pre-imported process.

Flower's default (``--isolation subprocess``) starts a fresh Python for every message a SuperNode
handles: ``flower-superexec`` polls the SuperNode's Runtime API for a task and runs
``flwr-clientapp --token ...`` as a new process. Each of those pays the interpreter's start and
the imports of Flower and torch again, about 3-4 CPU-seconds per message on this project's
machine, while the ClientApp's own data, model and training take a few hundredths
(docs/results/deployment-grpc.md).

This executor is Flower's own SuperExec loop (``run_superexec``: ask the Runtime API for a task,
hand the task's token to an executor) with one difference, the executor: instead of
``subprocess.Popen(["flwr-clientapp", ...])`` it forks itself. The parent imports Flower's
ClientApp runtime, torch and the app (``--preload``) once, and runs the app's warm-up
(``--warm``; by default this project's, which parses the digits table), before the first task;
each task's ClientApp then runs Flower's ``run_clientapp`` in a forked child, which exits when
the message is answered. So:

- **kept**: one process per message. A message's ClientApp cannot see what an earlier message's
  left in memory (each child starts from the parent's state at the time it was forked, which
  never runs a ClientApp), and a ClientApp that raises, hangs or is killed takes only its own
  message down; the parent reaps it and kills one that outlives ``--task-timeout``.
- **given up**: the child shares the parent's interpreter state as it was after the imports
  (the modules, their module-level objects, the random generators, which :func:`_reset_child`
  reseeds); a fresh interpreter would build its own. An app that changes global state at import
  time sees the parent's import, not a new one; an app whose module changes on disk between
  messages needs the executor restarted (``ba-supernode`` restarts it when it ends).
- **never in the parent**: a second thread, any torch operation or CUDA. A fork copies only the
  calling thread, so a parent that had started OpenMP's thread pool or initialised CUDA would hand
  its children a broken runtime, and a thread holding a lock at the fork leaves it held in the
  child for ever (Flower's ``--parent-pid`` watch is such a thread: :class:`ForkExecutor` watches
  in the loop instead). The parent only imports and warms up (torch starts no thread on import;
  a warm-up that leaves a thread is refused) and refuses to start if CUDA was initialised by a
  preloaded module; each child initialises CUDA itself, once per message, when its ClientApp
  first touches the GPU (docs/deployment.md, "Warm executor").

``ba-supernode`` (server/deploy/supervise.py) starts one next to each SuperNode by default and
starts it again when it ends; by hand, beside ``flower-supernode --isolation process``::

    flower-supernode --insecure --superlink 127.0.0.1:9092 --isolation process --port 9094 \\
        --node-config 'partition-id=0 num-partitions=2'
    ba-warm-executor --insecure --runtime-api-address 127.0.0.1:9094 --preload pytorchexample.task
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from beyond_averaging.server.pull import retry_objects_sooner

from .flower_release import FlowerRelease
from .pull_pace import FLOWER_TASK_POLL, PullPace, pace_superexec
from .resources import end_with_parent, set_process_name

if TYPE_CHECKING:
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult

#: Imported by the parent before the first task: Flower's ClientApp runtime (what
#: ``flwr-clientapp`` imports), torch, and this project's ClientApp. ``--preload`` adds more (a
#: user's app, torchvision, ``torch._dynamo`` for apps that build ``torch.optim`` optimizers).
DEFAULT_PRELOAD = (
    "flwr.supernode.runtime.run_clientapp",
    "flwr.supercore.tls",
    "torch",
    "beyond_averaging.client.app",
)
#: The warm-up run when ``--warm`` names none: this project's ClientApp's (it parses the digits
#: table, which its ClientApps would otherwise parse once per message). A user's ``--warm``
#: replaces it.
DEFAULT_WARM = "beyond_averaging.client.app:warm"
#: Seconds a ClientApp may run before the parent kills it (Flower's SuperNode then answers its
#: message with an error reply; the server's own ``round-timeout`` is 600 s by default too).
DEFAULT_TASK_TIMEOUT = 600.0
#: Tries at pushing a ClientApp's reply when the SuperNode refuses its objects (a new push
#: session each time, :func:`retrying_push`).
PUSH_ATTEMPTS = 3
#: Seconds between the warm parent's asks for a task right after it forked one (the SuperNode's
#: Runtime API is local: an ask costs the node, never the SuperLink); it backs off to Flower's.
TASK_POLL_FASTEST = 0.05
#: The line the warm parent prints once its modules are imported (tests and logs look for it).
READY = "ba-warm-executor: ready"
#: Process names (Linux ``comm``, 15 characters at most) that ``ps``, ``top`` and the deployment
#: benchmark see: the warm parent and a ClientApp forked from it.
PARENT_NAME = "ba-warm-exec"
CHILD_NAME = "ba-clientapp"


def preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules`` into this (the parent) process; return the names that failed.

    A module that is not installed is skipped with its name returned (a ClientApp that needs it
    fails in its own message, as it would without preloading). CUDA must not be initialised
    here: :func:`cuda_initialised` is checked by the caller.
    """
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


class UnfitToForkError(RuntimeError):
    """The warm-up left this process in a state a fork cannot copy safely (a thread, CUDA)."""


def _os_threads() -> int:
    """Threads of this process as the kernel counts them (OpenMP's and BLAS's included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's own count is all there is
        return threading.active_count()


def warm_up(target: str, node_config: Mapping[str, Any]) -> None:
    """Call the app's warm-up ``MODULE:FUNCTION`` once in this (the parent) process with the
    node's ``--node-config``, so that every ClientApp forked later inherits what it loaded and
    cached instead of paying for it per message.

    torch runs with one thread during the call (its OpenMP pool, which a fork would not copy,
    is then never started) and gets its thread count back after it.

    Raises
    ------
    ValueError
        ``target`` is not ``MODULE:FUNCTION``.
    UnfitToForkError
        The call left a thread running or initialised CUDA: no ClientApp may be forked.
    Exception
        Whatever importing or calling the function raised.
    """
    module_name, colon, function_name = target.partition(":")
    if not (colon and module_name and function_name):
        raise ValueError(f"--warm {target!r}: give MODULE:FUNCTION, e.g. pytorchexample.task:warm")
    function = getattr(importlib.import_module(module_name), function_name)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 1
    kernel_threads = _os_threads()
    # Judged against the threads before the call: the warm-up answers for the threads it
    # starts (the parent's own single thread at each fork is ForkExecutor's to keep).
    earlier = set(threading.enumerate())
    if torch is not None:
        torch.set_num_threads(1)
    try:
        function(dict(node_config))
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    started = [thread for thread in threading.enumerate() if thread not in earlier]
    if started or _os_threads() > kernel_threads:
        names = ", ".join(thread.name for thread in started) or "not Python's"
        raise UnfitToForkError(
            f"--warm {target} left threads running ({names}; {_os_threads()} in all, "
            f"{kernel_threads} before): a fork copies only the calling thread, so start none "
            "in the warm-up (or stop them before it returns)"
        )
    if cuda_initialised():
        raise UnfitToForkError(
            f"--warm {target} initialised CUDA: a forked ClientApp could not use the GPU; "
            "keep the warm-up on the CPU (each ClientApp moves its model to the GPU itself)"
        )


def cuda_initialised() -> bool:
    """Whether torch (if imported) has initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return bool(torch.cuda.is_initialized())


def _reset_child() -> None:
    """What a forked child sets up before it runs a ClientApp.

    Signal handlers go back to the defaults (the parent's run Flower's SuperExec exit handlers,
    which would close the parent's client and stop the parent's other children);
    ``run_clientapp`` installs its own. The random
    generators that Python does not reseed after a fork (NumPy's global one, torch's) are reseeded
    from the OS, as a fresh process would be: otherwise every message's ClientApp would draw the
    same numbers. (Python's ``random`` reseeds itself after a fork.)
    """
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):  # the ones Flower handles
        signal.signal(signum, signal.SIG_DFL)
    set_process_name(CHILD_NAME)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def retrying_push(push: Callable[..., None], attempts: int = PUSH_ATTEMPTS) -> Callable[..., None]:
    """Flower's ``push_message`` (a ClientApp's reply to its SuperNode), tried again with a new
    push session when the SuperNode refused one of the reply's objects.

    ``ObjectPushError`` says the push session "may have expired or been replaced"; the
    SuperNode's ``PushMessages`` then opens a new session for the same reply (and stores it
    again when the expired session took it away), so the reply can still arrive, where giving
    up left the SuperNode waiting for objects that never came and the round waiting minutes
    for the SuperLink to expire the reply. A reply another push already stored is not pushed
    twice (the SuperNode asks for no objects). Other errors are Flower's to handle.
    """
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    def pushing(*args: Any, **kwargs: Any) -> None:
        for attempt in range(1, attempts + 1):
            try:
                push(*args, **kwargs)
                return
            except ObjectPushError as refused:
                if attempt == attempts:
                    raise
                _flower_log(
                    f"pushing the reply failed ({refused}); pushing it again with a new push "
                    f"session ({attempt + 1} of {attempts})"
                )

    return pushing


def run_child(spec: ExecutionSpec) -> NoReturn:
    """Run one task's ClientApp with Flower's ``run_clientapp`` and leave the process.

    Always leaves with ``os._exit``: the parent's ``atexit`` handlers and its open client must
    not run or be closed from here.
    """
    code = 1
    try:
        _reset_child()
        from flwr.supercore.tls import validate_and_resolve_root_certificates
        from flwr.supernode.runtime import run_clientapp as runtime
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        # run_clientapp looks push_message up in its module: this child's copy retries.
        setattr(runtime, "push_message", retrying_push(runtime.push_message))  # noqa: B010

        run_clientapp(
            runtime_api_address=spec.runtime_api_address,
            token=spec.token,
            insecure=spec.insecure,
            certificates=validate_and_resolve_root_certificates(
                spec.root_certificates_path, spec.insecure
            ),
            parent_pid=spec.parent_pid,
            runtime_dependency_install=spec.runtime_dependency_install,
        )
        code = 0
    except SystemExit as leaving:  # flwr_exit ends the ClientApp with sys.exit(code)
        code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


@dataclass
class _Child:
    """A forked ClientApp: its task and when it must have ended."""

    task_id: int
    started: float
    deadline: float


class ForkExecutor:
    """Flower's ``Executor`` interface (``flwr.supercore.superexec.executor``): ClientApp tasks
    run in a child forked from this process; any other task type is started as Flower's
    ``SubprocessExecutor`` starts it.

    Parameters
    ----------
    task_timeout : float
        Seconds a child may run before it is killed (SIGKILL).
    say : callable, optional
        Where the executor's own lines go (Flower's logger by default).
    parent_pid : int, optional
        A process whose end ends this one: :meth:`reconcile`, which Flower's SuperExec loop calls
        before every poll, looks for it and raises SIGINT (Flower's exit handlers run) once it
        is gone. Flower's own ``--parent-pid`` watch is a thread, which every fork would then
        be made from (Python warns that such a fork may deadlock); this one keeps the parent
        single-threaded.
    launched : callable, optional
        Called in this process after each ClientApp is forked (the paced SuperExec loop then asks
        for the next task soon: :func:`server.deploy.pull_pace.pace_superexec`).
    """

    def __init__(
        self,
        task_timeout: float = DEFAULT_TASK_TIMEOUT,
        say: Any = None,
        parent_pid: int | None = None,
        launched: Callable[[], None] | None = None,
    ) -> None:
        from flwr.supercore.superexec.executor import SubprocessExecutor

        if task_timeout <= 0:
            raise ValueError(f"task_timeout must be positive seconds, got {task_timeout!r}")
        self.task_timeout = task_timeout
        self.parent_pid = parent_pid
        self.launched = launched
        self.children: dict[int, _Child] = {}
        self.fallback = SubprocessExecutor()
        self.say = say if say is not None else _flower_log

    def get_eligible_capacity(
        self,
        supported_task_types: set[TaskType],
        *,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> tuple[set[TaskType], set[str]]:
        """Every task type may be launched at once (a fork has no capacity gate)."""
        del insecure, root_certificates_path
        return supported_task_types, set()

    def wait_for_capacity(
        self,
        task_type: TaskType | None = None,
        *,
        fab_hash: str | None = None,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> None:
        """Return at once: launches are not gated."""
        del task_type, fab_hash, insecure, root_certificates_path

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        """Fork a child for a ClientApp task (other task types: a subprocess, as Flower does)."""
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        if cuda_initialised():
            return LaunchResult.failed(
                "CUDA is initialised in the warm executor's parent process, so a forked "
                "ClientApp cannot use it: preload no module that touches the GPU at import"
            )
        for stream in (sys.stdout, sys.stderr):  # what is buffered would be written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:
            self.children.clear()  # its siblings are not its to reap or stop
            run_child(spec)
        now = time.monotonic()
        self.children[pid] = _Child(spec.task_id, now, now + self.task_timeout)
        if self.launched is not None:
            self.launched()
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap ended children (logging any that failed), kill those past the timeout, and leave
        (SIGINT, as Flower's parent watch does) once the process to follow has ended."""
        if self.parent_pid is not None and not _process_exists(self.parent_pid):
            self.say(f"the process it follows (pid {self.parent_pid}) has ended: leaving")
            self.parent_pid = None  # raised once; Flower's SIGINT handler ends the loop
            signal.raise_signal(signal.SIGINT)
            return
        now = time.monotonic()
        for pid, child in list(self.children.items()):
            try:
                ended, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                del self.children[pid]
                continue
            if ended:
                del self.children[pid]
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    how = f"signal {-code}" if code < 0 else f"status {code}"
                    self.say(
                        f"the ClientApp of task {child.task_id} (pid {pid}) ended with {how} "
                        f"after {now - child.started:.1f} s: that message fails, the others go on"
                    )
            elif now > child.deadline:
                self.say(
                    f"the ClientApp of task {child.task_id} (pid {pid}) ran past the task "
                    f"timeout ({self.task_timeout:g} s): killed; its message fails"
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop every running child (the executor is shutting down)."""
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while self.children and time.monotonic() < deadline:
            self.reconcile()
            time.sleep(0.05)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.children.clear()


def _process_exists(pid: int) -> bool:
    """Whether process ``pid`` is alive (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux): the signal check is all there is
        return True


def _flower_log(line: str) -> None:
    from logging import WARNING

    from flwr.common.logger import log

    log(WARNING, "ba-warm-executor: %s", line)


def serve(
    runtime_api_address: str,
    *,
    insecure: bool,
    root_certificates: str | None,
    task_timeout: float,
    parent_pid: int | None = None,
    wake_fd: int | None = None,
) -> None:
    """Run Flower's SuperExec loop against a SuperNode's Runtime API with :class:`ForkExecutor`.

    ``run_superexec`` builds its executor with the module's ``get_executor``; that one name is
    pointed at a function that returns this process's :class:`ForkExecutor`, so everything else
    (authentication, retries, signal handling, tracing) is Flower's own code of the installed
    release. :meth:`server.deploy.flower_release.FlowerRelease.warm_executor_problem` names a
    release that lacks the pieces.

    ``parent_pid`` is watched by the executor in Flower's loop, not handed to
    ``run_superexec`` (whose watch is a thread): the parent forks with no thread but its main one.
    The loop's wait between asks for a task is paced (:mod:`server.deploy.pull_pace`): with
    ``wake_fd`` (``ba-supernode``'s pipe from its paced SuperNode) it is Flower's interval, ended
    at once by each message the SuperNode stores; without, it starts at
    :data:`TASK_POLL_FASTEST` after each fork and backs off to Flower's interval. A ClientApp
    asks again for an object of its message that its SuperNode has not stored yet after 0.05 s,
    not Flower's 1 s (:func:`server.pull.retry_objects_sooner`).
    """
    from flwr.supercore.superexec import run_superexec as superexec

    # Flower's wait between asks for a task (FLWR_SUPEREXEC_TASK_POLL_INTERVAL, 1 s by default)
    # is where the pace backs off to; right after a fork it asks every TASK_POLL_FASTEST seconds.
    interval = float(getattr(superexec, "_get_task_poll_interval", lambda: FLOWER_TASK_POLL)())
    fastest = interval if wake_fd is not None else min(TASK_POLL_FASTEST, interval)
    clock = pace_superexec(PullPace(fastest=fastest, slowest=interval), wake_fd)
    # A ClientApp forked while its SuperNode still stores the message's objects asks again for
    # a missing one after 0.05 s, not Flower's 1 s (every child inherits the setting).
    retry_objects_sooner()
    executor = ForkExecutor(
        task_timeout=task_timeout,
        parent_pid=parent_pid,
        launched=None if clock is None else clock.work_arrived,
    )

    def fork_executor(*_args: object, **_kwargs: object) -> ForkExecutor:
        return executor

    if parent_pid is not None and parent_pid == os.getppid():
        # The loop's own look (ForkExecutor.reconcile) is not reached while Flower's client
        # retries a Runtime API that went away with the parent; the kernel's signal is.
        end_with_parent()
        if os.getppid() != parent_pid:  # it ended before the kernel was asked
            signal.raise_signal(signal.SIGTERM)
    superexec.get_executor = fork_executor  # type: ignore[attr-defined]
    superexec.run_superexec(
        runtime_api_address=runtime_api_address,
        insecure=insecure,
        root_certificates_path=root_certificates,
        parent_pid=None,
        runtime_dependency_install=False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ba-warm-executor``."""
    parser = argparse.ArgumentParser(
        prog="ba-warm-executor",
        description="Run a SuperNode's ClientApps (flower-supernode --isolation process) in "
        "processes forked from this one, which imports Flower, torch and the app once.",
    )
    parser.add_argument(
        "--runtime-api-address",
        default="127.0.0.1:9094",
        help="the SuperNode's Runtime API (flower-supernode --host/--port; default 127.0.0.1:9094)",
    )
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument(
        "--insecure",
        action="store_true",
        help="the Runtime API serves no TLS (a SuperNode started without --ssl-* flags)",
    )
    security.add_argument(
        "--root-certificates",
        metavar="CA_FILE",
        help="the CA that signed the Runtime API's certificate (flower-supernode --ssl-*)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module to import before the first task, besides "
        f"{', '.join(DEFAULT_PRELOAD)} (repeatable; e.g. your app's task module, torchvision, "
        "torch._dynamo for apps that build torch.optim optimizers)",
    )
    parser.add_argument(
        "--task-timeout",
        type=float,
        default=DEFAULT_TASK_TIMEOUT,
        help=f"seconds a ClientApp may run before it is killed (default {DEFAULT_TASK_TIMEOUT:g})",
    )
    parser.add_argument(
        "--parent-pid", type=int, help="end when this process ends (as flower-superexec does)"
    )
    parser.add_argument(
        "--warm",
        metavar="MODULE:FUNCTION",
        default=DEFAULT_WARM,
        help="call FUNCTION(node_config) once before the first fork, so that every ClientApp "
        "inherits what it loads and caches (the app's data, its first training step's kernels; "
        f"default {DEFAULT_WARM}, this project's app's)",
    )
    parser.add_argument(
        "--node-config",
        default="",
        help="the SuperNode's --node-config, as the warm-up function receives it",
    )
    parser.add_argument(
        "--wake-fd",
        type=int,
        help="an inherited pipe on which the SuperNode (ba-supernode's) signals each message: "
        "ask for its task at once",
    )
    args = parser.parse_args(argv)
    if args.task_timeout <= 0:
        parser.error(f"--task-timeout must be positive seconds, got {args.task_timeout:g}")
    problem = FlowerRelease.installed().warm_executor_problem()
    if problem is not None:
        print(f"ba-warm-executor: {problem}", file=sys.stderr)
        return 2
    set_process_name(PARENT_NAME)
    missing = preload([*DEFAULT_PRELOAD, *args.preload])
    for name in missing:
        print(f"ba-warm-executor: --preload {name}: not importable here, skipped", file=sys.stderr)
    if cuda_initialised():
        print(
            "ba-warm-executor: CUDA was initialised while preloading "
            f"{', '.join(args.preload) or 'the default modules'}; a forked ClientApp could not "
            "use the GPU: preload no module that touches CUDA at import",
            file=sys.stderr,
        )
        return 2
    warmed = ""
    if args.warm:
        from flwr.common.config import parse_config_args

        try:
            warm_up(args.warm, parse_config_args([args.node_config] if args.node_config else None))
            warmed = f", warmed by {args.warm}"
        except UnfitToForkError as unfit:
            print(f"ba-warm-executor: {unfit}", file=sys.stderr)
            return 2
        except Exception:  # the app's own error: its ClientApps run unwarmed and show it
            traceback.print_exc()
            print(
                f"ba-warm-executor: --warm {args.warm} failed (above); the ClientApps run "
                "without it",
                file=sys.stderr,
            )
    # What the imports and the warm-up made is never freed: out of the collector's sight, a
    # child's collections do not write to (and so copy) the pages it shares with this process
    # (Python's gc docs).
    gc.collect()
    gc.freeze()
    loaded = [name for name in [*DEFAULT_PRELOAD, *args.preload] if name not in missing]
    print(
        f"{READY} (pid {os.getpid()}, preloaded {', '.join(loaded)}{warmed}); forking "
        f"the ClientApps of the SuperNode's Runtime API at {args.runtime_api_address}",
        file=sys.stderr,
        flush=True,
    )
    serve(
        args.runtime_api_address,
        insecure=args.insecure,
        root_certificates=args.root_certificates,
        task_timeout=args.task_timeout,
        parent_pid=args.parent_pid,
        wake_fd=args.wake_fd,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
