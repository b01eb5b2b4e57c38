"""Secure aggregation deployed: a SuperLink and three SuperNodes on this machine (``ba-deploy
local``'s processes), each SuperNode's Fleet API traffic tapped in the clear (no TLS).

What crosses the wire from a node is its keys, its sealed shares, its masked vector and its
unmasking shares: the tap sees the masked record and none of the names of what a plain reply
carries (the sensitivity record, the example count, the train loss).

On the warm executor (``ba-supernode --executor warm``: one forked ClientApp per message, the
node's Context kept by Flower's SuperNode between SecAgg+'s stages) a secure round trains the model
Flower's subprocess isolation (a fresh ``flwr-clientapp`` per message) trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy_helpers import (
    REPO,
    LocalDeployment,
    assert_same_final_model,
    lean_round,
    read_metrics,
)
from tests.test_deployment_local import (
    NUM_SUPERNODES,
    RUN_SETTINGS,
    TappedDeployment,
    tapped_deployment,
)

# CI repeats the masked-vector test on the newest Flower's HTTP Fleet API (http_fleet); the
# comparison of the two executors runs on flwr 1.39 only.
pytestmark = [pytest.mark.deployment]


@pytest.fixture(scope="module")
def insecure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TappedDeployment]:
    yield from tapped_deployment(tmp_path_factory.mktemp("deploy-secure"), None, "secure")


@pytest.mark.http_fleet
def test_a_deployed_elastic_round_under_secaggplus_uploads_masked_vectors_only(
    insecure: TappedDeployment,
) -> None:
    for tap in insecure.taps:
        tap.take()  # forget the idle traffic before this run
    settings = {
        **RUN_SETTINGS,
        "strategy": "elastic",
        "secure-aggregation": "secaggplus",
        "min-train-replies": NUM_SUPERNODES,
        "run-name": "elastic-secure",
        "output-dir": str(insecure.deployment.workdir / "runs"),
    }
    metrics = read_metrics(insecure.deployment.run(settings, timeout=300.0))
    uploads = [tap.take()[0] for tap in insecure.taps]
    last = metrics[-1]
    assert last["aggregated"] == 1
    assert last["replies-valid"] == NUM_SUPERNODES
    assert last["secure-dropped-after-keys"] == 0
    assert last["elastic-scaled-tensors"] > 0
    for node, upload in enumerate(uploads):
        assert b"secure-masked" in upload, f"SuperNode {node} sent no masked vector"
        for name in (b"sensitivity", b"num-examples", b"train-loss"):
            assert name not in upload, f"SuperNode {node} uploaded {name!r} in the clear"


def secure_round(workdir: Path, executor: str) -> Path:
    """One round of FedAvg under SecAgg+ on 2 SuperNodes run by ``executor``; the run folder."""
    settings = {
        **lean_round(2),
        "secure-aggregation": "secaggplus",
        "min-train-replies": 2,
        "run-name": f"secure-{executor}",
        "output-dir": str(workdir / "runs"),
    }
    with LocalDeployment(REPO, workdir, file_state=False, executor=executor) as deployment:  # type: ignore[arg-type]
        for partition in range(2):
            deployment.start_supernode(partition, 2)
        deployment.wait_for_nodes(2)
        run_dir = deployment.run(settings, timeout=600.0)
    last = read_metrics(run_dir)[-1]
    assert last["aggregated"] == 1
    assert last["replies-valid"] == 2
    assert last["secure-dropped-after-keys"] == 0
    return run_dir


@pytest.mark.extended  # left out of CI for its time (.ci/run)
def test_a_secure_round_on_the_warm_executor_trains_the_model_subprocess_isolation_trains(
    tmp_path: Path,
) -> None:
    warm = secure_round(tmp_path / "warm", "warm")
    fresh = secure_round(tmp_path / "subprocess", "subprocess")
    assert_same_final_model(warm, fresh, "secure rounds, warm and subprocess")
    assert read_metrics(warm)[-1]["test-accuracy"] == pytest.approx(
        read_metrics(fresh)[-1]["test-accuracy"], abs=1e-6
    )
