"""The warm ClientApp executor, ``ba-supernode``'s choice of it and ``ba-deploy``'s arguments,
without a deployment (tests/test_deployment_warm.py runs them for real).

The executor's children are real forks of the test process; Flower's ``run_clientapp`` is
replaced in them by small stand-ins that write what they saw to a file, so each test checks what
a forked ClientApp sees (fresh module state, fresh random numbers) and what the parent does when
one raises, exits or hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResultStatus

from beyond_averaging.server.deploy import local as deploy
from beyond_averaging.server.deploy import supervise, warm_executor
from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.deploy.warm_executor import ForkExecutor
from tests.conftest import REPO

#: Module state a child changes: a later child must not see the change.
STATE = {"calls": 0}
#: What the warm-up below loads in the parent, and every child then extends with its token.
WARM_CACHE: list[str] = []


def fill_cache(node_config: dict[str, Any]) -> None:
    """A warm-up (``--warm tests.test_warm_executor:fill_cache``): loads the node's "data" and
    runs a first training step with torch, as an app's first call would."""
    WARM_CACHE.append(f"partition {node_config['partition-id']}")
    STATE["warm-threads"] = torch.get_num_threads()
    layer = torch.nn.Linear(8, 2)
    torch.nn.functional.cross_entropy(
        layer(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])
    ).backward()


def spec(token: str, task_id: int = 1) -> ExecutionSpec:
    return ExecutionSpec(
        task_type=TaskType.CLIENT_APP,
        runtime_api_address="127.0.0.1:9",
        token=token,
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        parent_pid=None,
        suppress_output=False,
        task_id=task_id,
    )


