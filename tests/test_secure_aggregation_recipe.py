"""The secure-aggregation recipes of docs/fedgma.md, docs/elastic.md and docs/library.md, applied
to Flower's quickstart and run.

Each rule's server block (``fedgma-soft-secure-server``, ``elastic-secure-server``,
``fedavg-secure-server``) and the client block ``secure-client`` are pasted into the copy of the
quickstart in tests/apps/ as tests/test_user_apps.py pastes the rules' recipes, within the same
three-line budget (Elastic's client: ``secure-client`` within it on top of ``elastic-client``),
and the app runs two rounds in process: every round is summed by SecAgg+ from all the
quickstart's nodes, and the round's train loss is the weighted mean the clients folded into
their masked vectors.
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
SECURE_ELASTIC = Rule(
    "elastic-secure",
    "SecureAggregation",
    "elastic-secure-server",
    "elastic-client",
    client_extras=("secure-client",),
)
SECURE_FEDAVG = Rule("fedavg-secure", "SecureAggregation", "fedavg-secure-server", "secure-client")
SECURE_RULES = {
    "FedGMASoft": SECURE_SOFT,
    "ElasticAggregation": SECURE_ELASTIC,
    "FedAvg": SECURE_FEDAVG,
}
QUICKSTART = SHAPES[0]


@pytest.mark.parametrize("rule", list(SECURE_RULES.values()), ids=list(SECURE_RULES))
def test_the_secure_recipe_changes_at_most_three_lines_of_each_file(rule: Rule) -> None:
    files = patched_files(QUICKSTART, rule)
    assert set(files) == {QUICKSTART.server_module, QUICKSTART.client_module}
    plain_client = patched_files(
        QUICKSTART, Rule(rule.name, "", rule.server_recipe, rule.client_recipe)
    )
    for module, (before, after) in files.items():
        if module == QUICKSTART.client_module and rule.client_extras:
            before = plain_client[module][1]  # the secure lines on top of the rule's own
        added, removed = changed_lines(before, after)
        assert 0 < added <= LINE_BUDGET, f"{module}: {added} lines added"
        assert removed <= LINE_BUDGET, f"{module}: {removed} lines removed"
        compile(after, module, "exec")


@pytest.mark.parametrize("rule_class", list(SECURE_RULES))
def test_the_quickstart_with_the_secure_recipe_sums_every_round_securely(
    rule_class: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy, result = run_patched_in_process(
            QUICKSTART, SECURE_RULES[rule_class], NUM_SUPERNODES, tmp_path, monkeypatch
        )
    assert type(strategy.strategy).__name__ == rule_class  # type: ignore[attr-defined]
    for server_round in range(1, ROUNDS + 1):
        assert f"round {server_round}: SecAgg+ summed {NUM_SUPERNODES} masked vectors" in (
            caplog.text
        )
        figures = strategy.aggregation_metrics[server_round]  # type: ignore[attr-defined]
        assert figures["replies-valid"] == NUM_SUPERNODES
        assert figures["secure-dropped-after-keys"] == 0
        if rule_class == "FedGMASoft":
            assert 0.0 < figures["gma-mask-mean"] <= 1.0
        if rule_class == "ElasticAggregation":  # zeta from the summed sensitivities
            assert figures["elastic-scaled-tensors"] == 10  # the quickstart CNN's tensors
        assert math.isfinite(result.train_metrics_clientapp[server_round]["train_loss"])
