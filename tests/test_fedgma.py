"""FedGMA: the AND-mask and the soft mask against hand and per-element computations, the strategy's
record contract, the client's last-step gradient, and a real 2-round simulation."""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from beyond_averaging.server.config import RunConfig
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import (
    FedGMA,
    FedGMASoft,
    MissingRecordError,
    aggregate,
    aggregate_fedavg,
    aggregate_fedgma,
    and_mask,
)
from beyond_averaging.strategies.fedgma import (
    TrustVote,
    fedgma_step,
    hard_mask,
    soft_mask,
    trusted_agreement,
)
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.training import train_local
from tests.conftest import read_metrics, train_reply

Arrays = dict[str, np.ndarray[Any, Any]]


def random_clients(count: int, seed: int = 0) -> tuple[Arrays, list[Arrays], list[Arrays]]:
    """A global model, ``count`` client models and ``count`` client gradients."""
    rng = np.random.default_rng(seed)
    shapes = {"w": (3, 4), "b": (4,)}
    global_arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    models = [
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(count)
    ]
    # Gradients share a sign bias so that some coordinates agree and others do not.
    bias = {k: rng.normal(size=s) for k, s in shapes.items()}
    gradients = [
        {k: (bias[k] + rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
        for _ in range(count)
    ]
    return global_arrays, models, gradients


def naive_hard_step(
    global_arrays: Arrays,
    models: list[Arrays],
    gradients: list[Arrays],
    counts: list[float],
    threshold: float,
    server_lr: float,
) -> Arrays:
    """The seed paper's rule written one coordinate at a time (independent of the code)."""
    total = sum(counts)
    result: Arrays = {}
    for key, template in global_arrays.items():
        out = np.zeros(template.shape, dtype=np.float64)
        for index in np.ndindex(template.shape):
            average = sum(
                n / total * float(m[key][index]) for n, m in zip(counts, models, strict=True)
            )
            votes = sum(int(np.sign(g[key][index])) for g in gradients)
            keep = abs(votes) >= threshold * len(gradients) - 1e-9
            grad = sum(
                n / total * float(g[key][index]) for n, g in zip(counts, gradients, strict=True)
            )
            out[index] = average - server_lr * (grad if keep else 0.0)
        result[key] = out
    return result


def naive_soft_step(
    global_arrays: Arrays, models: list[Arrays], counts: list[float], tau: float, server_lr: float
) -> Arrays:
    """The TMLR soft-mask rule, one coordinate at a time."""
    total = sum(counts)
    result: Arrays = {}
    for key, template in global_arrays.items():
        out = np.zeros(template.shape, dtype=np.float64)
        for index in np.ndindex(template.shape):
            w = float(template[index])
            deltas = [w - float(m[key][index]) for m in models]
            agreement = abs(
                sum(n / total * np.sign(d) for n, d in zip(counts, deltas, strict=True))
            )
            mask = 1.0 if agreement >= tau else agreement
            mean_delta = sum(n / total * d for n, d in zip(counts, deltas, strict=True))
            out[index] = w - server_lr * mask * mean_delta
        result[key] = out
    return result


# ----------------------------------------------------------------------------- the AND-mask
def test_identical_client_gradients_pass_the_and_mask_unchanged() -> None:
    gradient = {"w": np.array([[0.5, -2.0], [3.0, -0.25]], np.float32)}
    masked = and_mask([gradient, gradient, gradient], [1, 2, 3], threshold=0.8)
    np.testing.assert_array_equal(masked["w"], gradient["w"])


def test_opposite_gradient_signs_are_masked_out() -> None:
    first = {"w": np.array([1.0, 2.0, -3.0], np.float32)}
    second = {"w": np.array([-1.0, 4.0, 3.0], np.float32)}  # coordinates 0 and 2 disagree
    masked = and_mask([first, second], [1, 1], threshold=0.8)
    # coordinate 1 agrees: its weighted mean (2 + 4) / 2 = 3 stays; the others are zeroed
    np.testing.assert_array_equal(masked["w"], [0.0, 3.0, 0.0])


def test_five_clients_threshold_0_8_keep_a_coordinate_only_when_all_five_nonzero_votes_agree() -> (
    None
):
    # Rule: keep iff |sum of signs| >= 0.8 * 5 = 4; with 5 non-zero votes the sum is odd, so
    # |sum| >= 4 means |sum| = 5, i.e. all five clients agree (4 against 1 gives only 3).
    patterns = np.array(list(itertools.product([-1.0, 1.0], repeat=5)))  # (32, 5): every pattern
    gradients = [{"g": patterns[:, k].astype(np.float32)} for k in range(5)]
    mask = hard_mask(gradients, threshold=0.8)["g"]
    for column, pattern in enumerate(patterns):
        all_agree = len(set(pattern.tolist())) == 1
        assert mask[column] == all_agree, pattern
    assert int(mask.sum()) == 2  # all +1 and all -1


def test_a_zero_vote_counts_for_neither_sign() -> None:
    # Four agree and one is exactly zero: |sum| = 4 >= 4, kept; three agree, two zero: dropped.
    gradients = [{"g": np.array([1.0, 1.0])} for _ in range(3)] + [
        {"g": np.array([1.0, 0.0])},
        {"g": np.array([0.0, 0.0])},
    ]
    np.testing.assert_array_equal(hard_mask(gradients, threshold=0.8)["g"], [True, False])


def test_masked_mean_uses_data_size_weights() -> None:
    gradients = [{"g": np.array([1.0, 1.0])}, {"g": np.array([3.0, -1.0])}]
    # n = (1, 3): p = (0.25, 0.75). Coordinate 0 agrees: 0.25 * 1 + 0.75 * 3 = 2.5.
    # Coordinate 1 disagrees (threshold 0 would keep it: 0.25 * 1 + 0.75 * (-1) = -0.5).
    np.testing.assert_allclose(and_mask(gradients, [1, 3], threshold=0.8)["g"], [2.5, 0.0])
    np.testing.assert_allclose(and_mask(gradients, [1, 3], threshold=0.0)["g"], [2.5, -0.5])


def test_the_mask_over_many_blocks_and_dtypes_equals_counting_signs_per_coordinate() -> None:
    # Several 65,536-element blocks (shared by threads), float16/32/64 gradients with exact zeros:
    # the integer vote count equals np.sign summed in float64, coordinate by coordinate.
    rng = np.random.default_rng(3)
    dtypes = [np.float16, np.float32, np.float64] * 3
    gradients = []
    for dtype in dtypes:
        values = rng.standard_normal(200_003).astype(dtype)
        values[rng.random(values.size) < 0.1] = 0.0
        gradients.append({"g": values})
    signs = sum(np.sign(g["g"].astype(np.float64)) for g in gradients)
    for threshold in (0.0, 0.5, 0.8, 1.0):
        expected = np.abs(signs) >= math.ceil(threshold * len(gradients) - 1e-9)
        np.testing.assert_array_equal(hard_mask(gradients, threshold)["g"], expected)


def test_threshold_times_clients_is_compared_without_float_rounding() -> None:
    # 0.7 * 10 = 7.000000000000001 in floating point; 7 agreeing net votes must still pass.
    votes = [1.0] * 8 + [-1.0] * 1 + [0.0]  # |sum| = 7
    gradients = [{"g": np.array([v])} for v in votes]
    assert bool(hard_mask(gradients, threshold=0.7)["g"][0])
    assert not bool(hard_mask(gradients, threshold=0.8)["g"][0])


# ----------------------------------------------------------------------------- full aggregation
def test_hard_fedgma_matches_the_per_coordinate_rule() -> None:
    global_arrays, models, gradients = random_clients(5, seed=1)
    counts = [10.0, 20.0, 5.0, 40.0, 25.0]
    result = aggregate_fedgma(
        global_arrays, models, gradients, counts, threshold=0.8, server_lr=0.1
    )
    expected = naive_hard_step(global_arrays, models, gradients, counts, 0.8, 0.1)
    for key in global_arrays:
        assert result[key].dtype == np.float32
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-6, atol=1e-6)


def test_hard_fedgma_with_server_lr_zero_is_fedavg_exactly() -> None:
    global_arrays, models, gradients = random_clients(4, seed=2)
    counts = [3, 1, 4, 1]
    result = aggregate_fedgma(global_arrays, models, gradients, counts, server_lr=0.0)
    fedavg = aggregate_fedavg(global_arrays, models, counts)
    for key in global_arrays:
        np.testing.assert_array_equal(result[key], fedavg[key])


def test_soft_fedgma_matches_the_per_coordinate_rule() -> None:
    global_arrays, models, _ = random_clients(4, seed=3)
    counts = [1.0, 2.0, 3.0, 4.0]
    result = aggregate_fedgma(
        global_arrays, models, None, counts, threshold=0.6, server_lr=0.5, mask="soft"
    )
    expected = naive_soft_step(global_arrays, models, counts, 0.6, 0.5)
    for key in global_arrays:
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask", ["hard", "soft"])
def test_votes_with_ties_and_zeros_match_the_per_coordinate_rule_across_blocks(
    mask: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aggregate, "BLOCK_ELEMENTS", 5)  # 12 + 4 elements: several blocks
    rng = np.random.default_rng(9)
    global_arrays, _, _ = random_clients(1, seed=9)
    # Models and gradients on a coarse grid: many exact zeros and equalities decide the votes.
    models = [
        {k: v + rng.integers(-1, 2, v.shape).astype(np.float32) for k, v in global_arrays.items()}
        for _ in range(5)
    ]
    gradients = [
        {k: rng.integers(-1, 2, v.shape).astype(np.float32) for k, v in global_arrays.items()}
        for _ in range(5)
    ]
    counts = [4.0, 1.0, 2.0, 2.0, 1.0]
    if mask == "hard":
        result = aggregate_fedgma(global_arrays, models, gradients, counts, 0.6, 0.5)
        expected = naive_hard_step(global_arrays, models, gradients, counts, 0.6, 0.5)
    else:
        result = aggregate_fedgma(global_arrays, models, None, counts, 0.5, 1.0, mask="soft")
        expected = naive_soft_step(global_arrays, models, counts, 0.5, 1.0)
    for key in global_arrays:
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-6, atol=1e-6)


