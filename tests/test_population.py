"""Million-client populations in process: a node costs nothing until it is sampled.

The in-process Grid makes a node's Context when the node is sent a message and keeps it only
while its state holds something; its node ids are a ``range``, which the strategies sample
without listing; every rule trains a 1,000,000-client synthetic population. Speed and memory at
that scale are measured by ``benchmarks/population.py``, not here; what is tested is that no
step of a round allocates per population (tracemalloc, exact, not timed).
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from benchmarks.population import Row, table, verdict
from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.interactive import federation
from beyond_averaging.server.pull import DelegatingGrid
from beyond_averaging.server.runtime.inprocess import FIRST_NODE_ID, InProcessGrid, run_inprocess
from beyond_averaging.strategies import FedAvg
from tests.deploy_helpers import REPO, read_metrics

MILLION = 1_000_000
POPULATION: dict[str, Any] = {
    "dataset": "synthetic",
    "model": "logreg",
    "local-epochs": 1,
    "device": "cpu",
    "fedlaw-epochs": 5,
}

stateful_app = ClientApp()


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process is told by its SuperLink (messages are stamped with it)."""
    for attribute in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attribute, 1 if attribute == "_run_id" else 0)


@stateful_app.train()
def remember(message: Message, context: Context) -> Message:
    """Counts in its node's state how often the node trained (Elastic keeps its average so)."""
    partition = int(context.node_config["partition-id"])
    if partition % 2 == 0:
        seen = context.state.metric_records.get("seen", MetricRecord({"times": 0}))
        context.state["seen"] = MetricRecord({"times": int(seen["times"]) + 1})
    return Message(
        RecordDict({"metrics": MetricRecord({"partition": partition})}), reply_to=message
    )


def test_a_million_node_grid_makes_a_context_only_for_a_served_node_and_keeps_it_with_state() -> (
    None
):
    grid = InProcessGrid(stateful_app, MILLION, {})
    assert grid.contexts == {}
    nodes = grid.get_node_ids()
    assert isinstance(nodes, range)
    assert len(nodes) == MILLION
    assert nodes[-1] == FIRST_NODE_ID + MILLION - 1
    last, odd, even = FIRST_NODE_ID + MILLION - 1, FIRST_NODE_ID + 3, FIRST_NODE_ID + 4
    messages = [Message(RecordDict(), node, "train") for node in (last, odd, even)]
    replies = list(grid.send_and_receive(messages))
    assert [r.content["metrics"]["partition"] for r in replies] == [MILLION - 1, 3, 4]
    assert set(grid.contexts) == {even}  # the nodes whose state holds something
    grid.send_and_receive([Message(RecordDict(), even, "train")])
    assert grid.contexts[even].state.metric_records["seen"]["times"] == 2
    assert grid.context(odd).node_config == {"partition-id": 3, "num-partitions": MILLION}
    with pytest.raises(ValueError, match="not in this federation"):
        grid.context(FIRST_NODE_ID + MILLION)


class ListedGrid(DelegatingGrid):
    """The same nodes, listed in a shuffled order (as a SuperLink lists its nodes)."""

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.inner.get_node_ids(), key=lambda node: (node * 7919) % 1009)


def test_sampling_a_range_of_node_ids_draws_the_cohort_of_the_sorted_list() -> None:
    strategy = FedAvg(fraction_train=5e-3, min_train_nodes=2, min_available_nodes=2, seed=5)
    in_range = InProcessGrid(stateful_app, 20_000, {})
    listed = ListedGrid(InProcessGrid(stateful_app, 20_000, {}))
    assert list(listed.get_node_ids()) != sorted(listed.get_node_ids())
    for server_round in (1, 2, 7):
        cohort = strategy._sample(in_range, 5e-3, 2, server_round)
        assert len(set(cohort)) == 100
        assert cohort == strategy._sample(listed, 5e-3, 2, server_round)
    million = strategy._sample(InProcessGrid(stateful_app, MILLION, {}), 1e-4, 2, 1)
    assert len(set(million)) == 100
    assert all(FIRST_NODE_ID <= node < FIRST_NODE_ID + MILLION for node in million)


