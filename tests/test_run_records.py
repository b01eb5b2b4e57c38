"""What ``ba-run`` shows and keeps of a run, and what it refuses before anything starts.

- Watch: off a terminal the console carries plain lines (no ANSI colour codes), on a terminal a
  progress bar (rounds done of the total, time left, test accuracy and loss, replies kept), and
  the whole console log lands in ``<run>/log.txt`` without colour codes.
- Keep: ``summary.json`` records the versions, the checkout's commit and whether it was dirty,
  the command line, start and end times, host, CPU and GPU; wall time adds up over a resume.
- No lost runs: a run-name that names a finished, failed, interrupted or running run is refused
  (exit 1) with the ways on, in both runtimes, before anything starts; ``--overwrite`` replaces
  a run that is not running.
- ``-c`` takes TOML files and pairs, the later winning; an unknown key is refused with the
  closest known key.

Runs use the in-process runtime (the real ServerApp and ClientApp, a few seconds each).
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import datetime, timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import beyond_averaging
from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.overrides import parse_overrides, run_config_argument
from beyond_averaging.server.runs import provenance
from beyond_averaging.server.runs.folder import read_summary
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.runtime import launch as launcher
from beyond_averaging.server.runtime.watch import (
    RunConsole,
    eta_seconds,
    round_figures,
    strip_ansi,
    warning_line,
)
from tests.deploy_helpers import REPO, read_metrics
from tests.test_run_outcomes import LEAN as LEAN_RUN

BA_RUN = Path(sys.executable).parent / "ba-run"
LEAN: dict[str, Any] = {**LEAN_RUN, "num-server-rounds": 2}
ESC = "\x1b"


def settings_for(tmp_path: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {**LEAN, "run-name": name, "output-dir": str(tmp_path), **extra}


def ba_run_inprocess(settings: dict[str, Any], *arguments: str) -> int:
    return ba_run(
        [
            "--app",
            str(REPO),
            "--runtime",
            "inprocess",
            *arguments,
            "-c",
            run_config_argument(settings),
        ]
    )


def ba_run_process(
    settings: dict[str, Any], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``ba-run --runtime inprocess`` as a user starts it, its output captured (not a TTY)."""
    base = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return subprocess.run(
        [str(BA_RUN), "--runtime", "inprocess", "-c", run_config_argument(settings)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**base, **(env or {})},
    )


def summary_of(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))


