"""The paper-setting options of the evidence benchmarks: variant names, baselines, cuts."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import benchmarks.fedgma_ood as fedgma_ood
from benchmarks.elastic_evidence import (
    baseline_of,
    describe_rounds_to_target,
    paired_rounds_to_target,
    rounds_to_target,
    variants,
)
from benchmarks.fedgma_ood import Settings, result_path, subsample, sweep_tag
from benchmarks.run_lock import claim_run
from benchmarks.seed_stats import band, mean_sd, seed_sd
from beyond_averaging.tasks.datasets import LabeledData


def test_every_base_runs_alone_and_with_elastic_at_each_tau() -> None:
    compared = variants(0.03, ["fedavg", "fedprox"], [0.2, 0.8])
    assert list(compared) == [
        "fedavg",
        "elastic-tau0.2",
        "elastic-tau0.8",
        "fedprox",
        "fedprox+elastic-tau0.2",
        "fedprox+elastic-tau0.8",
    ]
    assert compared["fedprox+elastic-tau0.8"] == {
        "strategy": "elastic",
        "proximal-mu": 0.01,
        "elastic-tau": 0.8,
    }
    assert compared["fedprox"] == {"strategy": "fedavg", "proximal-mu": 0.01}
    # without taus: the run config's tau under the historical names
    assert list(variants(0.03)) == ["fedavg", "elastic", "fedadam", "fedadam+elastic"]


def test_elastic_is_compared_with_its_own_base_and_a_base_with_fedavg() -> None:
    assert baseline_of("fedavgm+elastic-tau0.5") == "fedavgm"
    assert baseline_of("elastic-tau0.2") == "fedavg"
    assert baseline_of("elastic") == "fedavg"
    assert baseline_of("fedadam") == "fedavg"
    assert baseline_of("fedavg") is None


def test_rounds_to_target_is_the_first_round_at_or_above_it() -> None:
    curve = np.array([10.0, 50.0, 79.9, 80.0, 70.0, 90.0])  # round 0 is the initial model
    assert rounds_to_target(curve, 80.0) == 3
    assert rounds_to_target(curve, 95.0) is None
    assert describe_rounds_to_target(np.array([curve, curve[::-1]]), 80.0) == "2.5 (2/2)"
    assert describe_rounds_to_target(np.array([curve]), 95.0) == "never (0/1)"


def test_fedgma_cuts_are_seeded_subsets_and_tag_their_results() -> None:
    data = LabeledData(np.arange(100, dtype=np.float32)[:, None], np.arange(100) % 2, 2)
    tenth = subsample(data, 0.1, 0, seed=1)
    assert len(tenth) == 10
    assert set(tenth.features[:, 0]) <= set(data.features[:, 0])
    np.testing.assert_array_equal(tenth.features, subsample(data, 0.1, 0, seed=1).features)
    assert len(subsample(data, 1.0, 30, seed=1)) == 30
    assert subsample(data, 1.0, 0, seed=1) is data
    assert sweep_tag("digits", "mlp", 1.0) == ""
    assert sweep_tag("mnist", "cnn", 0.1) == "mnist-cnn-frac0.1"


def test_rounds_to_target_is_compared_seed_by_seed() -> None:
    fast = {0: np.array([0.0, 96.0, 97.0]), 1: np.array([0.0, 90.0, 96.0])}
    slow = {0: np.array([0.0, 90.0, 95.0]), 1: np.array([0.0, 90.0, 90.0])}
    # seed 0: 1 - 2 = -1; seed 1: the baseline never gets there, so it is left out
    assert paired_rounds_to_target(fast, slow, [0, 1], 95.0) == "rounds to 95 % -1.0 (1 seeds)"
    assert paired_rounds_to_target(fast, slow, [1], 95.0) == "rounds to 95 %: n/a"


def test_every_report_spreads_seeds_by_the_sample_standard_deviation() -> None:
    finals = [88.47, 89.18, 89.04]
    assert mean_sd(finals, digits=2) == f"88.90 ± {statistics.stdev(finals):.2f}"  # 0.38, not 0.31
    curves = np.array([[10.0, 20.0, 30.0], [12.0, 20.0, 33.0]])
    mean, spread = band(curves)
    assert mean.tolist() == [11.0, 20.0, 31.5]
    assert spread.tolist() == [statistics.stdev([10, 12]), 0.0, statistics.stdev([30, 33])]


def test_one_seed_has_no_spread_to_report() -> None:
    assert mean_sd([85.27]) == "85.3"  # no "± 0.0" pretending the seeds agreed
    assert math.isnan(float(seed_sd([85.27])))
    assert band([[0.5, 0.6]])[1].tolist() == [0.0, 0.0]  # a plot draws no band


def test_a_fedgma_sweep_reruns_runs_saved_with_other_rounds_and_leaves_claimed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple[str, float | None]] = []

    def fake_run(settings: Settings, task: str, split: str, seed: int, server_lr: Any, mask: Any):
        ran.append((task, server_lr))
        method = fedgma_ood.method_name(server_lr, mask)
        return {
            "method": method,
            "settings": {"rounds": settings.rounds},
            "ood_accuracy": [0.5],
            "id_accuracy": [0.5],
            "cpu_seconds": 0.0,
        }

    monkeypatch.setattr(fedgma_ood, "run_one", fake_run)
    monkeypatch.setattr(fedgma_ood, "RESULTS_DIR", tmp_path)
    settings = Settings(
        rounds=20,
        seeds=(0,),
        server_lrs=(0.1, 1.0),
        tasks=("binary",),
        splits=("non-iid",),
        skip_existing=True,
    )
    directory = fedgma_ood.results_dir(settings)
    directory.mkdir(parents=True, exist_ok=True)
    for method, rounds in (("fedavg", 10), ("fedgma-lr0.1", 20)):
        saved = result_path(directory, "binary", "non-iid", 0, method)
        saved.write_text(json.dumps({"settings": {"rounds": rounds}}))
    busy = claim_run(
        result_path(directory, "binary", "non-iid", 0, "fedgma-lr1").with_suffix(".lock")
    )
    assert busy is not None
    with busy:  # another process holds lr 1
        fedgma_ood.run_all(settings)
    # FedAvg was saved with 10 rounds of the 20 asked: run again; lr 0.1 has 20: kept.
    assert ran == [("binary", None)]
    saved = result_path(directory, "binary", "non-iid", 0, "fedavg").read_text()
    assert json.loads(saved)["settings"]["rounds"] == 20


def test_the_fedgma_report_gives_each_row_its_rounds_and_seed_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fedgma_ood, "DOCS_DIR", tmp_path)

    def run(task: str, seed: int, ood: list[float]) -> dict[str, Any]:
        settings = {**Settings(rounds=len(ood) - 1, seeds=(seed,)).__dict__, "base": "mnist"}
        return {
            "task": task,
            "split": "non-iid",
            "seed": seed,
            "method": "fedavg",
            "settings": settings,
            "ood_accuracy": ood,
            "id_accuracy": [0.8] * len(ood),
            "mask_kept": [math.nan] * len(ood),
            "cpu_seconds": 1.0,
        }

    results = [
        run("binary", 0, [0.5, 0.2, 0.6]),
        run("binary", 1, [0.5, 0.3, 0.7]),
        run("10-class", 0, [0.1, 0.12, 0.14, 0.13]),  # a longer sweep in the same folder
    ]
    fedgma_ood.write_report(results, "report", "the command")
    table = (tmp_path / "report.md").read_text(encoding="utf-8")
    peak_sd = statistics.stdev([60.0, 70.0])
    assert f"| binary | non-iid | fedavg | 2 | 2 | 65.0 ± {peak_sd:.1f} | 2 |" in table
    assert "| 10-class | non-iid | fedavg | 1 | 3 | 14.0 | 2 |" in table  # one seed: no ±
    assert "rounds = " not in table  # rounds differ between rows: not a sweep-wide setting