@pytest.mark.parametrize("strategy", ["fedavg", "elastic", "fedlaw", "fedgma"])
def test_every_rule_trains_a_million_client_synthetic_population_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    grids: list[InProcessGrid] = []

    def keep(*args: Any, **kwargs: Any) -> InProcessGrid:
        grids.append(InProcessGrid(*args, **kwargs))
        return grids[-1]

    monkeypatch.setattr("beyond_averaging.server.runtime.inprocess.InProcessGrid", keep)
    settings = {
        **POPULATION,
        "strategy": strategy,
        "num-clients": MILLION,
        "fraction-train": 1e-5,  # 10 clients a round
        "num-server-rounds": 2,
        "run-name": strategy,
        "output-dir": str(tmp_path),
    }
    run_inprocess(REPO, settings)
    summary = json.loads((tmp_path / strategy / "summary.json").read_text(encoding="utf-8"))
    # Two rounds of 10 clients do not lift the synthetic task above chance (0.16 here): the run
    # says so with never-above-chance, and with no other alarm.
    assert summary["status"] in ("completed", "completed-with-alarms")
    assert set(summary.get("alarms", {})) <= {"never-above-chance"}
    for entry in read_metrics(tmp_path / strategy)[1:]:
        assert entry["replies-sent"] == 10
        assert entry["replies-valid"] == 10
        assert entry["aggregated"]
    (grid,) = grids
    # Only Elastic's clients keep state (their sensitivity average): one Context per node that
    # trained, none for the other 999,980 nodes.
    if strategy == "elastic":
        assert 10 <= len(grid.contexts) <= 20
        assert all(context.state for context in grid.contexts.values())
    else:
        assert grid.contexts == {}


def test_the_vectorized_backend_trains_a_million_client_population(tmp_path: Path) -> None:
    settings = {
        **POPULATION,
        "client-backend": "vectorized",
        "num-clients": MILLION,
        "fraction-train": 1e-5,
        "num-server-rounds": 1,
        "run-name": "vectorized",
        "output-dir": str(tmp_path),
    }
    run_inprocess(REPO, settings)
    (entry,) = read_metrics(tmp_path / "vectorized")[1:]
    assert entry["replies-valid"] == 10


def _round_peak(num_clients: int) -> int:
    """Bytes traced at the peak of one round (the second: imports and caches are warm)."""
    fed = federation({**POPULATION, "num-clients": num_clients, "fraction-train": 5 / num_clients})
    fed.round(1)
    tracemalloc.start()
    try:
        replies = list(fed.grid.send_and_receive(fed.instructions(2)))
        fed.strategy.aggregate_train(2, replies)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_a_round_allocates_the_same_for_a_million_clients_as_for_a_thousand() -> None:
    # Any per-population structure would add at least 8 MB at a million clients (one int64 per
    # client; a list of their ids: 36 MB). The 5 sampled devices' data differ between the two
    # populations by at most 5 x 1,000 x 61 x 4 bytes (1.2 MB).
    thousand, million = _round_peak(1_000), _round_peak(MILLION)
    assert million - thousand < 4 * 2**20, (thousand, million)


def test_the_config_allows_a_million_clients_and_names_the_limit_above() -> None:
    assert parse_run_config({"num-clients": MILLION}).num_clients == MILLION
    with pytest.raises(ConfigError, match="num-clients' = 1000001"):
        parse_run_config({"num-clients": MILLION + 1})


def test_the_population_benchmark_judges_the_largest_population_against_the_smallest() -> None:
    def row(population: int, seconds: float, rss: float) -> Row:
        return Row("inprocess", "fedavg", population, "completed", 3, seconds, 0.0, 0.0, 1.0, rss)

    small = row(1_000, 1.0, 400.0)
    assert "peak RSS 1.45x" in verdict([small, row(MILLION, 1.9, 580.0)])
    assert verdict([small, row(MILLION, 1.9, 580.0)]).endswith(": met")
    assert verdict([small, row(MILLION, 1.9, 610.0)]).endswith("NOT met")  # 1.52x memory
    assert verdict([small, row(MILLION, 2.1, 400.0)]).endswith("NOT met")  # 2.1x time
    assert "| 1,000,000 | completed | 2.10 | 2.10x |" in table([small, row(MILLION, 2.1, 400.0)])
