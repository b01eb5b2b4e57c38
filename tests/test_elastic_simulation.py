"""Elastic aggregation end to end: the real ServerApp and ClientApp under Flower simulation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import read_metrics

pytestmark = pytest.mark.simulation


def test_elastic_with_fedprox_and_float16_sensitivity_trains_for_two_rounds(
    run_simulation: Callable[..., Path],
) -> None:
    run_dir = run_simulation(
        {
            "strategy": "elastic",
            "num-clients": 3,
            "num-server-rounds": 2,
            "sensitivity-dtype": "float16",
            "proximal-mu": 0.01,
            "elastic-tau": 0.5,
        }
    )
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == [0, 1, 2]
    for entry in rounds[1:]:
        # Every client sent a valid sensitivity record; none fell back to plain averaging.
        assert entry["replies-valid"] == 3
        assert entry["replies-dropped"] == 0
        assert entry["elastic-scaled-tensors"] == 6  # the mlp's 3 weights and 3 biases
        assert 0.5 <= entry["elastic-zeta-min"] <= entry["elastic-zeta-mean"] <= 1.5
    assert rounds[-1]["test-accuracy"] > rounds[0]["test-accuracy"]
