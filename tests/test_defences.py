"""The defences beyond the defaults, as pure functions and inside every rule, against references
computed here: scikit-learn's HDBSCAN for FLAME's clustering, explicit loops for FLTrust's
aggregate and Elastic's zeta under trust, a bisection on explicit distances for min-max and
min-sum, and a geometrically growing run for the model guard.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.attacks import shejwalkar_gamma
from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import ClientReply, ElasticAggregation, FedAvg, FedGMA, FedLAW
from beyond_averaging.strategies.defences.robust import (
    FLAME_NOISE_LAMBDA,
    flame_noise,
    flame_selection,
    majority_cluster,
    median_length_scales,
)
from beyond_averaging.strategies.defences.root_set import (
    PROXY_WEIGHT_EPOCHS,
    PROXY_WEIGHT_LR,
    root_update,
    trusted_replies,
)
from beyond_averaging.strategies.replies.validation import ModelGuard
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD, ClientTask
from tests.conftest import train_reply
from tests.test_byzantine_bounds import BOUNDS_OFF, TASK, Model
from tests.test_byzantine_bounds import fedlaw_setup as root_setup


def flat(model: Model) -> np.ndarray[Any, Any]:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in model.values()])


def unflat(vector: np.ndarray[Any, Any], like: Model) -> Model:
    out, start = {}, 0
    for key, value in like.items():
        out[key] = vector[start : start + value.size].reshape(value.shape).astype(np.float32)
        start += value.size
    return out


def aggregated(strategy: Any, models: list[Model], **extra: Any) -> Model:
    records = extra.get("records") or [None] * len(models)
    replies = [train_reply(m, 10, node_id=i + 1, extra=records[i]) for i, m in enumerate(models)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    return {key: value.numpy() for key, value in arrays.items()}


# ----------------------------------------------------------------------------- FLAME
def test_the_majority_cluster_is_hdbscans_cluster_under_flames_settings() -> None:
    hdbscan = pytest.importorskip("sklearn.cluster").HDBSCAN
    rng = np.random.default_rng(0)
    for trial in range(60):
        count = int(rng.integers(3, 14))
        points = rng.normal(size=(count, 6))
        if trial % 2:  # a tight majority and scattered others
            points[: count // 2 + 1] = rng.normal(size=6) * 3 + 0.3 * points[: count // 2 + 1]
        distances = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            labels = (
                hdbscan(
                    min_cluster_size=count // 2 + 1,
                    min_samples=1,
                    allow_single_cluster=True,
                    metric="precomputed",
                )
                .fit(distances)
                .labels_
            )
        assert majority_cluster(distances) == np.flatnonzero(labels >= 0).tolist()


def test_flame_keeps_a_majority_by_cosine_and_leaves_out_updates_pointing_elsewhere() -> None:
    rng = np.random.default_rng(1)
    global_model = {"w": np.zeros(50, np.float32)}
    direction = rng.normal(size=50)
    models = [
        {"w": (s * direction + 0.3 * rng.normal(size=50)).astype(np.float32)}
        for s in (1.0, 2.0, 0.5, 4.0, 1.5)
    ]
    models += [{"w": (-3.0 * direction).astype(np.float32)}, {"w": rng.normal(size=50) * 5}]
    kept = flame_selection(global_model, models)
    assert 5 not in kept
    assert 6 not in kept
    assert len(kept) >= 4  # a majority of 7, cosine alone: the norms (0.5 to 4) do not count


def test_flame_clips_the_kept_updates_at_their_median_norm_and_adds_lambda_scaled_noise() -> None:
    size = 20_000
    rng = np.random.default_rng(2)
    direction = rng.normal(size=size)
    direction /= np.linalg.norm(direction)
    global_model = {"w": np.zeros(size, np.float32)}
    models = [{"w": (norm * direction).astype(np.float32)} for norm in (1.0, 2.0, 4.0)]
    models.append({"w": (-2.0 * direction).astype(np.float32)})
    strategy = FedAvg(robust_aggregation="flame", **BOUNDS_OFF)
    strategy.global_arrays, strategy.reply_byte_limit = dict(global_model), 1 << 24
    result = aggregated(strategy, models)["w"]
    figures = strategy.aggregation_metrics[1]
    assert figures["dropped-flame-rejected"] == 1  # the reversed one
    # kept norms 1, 2, 4; their median 2 clips the 4: the mean of 1, 2 and 2 along the direction
    expected = (1.0 + 2.0 + 2.0) / 3 * direction
    noise = result - expected
    assert figures["flame-noise-std"] == pytest.approx(FLAME_NOISE_LAMBDA * 2.0)
    assert np.std(noise) == pytest.approx(FLAME_NOISE_LAMBDA * 2.0, rel=0.05)
    assert abs(float(np.mean(noise))) < 1e-4


@pytest.mark.parametrize(
    ("options", "std"),
    [
        ({"server_noise_std": 0.01}, 0.01),
        # FLAME's 0.005 x median 2 = 0.01 and weak DP's 0.02 add in variance: sqrt(5) x 0.01
        (
            {"robust_aggregation": "flame", "flame_noise_lambda": 0.005, "server_noise_std": 0.02},
            math.sqrt(0.01**2 + 0.02**2),
        ),
    ],
)
def test_server_noise_is_added_to_the_new_model_with_the_configured_std(
    options: dict[str, Any], std: float
) -> None:
    size = 20_000
    direction = np.zeros(size)
    direction[0] = 1.0
    global_model = {"w": np.zeros(size, np.float32)}
    models = [{"w": (norm * direction).astype(np.float32)} for norm in (1.0, 2.0, 2.0)]
    strategy = FedAvg(**options, **BOUNDS_OFF)
    strategy.global_arrays, strategy.reply_byte_limit = dict(global_model), 1 << 24
    noise = aggregated(strategy, models)["w"][1:]  # every coordinate but the update's
    assert np.std(noise) == pytest.approx(std, rel=0.05)
    assert strategy.aggregation_metrics[1].get("server-noise-std") == options["server_noise_std"]


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_a_negative_or_non_finite_noise_is_refused_naming_it(value: float) -> None:
    with pytest.raises(ValueError, match=f"server_noise_std = {value}"):
        FedAvg(server_noise_std=value)


def test_flame_noise_is_drawn_from_the_run_seed_and_round_and_spares_integer_tensors() -> None:
    arrays = {"w": np.ones(1000, np.float32), "count": np.array(3, np.int64)}
    first = flame_noise(arrays, 0.5, (7, 3))
    assert first["w"].dtype == np.float32
    assert first["count"] == 3
    np.testing.assert_array_equal(first["w"], flame_noise(arrays, 0.5, (7, 3))["w"])
    assert not np.array_equal(first["w"], flame_noise(arrays, 0.5, (7, 4))["w"])


# ----------------------------------------------------------------------------- FLTrust
def test_median_length_scales_bring_every_vector_to_the_trusted_median_length() -> None:
    norms = np.array([1.0, 3.0, 2.0, 100.0, 0.0])
    trusted = np.array([True, True, True, False, False])
    np.testing.assert_allclose(median_length_scales(norms, trusted), [2.0, 2 / 3, 1.0, 0.02, 1.0])
    np.testing.assert_allclose(median_length_scales(norms, np.zeros(5, bool)), np.ones(5))


def with_task(strategy: Any, state: Model) -> Any:
    """What configure_train gives the strategy: the round's client task and global model."""
    strategy._task = ClientTask.from_config(ConfigRecord(dict(TASK.to_config())))
    strategy.global_arrays, strategy.reply_byte_limit = dict(state), 1 << 20
    return strategy


