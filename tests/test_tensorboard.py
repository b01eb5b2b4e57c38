"""TensorBoard's dashboards of a run (``tracker = "tensorboard"``), read by TensorBoard's code.

HParams through the HParams plugin itself (the session groups its dashboard lists: the run's
options, its status, each metric's final value), images, histograms and scalars through
TensorBoard's ``EventAccumulator``; every expected value comes from the run's own files
(summary.json, metrics.jsonl, clients.jsonl, the PNG files), not from the tracker's code.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from tensorboard import context
from tensorboard.backend import experiment_id
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import hparams_plugin, metadata
from werkzeug.test import EnvironBuilder

from beyond_averaging import track
from beyond_averaging.server.runs.tracking import RunTracking
from beyond_averaging.strategies import FedAvg
from beyond_averaging.strategies.tracking import open_tracker
from tests.test_tracking import (
    run_with,
    server_process,  # noqa: F401  (a fixture, by usefixtures)
    start_tracked,
)


def session_groups(logdir: Path) -> list[dict[str, Any]]:
    """The session groups TensorBoard's HParams dashboard shows for ``logdir``, as its plugin
    answers the dashboard's request (every status, metrics included)."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    tb_context = base_plugin.TBContext(
        logdir=str(logdir), multiplexer=multiplexer, data_provider=provider
    )
    route = hparams_plugin.HParamsPlugin(tb_context).get_plugin_apps()["/session_groups"]
    request = {
        "startIndex": 0,
        "sliceSize": 100,
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
        "colParams": [],
        "aggregationType": "AGGREGATION_AVG",
        "includeMetrics": True,
    }
    environ = EnvironBuilder(
        method="POST", data=json.dumps(request), content_type="application/json"
    ).get_environ()
    context.set_in_environ(environ, context.RequestContext())
    environ[experiment_id.WSGI_ENVIRON_KEY] = ""
    statuses: list[str] = []
    body = b"".join(route(environ, lambda status, headers: statuses.append(status)))
    assert statuses[0].startswith("200"), body.decode()
    groups: list[dict[str, Any]] = json.loads(body)["sessionGroups"]
    return groups


def events(run: Path) -> EventAccumulator:
    """Every event the run's TensorBoard folder holds (no sampling of images or histograms)."""
    accumulator = EventAccumulator(
        str(run / "tensorboard"), size_guidance={"images": 0, "histograms": 0, "scalars": 0}
    )
    accumulator.Reload()
    return accumulator


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One in-process run (3 clients, 2 rounds) with ``tracker = "tensorboard"``: the output
    folder and the run's folder."""
    output = tmp_path_factory.mktemp("tensorboard")
    run, _ = run_with("tensorboard", output)
    return output, run


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_hparams_dashboard_lists_the_runs_options_status_and_final_metrics(
    tensorboard_run: tuple[Path, Path],
) -> None:
    output, run = tensorboard_run
    [group] = session_groups(output)
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    assert set(group["hparams"]) == set(summary["config"])  # every option, no more
    assert group["hparams"]["strategy"] == "fedavg"
    assert group["hparams"]["num-server-rounds"] == 2
    assert group["hparams"]["diagnostics"] is False
    [session] = group["sessions"]
    assert session["name"] == "r/tensorboard"
    assert session["status"] == "STATUS_SUCCESS"
    final = jsonl(run / "metrics.jsonl")[-1]
    metrics = {m["name"]["tag"]: m for m in session["metricValues"]}
    for key in ("test-accuracy", "test-loss"):
        assert metrics[key]["value"] == pytest.approx(final[key], rel=1e-6), key
        assert metrics[key]["trainingStep"] == 2, key


def test_the_runs_figures_are_images_at_the_round_they_were_written_after(
    tensorboard_run: tuple[Path, Path],
) -> None:
    _, run = tensorboard_run
    recorded = events(run)
    assert sorted(recorded.Tags()["images"]) == ["figures/curves", "figures/partitions"]
    [partitions] = recorded.Images("figures/partitions")
    [curves] = recorded.Images("figures/curves")
    assert partitions.step == 0  # drawn before the first round
    assert curves.step == 2  # drawn once the last round ran
    assert partitions.encoded_image_string == (run / "partitions.png").read_bytes()
    assert curves.encoded_image_string == (run / "curves.png").read_bytes()
    assert curves.width > curves.height > 100