@pytest.fixture
def outbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder the stand-in ClientApps write to, one JSON file per token; the stand-in
    replaces Flower's ``run_clientapp`` (the children import it from Flower's module)."""
    from flwr.supernode.runtime import run_clientapp as flower_module

    def stand_in(*, token: str, **_: Any) -> None:
        STATE["calls"] += 1
        seen = {
            "pid": os.getpid(),
            "calls": STATE["calls"],
            "python-random": random.random(),
            "numpy-random": float(np.random.random()),  # noqa: NPY002 - the global one, on purpose
            "torch-random": float(torch.rand(1)),
            "warm": list(WARM_CACHE),
            "push": flower_module.push_message.__qualname__,
        }
        WARM_CACHE.append(token)
        (tmp_path / f"{token}.json").write_text(json.dumps(seen), encoding="utf-8")
        if token.startswith("raise"):
            raise RuntimeError("stand-in ClientApp raising")
        if token.startswith("exit"):
            sys.exit(int(token.removeprefix("exit")))
        if token.startswith("hang"):
            time.sleep(3600)

    monkeypatch.setattr(flower_module, "run_clientapp", stand_in)
    return tmp_path


def wait_until_reaped(executor: ForkExecutor, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while executor.children:
        assert time.monotonic() < deadline, f"children still running: {executor.children}"
        executor.reconcile()
        time.sleep(0.02)


def seen(outbox: Path, token: str) -> dict[str, Any]:
    return dict(json.loads((outbox / f"{token}.json").read_text(encoding="utf-8")))


def test_each_message_runs_in_its_own_fork_and_sees_no_state_of_an_earlier_message(
    outbox: Path,
) -> None:
    executor = ForkExecutor(say=lambda line: None)
    for token in ("first", "second"):
        assert executor.launch(spec(token)).status == LaunchResultStatus.ACCEPTED
        wait_until_reaped(executor)
    first, second = seen(outbox, "first"), seen(outbox, "second")
    assert first["pid"] != second["pid"]
    assert os.getpid() not in (first["pid"], second["pid"])
    # Each child incremented its own copy of the parent's state; neither saw the other's.
    assert first["calls"] == second["calls"] == 1
    assert STATE["calls"] == 0


def test_a_warmed_child_inherits_the_warm_up_and_no_earlier_message_s_state(
    outbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "WARM_CACHE", [])
    threads = torch.get_num_threads()
    warm_executor.warm_up(f"{__name__}:fill_cache", {"partition-id": 3})
    assert STATE.pop("warm-threads") == 1  # no OpenMP pool in the parent, which forks
    assert torch.get_num_threads() == threads  # given back for the children
    executor = ForkExecutor(say=lambda line: None)
    for token in ("first", "second"):
        assert executor.launch(spec(token)).status == LaunchResultStatus.ACCEPTED
        wait_until_reaped(executor)
    # Each child starts from the warmed parent: the partition is there, the other's token not.
    assert seen(outbox, "first")["warm"] == seen(outbox, "second")["warm"] == ["partition 3"]
    assert sys.modules[__name__].WARM_CACHE == ["partition 3"]


def test_a_clientapp_pushes_its_reply_through_the_retrying_push(outbox: Path) -> None:
    from flwr.supernode.runtime import run_clientapp as flower_module

    executor = ForkExecutor(say=lambda line: None)
    executor.launch(spec("pushing"))
    wait_until_reaped(executor)
    assert seen(outbox, "pushing")["push"] == "retrying_push.<locals>.pushing"
    assert flower_module.push_message.__qualname__ == "push_message"  # the parent's is Flower's


def test_a_refused_reply_push_is_tried_again_with_a_new_session_then_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    monkeypatch.setattr(warm_executor, "_flower_log", lambda line: None)
    calls: list[str] = []

    def refused_then(outcomes: list[Exception | None]) -> Any:
        def push(client: object, message: str, context: object) -> None:
            calls.append(message)
            outcome = outcomes.pop(0)
            if outcome is not None:
                raise outcome

        return push

    expired = ObjectPushError("object", 1, "session")
    warm_executor.retrying_push(refused_then([expired, None]))(None, "reply", None)
    assert calls == ["reply", "reply"]
    calls.clear()
    with pytest.raises(ObjectPushError):
        warm_executor.retrying_push(refused_then([expired] * 5), attempts=3)(None, "reply", None)
    assert calls == ["reply"] * 3
    calls.clear()
    with pytest.raises(ConnectionError):  # not a refused object: Flower's to handle, at once
        warm_executor.retrying_push(refused_then([ConnectionError()]))(None, "reply", None)
    assert calls == ["reply"]


def start_a_thread(node_config: dict[str, Any]) -> None:
    """A warm-up that leaves a thread running (what a fork must not copy a process beside)."""
    del node_config
    threading.Thread(target=STOP_THREAD.wait, name="left-running", daemon=True).start()


STOP_THREAD = threading.Event()


def test_a_warm_up_that_leaves_a_thread_running_is_refused_with_the_thread_s_name() -> None:
    try:
        with pytest.raises(warm_executor.UnfitToForkError, match="left-running"):
            warm_executor.warm_up(f"{__name__}:start_a_thread", {})
    finally:
        STOP_THREAD.set()


def test_without_warm_the_parent_runs_this_project_s_warm_up_which_is_fit_to_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The default --warm parses the digits table in the parent; it must start no thread and
    # touch no CUDA, or no ClientApp could be forked after it.
    from beyond_averaging.tasks import datasets

    seen: list[str] = []
    # main() as far as its serving loop, without renaming or freezing this test's process.
    monkeypatch.setattr(warm_executor, "serve", lambda *args, **kwargs: None)
    monkeypatch.setattr(warm_executor, "set_process_name", lambda name: None)
    monkeypatch.setattr(warm_executor.gc, "freeze", lambda: None)
    monkeypatch.setattr(warm_executor, "warm_up", lambda target, config: seen.append(target))
    assert warm_executor.main(["--insecure"]) == 0
    assert seen == [warm_executor.DEFAULT_WARM] == ["beyond_averaging.client.app:warm"]
    monkeypatch.undo()
    datasets._parsed_digits.cache_clear()
    warm_executor.warm_up(warm_executor.DEFAULT_WARM, {"partition-id": 0, "num-partitions": 2})
    assert datasets._parsed_digits.cache_info().currsize == 1


@pytest.mark.parametrize("target", ["pytorchexample.task", ":warm", "tests.test_warm_executor:"])
def test_a_warm_up_target_that_is_not_module_colon_function_is_refused(target: str) -> None:
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        warm_executor.warm_up(target, {})


def test_forked_clientapps_draw_other_random_numbers_as_fresh_processes_would(
    outbox: Path,
) -> None:
    # Without the reseed after the fork, every child would continue the parent's generators
    # and draw the same numbers (Python's own random module reseeds itself after a fork).
    np.random.seed(0)  # noqa: NPY002 - the global generator a fork inherits
    torch.manual_seed(0)
    executor = ForkExecutor(say=lambda line: None)
    for token in ("a", "b"):
        executor.launch(spec(token))
        wait_until_reaped(executor)
    a, b = seen(outbox, "a"), seen(outbox, "b")
    for generator in ("python-random", "numpy-random", "torch-random"):
        assert a[generator] != b[generator], generator
    parent_next = float(np.random.random())  # noqa: NPY002 - what a child without reseed draws
    assert parent_next not in (a["numpy-random"], b["numpy-random"])


@pytest.mark.parametrize(
    ("token", "status"), [("raise", "status 1"), ("exit3", "status 3"), ("exit0", None)]
)
def test_a_clientapp_that_raises_or_exits_fails_only_its_own_message(
    outbox: Path, token: str, status: str | None
) -> None:
    said: list[str] = []
    executor = ForkExecutor(say=said.append)
    executor.launch(spec(token, task_id=7))
    executor.launch(spec("healthy", task_id=8))
    wait_until_reaped(executor)
    assert seen(outbox, token)["calls"] == 1  # it ran
    assert seen(outbox, "healthy")["calls"] == 1  # and the other message was not touched
    if status is None:
        assert said == []
    else:
        assert len(said) == 1
        assert "task 7" in said[0]
        assert status in said[0]


def test_a_clientapp_past_the_task_timeout_is_killed_and_reaped(outbox: Path) -> None:
    said: list[str] = []
    executor = ForkExecutor(task_timeout=0.5, say=said.append)
    executor.launch(spec("hang", task_id=3))
    started = time.monotonic()
    wait_until_reaped(executor)
    assert 0.5 <= time.monotonic() - started < 20.0
    assert any("task 3" in line and "ran past the task timeout" in line for line in said)
    assert any(f"signal {int(signal.SIGKILL)}" in line for line in said)


def test_close_stops_every_running_clientapp(outbox: Path) -> None:
    executor = ForkExecutor(say=lambda line: None)
    executor.launch(spec("hang-1"))
    executor.launch(spec("hang-2"))
    pids = list(executor.children)
    executor.close()
    assert executor.children == {}
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_no_clientapp_is_forked_once_cuda_is_initialised_in_the_parent(
    outbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    executor = ForkExecutor(say=lambda line: None)
    result = executor.launch(spec("never"))
    assert result.status == LaunchResultStatus.FAILED
    assert result.message is not None
    assert "CUDA" in result.message
    assert executor.children == {}
    assert not (outbox / "never.json").exists()


#: Flower's own SuperExec loop (``run_superexec``) driven by ``serve`` with a stand-in Runtime API
#: client that hands out one ClientApp task; the fork is replaced by a probe that writes the
#: threads alive at that moment and ends the process.
FORK_PROBE = """
import json, os, sys, threading
from flwr.proto.runtime_pb2 import AcquireTaskResponse
from flwr.proto.task_pb2 import Task
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec import run_superexec as superexec
from beyond_averaging.server.deploy import warm_executor