def fltrust_reference(state: Model, g0: np.ndarray[Any, Any], updates: list[Any]) -> Any:
    """w + sum_k TS_k m u_k / ||u_k|| / sum_k TS_k, TS_k = ReLU(cos(u_k, g0)), m the median norm
    of the trusted updates: written out with loops."""
    trust = [max(0.0, float(u @ g0 / (np.linalg.norm(u) * np.linalg.norm(g0)))) for u in updates]
    median = float(
        np.median([np.linalg.norm(u) for u, t in zip(updates, trust, strict=True) if t > 0])
    )
    total = np.zeros_like(g0)
    for u, t in zip(updates, trust, strict=True):
        total += t * median * u / np.linalg.norm(u)
    return trust, flat(state) + total / sum(trust)


def client_updates(g0: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    """Along g0 (twice, at two lengths), against it, and at 45 degrees to it."""
    side = np.random.default_rng(3).normal(size=g0.shape)
    side -= (side @ g0) / (g0 @ g0) * g0
    side *= np.linalg.norm(g0) / np.linalg.norm(side)
    return [1.0 * g0, 3.0 * g0, -1.0 * g0, g0 + side]


@pytest.mark.parametrize("rule", [FedAvg, FedGMA])
def test_fltrust_weighs_each_update_by_its_trust_at_the_trusted_median_length(rule: type) -> None:
    model, root, state = root_setup()
    strategy = with_task(
        rule(robust_aggregation="fltrust", model=model, proxy_set=root, **BOUNDS_OFF), state
    )
    g0 = flat(strategy.root_set.update(state, strategy._task, 1))
    updates = client_updates(g0)
    models = [unflat(flat(state) + u, state) for u in updates]
    # FedGMA's gradients agree in sign on every coordinate for the trusted three, against the
    # root set's vote sign(w - theta_0) = -sign(g0) of weight 1: their agreement is
    # (1 + 1 + 0.71 - 1) / 3.71 = 0.46 < 0.8, so the mask keeps no coordinate.
    gradient = unflat(g0, state)
    records = [{GRADIENT_RECORD: {k: np.asarray(v) for k, v in gradient.items()}}] * 4
    result = aggregated(strategy, models, records=records if rule is FedGMA else None)
    trust, expected = fltrust_reference(state, g0, updates)
    np.testing.assert_allclose(strategy.aggregation_metrics[1]["fltrust-trust"], trust, atol=1e-6)
    np.testing.assert_allclose(flat(result), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- proxy weights
def root_logits(state: Model, root: Any) -> np.ndarray[Any, Any]:
    return root.features @ np.asarray(state["0.weight"]).T + np.asarray(state["0.bias"])


def root_accuracy(state: Model, root: Any) -> float:
    return float(np.mean(root_logits(state, root).argmax(axis=1) == root.labels))


def root_cross_entropy(state: Model, root: Any) -> float:
    logits = root_logits(state, root).astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-np.mean(log_softmax[np.arange(len(root.labels)), root.labels]))


@pytest.mark.parametrize("rule", [FedAvg, ElasticAggregation, FedGMA])
def test_proxy_weights_give_the_mix_to_the_client_whose_model_fits_the_root_set(
    rule: type, caplog: pytest.LogCaptureFixture
) -> None:
    model, root, state = root_setup()
    # A root set whose classes sit apart; one client's model fits it (least squares on one-hot
    # labels), the other's is its negation: equal data sizes average them to nothing, the root
    # set tells them apart.
    centres = 3.0 * np.eye(3, 4, dtype=np.float32)
    noise = 0.3 * np.random.default_rng(2).normal(size=root.features.shape).astype(np.float32)
    root = dataclasses.replace(root, features=centres[root.labels] + noise)
    targets = np.eye(3)[root.labels]
    design = np.hstack([root.features, np.ones((len(root.labels), 1))])
    fitted = np.linalg.lstsq(design, targets, rcond=None)[0]
    good = {"0.weight": fitted[:4].T.astype(np.float32), "0.bias": fitted[4].astype(np.float32)}
    bad = {key: -value for key, value in good.items()}
    assert root_accuracy(good, root) > 0.9 > 0.1 > root_accuracy(bad, root)
    strategy = with_task(
        rule(robust_aggregation="proxy-weights", model=model, proxy_set=root, **BOUNDS_OFF), state
    )
    records: list[Any] = [None, None]
    if rule is not FedAvg:
        name = SENSITIVITY_RECORD if rule is ElasticAggregation else GRADIENT_RECORD
        records = [{name: {k: np.ones_like(v) for k, v in m.items()}} for m in (good, bad)]
    result = aggregated(strategy, [good, bad], records=records)
    weights = strategy.aggregation_metrics[1]["proxy-weights"]
    # From the data sizes' 0.5 each, FedLAW's schedule (100 Adam epochs from lr 0.005, halved
    # every 20) moves the weight logits by at most about 0.2 each: a bounded tilt, not a vote.
    assert 0.55 < weights[0] < 0.7, weights
    equal = {k: 0.5 * good[k] + 0.5 * bad[k] for k in good}
    if rule is FedAvg:  # the weighted mean of the two models, in the learned weights
        expected = {k: weights[0] * good[k] + weights[1] * bad[k] for k in good}
        np.testing.assert_allclose(flat(result), flat(expected), rtol=1e-5, atol=1e-6)
    assert root_cross_entropy(result, root) < root_cross_entropy(equal, root)
    assert f"proxy weights [{weights[0]:.3f}, {weights[1]:.3f}]" in caplog.text  # round line


def test_fedlaw_refuses_proxy_weights_for_it_learns_its_own() -> None:
    model, root, _ = root_setup()
    with pytest.raises(ValueError, match=r"proxy-weights.*FedLAW"):
        FedLAW(robust_aggregation="proxy-weights", model=model, proxy_set=root)


def test_proxy_weights_without_a_root_set_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"learns the clients' weights.*proxy_set="):
        FedAvg(robust_aggregation="proxy-weights")


