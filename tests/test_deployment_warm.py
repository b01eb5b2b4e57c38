"""The warm ClientApp executor in a real deployment (SuperLink and SuperNodes as local processes).

- the same seed trains the same model with the warm executor as with Flower's subprocess
  isolation (a fresh ``flwr-clientapp`` per message);
- a ClientApp that raises, is killed, or hangs past the task timeout fails only its own message:
  round 1 closes with the other replies, and in round 2 the same warm executors serve every
  node again (tests/crashing_app.py);
- ``ba-deploy local --tls`` brings a federation up, the command it prints runs an app on it, and
  Ctrl-C leaves no process behind.

Killing the warm parent mid-run is in tests/test_deployment_recovery.py, beside the other
``kill -9`` cases. CI runs every test here on flwr 1.39 and the crash test, with the parent's
``kill -9``, also on the newest Flower (``http_fleet``; all of them passed there on 1.42.0).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.deploy.warm_executor import CHILD_NAME, PARENT_NAME, READY
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runs.folder import read_summary
from beyond_averaging.server.runtime.processes import descendants, free_port
from tests.deploy_helpers import (
    REPO,
    LocalDeployment,
    assert_same_final_model,
    lean_round,
    read_metrics,
    stage_app,
)

pytestmark = pytest.mark.deployment

BA_DEPLOY = Path(sys.executable).parent / "ba-deploy"
#: Long enough for an honest round-1 ClientApp on a loaded 2-core machine (5 s was not).
TASK_TIMEOUT = 30.0
FLWR = str(Path(sys.executable).parent / "flwr")
#: The names (``comm``) of the processes a deployment runs.
DEPLOYMENT_PROCESSES = {
    "flower-superlin",
    "flower-supernod",
    "flower-superexe",
    "flwr-serverapp",
    "ba-supernode",
    PARENT_NAME,
    CHILD_NAME,
}


def comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def two_rounds(name: str, workdir: Path, nodes: int) -> dict[str, Any]:
    return {
        **lean_round(nodes),
        "num-server-rounds": 2,
        "run-name": name,
        "output-dir": str(workdir / "runs"),
    }


def train_twice(workdir: Path, executor: str) -> tuple[Path, LocalDeployment]:
    """Two rounds of FedAvg on 2 SuperNodes run by ``executor``; the run folder."""
    with LocalDeployment(REPO, workdir, file_state=False, executor=executor) as deployment:  # type: ignore[arg-type]
        for partition in range(2):
            deployment.start_supernode(partition, 2)
        deployment.wait_for_nodes(2)
        run_dir = deployment.run(two_rounds(executor, workdir, 2), timeout=600.0)
        logs = "".join(node.log() for node in deployment.supernodes)
    assert (READY in logs) is (executor == "warm")
    return run_dir, deployment


def test_the_warm_executor_trains_the_model_flower_s_subprocess_isolation_trains(
    tmp_path: Path,
) -> None:
    warm, _ = train_twice(tmp_path / "warm", "warm")
    fresh, _ = train_twice(tmp_path / "subprocess", "subprocess")
    assert_same_final_model(warm, fresh, "warm and subprocess")
    assert [m["test-accuracy"] for m in read_metrics(warm)] == pytest.approx(
        [m["test-accuracy"] for m in read_metrics(fresh)], abs=1e-6
    )


@pytest.mark.http_fleet
def test_clientapps_that_raise_are_killed_or_hang_fail_only_their_own_messages(
    tmp_path: Path,
) -> None:
    crashes = ["raise", "kill", "hang", "", ""]
    nodes = len(crashes)
    deployment = LocalDeployment(
        REPO, tmp_path, file_state=False, executor="warm", task_timeout=TASK_TIMEOUT
    )
    with deployment:
        deployment.use_clientapp("tests.crashing_app:app")
        for partition, crash in enumerate(crashes):
            deployment.start_supernode(
                partition,
                nodes,
                node_config=(
                    f'crash="{crash}" crash-marker="{tmp_path / f"crashed-{partition}"}"'
                    if crash
                    else ""
                ),
            )
        deployment.wait_for_nodes(nodes)
        executors = {pid for pid in descendants(os.getpid()) if comm(pid) == PARENT_NAME}
        assert len(executors) == nodes
        settings = {
            **two_rounds("crashes", tmp_path, nodes),
            "round-timeout": 120.0,
            "min-train-replies": 2,
        }
        run_dir = deployment.run(settings, timeout=600.0)
        after = {pid for pid in descendants(os.getpid()) if comm(pid) == PARENT_NAME}
        logs = "".join(node.log() for node in deployment.supernodes)
    first, second = read_metrics(run_dir)[1:]
    # Round 1: the two honest replies; Flower's SuperNode answers each failed ClientApp's
    # message with an error reply as soon as the executor has reaped it (raised: at once;
    # killed: at once; hung: after the task timeout), so the round waits for no timeout.
    assert first["replies-valid"] == 2
    assert first["dropped-error-reply"] == 3
    assert first["round-seconds"] < settings["round-timeout"]
    assert second["replies-valid"] == nodes  # every node again, crashed ones included
    assert all((tmp_path / f"crashed-{p}").exists() for p in range(3))  # each failed once
    assert after == executors  # no warm parent died with its ClientApp
    assert "ran past the task timeout" in logs
    assert re.search(r"ended with signal 9", logs)
    assert read_summary(run_dir)["status"] == "completed"


def test_ba_deploy_local_runs_an_app_over_tls_and_stops_everything_on_ctrl_c(
    tmp_path: Path,
) -> None:
    app = stage_app(REPO, tmp_path / "app")
    workdir = tmp_path / "d"
    process = subprocess.Popen(
        [
            str(BA_DEPLOY),
            "local",
            "--nodes",
            "2",
            "--tls",
            "--resources",
            "--workdir",
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        printed: list[str] = []
        deadline = time.monotonic() + 300
        while not any("Ctrl-C" in line for line in printed):
            assert time.monotonic() < deadline, "".join(printed)
            line = process.stdout.readline()
            assert line, f"ba-deploy ended early ({process.poll()}):\n{''.join(printed)}"
            printed.append(line)
        text = "".join(printed)
        assert "TLS" in text
        assert "warm executor" in text
        command = next(line for line in printed if "flwr run" in line)
        flwr_home = re.search(r"FLWR_HOME=(\S+)", command)
        assert flwr_home is not None
        started = set(descendants(process.pid))
        assert {comm(pid) for pid in started} >= {"flower-superlin", "ba-supernode", PARENT_NAME}
        settings = {**lean_round(2), "run-name": "deployed", "output-dir": str(tmp_path / "runs")}
        env = {**os.environ, "FLWR_HOME": flwr_home.group(1)}
        argv = shlex.split(command.split("flwr run", 1)[1].split("--run-config")[0])
        ran = subprocess.run(
            [FLWR, "run", str(app), *argv[1:], "--run-config", run_config_argument(settings)],
            env=env,
            cwd=app,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        summary = read_summary(tmp_path / "runs" / "deployed")
        assert summary["status"] == "completed", ran.stdout + ran.stderr
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
        report = process.stdout.read()
        # --resources: what each node cost while up; each trained a round in forked ClientApps.
        usage = json.loads((workdir / "resources.json").read_text(encoding="utf-8"))["groups"]
        assert list(usage) == ["SuperLink", "node 0", "node 1"]
        for label in ("node 0", "node 1"):
            assert f"  {label}" in report
            assert usage[label]["processes"] >= 4  # ba-supernode, SuperNode, executor, ClientApp
            assert usage[label]["cpu-seconds"] > 0
            assert usage[label]["peak-pss-mib"] <= usage[label]["peak-rss-mib"]
        assert usage["SuperLink"]["processes"] >= 3  # SuperLink, SuperExec, ServerApp
    finally:
        if process.poll() is None:  # a failed assertion: stop it as a user would, then for good
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    time.sleep(1.0)
    alive = [(pid, comm(pid)) for pid in started if comm(pid) in DEPLOYMENT_PROCESSES]
    assert alive == []


def test_a_ba_deploy_killed_with_sigkill_leaves_no_superlink_or_supernode(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [str(BA_DEPLOY), "local", "--nodes", "1", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 300
    for line in process.stdout:
        if "Ctrl-C" in line:
            break
        assert time.monotonic() < deadline
    started = set(descendants(process.pid))
    assert {comm(pid) for pid in started} >= {"flower-superlin", "ba-supernode"}
    process.kill()  # SIGKILL: ba-deploy cannot stop anything itself
    process.wait()
    deadline = time.monotonic() + 60
    while alive := [(pid, comm(pid)) for pid in started if comm(pid) in DEPLOYMENT_PROCESSES]:
        assert time.monotonic() < deadline, alive
        time.sleep(0.5)


# ----------------------------------------- docs: "Your own app on the warm executor"
USER_SECTION = "### Your own app on the warm executor"
#: The ports the section prints, in the order the test replaces them with free ones (another
#: deployment on this machine may hold the printed ones).
PRINTED_PORTS = ("9092", "9093", "9094", "9095")


def user_section_blocks() -> list[str]:
    """The ``bash`` blocks of docs/deployment.md's user section: flwr 1.39's, then 1.40+'s."""
    text = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")
    section = text[text.index(USER_SECTION) :]
    section = section[: section.index("\n## ")]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)