def test_soft_fedgma_with_tau_zero_is_fedavg() -> None:
    global_arrays, models, _ = random_clients(3, seed=4)
    counts = [2, 5, 3]
    result = aggregate_fedgma(
        global_arrays, models, None, counts, threshold=0.0, server_lr=1.0, mask="soft"
    )
    fedavg = aggregate_fedavg(global_arrays, models, counts)
    for key in global_arrays:
        # w - (w - avg) differs from avg only by float32 rounding
        np.testing.assert_allclose(result[key], fedavg[key], rtol=0, atol=1e-6)


def test_soft_mask_is_one_where_weighted_agreement_reaches_tau_else_the_agreement() -> None:
    updates = [{"d": np.array([1.0, 1.0])}, {"d": np.array([1.0, -1.0])}]
    # p = (0.75, 0.25): agreement = [1.0, |0.75 - 0.25| = 0.5]; tau 0.8 -> mask [1, 0.5]
    np.testing.assert_allclose(soft_mask(updates, [3, 1], threshold=0.8)["d"], [1.0, 0.5])


def test_integer_buffers_are_averaged_not_stepped() -> None:
    global_arrays = {"w": np.zeros(2, np.float32), "count": np.array(0, np.int64)}
    models = [
        {"w": np.ones(2, np.float32), "count": np.array(2, np.int64)},
        {"w": np.ones(2, np.float32), "count": np.array(4, np.int64)},
    ]
    gradients = [{"w": np.ones(2, np.float32)}, {"w": np.ones(2, np.float32)}]
    result = aggregate_fedgma(global_arrays, models, gradients, [1, 1], server_lr=0.5)
    assert int(result["count"]) == 3
    assert result["count"].dtype == np.int64
    np.testing.assert_allclose(result["w"], [0.5, 0.5])  # 1 - 0.5 * 1


