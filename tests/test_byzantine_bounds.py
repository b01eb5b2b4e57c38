"""Byzantine bounds inside the strategies: what the defaults do to a lying reply, and each rule's
robust form, against references computed here with NumPy's median (never the code under test).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from beyond_averaging.strategies import (
    ContractStrategy,
    ElasticAggregation,
    FedAvg,
    FedGMA,
    FedGMASoft,
    FedLAW,
)
from beyond_averaging.strategies.elastic import elastic_zeta
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD, ClientTask
from tests.conftest import train_reply
from tests.factories import make_task

Model = dict[str, np.ndarray[Any, Any]]
#: Every Byzantine bound off, so that a robust form is tested alone.
BOUNDS_OFF: dict[str, Any] = {
    "update_norm_factor": 0.0,
    "update_clip_factor": 0.0,
    "direction_outlier_factor": 0.0,
    "max_claim_factor": 0.0,
    "min_train_replies": 1,
}
rng = np.random.default_rng(0)
GLOBAL: Model = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
DIRECTION = {k: rng.normal(size=v.shape) for k, v in GLOBAL.items()}


def honest(index: int) -> Model:
    """A client that moved along the common direction, with a little noise of its own."""
    noise = np.random.default_rng(100 + index)
    return {
        k: (GLOBAL[k] + DIRECTION[k] + 0.2 * noise.normal(size=v.shape)).astype(np.float32)
        for k, v in GLOBAL.items()
    }


def moved(scale: float, base: Model) -> Model:
    """w + scale * (base - w)."""
    return {k: (GLOBAL[k] + scale * (base[k] - GLOBAL[k])).astype(np.float32) for k in GLOBAL}


def started(strategy: ContractStrategy) -> ContractStrategy:
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}
    strategy.reply_byte_limit = 1 << 20
    return strategy


def aggregate(strategy: ContractStrategy, models: list[Model], **kwargs: Any) -> Model:
    replies = [
        train_reply(
            model,
            kwargs.get("counts", [10] * len(models))[i],
            node_id=i + 1,
            extra=kwargs.get("extra", [None] * len(models))[i],
        )
        for i, model in enumerate(models)
    ]
    arrays, _ = started(strategy).aggregate_train(1, replies)
    assert arrays is not None
    return {key: value.numpy() for key, value in arrays.items()}


def test_under_the_defaults_a_sign_flipped_reply_is_dropped_as_a_direction_outlier() -> None:
    models = [honest(i) for i in range(3)]
    strategy = FedAvg()
    result = aggregate(strategy, [*models, moved(-5.0, models[0])])
    figures = strategy.aggregation_metrics[1]
    assert figures["dropped-direction-outlier"] == 1
    assert figures["replies-valid"] == 3
    for key in GLOBAL:  # the mean of the honest replies (their norms are alike: none clipped)
        np.testing.assert_allclose(
            result[key], np.mean([m[key] for m in models], axis=0), rtol=1e-5
        )


def test_under_the_defaults_a_large_reply_is_clipped_to_twice_the_median_norm() -> None:
    models = [honest(i) for i in range(3)]
    large = moved(8.0, models[2])
    strategy = FedAvg()
    result = aggregate(strategy, [*models[:2], large, honest(3)])
    assert strategy.aggregation_metrics[1]["replies-clipped"] == 1
    replies = [*models[:2], large, honest(3)]
    norms = [
        np.sqrt(sum(np.sum((m[k].astype(np.float64) - GLOBAL[k]) ** 2) for k in GLOBAL))
        for m in replies
    ]
    bound = 2.0 * np.median(norms)
    clipped = [moved(min(1.0, bound / n), m) for m, n in zip(replies, norms, strict=True)]
    for key in GLOBAL:
        np.testing.assert_allclose(
            result[key], np.mean([m[key] for m in clipped], axis=0), atol=1e-5
        )


def test_under_the_defaults_a_claim_of_1e12_examples_counts_as_ten_times_the_median() -> None:
    models = [honest(i) for i in range(4)]
    strategy = FedAvg()
    result = aggregate(strategy, models, counts=[10, 20, 30, int(1e12)])
    assert strategy.aggregation_metrics[1]["claims-bounded"] == 1
    weights = np.array([10, 20, 30, 10 * 25.0])  # the median claim is 25
    weights /= weights.sum()
    for key in GLOBAL:
        expected = sum(p * m[key].astype(np.float64) for p, m in zip(weights, models, strict=True))
        np.testing.assert_allclose(result[key], expected, rtol=1e-5)


def wild_round() -> list[Model]:
    """Three honest replies and one far away in values (1e4), in range for every check."""
    return [honest(0), honest(1), honest(2), {k: np.full_like(v, 1e4) for k, v in GLOBAL.items()}]


def median_update(models: list[Model]) -> Model:
    return {
        k: np.median([GLOBAL[k].astype(np.float64) - m[k] for m in models], axis=0) for k in GLOBAL
    }


def test_elastic_robust_form_is_zeta_times_the_median_update_from_the_median_sensitivity() -> None:
    models = wild_round()
    sensitivities = [
        {k: np.abs(rng.normal(size=v.shape)) for k, v in GLOBAL.items()} for _ in models
    ]
    sensitivities[3] = {k: np.full(v.shape, 1e4) for k, v in GLOBAL.items()}
    strategy = ElasticAggregation(robust_aggregation="median", **BOUNDS_OFF)
    extra = [{SENSITIVITY_RECORD: s} for s in sensitivities]
    result = aggregate(strategy, models, extra=extra)
    update = median_update(models)
    for key in GLOBAL:
        omega = np.median([s[key] for s in sensitivities], axis=0)
        expected = GLOBAL[key] - elastic_zeta(omega, 0.5) * update[key]
        np.testing.assert_allclose(result[key], expected, rtol=1e-5, atol=1e-6)


def test_soft_fedgma_robust_form_masks_the_median_update() -> None:
    models = wild_round()
    strategy = FedGMASoft(robust_aggregation="median", threshold=0.4, **BOUNDS_OFF)
    result = aggregate(strategy, models)
    update = median_update(models)
    for key in GLOBAL:
        votes = np.mean([np.sign(GLOBAL[key] - m[key]) for m in models], axis=0)
        agreement = np.abs(votes)
        mask = np.where(agreement >= 0.4, 1.0, agreement)
        np.testing.assert_allclose(result[key], GLOBAL[key] - mask * update[key], rtol=1e-5)


def test_hard_fedgma_robust_form_steps_the_median_model_along_the_masked_median_gradient() -> None:
    models = wild_round()
    gradients = [{k: rng.normal(size=v.shape) for k, v in GLOBAL.items()} for _ in models]
    gradients[3] = {k: np.full(v.shape, 1e4) for k, v in GLOBAL.items()}
    strategy = FedGMA(robust_aggregation="median", threshold=0.5, server_lr=0.1, **BOUNDS_OFF)
    result = aggregate(strategy, models, extra=[{GRADIENT_RECORD: g} for g in gradients])
    for key in GLOBAL:
        average = np.median([m[key].astype(np.float64) for m in models], axis=0)
        votes = np.abs(np.sum([np.sign(g[key]) for g in gradients], axis=0))
        mask = votes >= 2  # 0.5 x 4 clients
        step = mask * np.median([g[key] for g in gradients], axis=0)
        np.testing.assert_allclose(result[key], average - 0.1 * step, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAvg(robust_aggregation="multi-krum", trim_fraction=0.25, **BOUNDS_OFF),
        lambda: ElasticAggregation(robust_aggregation="krum", trim_fraction=0.25, **BOUNDS_OFF),
        lambda: FedGMASoft(robust_aggregation="multi-krum", trim_fraction=0.25, **BOUNDS_OFF),
    ],
)
def test_krum_selection_leaves_the_far_reply_out_of_every_rule(make: Any) -> None:
    models = wild_round()
    strategy = make()
    extra = None
    if isinstance(strategy, ElasticAggregation):
        extra = [{SENSITIVITY_RECORD: {k: np.ones(v.shape) for k, v in GLOBAL.items()}}] * 4
    result = aggregate(strategy, models, extra=extra or [None] * 4)
    figures = strategy.aggregation_metrics[1]
    kept = 1 if strategy.robust_aggregation == "krum" else 3
    assert figures["replies-valid"] == kept
    assert figures["dropped-krum-rejected"] == 4 - kept
    assert all(np.abs(value).max() < 100 for value in result.values())


def fedlaw_setup() -> tuple[torch.nn.Module, LabeledData, Model]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    features = np.random.default_rng(1).normal(size=(30, 4)).astype(np.float32)
    labels = np.arange(30) % 3
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model, LabeledData(features, labels.astype(np.int64), 3), state


#: The clients' local training of the small proxy-set tests (what configure_train reads).
TASK = make_task()


def test_fedlaw_robust_form_learns_its_shrink_over_the_median_model() -> None:
    model, proxy, state = fedlaw_setup()
    models = [{k: v + 0.1 * (i + 1) for k, v in state.items()} for i in range(3)]
    models.append({k: np.full_like(v, 1e4) for k, v in state.items()})
    strategy = FedLAW(
        model=model,
        proxy_set=proxy,
        batch_size=30,
        epochs=5,
        robust_aggregation="median",
        **BOUNDS_OFF,
    )
    strategy.global_arrays = dict(state)
    strategy.reply_byte_limit = 1 << 20
    replies = [train_reply(m, 10, node_id=i + 1) for i, m in enumerate(models)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    figures = strategy.aggregation_metrics[1]
    assert figures["fedlaw-node-ids"] == [-1]  # one model: the median of the replies
    gamma = figures["fedlaw-gamma"]
    for key, value in arrays.items():
        median = np.median([m[key] for m in models], axis=0)
        np.testing.assert_allclose(value.numpy(), gamma * median, rtol=1e-5)


def test_fltrust_leaves_out_a_reply_pointing_against_the_servers_proxy_update() -> None:
    model, proxy, state = fedlaw_setup()
    strategy = FedLAW(
        model=model,
        proxy_set=proxy,
        batch_size=30,
        epochs=2,
        robust_aggregation="fltrust",
        **BOUNDS_OFF,
    )
    strategy._task = ClientTask.from_config(ConfigRecord(dict(TASK.to_config())))  # configure_train
    strategy.global_arrays = dict(state)
    strategy.reply_byte_limit = 1 << 20
    assert strategy.root_set is not None
    g0 = strategy.root_set.update(state, strategy._task, 1)
    along = {k: v + g0[k] for k, v in state.items()}
    against = {k: v - 3.0 * g0[k] for k, v in state.items()}
    replies = [train_reply(m, 10, node_id=i + 1) for i, m in enumerate([along, along, against])]
    result, _ = strategy.aggregate_train(1, replies)
    assert result is not None
    figures = strategy.aggregation_metrics[1]
    np.testing.assert_allclose(figures["fltrust-trust"], [1.0, 1.0, 0.0], atol=1e-6)
    assert figures["fedlaw-node-ids"] == [1, 2]


def test_clients_that_disagree_from_the_first_round_turn_the_direction_check_off_with_a_note(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def scattered(seed: int) -> list[Model]:
        return [
            {
                k: (GLOBAL[k] + np.random.default_rng(seed + i).normal(size=v.shape)).astype(
                    np.float32
                )
                for k, v in GLOBAL.items()
            }
            for i in range(5)
        ]

    strategy = started(FedAvg())
    first = scattered(0)
    strategy.aggregate_train(1, [train_reply(m, 10, node_id=i + 1) for i, m in enumerate(first)])
    assert strategy.aggregation_metrics[1]["direction-cosine-median"] < 0.3
    (note,) = [r for r in caplog.records if "off for this run" in r.getMessage()]
    assert note.levelname == "INFO"  # the default factor: expected under skew, not a warning
    assert strategy.state_dict()["reply-bounds"]["direction-check"] == 0
    # round 2: a reply pointing straight against another is no longer dropped for it
    second = scattered(10)
    second[4] = moved(-5.0, second[0])
    strategy.aggregate_train(2, [train_reply(m, 10, node_id=i + 1) for i, m in enumerate(second)])
    assert "dropped-direction-outlier" not in strategy.aggregation_metrics[2]
    resumed = FedAvg()
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.state_dict() == strategy.state_dict()


def test_a_direction_factor_the_user_chose_warns_when_the_check_cannot_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = np.random.default_rng(0)
    scattered = [
        {k: (GLOBAL[k] + rng.normal(size=v.shape)).astype(np.float32) for k, v in GLOBAL.items()}
        for _ in range(5)
    ]
    strategy = started(FedAvg(direction_outlier_factor=3.0))
    strategy.aggregate_train(
        1, [train_reply(m, 10, node_id=i + 1) for i, m in enumerate(scattered)]
    )
    (warning,) = [r for r in caplog.records if "off for this run" in r.getMessage()]
    assert warning.levelname == "WARNING"


def test_a_check_kept_on_warns_when_it_drops_replies_in_a_round_whose_replies_disagree(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = started(FedAvg())
    first = [honest(i) for i in range(5)]  # round 1: the clients agree, the check stays on
    strategy.aggregate_train(1, [train_reply(m, 10, node_id=i + 1) for i, m in enumerate(first)])
    assert "disagree" not in caplog.text
    # Round 2: four clients move along orthogonal directions (as clients with disjoint label
    # sets can), the fifth sends -5 x the first's update. Cosines with the others' clipped mean:
    # -1/2 for the first and the fifth, 0 for the rest; both fall below the round's median 0.
    second = []
    for row in range(4):
        update = {k: np.zeros_like(v) for k, v in GLOBAL.items()}
        update["w"][row] = 1.0
        second.append({k: GLOBAL[k] + update[k] for k in GLOBAL})
    second.append(moved(-5.0, second[0]))
    started(strategy)  # round 2 starts from the same global model, for the arithmetic's sake
    strategy.aggregate_train(2, [train_reply(m, 10, node_id=i + 1) for i, m in enumerate(second)])
    figures = strategy.aggregation_metrics[2]
    assert figures["direction-cosine-median"] == pytest.approx(0.0, abs=1e-6)
    assert figures["dropped-direction-outlier"] == 2  # the attacker and an honest client
    assert "round 2: the direction check drops 2 replies" in caplog.text
    assert "direction-outlier-factor = 0" in caplog.text


def test_clients_that_agree_keep_the_direction_check_on(caplog: pytest.LogCaptureFixture) -> None:
    strategy = FedAvg()
    aggregate(strategy, [honest(i) for i in range(5)])
    assert strategy.aggregation_metrics[1]["direction-cosine-median"] > 0.3
    assert "off for this run" not in caplog.text
    bounds = strategy.state_dict()["reply-bounds"]
    assert bounds["direction-check"] == 1
    # the secret that draws the compared coordinates of a large model, kept for a resumed run
    assert isinstance(bounds["direction-secret"], int)
    resumed = FedAvg()
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.state_dict() == strategy.state_dict()
    assert "reply-bounds" not in FedAvg().state_dict()  # nothing before the first round


def test_krum_keeping_one_reply_still_aggregates_under_the_default_quorum() -> None:
    # min_train_replies defaults to 2: the quorum counts the replies Krum chose from.
    strategy = FedAvg(robust_aggregation="krum", trim_fraction=0.25)
    models = [honest(i) for i in range(4)]
    result = aggregate(strategy, models)
    figures = strategy.aggregation_metrics[1]
    assert figures["aggregated"] == 1
    assert figures["dropped-krum-rejected"] == 3
    kept = [m for m in models if all(np.allclose(result[k], m[k]) for k in GLOBAL)]
    assert len(kept) == 1  # the model is one reply's, unchanged
