"""Secure aggregation end to end: the real ServerApp and ClientApp under Flower simulation, where
each node's Context (and so its round's secrets between the stages) is kept by Flower."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import read_metrics

pytestmark = pytest.mark.simulation


def test_elastic_under_secaggplus_trains_for_two_rounds_in_simulation(
    run_simulation: Callable[..., Path],
) -> None:
    run_dir = run_simulation(
        {
            "strategy": "elastic",
            "num-clients": 4,
            "min-train-replies": 4,
            "num-server-rounds": 2,
            "secure-aggregation": "secaggplus",
            "secure-clip-norm": 5.0,
        }
    )
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == [0, 1, 2]
    for entry in rounds[1:]:
        assert entry["replies-valid"] == 4
        assert entry["secure-dropped-after-keys"] == 0
        assert entry["elastic-scaled-tensors"] == 6  # zeta from the summed sensitivities
        assert 0.5 <= entry["elastic-zeta-min"] <= entry["elastic-zeta-mean"] <= 1.5
    assert rounds[-1]["test-accuracy"] > rounds[0]["test-accuracy"]