def test_each_round_has_histograms_of_its_clients_figures_and_counts_of_their_fates(
    tensorboard_run: tuple[Path, Path],
) -> None:
    _, run = tensorboard_run
    recorded = events(run)
    clients = jsonl(run / "clients.jsonl")
    assert {c["round"] for c in clients} == {1, 2}
    for figure in ("update-norm", "direction-cosine", "weight", "train-loss"):
        histograms = {h.step: h.histogram_value for h in recorded.Histograms(f"clients/{figure}")}
        # A round whose replies lack a figure (null in clients.jsonl) has no histogram of it.
        rounds = sorted({c["round"] for c in clients if c[figure] is not None})
        assert sorted(histograms) == rounds, figure
        for step, histogram in histograms.items():
            values = [c[figure] for c in clients if c["round"] == step and c[figure] is not None]
            assert histogram.num == len(values), (figure, step)
            assert histogram.sum == pytest.approx(sum(values)), (figure, step)
            assert histogram.min == pytest.approx(min(values)), (figure, step)
            assert histogram.max == pytest.approx(max(values)), (figure, step)
    assert "clients/trust" not in recorded.Tags()["histograms"]  # FedAvg has no trust
    for status in ("kept", "clipped", "dropped"):
        counts = {s.step: s.value for s in recorded.Scalars(f"clients/{status}")}
        expected = {
            r: sum(c["status"] == status for c in clients if c["round"] == r) for r in (1, 2)
        }
        assert counts == expected, status
    assert {s.step: s.value for s in recorded.Scalars("clients/kept")} == {1: 3, 2: 3}
    assert len(recorded.Histograms("clients/update-norm")) == 2  # both rounds, 3 replies each
    assert all(h.histogram_value.num == 3 for h in recorded.Histograms("clients/update-norm"))


def test_a_failed_runs_session_ends_failed_and_every_option_is_an_hparam(tmp_path: Path) -> None:
    """Options that are neither numbers nor text (None, a list) are HParams as their JSON."""
    tracker = open_tracker("tensorboard", tmp_path / "run", run_name="run")
    assert tracker is not None
    tracker.log_params({"lr": 0.1, "name": "x", "on": True, "off": None, "sizes": [1, 2]})
    tracker.close("failed")
    assert not tracker.failed
    recorded = events(tmp_path / "run")
    start_info = metadata.parse_session_start_info_plugin_data(
        recorded.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content
    )
    hparams = dict(start_info.hparams)
    assert hparams["lr"].number_value == 0.1
    assert hparams["name"].string_value == "x"
    assert hparams["on"].bool_value is True
    assert hparams["off"].string_value == "null"
    assert hparams["sizes"].string_value == "[1, 2]"
    [group] = session_groups(tmp_path)
    assert group["sessions"][0]["status"] == "STATUS_FAILURE"


@pytest.mark.usefixtures("server_process")
def test_track_sends_a_package_strategys_clients_as_histograms(tmp_path: Path) -> None:
    """A library user's app with this package's FedAvg: its per-reply records reach
    TensorBoard as they do from ba-run."""
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3)
    track(strategy, "tensorboard", directory=tmp_path, run_name="mine")
    start_tracked(strategy, rounds=2)
    recorded = events(tmp_path / "mine")
    norms = {h.step: h.histogram_value.num for h in recorded.Histograms("clients/update-norm")}
    assert norms == {1: 3, 2: 3}
    assert {s.step: s.value for s in recorded.Scalars("clients/kept")} == {1: 3, 2: 3}


def tiny_png(width: int, height: int) -> bytes:
    """A valid RGB PNG of ``width`` x ``height`` black pixels, built by hand (PNG's spec)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + b"\x00" * 3 * width for _ in range(height)))
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def test_a_line_being_written_waits_and_a_damaged_line_or_file_is_skipped(tmp_path: Path) -> None:
    """What the run tracking reads from the folder never turns the tracker off: a line of
    clients.jsonl cut mid-write is read once whole, a damaged line and a file named .png that
    is none are left out, and the rest still reaches TensorBoard."""
    tracker = open_tracker("tensorboard", tmp_path, run_name="run")
    assert tracker is not None
    tracking = RunTracking(tracker, tmp_path)
    clients = tmp_path / "clients.jsonl"
    tracking.on_round({"round": 0, "test-accuracy": 0.1})
    (tmp_path / "dot.png").write_bytes(tiny_png(3, 2))
    (tmp_path / "notes.png").write_text("not an image, " * 8, encoding="utf-8")
    line = '{{"round": {}, "status": "kept", "update-norm": {}}}\n'
    late = line.format(2, 4.0)
    clients.write_text(
        line.format(1, 1.0) + "{damaged\n" + line.format(1, 2.0) + late[:10], encoding="utf-8"
    )
    tracking.on_round({"round": 1, "test-accuracy": 0.2})
    with clients.open("a", encoding="utf-8") as file:
        file.write(late[10:])
    tracking.on_round({"round": 2, "test-accuracy": 0.3})
    tracking.on_end(tmp_path, "completed")
    assert not tracker.failed
    recorded = events(tmp_path)
    norms = {h.step: h.histogram_value for h in recorded.Histograms("clients/update-norm")}
    assert sorted(norms) == [1, 2]
    assert (norms[1].num, norms[1].sum) == (2, 3.0)
    assert (norms[2].num, norms[2].sum) == (1, 4.0)
    assert recorded.Tags()["images"] == ["figures/dot"]
    [dot] = recorded.Images("figures/dot")
    assert (dot.step, dot.width, dot.height) == (1, 3, 2)
