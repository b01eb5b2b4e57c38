"""``ba-supernode`` keeps a SuperNode running: it starts it again when it ends, stops and starts
again one that the SuperLink forgot but that hangs, passes its output through, and stops for good
on SIGTERM. Stand-in processes (small Python scripts) play the SuperNode; the real one is
exercised by tests/test_deployment_recovery.py (``-m deployment``).
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from pathlib import Path

from beyond_averaging.server.deploy import supervise
from beyond_averaging.server.deploy.supervise import FORGOTTEN, Supervisor
from tests.conftest import REPO


def stand_in(tmp_path: Path, body: str) -> list[str]:
    """A command that runs ``body`` as a Python script (the SuperNode's stand-in)."""
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(body), encoding="utf-8")
    return [sys.executable, str(script)]


def run_until(supervisor: Supervisor, condition: object, timeout: float = 60.0) -> int:
    """Run the supervisor in a thread until ``condition()`` holds, then stop it."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)
    supervisor.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return result[0]


def test_the_console_script_is_the_supervisors_main() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    module, function = data["project"]["scripts"]["ba-supernode"].split(":")
    assert module == "beyond_averaging.server.deploy.supervise"
    assert getattr(supervise, function) is supervise.main


def test_a_process_that_ends_is_started_again_whatever_its_status(tmp_path: Path) -> None:
    # Flower's SuperNode exits with status 0 when a restarted SuperLink forgot it.
    starts = tmp_path / "starts"
    command = stand_in(
        tmp_path,
        f"""
        import sys
        with open({str(starts)!r}, "a") as f:
            f.write("x")
        sys.exit(0 if len(open({str(starts)!r}).read()) % 2 else 1)
        """,
    )
    output = io.BytesIO()
    supervisor = Supervisor(
        command, delay=0.01, healthy_after=0.0, say=lambda _: None, output=output
    )
    run_until(supervisor, lambda: starts.is_file() and len(starts.read_text()) >= 4)
    assert supervisor.starts >= 4


def test_a_forgotten_process_that_hangs_is_stopped_and_started_again(tmp_path: Path) -> None:
    # Flower's SuperNode sometimes logs "Invalid node ID" and then retries forever.
    starts = tmp_path / "starts"
    command = stand_in(
        tmp_path,
        f"""
        import time
        with open({str(starts)!r}, "a") as f:
            f.write("x")
        print("grpc error: details = {FORGOTTEN[0]!r}", flush=True)
        time.sleep(600)
        """,
    )
    output, said = io.BytesIO(), []
    supervisor = Supervisor(
        command, delay=0.01, healthy_after=0.0, exit_grace=0.5, say=said.append, output=output
    )
    run_until(supervisor, lambda: starts.is_file() and len(starts.read_text()) >= 2)
    assert FORGOTTEN[0].encode() in output.getvalue()  # its output was passed through
    assert any("unknown to the SuperLink" in line for line in said)


def test_a_process_that_cannot_join_is_started_again_after_a_doubling_delay(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    supervisor = Supervisor(
        stand_in(tmp_path, "import sys; sys.exit(1)"),
        delay=0.05,
        max_delay=0.2,
        healthy_after=60.0,
        say=said.append,
        output=io.BytesIO(),
    )
    run_until(supervisor, lambda: len(said) >= 4)
    delays = [float(line.rsplit("again in ", 1)[1].split(" s")[0]) for line in said[:4]]
    assert delays == [0.1, 0.2, 0.2, 0.2]


def test_a_process_that_ignores_the_stop_is_killed_after_the_exit_grace(tmp_path: Path) -> None:
    # A SuperNode told to stop while it retries a SuperLink that is gone has kept running; the
    # supervisor must not wait for it for ever.
    started = tmp_path / "started"
    command = stand_in(
        tmp_path,
        f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(started)!r}, "w").close()
        time.sleep(600)
        """,
    )
    said: list[str] = []
    supervisor = Supervisor(command, exit_grace=0.5, say=said.append, output=io.BytesIO())
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60.0
    while not started.is_file():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    supervisor.stop()
    thread.join(timeout=30.0)
    assert not thread.is_alive()  # run() returned: the process was killed, not waited for
    assert supervisor.child is not None
    assert supervisor.child.returncode == -signal.SIGKILL
    assert any("told to stop: killing it" in line for line in said)


def test_sigterm_stops_the_supervisor_and_its_process_for_good(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = tmp_path / "node.py"
    script.write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "print('up', flush=True)\ntime.sleep(600)\n",
        encoding="utf-8",
    )
    # ba-supernode's main, with the stand-in in place of flower-supernode, run as given (an
    # unpaced node, --pull-every 3: a paced one runs Flower's own entry point).
    program = (
        "import sys\nfrom beyond_averaging.server.deploy import supervise\n"
        "supervise.flower_supernode = lambda: sys.executable\n"
        f"raise SystemExit(supervise.main(['--pull-every', '3', {str(script)!r}]))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"up\n"  # the SuperNode's output, passed through
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM  # its process's status, as a shell
    child = int(pid_file.read_text())
    assert not Path(f"/proc/{child}").exists()  # ended and reaped, not left behind
    assert process.stdout.read() == b""  # nothing was started again