@pytest.mark.parametrize("agrees_with_root", [True, False])
def test_fedgma_under_fltrust_lets_the_root_set_vote_as_one_typical_trusted_reply(
    agrees_with_root: bool,
) -> None:
    model, root, state = root_setup()
    strategy = with_task(
        FedGMA(robust_aggregation="fltrust", model=model, proxy_set=root, **BOUNDS_OFF), state
    )
    g0 = flat(strategy.root_set.update(state, strategy._task, 1))
    updates = [u for k, u in enumerate(client_updates(g0)) if k != 2]  # all trusted
    models = [unflat(flat(state) + u, state) for u in updates]
    # The three trusted gradients agree in sign on every coordinate (trust 1, 1, 0.71). The root
    # set votes sign(w - theta_0) = -sign(g0) with the median trust, 1: agreeing, A = 1 and the
    # whole trust-weighted mean gradient is stepped; against, A = (2.71 - 1) / 3.71 = 0.46 < 0.8
    # and nothing is (one vote per reply, without the root, would step it in both cases).
    descent = -g0 / np.linalg.norm(g0)
    gradient = unflat(descent if agrees_with_root else -descent, state)
    records = [{GRADIENT_RECORD: {k: np.asarray(v) for k, v in gradient.items()}}] * 3
    result = aggregated(strategy, models, records=records)
    _, expected = fltrust_reference(state, g0, updates)
    # every trusted gradient is the same vector (already at the trusted median length), so
    # their trust-weighted mean is that vector; server lr 1
    stepped = expected - descent if agrees_with_root else expected
    np.testing.assert_allclose(flat(result), stepped, rtol=1e-5, atol=1e-6)
    assert strategy.last_mask_mean == (1.0 if agrees_with_root else 0.0)