def test_bad_arguments_are_clear_errors() -> None:
    global_arrays, models, gradients = random_clients(2)
    with pytest.raises(ValueError, match=r"threshold = 1.5: allowed is \[0, 1\]"):
        aggregate_fedgma(global_arrays, models, gradients, [1, 1], threshold=1.5)
    with pytest.raises(ValueError, match=r"mask = 'hard' needs one gradient dict per client"):
        aggregate_fedgma(global_arrays, models, None, [1, 1])
    with pytest.raises(ValueError, match=r"mask = 'medium'"):
        aggregate_fedgma(global_arrays, models, gradients, [1, 1], mask="medium")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys .* differ from client 0's"):
        aggregate_fedgma(global_arrays, models, [gradients[0], {"w": gradients[1]["w"]}], [1, 1])


def test_torch_tensors_are_accepted() -> None:
    gradients = [{"g": torch.tensor([1.0, -1.0])}, {"g": torch.tensor([3.0, 1.0])}]
    np.testing.assert_allclose(and_mask(gradients, [1, 1], threshold=1.0)["g"], [2.0, 0.0])


# ----------------------------------------------------------------------------- the strategy
GLOBAL = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}


def with_global(strategy: FedGMA) -> FedGMA:
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}
    return strategy


def reply(value: float, grad: Arrays | None, count: int, node_id: int) -> Any:
    arrays = {k: np.full_like(v, value) for k, v in GLOBAL.items()}
    extra = {"gradient": grad} if grad is not None else None
    return train_reply(arrays, count, node_id=node_id, extra=extra)


