"""Secure aggregation deployed: a SuperLink and three SuperNodes on this machine (``ba-deploy
local``'s processes), each SuperNode's Fleet API traffic tapped in the clear (no TLS).

What crosses the wire from a node is its keys, its sealed shares, its masked vector and its
unmasking shares: the tap sees the masked record and none of the names of what a plain reply
carries (the sensitivity record, the example count, the train loss).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy_helpers import read_metrics
from tests.test_deployment_local import (
    NUM_SUPERNODES,
    RUN_SETTINGS,
    TappedDeployment,
    tapped_deployment,
)

pytestmark = [pytest.mark.deployment, pytest.mark.http_fleet]


@pytest.fixture(scope="module")
def insecure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TappedDeployment]:
    yield from tapped_deployment(tmp_path_factory.mktemp("deploy-secure"), None, "secure")


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