def test_trusted_replies_weigh_by_trust_at_the_trusted_median_or_the_root_length() -> None:
    replies = [
        ClientReply(node_id=k, arrays={}, num_examples=1000.0, metrics={}, update_scale=0.5)
        for k in range(3)
    ]
    trust, norms = np.array([0.5, 0.0, 1.0]), np.array([1.0, 5.0, 4.0])
    median = trusted_replies(replies, trust, norms)  # trusted norms 1 and 4: median 2.5
    assert [(r.node_id, r.num_examples, r.update_scale) for r in median] == [
        (0, 0.5, 2.5),
        (2, 1.0, 0.625),
    ]
    root = trusted_replies(replies, trust, norms, length=2.0)  # FLTrust's ||g_0||: FedLAW's
    assert [r.update_scale for r in root] == [2.0, 0.5]
    assert FedLAW.trusted_length == "root"
    assert FedAvg.trusted_length == "median"


def test_fltrust_in_elastic_takes_zeta_from_the_trust_weighted_sensitivities() -> None:
    model, root, state = root_setup()
    strategy = with_task(
        ElasticAggregation(robust_aggregation="fltrust", model=model, proxy_set=root, **BOUNDS_OFF),
        state,
    )
    g0 = flat(strategy.root_set.update(state, strategy._task, 1))
    updates = client_updates(g0)
    models = [unflat(flat(state) + u, state) for u in updates]
    rng = np.random.default_rng(4)
    sensitivities = [
        {k: rng.uniform(0, s, size=v.shape) for k, v in state.items()} for s in (1.0, 2.0, 5.0, 3.0)
    ]
    records = [{SENSITIVITY_RECORD: sens} for sens in sensitivities]
    result = aggregated(strategy, models, records=records)
    trust, plain = fltrust_reference(state, g0, updates)
    kept = [k for k, t in enumerate(trust) if t > 0]
    norms = [np.linalg.norm(flat(sensitivities[k])) for k in kept]
    omega = sum(
        trust[k] * np.median(norms) / n * flat(sensitivities[k])
        for k, n in zip(kept, norms, strict=True)
    ) / sum(trust[k] for k in kept)
    zeta = np.concatenate(
        [1.5 - part / (part.max() + 1e-13) for part in np.split(omega, [state["0.weight"].size])]
    )
    expected = flat(state) + zeta * (plain - flat(state))  # w - zeta * D, D = w - FLTrust's model
    np.testing.assert_allclose(flat(result), expected, rtol=1e-5, atol=1e-6)