class OneTask:
    @classmethod
    def from_server_address(cls, **_):
        return cls()
    def AcquireTask(self, request):
        task = Task(task_id=7, run_id=1, type=TaskType.CLIENT_APP)
        return AcquireTaskResponse(task=task, token="probe")
    def close(self):
        pass

def probe():
    seen = {"threads": threading.active_count(),
            "names": [thread.name for thread in threading.enumerate()]}
    with open(sys.argv[1], "w") as out:
        json.dump(seen, out)
    os._exit(0)

superexec.RuntimeHttpClient = OneTask
os.fork = probe
warm_executor.serve("127.0.0.1:9", insecure=True, root_certificates=None,
                    task_timeout=60.0, parent_pid=int(sys.argv[2]))
"""


def test_the_warm_parent_forks_with_its_main_thread_only_while_it_follows_a_parent(
    tmp_path: Path,
) -> None:
    # Flower's --parent-pid watch is a thread: a fork made beside it copies a process whose
    # other thread may hold a lock (logging, gRPC, the allocator) the child then waits on.
    followed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        seen_at_fork = tmp_path / "fork.json"
        subprocess.run(
            [sys.executable, "-c", FORK_PROBE, str(seen_at_fork), str(followed.pid)],
            check=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        followed.kill()
        followed.wait()
    seen_threads = json.loads(seen_at_fork.read_text(encoding="utf-8"))
    assert seen_threads == {"threads": 1, "names": ["MainThread"]}


#: Starts ba-warm-executor following this process, against a Runtime API nobody serves (as
#: after its SuperNode went), prints the executor's pid and waits to be killed.
FOLLOWED_PARENT = """
import os, subprocess, sys, time
executor = subprocess.Popen([sys.executable, "-m", "beyond_averaging.server.deploy.warm_executor",
    "--insecure", "--runtime-api-address", sys.argv[1], "--parent-pid", str(os.getpid())],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(executor.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_warm_parent_ends_with_its_supervisor_while_flower_retries_a_lost_runtime_api(
    tmp_path: Path,
) -> None:
    # Flower's client retries the lost Runtime API inside the loop, so the loop's own look
    # at the parent is not reached: the kernel's signal (PR_SET_PDEATHSIG) must end it.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    parent = subprocess.Popen(
        [sys.executable, "-c", FOLLOWED_PARENT, address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )
    assert parent.stdout is not None
    executor = int(parent.stdout.readline())
    try:
        time.sleep(20.0)  # imported, serving and retrying by now on a loaded machine
        assert running(executor)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30.0
        while running(executor) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(executor), "the warm executor outlived the process it follows"
    finally:
        parent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(executor, signal.SIGKILL)


def test_the_warm_parent_leaves_as_flower_s_would_once_the_process_it_follows_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    raised: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    lines: list[str] = []
    executor = ForkExecutor(say=lines.append, parent_pid=ended.pid)
    executor.reconcile()
    executor.reconcile()
    assert raised == [signal.SIGINT]  # once: Flower's SIGINT handler closes and leaves
    assert str(ended.pid) in lines[0]
    alive = ForkExecutor(say=lines.append, parent_pid=os.getpid())
    alive.reconcile()
    assert raised == [signal.SIGINT]


def test_a_non_positive_task_timeout_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match="-1"):
        ForkExecutor(task_timeout=-1)
    with pytest.raises(SystemExit):
        warm_executor.main(["--insecure", "--task-timeout", "0"])


def test_preload_imports_what_it_can_and_names_what_it_cannot() -> None:
    missing = warm_executor.preload(["json", "no_such_module_for_the_warm_executor"])
    assert missing == ["no_such_module_for_the_warm_executor"]


# ------------------------------------------------------------------------- release and supervisor
@pytest.mark.parametrize(
    ("version", "supported"), [("1.21.0", False), ("1.38.2", False), ("1.39.0", True)]
)
def test_the_warm_executor_needs_flower_1_39_and_later_releases_default_to_it(
    version: str, supported: bool
) -> None:
    release = FlowerRelease(version)
    assert (release.warm_executor_problem() is None) is supported
    assert release.default_executor() == ("warm" if supported else "subprocess")
    if not supported:
        assert "--executor subprocess" in str(release.warm_executor_problem())
    assert FlowerRelease("1.42.0").supernode_isolation("warm") == ["--isolation", "process"]
    assert FlowerRelease("1.42.0").supernode_isolation("subprocess") == [
        "--isolation",
        "subprocess",
    ]


def test_the_warm_executor_dials_the_supernode_s_runtime_api_with_its_tls() -> None:
    plain = supervise.warm_executor_command(["--insecure", "--port", "9200"], [], 600.0)
    assert plain[plain.index("--runtime-api-address") + 1] == "127.0.0.1:9200"
    assert "--insecure" in plain
    served = supervise.warm_executor_command(
        ["--host=0.0.0.0", "--port", "9300", "--ssl-ca-certfile", "/certs/ca.crt"],
        ["torchvision"],
        30.0,
    )
    assert served[served.index("--runtime-api-address") + 1] == "127.0.0.1:9300"
    assert served[served.index("--root-certificates") + 1] == "/certs/ca.crt"
    assert served[served.index("--preload") + 1] == "torchvision"
    assert served[served.index("--task-timeout") + 1] == "30"
    assert supervise.runtime_api_dial_address([]) == "127.0.0.1:9094"  # Flower's default
    warmed = supervise.warm_executor_command(
        ["--node-config", "partition-id=1 num-partitions=2"], [], 30.0, warm="app.task:warm"
    )
    assert warmed[warmed.index("--warm") + 1] == "app.task:warm"
    assert warmed[warmed.index("--node-config") + 1] == "partition-id=1 num-partitions=2"
    assert "--warm" not in plain


def test_take_option_removes_every_form_of_a_flag_and_keeps_the_rest() -> None:
    arguments = ["--isolation", "process", "--insecure", "--isolation=subprocess", "--port", "1"]
    assert supervise.take_option(arguments, "--isolation") == "subprocess"
    assert arguments == ["--insecure", "--port", "1"]


def test_ba_supernode_refuses_flower_s_subprocess_isolation_with_the_warm_executor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as leaving:
        supervise.main(["--executor", "warm", "--isolation", "subprocess", "--insecure"])
    assert leaving.value.code == 2
    assert "--executor subprocess" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- ba-deploy
def test_ba_deploy_refuses_a_fleet_transport_the_installed_flower_does_not_speak(
    capsys: pytest.CaptureFixture[str],
) -> None:
    release = FlowerRelease.installed()
    other = "http" if release.transport == "grpc" else "grpc"
    with pytest.raises(SystemExit) as leaving:
        deploy.main(["local", "--fleet", other])
    assert leaving.value.code == 2
    error = capsys.readouterr().err
    assert f"flwr {release.version}" in error
    assert "ba-deploy" in error  # which environment's ba-deploy to run instead


def test_ba_deploy_refuses_fewer_than_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        deploy.main(["local", "--nodes", "0"])
    assert "--nodes must be 1 or more, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_ba_deploy_refuses_a_pull_interval_that_is_not_positive_seconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as leaving:
        deploy.main(["local", "--pull-every", value])
    assert leaving.value.code == 2
    assert f"--pull-every must be positive seconds, got {float(value):g}" in capsys.readouterr().err


def handshake(certificates: deploy.Certificates, hostname: str) -> str:
    """A TLS handshake on loopback between a server with the SuperLink's certificate and a
    client that trusts only the CA, for ``hostname``; the negotiated version."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(certificates.server_cert, certificates.server_key)
    client_context = ssl.create_default_context(cafile=str(certificates.ca_cert))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        failures: list[BaseException] = []

        def serve() -> None:
            connection, _ = listener.accept()
            try:
                with server_context.wrap_socket(connection, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError) as error:
                failures.append(error)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            client_context.wrap_socket(raw, server_hostname=hostname) as tls,
        ):
            version = str(tls.version())
            tls.sendall(b"x")
        thread.join(timeout=10)
    assert not failures, failures
    return version


def test_ba_deploy_tls_certificates_verify_for_the_loopback_names_and_only_those(
    tmp_path: Path,
) -> None:
    certificates = deploy.loopback_certificates(tmp_path / "certs")
    assert certificates.server_key.stat().st_mode & 0o077 == 0  # private to its owner
    for name in ("localhost", "127.0.0.1"):
        assert handshake(certificates, name).startswith("TLS")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(certificates, "superlink.example")


def test_the_printed_connection_runs_flwr_against_this_deployment(tmp_path: Path) -> None:
    deployment = deploy.LocalDeployment(None, tmp_path, executor="warm")
    lines = deploy.connection_lines(deployment, 4)
    command = next(line for line in lines if "flwr run" in line)
    assert f"FLWR_HOME={deployment.flwr_home}" in command
    assert f"flwr run . {deploy.CONNECTION}" in command
    assert "num-clients=4" in command
    assert any("warm executor" in line for line in lines)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_a_signal_to_one_clientapp_ends_it_alone(outbox: Path, signum: int) -> None:
    # The parent runs Flower's exit handlers on these signals (they would stop every child); a
    # child must take the default action instead, and leave its siblings running.
    said: list[str] = []
    executor = ForkExecutor(say=said.append)
    # What Flower's SuperExec registers in the parent: on the signal, its exit handlers run.
    previous = signal.signal(signum, lambda *_: (outbox / "parent-handler-ran").touch())
    try:
        executor.launch(spec("hang-a", task_id=1))
        executor.launch(spec("hang-b", task_id=2))
    finally:
        signal.signal(signum, previous)
    deadline = time.monotonic() + 30
    while not (outbox / "hang-a.json").exists() or not (outbox / "hang-b.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        target, sibling = (seen(outbox, token)["pid"] for token in ("hang-a", "hang-b"))
        os.kill(target, signum)
        deadline = time.monotonic() + 30
        while target in executor.children:
            assert time.monotonic() < deadline
            executor.reconcile()
            time.sleep(0.02)
        assert sibling in executor.children
        os.kill(sibling, 0)  # still running
        assert any("task 1" in line for line in said)
        assert not (outbox / "parent-handler-ran").exists()
    finally:
        executor.close()  # also when an assertion failed: no hanging child left
