"""What a strategy tells about each round (strategies/replies/reporting.py): the per-round log
line about its rule, and the per-reply records a run keeps in ``clients.jsonl`` with the
partitions' label counts in ``partitions.json``."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.runs.partitions import draw_label_counts, record_partitions
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.runtime.inprocess import run_inprocess
from beyond_averaging.strategies import ContractStrategy, FedAvg
from beyond_averaging.strategies.replies.reporting import figures_text, round_line
from beyond_averaging.tasks.protocol import CLIENT_RECORD, PARTITION_ID_KEY
from tests.conftest import reply_message, train_reply
from tests.test_defences import (
    BOUNDS_OFF,
    aggregated,
    client_updates,
    flat,
    root_setup,
    unflat,
    with_task,
)

REPO = Path(__file__).resolve().parents[1]
GLOBAL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


def client(value: float) -> dict[str, np.ndarray[Any, Any]]:
    return {"w": np.full((2, 3), value, np.float32), "b": np.full(3, value, np.float32)}


def from_partition(message: Message, partition: int) -> Message:
    """``message`` with the ``client`` record this project's ClientApp adds to its replies."""
    message.content[CLIENT_RECORD] = ConfigRecord({PARTITION_ID_KEY: partition})
    return message


def started(strategy: ContractStrategy) -> ContractStrategy:
    strategy.global_arrays = {key: value.copy() for key, value in GLOBAL.items()}
    strategy.reply_byte_limit = 1 << 20
    return strategy


# ------------------------------------------------------------------------------ the round line
def test_a_rules_fields_are_shown_with_their_labels_lists_by_range_flags_when_true() -> None:
    fields = {
        "g": ("gamma", ".2f"),
        "l": ("lambda", ".1f"),
        "t": ("sensitivity on {} tensors", "d"),
        "f": ("fell back", "flag"),
        "absent": ("never", ".1f"),
    }
    text = figures_text({"g": 0.987, "l": [0.25, 0.75], "t": 4, "f": 0}, fields)
    assert text == "gamma 0.99, lambda [0.2, 0.8], sensitivity on 4 tensors"
    long = figures_text({"l": [0.1 * i for i in range(10)], "f": 1}, fields)
    assert long == "lambda [10 values, min 0.0, max 0.9], fell back"


def test_a_round_that_kept_the_previous_model_says_so_instead_of_the_rules_figures() -> None:
    figures = {"aggregated": 0, "replies-received": 3, "replies-valid": 1, "replies-dropped": 2}
    line = round_line("FedLAW", 4, {**figures, "dropped-error-reply": 2}, {})
    assert line == (
        "round 4: FedLAW | too few valid replies: previous model kept | 1/3 replies kept, "
        "0 clipped, 2 dropped (error-reply 2)"
    )


