"""The secure-aggregation recipe of docs/fedgma.md, applied to Flower's quickstart and run.

The blocks ``fedgma-soft-secure-server`` and ``secure-client`` are pasted into the copy of the
quickstart in tests/apps/ as tests/test_user_apps.py pastes the rules' recipes, within the same
three-line budget, and the app runs two rounds in process: every round is summed by SecAgg+
from all the quickstart's nodes, and the round's train loss is the weighted mean the clients
folded into their masked vectors.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from tests.test_user_apps import (
    LINE_BUDGET,
    NUM_SUPERNODES,
    ROUNDS,
    SHAPES,
    Rule,
    changed_lines,
    patched_files,
    run_patched_in_process,
)

SECURE_SOFT = Rule(
    "fedgma-soft-secure", "SecureAggregation", "fedgma-soft-secure-server", "secure-client"
)
QUICKSTART = SHAPES[0]


def test_the_secure_recipe_changes_at_most_three_lines_of_each_file() -> None:
    files = patched_files(QUICKSTART, SECURE_SOFT)
    assert set(files) == {QUICKSTART.server_module, QUICKSTART.client_module}
    for module, (before, after) in files.items():
        added, removed = changed_lines(before, after)
        assert 0 < added <= LINE_BUDGET, f"{module}: {added} lines added"
        assert removed <= LINE_BUDGET, f"{module}: {removed} lines removed"
        compile(after, module, "exec")


def test_the_quickstart_with_the_secure_recipe_sums_every_round_securely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy, result = run_patched_in_process(
            QUICKSTART, SECURE_SOFT, NUM_SUPERNODES, tmp_path, monkeypatch
        )
    for server_round in range(1, ROUNDS + 1):
        assert f"round {server_round}: SecAgg+ summed {NUM_SUPERNODES} masked vectors" in (
            caplog.text
        )
        figures = strategy.aggregation_metrics[server_round]  # type: ignore[attr-defined]
        assert figures["replies-valid"] == NUM_SUPERNODES
        assert figures["secure-dropped-after-keys"] == 0
        assert 0.0 < figures["gma-mask-mean"] <= 1.0
        assert math.isfinite(result.train_metrics_clientapp[server_round]["train_loss"])