def test_strategy_aggregates_replies_like_the_pure_function_and_reports_the_mask() -> None:
    strategy = with_global(FedGMA(threshold=0.8, server_lr=0.5, min_train_replies=1))
    grads = [
        {"w": np.array([[1.0, -1.0], [2.0, 2.0]], np.float32), "b": np.array([1.0, 1.0])},
        {"w": np.array([[3.0, 1.0], [2.0, 2.0]], np.float32), "b": np.array([1.0, -1.0])},
    ]
    grads = [{k: v.astype(np.float32) for k, v in g.items()} for g in grads]
    arrays, metrics = strategy.aggregate_train(
        1, [reply(1.0, grads[0], 10, 1), reply(3.0, grads[1], 30, 2)]
    )
    assert arrays is not None
    assert metrics is not None
    # average 2.5; masked mean gradient w: [[2.5, 0], [2, 2]], b: [1, 0]; step 0.5
    np.testing.assert_allclose(arrays["w"].numpy(), [[1.25, 2.5], [1.5, 1.5]])
    np.testing.assert_allclose(arrays["b"].numpy(), [2.0, 2.5])
    figures = strategy.aggregation_metrics[1]
    assert figures["gma-mask-mean"] == pytest.approx(4 / 6)  # 4 of 6 coordinates kept


def test_hard_strategy_requests_the_gradient_record_and_drops_replies_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert "gradient" in FedGMA.required_records
    strategy = with_global(FedGMA(min_train_replies=1))
    grad = {k: np.ones_like(v) for k, v in GLOBAL.items()}
    with caplog.at_level(logging.WARNING):
        _, metrics = strategy.aggregate_train(1, [reply(1.0, grad, 10, 1), reply(2.0, None, 10, 2)])
    assert metrics is not None
    assert strategy.aggregation_metrics[1]["dropped-missing-gradient"] == 1
    assert "no ArrayRecord named 'gradient'" in caplog.text


def test_hard_strategy_stops_when_no_reply_carries_a_gradient() -> None:
    strategy = with_global(FedGMA(min_train_replies=1))
    with pytest.raises(MissingRecordError, match=r"'gradient'.*last_step_gradient.*FedGMASoft"):
        strategy.aggregate_train(1, [reply(1.0, None, 10, 1), reply(2.0, None, 10, 2)])


def test_soft_strategy_needs_no_gradient() -> None:
    assert dict(FedGMASoft.required_records) == {}
    strategy = with_global(FedGMASoft(threshold=0.0, server_lr=1.0, min_train_replies=1))
    arrays, _ = strategy.aggregate_train(1, [reply(1.0, None, 10, 1), reply(3.0, None, 30, 2)])
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 2), 2.5), atol=1e-6)