# --- watch ---------------------------------------------------------------------------------
def test_off_a_terminal_the_console_is_plain_lines_and_all_of_it_is_in_log_txt(
    tmp_path: Path,
) -> None:
    done = ba_run_process(settings_for(tmp_path, "piped"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ESC not in done.stdout + done.stderr  # Flower's log lines carried colour codes
    log_file = tmp_path / "piped" / "log.txt"
    assert log_file.stat().st_mode & 0o777 == 0o600  # as every file of the run folder
    log = log_file.read_text(encoding="utf-8")
    assert ESC not in log
    for line in ("round 2/2 | test accuracy", "[ROUND 1/2]", "ba-run: run completed"):
        assert line in done.stdout
        assert line in log
    assert re.search(r"ba-run: final test accuracy \d\.\d{4} after round 2\n", log)
    assert "rounds | ETA" not in done.stdout  # no progress bar off a terminal


def test_on_a_terminal_a_progress_bar_shows_rounds_eta_accuracy_loss_and_replies_kept(
    tmp_path: Path,
) -> None:
    # FORCE_COLOR: rich's (and https://force-color.org's) way to say "this is a terminal".
    done = ba_run_process(
        settings_for(tmp_path, "tty", **{"num-server-rounds": 3}),
        env={"FORCE_COLOR": "1", "TERM": "xterm", "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rounds = read_metrics(tmp_path / "tty")
    screen = strip_ansi(done.stdout)
    assert re.search(r"3/3 rounds \| ETA 0:00 \| ", screen)
    last = rounds[-1]
    assert f"acc {last['test-accuracy']:.4f} | loss {last['test-loss']:.4f}" in screen
    assert f"replies kept {last['replies-valid']}/{last['replies-sent']}" in screen
    log = (tmp_path / "tty" / "log.txt").read_text(encoding="utf-8")
    assert ESC not in log
    assert "rounds | ETA" not in log  # the bar is the terminal's, not the log's
    assert "round 3/3 | test accuracy" in log
    # The bar's final state is drawn before the closing lines, not under them.
    assert screen.rindex("3/3 rounds") < screen.index("ba-run: run completed")


def test_the_closing_line_lists_every_file_the_run_wrote_tracker_folders_included(
    tmp_path: Path,
) -> None:
    done = ba_run_process(settings_for(tmp_path, "files", tracker="tensorboard"))
    assert done.returncode == 0, done.stdout + done.stderr
    listed = re.search(r"ba-run: in the run folder: (.*)\n", done.stdout)
    assert listed is not None, done.stdout
    names = listed.group(1).split(", ")
    for name in (
        "clients.jsonl",
        "curves.png",
        "log.txt",
        "metrics.csv",
        "metrics.jsonl",
        "partitions.png",
        "summary.json",
        "tensorboard/",
    ):
        assert name in names
    on_disk = sorted(p.name for p in (tmp_path / "files").iterdir() if not p.name.startswith("."))
    assert [name.rstrip("/") for name in names] == on_disk
    # A tracker's own place (an MLflow store lies outside the folder) is named with how to open it.
    where = re.search(r"ba-run: tracker tensorboard: (.*)\n", done.stdout)
    assert where is not None, done.stdout
    assert "tensorboard --logdir" in where.group(1)
    assert read_summary(tmp_path / "files")["tracker"]["name"] == "tensorboard"


def test_status_prints_the_accuracy_to_four_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "rounded"
    run_dir.mkdir()
    summary = {
        "status": "completed",
        "rounds-completed": 2,
        "config": {"num-server-rounds": 2},
        "final": {"round": 2, "test-accuracy": 0.912345678},
        "updated-at": "2026-01-01T00:00:00+00:00",
    }
    (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    assert ba_run(["--status", str(run_dir)]) == 0
    assert "2 of 2 rounds, test accuracy 0.9123, updated" in capsys.readouterr().out


def test_the_time_left_leaves_out_the_first_rounds_warm_up_and_shows_once_round_2_ends() -> None:
    rounds = [{"round": 0, "round-seconds": 100.0}]  # the initial evaluation is no round
    rounds += [{"round": r, "round-seconds": s} for r, s in enumerate([30, 2, 4, 6, 8], 1)]
    # Round 1's 30 s are Ray's warm-up: rounds 2-5 took 2, 4, 6, 8 s, 5 s each; 5 of 10 left.
    assert eta_seconds(rounds, 10) == pytest.approx(25.0)
    assert eta_seconds(rounds[:2], 10) is None  # round 1 alone says nothing of the rest
    assert eta_seconds(rounds[:3], 10) == pytest.approx(8 * 2.0)
    # After a resume at round 3, round 4 is the launch's warm-up: round 5's 8 s remain.
    assert eta_seconds(rounds, 10, first_round=4) == pytest.approx(5 * 8.0)
    entry = {"test-accuracy": 0.91234, "test-loss": 0.3, "replies-valid": 7, "replies-sent": 9}
    assert round_figures(entry) == "acc 0.9123 | loss 0.3000 | replies kept 7/9"


RAY_WARNING = (
    "/venv/lib/python3.11/site-packages/ray/_private/worker.py:2053: FutureWarning: Tip: In "
    "future versions of Ray, Ray will no longer override accelerator visible devices env var"
)


def test_a_child_processs_python_warning_is_one_log_line_above_the_bar(tmp_path: Path) -> None:
    assert warning_line(RAY_WARNING) == (
        "WARNING :   FutureWarning: Tip: In future versions of Ray, Ray will no longer override "
        "accelerator visible devices env var (worker.py:2053)"
    )
    assert warning_line("INFO :      round 1/3 | test accuracy 0.5") is None
    screen = io.StringIO()
    with RunConsole(tmp_path / "run", 3, stream=screen, terminal=False) as console:
        for text in (RAY_WARNING, "  warnings.warn(", "INFO :      [ROUND 1]", "  indented"):
            console.line(text)
        console.line("50%\r100% done")  # a child's progress meter redraws its line
    lines = screen.getvalue().splitlines()
    assert lines == [
        "WARNING :   FutureWarning: Tip: In future versions of Ray, Ray will no longer override "
        "accelerator visible devices env var (worker.py:2053)",
        "INFO :      [ROUND 1]",
        "  indented",  # only the line under a warning is its source echo
        "100% done",
    ]
    assert (tmp_path / "run" / "log.txt").read_text(encoding="utf-8").splitlines() == lines


def test_colour_codes_of_flower_and_rich_are_removed() -> None:
    from flwr.supercore.logger import LOG_COLORS

    coloured = f"{LOG_COLORS['WARNING']}WARNING {LOG_COLORS['RESET']}:   x \x1b[1;32mok\x1b[0m"
    assert strip_ansi(coloured) == "WARNING :   x ok"
    assert strip_ansi("\x1b]8;;http://a\x1b\\link\x1b]8;;\x1b\\") == "link"


# --- keep ----------------------------------------------------------------------------------
def git(*arguments: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *arguments], capture_output=True, text=True, check=True
    ).stdout


def test_the_summary_records_versions_commit_command_line_times_host_cpu_and_gpu(
    tmp_path: Path,
) -> None:
    settings = settings_for(tmp_path, "kept")
    before = datetime.now().astimezone()
    assert ba_run_inprocess(settings) == 0
    summary = summary_of(tmp_path / "kept")
    environment = summary["environment"]
    assert environment["versions"] == {
        "python": platform.python_version(),
        "flwr": version("flwr"),
        "torch": version("torch"),
        "numpy": np.__version__,
        "beyond-averaging": beyond_averaging.__version__,
    }
    assert environment["git"] == {
        "commit": git("rev-parse", "HEAD").strip(),
        "dirty": bool(git("status", "--porcelain").strip()),
        "checkout": str(REPO),
    }
    assert summary["command-line"].startswith("ba-run --app ")
    assert "--runtime inprocess" in summary["command-line"]
    assert "run-name=" in summary["command-line"]
    started = datetime.fromisoformat(summary["started-at"])
    ended = datetime.fromisoformat(summary["ended-at"])
    assert started.utcoffset() == timedelta(0)  # UTC
    assert before.replace(microsecond=0) <= started <= ended
    assert environment["host"] == socket.gethostname()
    assert environment["cpu"]["cores"] == os.cpu_count()
    # Machines of one model name differ in these, and torch's float kernels with them.
    assert environment["cpu"]["vector-instructions"] == torch.backends.cpu.get_cpu_capability()
    assert environment["gpu"] == [
        torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
    ]
    assert [s["command-line"] for s in summary["sessions"]] == [summary["command-line"]]


def test_no_checkout_or_no_git_records_no_commit_and_never_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert provenance.git_state(tmp_path) is None  # a folder that is no repository
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on this machine
    assert provenance.git_state(REPO) is None
    # An installed wheel: site-packages is never taken for a checkout.
    package = tmp_path / "site-packages" / "beyond_averaging"
    package.mkdir(parents=True)
    monkeypatch.setattr(beyond_averaging, "__file__", str(package / "__init__.py"))
    assert provenance.source_checkout() is None
    assert provenance.run_environment()["git"] is None


def test_wall_time_and_sessions_add_up_over_a_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "long"
    assert ba_run_inprocess(settings_for(tmp_path, "long")) == 0
    first = summary_of(run_dir)
    assert (
        ba_run(["--resume", str(run_dir), "--runtime", "inprocess", "-c", "num-server-rounds=3"])
        == 0
    )
    second = summary_of(run_dir)
    assert [s["command-line"].split()[1] for s in second["sessions"]] == ["--app", "--resume"]
    earlier, resumed = second["sessions"]
    assert earlier["wall-seconds"] == first["wall-seconds"]
    assert resumed["wall-seconds"] > 0
    assert second["wall-seconds"] == pytest.approx(
        first["wall-seconds"] + resumed["wall-seconds"], abs=2e-3
    )
    assert second["started-at"] == first["started-at"]
    assert second["ended-at"] == resumed["ended-at"] >= first["ended-at"]
    log = (run_dir / "log.txt").read_text(encoding="utf-8")
    assert "round 2/2 | test accuracy" in log  # the first session's log is kept
    assert "---- resumed at" in log
    assert "round 3/3 | test accuracy" in log


# --- no lost runs --------------------------------------------------------------------------
def folder_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def refuse_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any run starting (either runtime) fails the test: the refusal comes before."""

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a run started")

    monkeypatch.setattr(launcher, "launch", started)
    monkeypatch.setattr(launcher, "launch_inprocess", started)


def test_a_finished_run_survives_a_second_ba_run_with_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path, "same", **{"num-server-rounds": 3})
    assert ba_run_inprocess(settings) == 0
    run_dir = tmp_path / "same"
    kept = folder_bytes(run_dir)
    capsys.readouterr()
    refuse_to_start(monkeypatch)
    again = {**settings, "num-server-rounds": 1}
    for runtime in launcher.RUNTIMES:
        code = ba_run(["--app", str(REPO), "--runtime", runtime, "-c", run_config_argument(again)])
        assert code == 1
        error = capsys.readouterr().err
        assert f"run folder {run_dir} already holds run 'same' (completed, 3 of 3" in error
        assert f"ba-run --resume {run_dir}" in error
        assert "-c run-name=" in error
        assert "--overwrite" in error
        assert folder_bytes(run_dir) == kept  # metrics, summary, model, checkpoint, log
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_interrupted_failed_and_running_runs_are_refused_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_to_start(monkeypatch)
    for status in ("interrupted", "failed"):
        RunRecorder(tmp_path, status, {"num-server-rounds": 5}).write_summary(status)
        assert ba_run_inprocess(settings_for(tmp_path, status)) == 1
        assert f"already holds run '{status}' ({status}, 0 of 5" in capsys.readouterr().err
    live = RunRecorder(tmp_path, "live", {"num-server-rounds": 5})  # holds the owner lock
    try:
        assert ba_run_inprocess(settings_for(tmp_path, "live"), "--overwrite") == 1
        assert "run 'live' is running right now" in capsys.readouterr().err
        assert (tmp_path / "live" / "summary.json").is_file()
    finally:
        live.close()


def test_overwrite_replaces_a_finished_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ba_run_inprocess(settings_for(tmp_path, "again", **{"num-server-rounds": 3})) == 0
    assert ba_run_inprocess(settings_for(tmp_path, "again"), "--overwrite") == 0
    assert "--overwrite: deleted the earlier run" in capsys.readouterr().err
    run_dir = tmp_path / "again"
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert summary_of(run_dir)["config"]["num-server-rounds"] == 2
    assert "round 3/3" not in (run_dir / "log.txt").read_text(encoding="utf-8")


# --- -c ------------------------------------------------------------------------------------
def test_run_config_takes_a_toml_file_and_pairs_after_it_win(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = tmp_path / "my-run.toml"
    options.write_text(
        'run-name = "from-file"\nstrategy = "elastic"\nseed = 4\nnum-server-rounds = 2\n'
        f'output-dir = "{tmp_path}"\nnum-clients = 3\nlocal-epochs = 1\ndevice = "cpu"\n',
        encoding="utf-8",
    )
    assert parse_overrides([str(options), "seed=5"])["seed"] == 5
    assert parse_overrides(["seed=5", str(options)])["seed"] == 4
    code = ba_run(["--runtime", "inprocess", "-c", str(options), "-c", "seed=5 local-epochs=2"])
    assert code == 0, capsys.readouterr().err
    config = summary_of(tmp_path / "from-file")["config"]
    assert (config["strategy"], config["seed"], config["local-epochs"]) == ("elastic", 5, 2)
    assert config["num-server-rounds"] == 2


def test_an_unknown_key_is_refused_with_the_closest_key_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_to_start(monkeypatch)
    options = tmp_path / "typo.toml"
    options.write_text("local-epoch = 3\n", encoding="utf-8")
    for runtime in launcher.RUNTIMES:
        for given in (["-c", "num-server-round=3"], ["-c", str(options)]):
            assert ba_run(["--app", str(REPO), "--runtime", runtime, *given]) == 2
            error = capsys.readouterr().err
            wanted = "num-server-rounds" if "round" in given[1] else "local-epochs"
            assert f"did you mean '{wanted}'?" in error
    assert not (tmp_path / "runs").exists()
    assert ba_run(["--app", str(REPO), "-c", str(tmp_path / "missing.toml")]) == 1
    assert "cannot read the file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="did you mean 'dirichlet-alpha'"):
        parse_run_config({"dirichlet-alfa": 0.3})  # a Flower app run without ba-run


@pytest.mark.parametrize(
    ("given", "line"),
    [
        (
            'strategy="fedav"',
            "key 'strategy' = 'fedav' is not allowed: allowed is 'fedavg', 'elastic', 'fedlaw' or "
            "'fedgma'; the closest allowed value is 'fedavg'",
        ),
        (
            "num-server-rounds=0",
            "key 'num-server-rounds' = 0 is not allowed: allowed is >= 1; the closest allowed "
            "value is 1",
        ),
        (  # a relation between keys (RunConfig's model validator), checked as early
            "min-train-replies=11 num-clients=10",
            "min-train-replies = 11 exceeds num-clients = 10",
        ),
    ],
)
def test_a_bad_value_is_refused_in_one_line_with_exit_2_before_anything_starts(
    given: str,
    line: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refuse_to_start(monkeypatch)
    runs = tmp_path / "runs"
    for runtime in launcher.RUNTIMES:
        overrides = f'{given} output-dir="{runs}"'
        assert ba_run(["--app", str(REPO), "--runtime", runtime, "-c", overrides]) == 2
        error = capsys.readouterr().err
        assert error.startswith("ba-run: error: invalid run configuration: ")
        assert line in error
        assert error.count("\n") == 1  # one line, no traceback
    assert not runs.exists()


def test_the_readme_default_run_logs_no_warning(tmp_path: Path) -> None:
    # The README's run, shortened: digits, Dirichlet 0.5, 10 clients, every other option its
    # default. Its clients disagree from round 1 (label skew), which turns the direction check
    # off as the docs describe: a note, not a warning, for a user who changed nothing.
    settings = {"num-server-rounds": 2, "run-name": "default", "output-dir": str(tmp_path)}
    assert ba_run_inprocess(settings) == 0
    log = (tmp_path / "default" / "log.txt").read_text(encoding="utf-8")
    assert "direction check" in log  # the note is there, and said at INFO
    assert [line for line in log.splitlines() if "WARNING" in line] == []


def test_a_refused_ray_address_leaves_no_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_to_start(monkeypatch)
    runs = tmp_path / "runs"
    given = ["--runtime", "inprocess", "--ray-address", "127.0.0.1:1"]
    assert ba_run(["--app", str(REPO), *given, "-c", f'output-dir="{runs}"']) == 1
    assert "the 'inprocess' runtime uses no Ray" in capsys.readouterr().err
    assert not runs.exists()


# --- smaller -------------------------------------------------------------------------------
def test_the_strategy_banner_names_the_least_connected_nodes_a_round_waits_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from beyond_averaging import FedAvg

    with caplog.at_level("INFO", logger="flwr"):
        FedAvg(min_available_nodes=2).summary()
    text = caplog.text
    assert "available 2" not in text  # read as "2 nodes are up" while 10 were
    assert "a round waits for at least 2 connected nodes (min_available_nodes)" in text


def test_the_cpu_s_family_and_model_numbers_come_from_the_first_processor_s_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two machines named "AMD EPYC" are told apart by these numbers (docs/benchmarks.md)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC 9454\n\nprocessor\t: 1\ncpu family\t: 23\nmodel\t\t: 49\n"
        "model name\t: another\n",
        encoding="utf-8",
    )
    real_path = provenance.Path
    monkeypatch.setattr(
        provenance,
        "Path",
        lambda name: cpuinfo if name == "/proc/cpuinfo" else real_path(name),
    )
    cpu = provenance.cpu_description()
    assert (cpu["model"], cpu["family"], cpu["model-number"]) == ("AMD EPYC 9454", "25", "17")
    assert provenance.hardware_line().startswith(
        f"AMD EPYC 9454 (family 25, model 17, {cpu['vector-instructions']}), "
    )