def test_the_user_section_runs_as_printed(tmp_path: Path) -> None:
    blocks = user_section_blocks()
    assert len(blocks) == 2
    release = FlowerRelease.installed()
    block = blocks[0 if release.transport == "grpc" else 1]
    for printed in PRINTED_PORTS:  # 1.40+ has no Fleet port of its own (9092)
        block = block.replace(printed, str(free_port()))
    app = tmp_path / "app"
    shutil.copytree(REPO / "tests" / "apps" / "quickstart", app)
    config = app / "pyproject.toml"
    one_round = config.read_text(encoding="utf-8").replace(
        "num-server-rounds = 3", "num-server-rounds = 1"
    )
    config.write_text(one_round, encoding="utf-8")
    # The section's commands are the installed ones (a user's activated environment).
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    shell = subprocess.Popen(
        ["bash", "-e", "-c", block],
        cwd=app,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the block's background processes share its group
    )
    try:
        streamed, _ = shell.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and group_alive(shell.pid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    logs = {path.name: path.read_text(errors="replace") for path in sorted(app.glob("*.log"))}
    tail = streamed[-4000:] + "".join(f"\n--- {n}\n{log[-2000:]}" for n, log in logs.items())
    assert shell.returncode == 0, tail
    assert "Saving final model to disk" in streamed, tail
    assert (app / "final_model.pt").exists() or "final_model" in streamed, tail
    for node in ("supernode-0.log", "supernode-1.log"):
        assert READY in logs[node], tail


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