def test_gradient_keys_missing_from_some_replies_are_only_averaged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = with_global(FedGMA(threshold=0.0, server_lr=1.0, min_train_replies=1))
    full = {k: np.ones_like(v) for k, v in GLOBAL.items()}
    only_w = {"w": np.ones_like(GLOBAL["w"])}
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, [reply(2.0, full, 1, 1), reply(2.0, only_w, 1, 2)])
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 2), 1.0))  # 2 - 1 * 1
    np.testing.assert_allclose(arrays["b"].numpy(), [2.0, 2.0])  # no gradient from all: averaged
    assert "['b']" in caplog.text


@pytest.mark.parametrize(("mask", "expected"), [("hard", FedGMA), ("soft", FedGMASoft)])
def test_run_config_selects_the_mask_variant_with_its_options(
    mask: str, expected: type[FedGMA]
) -> None:
    config = RunConfig.model_validate(
        {"strategy": "fedgma", "gma-mask": mask, "gma-threshold": 0.6, "gma-server-lr": 0.1}
    )
    data = LabeledData(np.zeros((1, 4), np.float32), np.zeros(1, np.int64), 2)
    strategy = build_strategy(
        config, ServerResources(torch.nn.Linear(4, 2), data, torch.device("cpu"))
    )
    assert type(strategy) is expected
    assert isinstance(strategy, FedGMA)
    assert (strategy.threshold, strategy.server_lr) == (0.6, 0.1)