def test_the_strategy_logs_one_line_per_round_unless_silenced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replies = [train_reply(client(v), 10, node_id=i) for i, v in enumerate([1.0, 1.2, 0.8, 50.0])]
    with caplog.at_level(logging.INFO, logger="flwr"):
        started(FedAvg(min_train_replies=1, update_norm_factor=3.0)).aggregate_train(1, replies)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and r.getMessage().startswith("round 1:")
    ]
    assert lines == ["round 1: FedAvg | 3/4 replies kept, 0 clipped, 1 dropped (norm-outlier 1)"], (
        lines
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        quiet = started(FedAvg(min_train_replies=1, update_norm_factor=3.0, log_rounds=False))
        quiet.aggregate_train(1, replies)
    assert not [
        r
        for r in caplog.records
        if r.levelno == logging.INFO and r.getMessage().startswith("round 1:")
    ]
    assert quiet.aggregation_metrics[1]["dropped-norm-outlier"] == 1  # the figures stay


# ---------------------------------------------------------------------------- reply records
def test_each_reply_is_recorded_kept_clipped_or_dropped_with_its_reason() -> None:
    # From the zero model, ||client(v)|| = |v| x 3 over the 9 entries. The median of the accepted
    # updates (v = 1, 1, 1.5, 3, 40) is 1.5 x 3: v = 40 is a norm outlier (factor 10). Clipping
    # then bounds the others at 2 x their median (v = 1, 1, 1.5, 3: 1.25 x 3): v = 3 is scaled by
    # 2.5 / 3, the rest pass as sent.
    values = {11: 1.0, 12: 1.0, 13: 1.5, 14: 3.0, 15: 40.0}
    replies = [
        from_partition(train_reply(client(v), 10 * n, node_id=n, metrics={"train-loss": v}), n)
        for n, v in values.items()
    ]
    replies.append(reply_message(node_id=16, error="node crashed"))
    strategy = started(FedAvg(min_train_replies=1))
    strategy.aggregate_train(3, replies)
    records = {record["node-id"]: record for record in strategy.last_client_records}
    assert sorted(records) == [11, 12, 13, 14, 15, 16]
    assert {n: records[n]["status"] for n in records} == {
        11: "kept",
        12: "kept",
        13: "kept",
        14: "clipped",
        15: "dropped",
        16: "dropped",
    }
    assert records[15]["reason"] == "norm-outlier"
    assert "exceeds" in records[15]["detail"]
    assert records[16]["reason"] == "error-reply"
    assert records[16]["partition"] is None
    assert records[16]["num-examples"] is None
    assert records[14]["reason"] == "update-clip"
    assert records[14]["update-scale"] == pytest.approx(2 * 1.25 / 3.0)
    for node, value in values.items():
        record = records[node]
        assert record["round"] == 3
        assert record["partition"] == node
        assert record["num-examples"] == 10 * node
        assert record["train-loss"] == value
        assert record["update-norm"] == pytest.approx(value * 3.0, rel=1e-6)
    # The four aggregated replies' weights: their claims, normalised.
    claims = np.array([110, 120, 130, 140], dtype=np.float64)
    for node, share in zip((11, 12, 13, 14), claims / claims.sum(), strict=True):
        assert records[node]["weight"] == pytest.approx(share)
    assert records[15]["weight"] is None


# ------------------------------------------------------------------------------- in a real run
def test_a_run_records_every_reply_and_the_partitions_label_counts(tmp_path: Path) -> None:
    settings = {
        "strategy": "fedavg",
        "num-clients": 4,
        "num-server-rounds": 2,
        "local-epochs": 1,
        "device": "cpu",
        "output-dir": str(tmp_path),
        "run-name": "r",
    }
    run_inprocess(REPO, settings)
    run = tmp_path / "r"
    lines = (run / "clients.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["round"] for r in records] == [1] * 4 + [2] * 4  # appended round by round
    assert sorted((r["round"], r["partition"]) for r in records) == [
        (server_round, partition) for server_round in (1, 2) for partition in range(4)
    ]
    assert {r["status"] for r in records} <= {"kept", "clipped"}
    partitions = json.loads((run / "partitions.json").read_text(encoding="utf-8"))
    counts = np.array(partitions["label-counts"])
    assert counts.shape == (4, partitions["num-classes"]) == (4, 10)
    # Each client's own count of what it trained on (its reply's num-examples) is its row's sum.
    for record in records:
        assert record["num-examples"] == counts[record["partition"]].sum()
    assert partitions["num-examples"] == counts.sum(axis=1).tolist()
    assert (run / "partitions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_run_keeps_the_client_records_of_the_rounds_it_keeps(tmp_path: Path) -> None:
    first = RunRecorder(tmp_path, "r", {"seed": 0})
    for server_round in (1, 2, 3):
        first.log_clients([{"round": server_round, "node-id": n} for n in (1, 2)])
    first.write_summary("interrupted")
    resumed = RunRecorder(tmp_path, "r", {"seed": 0}, resume_round=2)
    resumed.log_clients([{"round": 3, "node-id": 7}])
    lines = (tmp_path / "r" / "clients.jsonl").read_text(encoding="utf-8").splitlines()
    kept = [(json.loads(line)["round"], json.loads(line)["node-id"]) for line in lines]
    assert kept == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 7)]
    resumed.write_summary("completed")
    fresh = RunRecorder(tmp_path, "r", {"seed": 0})  # a new run of the name starts empty
    assert (tmp_path / "r" / "clients.jsonl").read_text(encoding="utf-8") == ""
    fresh.close()


def test_fltrust_s_untrusted_reply_is_recorded_dropped_and_the_line_gives_each_trust(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, root, state = root_setup()
    strategy = with_task(
        FedAvg(robust_aggregation="fltrust", model=model, proxy_set=root, **BOUNDS_OFF), state
    )
    g0 = flat(strategy.root_set.update(state, strategy._task, 1))
    # Along g0 twice (trust 1), against it (trust 0), at 45 degrees (trust cos 45 = 0.71).
    models = [unflat(flat(state) + update, state) for update in client_updates(g0)]
    with caplog.at_level(logging.INFO, logger="flwr"):
        aggregated(strategy, models)
    records = strategy.last_client_records
    assert [(r["node-id"], r["status"], r["reason"]) for r in records] == [
        (1, "kept", None),
        (2, "kept", None),
        (3, "dropped", "untrusted"),
        (4, "kept", None),
    ]
    assert [r["trust"] for r in records] == pytest.approx([1.0, 1.0, 0.0, 2**-0.5], abs=1e-5)
    assert "round 1: FedAvg | trust [1.00, 1.00, 0.00, 0.71] | 4/4 replies kept" in caplog.text


@pytest.mark.filterwarnings("ignore:partition=.classes.:UserWarning")  # 3 clients x 2 labels
def test_without_matplotlib_the_label_counts_are_saved_and_a_note_says_why_not_plotted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    spec = data_spec(parse_run_config({"num-clients": 3, "partition": "classes"}))
    with caplog.at_level(logging.INFO, logger="flwr"):
        path = record_partitions(tmp_path, spec)
    assert path == tmp_path / "partitions.json"
    counts = np.array(json.loads(path.read_text(encoding="utf-8"))["label-counts"])
    assert ((counts > 0).sum(axis=1) <= 2).all()  # classes-per-client = 2 labels each at most
    assert not (tmp_path / "partitions.png").exists()
    assert "pip install 'beyond-averaging[bench]'" in caplog.text


def test_the_partitions_figure_leaves_room_above_its_tallest_bar() -> None:
    import matplotlib.pyplot as plt

    counts = np.array([[50, 30], [10, 90], [40, 40]])  # clients of 80, 100 and 80 samples
    figure = draw_label_counts(counts, "digits, dirichlet partition of 3 clients")
    bottom, top = figure.axes[0].get_ylim()
    assert bottom == 0
    assert top >= 110  # a tenth of the tallest bar (100) at least between it and the frame
    plt.close(figure)
