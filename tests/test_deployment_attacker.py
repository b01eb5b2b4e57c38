"""One attacker beside honest SuperNodes, via a real SuperLink: no kind crashes or poisons a run.

A SuperLink and four SuperNodes run as local processes (``tests/deploy_helpers.py``); every node
runs ``tests/attacker_app.py`` (the project's ClientApp plus an attack switch in the node config).
Three nodes are honest; the fourth sends, in round r, the reply of attack kind ``r`` of its cycle
(``tests/attacker_app.py``: every kind that crashed or poisoned a run before the reply checks).
Each strategy's run must complete, drop or bound every malformed reply, and end near the final
accuracy of an honest run of the same settings (all four nodes honest, in-process runtime).

The ServerApp's peak memory is measured with and without a node that sends an unrequested
record of ``BA_EXTRA_RECORD_MB`` MB (default 256; the issue's probe used 1024) every round.
Run with ``-m deployment -s`` to see the per-round drop reasons and the memory figures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.deploy.resources import peak_rss_sampler
from beyond_averaging.server.runtime.inprocess import run_inprocess
from tests.deploy_helpers import REPO, LocalDeployment, read_metrics

pytestmark = pytest.mark.deployment

HONEST_NODES = 3
NODES = HONEST_NODES + 1
ATTACKER_APP = "tests.attacker_app:app"
#: Poison first: a strategy's short run meets those kinds before the crash kinds.
GENERIC_KINDS = [
    "zero-model-claiming-1e12-examples",
    "values-1e30",
    "bool-arrays",
    "num-examples-half",
    "num-examples-inf",
    "not-npy-bytes",
    "object-npy",
    "truncated-buffer",
    "complex64",
    "string-dtype",
    "structured-dtype",
    "extra-record",
]
#: Per strategy: the kinds of its run, one per round.
RUNS: dict[str, list[str]] = {
    "fedavg": GENERIC_KINDS,
    "elastic": ["huge-sensitivity", *GENERIC_KINDS[:2]],
    "fedgma": ["huge-gradient", *GENERIC_KINDS[:2]],
    "fedlaw": GENERIC_KINDS[:2],
}
#: Kinds whose reply is well-formed and passes the checks, so it is bounded, not dropped: a
#: claim of 1e12 examples gets at most ``max-client-weight`` of the round's weight.
BOUNDED_KINDS = frozenset({"zero-model-claiming-1e12-examples"})
SETTINGS: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": NODES,
    # IID: the attacked run trains on three of the four partitions; with a label skew the
    # missing one could hold whole classes and the comparison would measure that, not poison.
    "partition": "iid",
    "local-epochs": 1,
    "fraction-train": 1.0,
    "seed": 0,
    "device": "cpu",
    "fedlaw-epochs": 20,
    "round-timeout": 300.0,
    # No honest share of 4 digits clients comes near 0.5 (docs/reliability.md, Replies).
    "max-client-weight": 0.5,
}
#: How far below an honest run's final accuracy an attacked run may end. The attacked run
#: loses the attacker's partition (a quarter of the data, IID) in every round it drops the
#: reply, and the short runs of three valid replies move by up to 0.09 from one round to the
#: next (measured: Elastic 0.75 -> 0.67 in a round whose attacker reply was dropped); a poisoned
#: run ends near chance (0.1), far below honest - 0.2 (honest runs here end at 0.76-0.93).
ACCURACY_MARGIN = 0.2


def attacker_node_config(kinds: list[str], extra_megabytes: int = 16) -> str:
    return f'attack-kinds="{",".join(kinds)}" extra-megabytes={extra_megabytes}'


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """SuperLink, three honest SuperNodes; attackers are started per run."""
    workdir = tmp_path_factory.mktemp("deploy-attacker")
    local = LocalDeployment(REPO, workdir)
    try:
        local.start()
        local.use_clientapp(ATTACKER_APP)
        for partition in range(HONEST_NODES):
            local.start_supernode(partition, NODES)
        local.wait_for_nodes(HONEST_NODES)
        yield local
    finally:
        local.close()


def run_with_attacker(
    deployment: LocalDeployment, name: str, settings: dict[str, Any], node_config: str
) -> tuple[Path, int]:
    """One run with a fourth node started with ``node_config``; its folder and the ServerApp's
    peak RSS. The fourth node is stopped afterwards, so each run picks its own attacker."""
    attacker = deployment.start_supernode(HONEST_NODES, NODES, node_config=node_config)
    try:
        deployment.wait_for_nodes(NODES)
        with peak_rss_sampler(deployment.serverapp_pids) as memory:
            run_dir = deployment.run(
                {**settings, "run-name": name, "output-dir": str(deployment.workdir / "runs")},
                timeout=900.0,
            )
    finally:
        deployment.stop_supernode(attacker)
    return run_dir, int(memory.peaks["rss"])


def honest_final_accuracy(tmp_path: Path, settings: dict[str, Any]) -> float:
    run_inprocess(REPO, {**settings, "run-name": "honest", "output-dir": str(tmp_path)})
    return float(read_metrics(tmp_path / "honest")[-1]["test-accuracy"])


@pytest.mark.parametrize(
    "strategy",
    # FedAvg's run meets every generic kind; the others' runs (their records' kinds) are left
    # out of CI for its time (marker extended; `pytest -m deployment` runs them).
    [pytest.param(name, marks=() if name == "fedavg" else pytest.mark.extended) for name in RUNS],
)
def test_one_attacker_neither_crashes_nor_poisons_the_run(
    deployment: LocalDeployment, tmp_path: Path, strategy: str
) -> None:
    kinds = RUNS[strategy]
    settings = {**SETTINGS, "strategy": strategy, "num-server-rounds": len(kinds)}
    run_dir, _ = run_with_attacker(
        deployment, f"attacked-{strategy}", settings, attacker_node_config(kinds)
    )
    rounds = read_metrics(run_dir)[1:]
    report = [
        {
            "kind": kind,
            "valid": entry["replies-valid"],
            "dropped": {k: v for k, v in entry.items() if k.startswith("dropped-")},
            "model-rejected": entry.get("model-rejected", 0),
            "accuracy": round(entry["test-accuracy"], 4),
        }
        for kind, entry in zip(kinds, rounds, strict=True)
    ]
    print(f"\n[{strategy}] " + json.dumps(report, indent=1))
    (deployment.workdir / f"attacker-report-{strategy}.json").write_text(json.dumps(report))
    for kind, entry in zip(kinds, rounds, strict=True):
        assert entry["aggregated"] == 1, f"{kind}: the round kept the old model: {entry}"
        if kind in BOUNDED_KINDS:
            continue
        # Every other kind is dropped with a reason: the attacker's reply never counts.
        assert entry["replies-valid"] <= HONEST_NODES, f"{kind}: {entry}"
        assert entry["replies-dropped"] >= 1, f"{kind} was not dropped: {entry}"
    honest = honest_final_accuracy(tmp_path, settings)
    attacked = rounds[-1]["test-accuracy"]
    print(f"[{strategy}] final accuracy attacked {attacked:.4f} vs honest {honest:.4f}")
    assert attacked >= honest - ACCURACY_MARGIN


@pytest.mark.extended  # 3.7 min (its round waits 150 s); left out of CI for its time (.ci/run)
def test_a_hanging_node_costs_each_round_the_round_timeout_and_counts_as_dropped(
    deployment: LocalDeployment,
) -> None:
    # The honest nodes answer within 150 s even on a loaded 2-core machine (their ClientApp
    # processes start, import torch and train); the hanging one would take 600 s.
    settings = {**SETTINGS, "strategy": "fedavg", "num-server-rounds": 1, "round-timeout": 150.0}
    run_dir, _ = run_with_attacker(deployment, "hanging", settings, "hang-seconds=600")
    rounds = read_metrics(run_dir)[1:]
    print("\n[hanging] round seconds:", [round(entry["round-seconds"], 1) for entry in rounds])
    for entry in rounds:
        assert entry["replies-sent"] == NODES
        assert entry["replies-received"] == HONEST_NODES
        assert entry["dropped-timeout"] == 1
        assert entry["replies-valid"] == HONEST_NODES
        assert entry["aggregated"] == 1


@pytest.mark.extended  # 2.8 min (two runs); left out of CI for its time (.ci/run)
def test_unrequested_record_does_not_grow_the_serverapp_beyond_one_reply(
    deployment: LocalDeployment,
) -> None:
    megabytes = int(os.environ.get("BA_EXTRA_RECORD_MB", "256"))
    settings = {**SETTINGS, "strategy": "fedavg", "num-server-rounds": 2}
    _, honest_peak = run_with_attacker(deployment, "memory-honest", settings, "")
    run_dir, attacked_peak = run_with_attacker(
        deployment,
        "memory-extra-record",
        settings,
        attacker_node_config(["extra-record"], extra_megabytes=megabytes),
    )
    figures = {
        "extra-record-mb": megabytes,
        "serverapp-peak-rss-mb-honest": round(honest_peak / 2**20, 1),
        "serverapp-peak-rss-mb-with-extra-record": round(attacked_peak / 2**20, 1),
    }
    print("\n" + json.dumps(figures))
    (deployment.workdir / "attacker-memory.json").write_text(json.dumps(figures))
    for entry in read_metrics(run_dir)[1:]:
        assert entry["dropped-oversized"] == 1
    assert honest_peak > 0
    # The ServerApp stops pulling the reply once it passes the byte bound (server/bounded_pull.py:
    # a few MB for this model, plus the two 5 MB chunks in flight), so its peak does not follow
    # the record's size (before the bounded pull: +529 MB for 256 MB). 64 MB: room for RSS noise.
    assert attacked_peak <= honest_peak + 64 * 2**20