# ----------------------------------------------------------------------------- the client
def test_client_reports_the_autograd_gradient_of_its_last_local_step() -> None:
    rng = np.random.default_rng(0)
    data = LabeledData(
        rng.random((10, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 10).astype(np.int64), 3
    )
    model = build_model("mlp", (1, 8, 8), 3, seed=0)
    reference = copy.deepcopy(model)
    lr, momentum, decay, epochs = 0.1, 0.9, 0.01, 2
    result = train_local(
        model,
        DeviceData.from_labeled(data, torch.device("cpu")),
        list(torch.arange(10).split(4)) * epochs,  # batches of 4, 4 and 2 samples
        learning_rate=lr,
        momentum=momentum,
        weight_decay=decay,
        keep_last_gradient=True,
    )
    # Independent re-run: SGD with momentum and weight decay written out, torch.autograd.grad for
    # the loss gradient; the gradient kept is the last step's, before its update.
    params = dict(reference.named_parameters())
    velocity: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    batches = [(0, 4), (4, 8), (8, 10)] * epochs
    for start, stop in batches:
        features = torch.from_numpy(data.features[start:stop])
        labels = torch.from_numpy(data.labels[start:stop])
        loss = torch.nn.functional.cross_entropy(reference(features), labels)
        grads = torch.autograd.grad(loss, list(params.values()))
        last = {name: g.detach().clone() for name, g in zip(params, grads, strict=True)}
        with torch.no_grad():
            for (name, p), g in zip(params.items(), grads, strict=True):
                direction = g + decay * p
                velocity[name] = (
                    direction if name not in velocity else momentum * velocity[name] + direction
                )
                p -= lr * velocity[name]
    assert result.last_gradient is not None
    assert set(result.last_gradient) == set(params)
    for name in params:
        torch.testing.assert_close(result.last_gradient[name], last[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dict(model.named_parameters())[name], params[name])
    assert result.steps == len(batches)


# ----------------------------------------------------------------------------- a real run
@pytest.mark.simulation
def test_fedgma_simulation_runs_two_rounds_with_client_gradients(
    run_simulation: Callable[..., Path],
) -> None:
    run_dir = run_simulation(
        {
            "strategy": "fedgma",
            "gma-mask": "hard",
            "gma-server-lr": 0.1,
            "dataset": "colored-digits-binary",
            "num-clients": 3,
            "num-server-rounds": 2,
            "min-train-replies": 3,
        }
    )
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == [0, 1, 2]
    for entry in rounds[1:]:
        assert entry["replies-valid"] == 3  # every reply carried a valid 'gradient' record
        assert entry["replies-dropped"] == 0
        assert 0.0 <= entry["gma-mask-mean"] <= 1.0
        assert entry["aggregated"] == 1
    assert rounds[2]["test-loss"] != rounds[0]["test-loss"]


# ------------------------------------------------------------------ the mask under root-set trust
def loop_agreement(
    votes: list[np.ndarray[Any, Any]],
    trust: list[float],
    root: np.ndarray[Any, Any] | None,
    abstaining: float = 0.0,
) -> np.ndarray[Any, Any]:
    """(sum_k TS_k sign(v_k) + sign(v_0)) / (sum_k TS_k + 1 + a), coordinate by coordinate."""
    out = np.zeros(votes[0].size)
    for index in range(out.size):
        total, weight = 0.0, abstaining
        for vote, score in zip(votes, trust, strict=True):
            value = float(vote.reshape(-1)[index])
            total += score * ((value > 0) - (value < 0))
            weight += score
        if root is not None:
            value = float(root.reshape(-1)[index])
            total += (value > 0) - (value < 0)
            weight += 1.0
        out[index] = total / weight if weight else 0.0
    return out.reshape(votes[0].shape)


@pytest.mark.parametrize("with_root", [True, False])
def test_the_trusted_agreement_is_the_trust_weighted_sign_vote_with_the_root_voting(
    with_root: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aggregate, "BLOCK_ELEMENTS", 5)  # several blocks
    rng = np.random.default_rng(11)
    votes = [{"w": rng.integers(-1, 2, (3, 4)).astype(np.float32)} for _ in range(5)]
    trust = [0.9, 0.0, 0.3, 0.05, 0.6]
    root = {"w": rng.normal(size=(3, 4))} if with_root else None
    got = trusted_agreement(votes, trust, "w", root=root)
    expected = loop_agreement([v["w"] for v in votes], trust, None if root is None else root["w"])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    # soft: the votes are sign(w - theta_k)
    global_w = rng.normal(size=(3, 4)).astype(np.float32)
    models = [{"w": global_w - v["w"]} for v in votes]
    soft = trusted_agreement(models, trust, "w", reference=global_w, root=root)
    np.testing.assert_allclose(soft, expected, rtol=0, atol=1e-12)
    # two abstentions of weight 0.4 each count in the quorum, for no sign
    abstained = trusted_agreement(votes, trust, "w", root=root, abstaining=0.8)
    expected = loop_agreement([v["w"] for v in votes], trust, root and root["w"], 0.8)
    np.testing.assert_allclose(abstained, expected, rtol=0, atol=1e-12)


def test_one_client_of_small_trust_cannot_cancel_the_honest_agreement() -> None:
    # Three honest gradients agree on every sign (trust 0.5 each) and so does the root set; the
    # fourth reply keeps a small positive trust (0.05) and votes against every coordinate. One
    # vote per reply would give |3 - 1| = 2 < 0.8 x 4 and mask every coordinate out.
    global_arrays = {"w": np.zeros(6, np.float32)}
    honest = {"w": np.linspace(1.0, 2.0, 6).astype(np.float32)}
    against = {"w": -honest["w"]}
    gradients = [honest, honest, honest, against]
    models = [{"w": -0.1 * g["w"]} for g in gradients]
    trust = np.array([0.5, 0.5, 0.5, 0.05])
    unweighted = fedgma_step(global_arrays, models, gradients, trust, threshold=0.8)
    assert unweighted.mask_mean == 0.0
    root = {"w": honest["w"].astype(np.float64)}  # the root set's w - theta_0 agrees
    weighted = fedgma_step(
        global_arrays, models, gradients, trust, threshold=0.8, trust=TrustVote(trust, root)
    )
    # agreement (1.5 - 0.05 + 1) / 2.55 = 0.96 >= 0.8: every coordinate kept
    assert weighted.mask_mean == 1.0
    # ... and one reply of trust 0.5 against the others is still enough to mask: it is not
    # a minority of the trust any more ((1.0 - 0.5 + 1) / 2.5 = 0.6 < 0.8)
    split = fedgma_step(
        global_arrays,
        models,
        [honest, honest, against, against],
        trust,
        threshold=0.8,
        trust=TrustVote(np.array([0.5, 0.5, 0.5, 0.0]), root),
    )
    assert split.mask_mean == 0.0
