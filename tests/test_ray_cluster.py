"""Flower's simulation of this app on an existing Ray cluster (``ba-run --ray-address``).

Two Ray nodes on this machine, started with ``ray start`` as docs/ray-cluster.md starts them: a
head with 1 CPU, and later a worker with 1 CPU that joins it. The same run (digits, 4 clients,
3 rounds, seed 5) goes first to the head alone, then to the two nodes. Ray's actor table shows
where the ClientApp actors ran (the head only, then one on each node; nodes are told apart by the
custom resource each was started with), each node's own partition cache shows that ClientApps
loaded data there, and the two runs end with the same global model. Every Ray process the test
started is stopped by PID in its teardown, whatever happened.

Cost: two Ray node starts and two simulation runs against them, about 1-3 minutes on the shared
2-core machine; marked ``deployment`` (``pytest -m deployment``, after the default suite in CI).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from beyond_averaging.server.cli.main import main
from beyond_averaging.server.overrides import LaunchError, run_config_argument
from beyond_averaging.server.runtime.launch import launch
from tests.deploy_helpers import REPO
from tests.ray_cluster import RayCluster, alive

SETTINGS: dict[str, Any] = {
    "dataset": "digits",
    "num-clients": 4,
    "num-server-rounds": 3,
    "local-epochs": 1,
    "seed": 5,
    "device": "cpu",
}
CLIENT_ACTOR = "ClientAppActor"  # Flower's Ray actor that runs ClientApps


def run_on(address: str, name: str, output: Path) -> dict[str, Any]:
    """One ``ba-run --ray-address`` run; returns its summary."""
    overrides = {**SETTINGS, "run-name": name, "output-dir": str(output)}
    folder = launch(
        REPO,
        [run_config_argument(overrides)],
        client_cpus=1,
        timeout=600,
        ray_address=address,
    )
    summary: dict[str, Any] = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    return summary


def client_actor_nodes(cluster: RayCluster, jobs_before: set[str]) -> list[str]:
    """Names of the nodes that hosted the ClientApp actors of jobs not in ``jobs_before``."""
    table = cluster.query()
    names = cluster.node_names()
    return sorted(
        names.get(actor["node"], "?")
        for actor in table["actors"]
        if actor["class"] == CLIENT_ACTOR and actor["job"] not in jobs_before
    )


def jobs(cluster: RayCluster) -> set[str]:
    return {actor["job"] for actor in cluster.query()["actors"]}


def cached_partitions(folder: Path) -> list[Path]:
    return sorted(folder.glob("*")) if folder.is_dir() else []


@pytest.mark.deployment
@pytest.mark.extended  # left out of CI for its time (.ci/run)
def test_a_two_node_ray_cluster_runs_the_clientapps_on_both_nodes_with_the_one_node_result(
    tmp_path: Path,
) -> None:
    with RayCluster() as cluster:
        address = cluster.start_head("head", cpus=1)
        one = run_on(address, "one-node", tmp_path)
        assert client_actor_nodes(cluster, set()) == ["head"]  # 1 CPU: one actor
        assert cached_partitions(cluster.caches["head"])  # ClientApps loaded data on the head
        before = jobs(cluster)
        shutil.rmtree(cluster.caches["head"])  # the second run must leave its own evidence

        cluster.add_worker("worker", cpus=1)
        assert sorted(cluster.node_names().values()) == ["head", "worker"]
        two = run_on(address, "two-nodes", tmp_path)
        assert client_actor_nodes(cluster, before) == ["head", "worker"]
        assert cached_partitions(cluster.caches["head"])
        assert cached_partitions(cluster.caches["worker"])
        started = cluster.processes()
    assert started
    assert not alive(set(started))  # every Ray process of both nodes was stopped

    assert one["status"] == two["status"] == "completed"
    assert one["final"]["round"] == two["final"]["round"] == 3
    assert two["final"]["test-accuracy"] == pytest.approx(one["final"]["test-accuracy"], abs=1e-9)
    first = torch.load(tmp_path / "one-node" / "final_model.pt", weights_only=True)
    second = torch.load(tmp_path / "two-nodes" / "final_model.pt", weights_only=True)
    assert first.keys() == second.keys()
    for key in first:  # the replies arrive in another order: float summation noise only
        torch.testing.assert_close(second[key], first[key], atol=1e-5, rtol=0)


def test_an_address_where_no_ray_head_answers_is_refused_naming_the_value() -> None:
    with pytest.raises(LaunchError, match=r"--ray-address = '127\.0\.0\.1:1': nothing answers"):
        launch(REPO, [], ray_address="127.0.0.1:1")
    with pytest.raises(LaunchError, match="is not HOST:PORT"):
        launch(REPO, [], ray_address="head-node")
    assert main(["--runtime", "inprocess", "--ray-address", "127.0.0.1:1"]) == 1