def test_fedlaw_and_every_rule_share_one_root_update() -> None:
    model, root, state = root_setup()
    fedlaw = with_task(
        FedLAW(model=model, proxy_set=root, batch_size=30, epochs=1, robust_aggregation="fltrust"),
        state,
    )
    fedavg = with_task(FedAvg(robust_aggregation="fltrust", model=model, proxy_set=root), state)
    for strategy in (fedlaw, fedavg):
        assert strategy.root_set is not None
        assert len(strategy.root_set) == 30
    np.testing.assert_array_equal(
        flat(fedlaw.root_set.update(state, fedlaw._task, 1)),
        flat(fedavg.root_set.update(state, fedavg._task, 1)),
    )


@pytest.mark.parametrize(
    ("momentum", "weight_decay", "epochs", "batch_size", "server_round"),
    [(0.9, 5e-4, 2, 32, 3), (0.0, 0.0, 1, 7, 1), (0.5, 1e-3, 3, 100, 9)],
)
def test_the_root_update_is_sgd_on_the_root_set_with_the_clients_settings(
    momentum: float, weight_decay: float, epochs: int, batch_size: int, server_round: int
) -> None:
    # The reference: FLTrust's server update written with torch.optim.SGD and a plain loop over
    # one seeded permutation per epoch, as the docstring states it; root_update trains with the
    # clients' own loop (tasks.training.train_local), which must give the same bits.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    features, labels = torch.randn(90, 12), torch.arange(90) % 4
    task = dataclasses.replace(
        TASK,
        momentum=momentum,
        weight_decay=weight_decay,
        local_epochs=epochs,
        batch_size=batch_size,
    )
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(
        reference.parameters(),
        lr=task.round_learning_rate(server_round),
        momentum=momentum,
        weight_decay=weight_decay,
    )
    generator = torch.Generator().manual_seed(task.seed * 100_003 + server_round)
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), batch_size):
            rows = order[start : start + batch_size]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(reference(features[rows]), labels[rows]).backward()
            optimizer.step()
    expected = {
        k: v.detach().numpy().astype(np.float64) - state[k]
        for k, v in reference.state_dict().items()
    }
    update = root_update(model, state, features, labels, task, server_round)
    assert update.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(update[key], value)
    assert all(np.array_equal(v.detach().numpy(), state[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- the model guard
def test_the_model_guard_refuses_a_model_that_grows_round_after_round() -> None:
    rng = np.random.default_rng(5)
    model = {"w": rng.normal(size=1000)}
    guard, refused = ModelGuard(), None
    for server_round in range(1, 12):
        median_update = 0.5 * 5.0**server_round  # a Byzantine majority's updates, x5 a round
        grown = {"w": model["w"] * 5.0}
        reason = guard.rejection(grown, model, median_update)
        if reason is not None:
            refused = server_round
            break
        model = grown
    assert refused is not None
    assert refused <= 5
    assert "honest scale" in str(reason)


def test_the_model_guard_passes_an_honest_run_and_resumes_with_its_scale() -> None:
    rng = np.random.default_rng(6)
    model = {"w": rng.normal(size=1000) * 0.1}
    guard = ModelGuard()
    for server_round in range(1, 41):
        update = rng.normal(size=1000) * 0.05 / math.sqrt(server_round)
        new = {"w": model["w"] + update}
        assert guard.rejection(new, model, float(np.linalg.norm(update))) is None
        model = new
        if server_round == 20:  # a checkpoint and a resume in the middle
            resumed = ModelGuard()
            resumed.load_state_dict(guard.state_dict())
            assert resumed == guard
            guard = resumed


# ----------------------------------------------------------------------------- min-max, min-sum
def bisection(updates: list[dict[str, Any]], perturbation: dict[str, Any], objective: str) -> float:
    """The largest gamma within the paper's bound, by bisection on explicit distances (the
    paper halves a step from gamma = 10, which reaches [5, 15] only)."""
    vectors = [flat(u) for u in updates]
    p, mu = flat(perturbation), np.mean(vectors, axis=0)
    pairwise = [[np.linalg.norm(a - b) ** 2 for b in vectors] for a in vectors]

    def fits(gamma: float) -> bool:
        distances = [np.linalg.norm(mu + gamma * p - v) ** 2 for v in vectors]
        if objective == "min-max":
            return bool(max(distances) <= max(max(row) for row in pairwise))
        return bool(sum(distances) <= max(sum(row) for row in pairwise))

    low, high = 0.0, 1.0
    while fits(high):
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@pytest.mark.parametrize("objective", ["min-max", "min-sum"])
def test_min_max_and_min_sum_take_the_largest_gamma_the_papers_search_finds(objective: str) -> None:
    rng = np.random.default_rng(7)
    updates = [{"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)} for _ in range(6)]
    perturbation = {k: -np.std([u[k] for u in updates], axis=0) for k in updates[0]}
    gamma = shejwalkar_gamma(updates, perturbation, objective)
    assert gamma > 0.0
    assert gamma == pytest.approx(bisection(updates, perturbation, objective), rel=1e-6)


def test_a_run_with_proxy_weights_takes_the_proxy_set_as_its_root_set() -> None:
    config = parse_run_config(
        {"dataset": "digits", "model": "mlp", "robust-aggregation": "proxy-weights"}
    )
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, seed=0)
    strategy = build_strategy(
        config, ServerResources(model, proxy_set, torch.device("cpu"), test_set)
    )
    assert strategy.root_set is not None  # type: ignore[attr-defined]
    assert len(strategy.root_set.labels) == 100  # type: ignore[attr-defined]  # 10 per class
    # the weights' schedule is FedLAW's defaults
    assert (config.fedlaw_epochs, config.fedlaw_lr) == (PROXY_WEIGHT_EPOCHS, PROXY_WEIGHT_LR)
    with pytest.raises(ConfigError, match=r"proxy-weights.*proxy-per-class >= 1"):
        parse_run_config({"robust-aggregation": "proxy-weights", "proxy-per-class": 0})
