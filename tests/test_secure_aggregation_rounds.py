"""SecAgg+'s rounds end to end: the server's driver (strategies/secure/driver.py) and the client's
mod (client/secure.py) over the in-process Grid, with a small ClientApp whose replies are known.

What the tests hold: the new model is the rule's over the individual replies (computed here,
independently, from the same replies in the clear) within the quantisation error; what reaches
the aggregation is masked vectors and their unmasked sum, never a reply's model, weight or
metrics; a node that drops after sharing its keys does not stop the round, and below the
threshold the round fails with an error that says how to resume.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.client import secure as client_secure
from beyond_averaging.client.secure import secure_aggregation_mod
from beyond_averaging.server.config import config_problems, parse_run_config
from beyond_averaging.server.runtime.inprocess import FIRST_NODE_ID, InProcessGrid, run_inprocess
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import (
    ContractStrategy,
    ElasticAggregation,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedGMA,
    FedGMASoft,
    FedLAW,
    aggregate_elastic,
    aggregate_fedavg,
)
from beyond_averaging.strategies.fedgma import fedgma_step
from beyond_averaging.strategies.replies.validation import reply_bytes
from beyond_averaging.strategies.secure import (
    SecAggOptions,
    SecureAggregation,
    SecureAggregationError,
)
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.secure_aggregation import MASKED_RECORD, SECURE_RECORD, STAGE_KEY
from tests.conftest import instruction_message

NUM_NODES = 6
GLOBAL = {"w": np.linspace(-1.0, 1.0, 12, dtype=np.float64).reshape(3, 4), "b": np.zeros(4)}
BOUNDS_OFF: dict[str, Any] = {
    "update_norm_factor": 0.0,
    "update_clip_factor": 0.0,
    "direction_outlier_factor": 0.0,
    "max_claim_factor": 0.0,
    "min_train_nodes": NUM_NODES,
    "min_available_nodes": NUM_NODES,
    "fraction_evaluate": 0.0,
    "min_train_replies": 2,
    "log_rounds": False,
}


def client_reply(
    node: int,
) -> tuple[dict[str, np.ndarray], float, dict[str, dict[str, np.ndarray]]]:
    """Node ``node``'s trained model, example count and records: fixed, so the test knows them."""
    rng = np.random.default_rng(node)
    model = {k: v + rng.normal(scale=0.2, size=v.shape) for k, v in GLOBAL.items()}
    records = {
        "sensitivity": {k: rng.uniform(0.0, 2.0, size=v.shape) for k, v in GLOBAL.items()},
        "gradient": {k: rng.normal(loc=0.2, size=v.shape) for k, v in GLOBAL.items()},
    }
    return model, float(20 + 13 * (node % 5)), records


def make_app(seen: list[RecordDict]) -> ClientApp:
    app = ClientApp()

    @app.train(mods=[secure_aggregation_mod])
    def train(message: Message, context: Context) -> Message:
        seen.append(message.content)  # what the wrapped function receives
        model, examples, records = client_reply(message.metadata.dst_node_id)
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                "metrics": MetricRecord({"num-examples": examples, "train-loss": 0.25}),
            }
        )
        requested = str(message.content["config"].get("request-records", ""))
        for name in filter(None, requested.split(",")):
            content[name] = ArrayRecord({k: Array(v) for k, v in records[name].items()})
        return Message(content=content, reply_to=message)

    return app


class DroppingGrid(InProcessGrid):
    """The in-process Grid, where the given nodes go silent from the given stage on."""

    def __init__(self, app: ClientApp, drop: dict[str, set[int]]) -> None:
        super().__init__(app, NUM_NODES, {})
        self.drop = drop
        self.gone: set[int] = set()
        self.aggregated_inputs: list[Message] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        stage = ""
        if messages and SECURE_RECORD in messages[0].content:
            stage = str(messages[0].content[SECURE_RECORD][STAGE_KEY])
        self.gone |= self.drop.get(stage, set())
        kept = [m for m in messages if m.metadata.dst_node_id not in self.gone]
        replies = list(super().send_and_receive(kept, timeout=timeout))
        if stage == "collect":
            self.aggregated_inputs = replies
        return replies


def run_round(
    strategy: ContractStrategy, options: SecAggOptions, drop: dict[str, set[int]] | None = None
) -> tuple[SecureAggregation, DroppingGrid, dict[str, np.ndarray], list[RecordDict]]:
    seen: list[RecordDict] = []
    grid = DroppingGrid(make_app(seen), drop or {})
    secure = SecureAggregation(strategy, options, stage_timeout=30.0)
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    instructions = secure.configure_train(1, arrays, ConfigRecord({"seed": 0}), grid)
    replies = grid.send_and_receive(instructions)
    new, metrics = secure.aggregate_train(1, replies)
    assert new is not None
    assert metrics is not None
    assert metrics["train-loss"] == pytest.approx(0.25, abs=1e-4)
    return secure, grid, {k: v.numpy() for k, v in new.items()}, seen


def plain(rule: str, nodes: list[int]) -> dict[str, np.ndarray]:
    """The rule over the individual replies of ``nodes``, in the clear (weights capped at W)."""
    replies = [client_reply(n) for n in nodes]
    models = [r[0] for r in replies]
    weights = np.array([r[1] for r in replies])
    if rule == "fedavg":
        return aggregate_fedavg(GLOBAL, models, weights)
    if rule == "elastic":
        return aggregate_elastic(
            GLOBAL, models, [r[2]["sensitivity"] for r in replies], weights, 0.5
        )
    gradients = [r[2]["gradient"] for r in replies] if rule == "fedgma" else None
    mask = "hard" if rule == "fedgma" else "soft"
    return fedgma_step(
        GLOBAL, models, gradients, weights, threshold=0.5, server_lr=1.0, mask=mask
    ).arrays


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process is told before it makes messages."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


RULES = {
    "fedavg": lambda: FedAvg(**BOUNDS_OFF),
    "elastic": lambda: ElasticAggregation(tau=0.5, **BOUNDS_OFF),
    "fedgma": lambda: FedGMA(threshold=0.5, server_lr=1.0, **BOUNDS_OFF),
    "fedgma-soft": lambda: FedGMASoft(threshold=0.5, server_lr=1.0, **BOUNDS_OFF),
}
ALL = list(range(FIRST_NODE_ID, FIRST_NODE_ID + NUM_NODES))


def quanta(options: SecAggOptions, count: int = NUM_NODES) -> float:
    """``count`` steps of the round's levels (:meth:`SecAggOptions.for_cohort`), and at least
    1e-12: float64's rounding of the rules' own arithmetic on values of about 1, which the
    64-bit levels (16 / 2^61 here) are finer than."""
    return max(count * options.for_cohort(count).quantum, 1e-12)


@pytest.mark.parametrize("modulus", [64, 32])
@pytest.mark.parametrize("rule", list(RULES))
def test_the_secure_round_gives_the_rules_model_over_the_replies_within_quantisation(
    rule: str, modulus: int
) -> None:
    options = SecAggOptions(max_weight=100.0, modulus_bits=modulus)
    _, _, new, _ = run_round(RULES[rule](), options)
    expected = plain(rule, ALL)
    for key in GLOBAL:
        # Each weighted value is within half a step; the mean divides by R = sum r >= 1.2.
        np.testing.assert_allclose(new[key], expected[key], atol=quanta(options))


# ------------------------------------------------- the server optimizers: FedAvgM and FedAdam
#: Below the update norms of the fixed replies (about 0.8): most clients are clipped.
CLIP = 0.6


def clipped_mean_update(global_arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """sum_k r_k c_k (theta_k - w) / sum_k r_k over every node's fixed reply, each update scaled
    to L2 norm <= CLIP (c_k) and weighted by r_k = min(n_k, W) / W: what the clients' side does,
    written out here in the clear."""
    total = {k: np.zeros_like(v) for k, v in global_arrays.items()}
    weights = 0.0
    for node in ALL:
        model, examples, _ = client_reply(node)
        update = {k: model[k] - global_arrays[k] for k in global_arrays}
        norm = float(np.sqrt(sum(np.sum(u**2) for u in update.values())))
        scale = min(1.0, CLIP / norm)
        weight = min(examples, 100.0) / 100.0
        weights += weight
        for k in total:
            total[k] += weight * scale * update[k]
    return {k: v / weights for k, v in total.items()}


def fedavgm_by_hand(rounds: int, lr: float, momentum: float) -> list[dict[str, np.ndarray]]:
    """Flower's FedAvgM: D = w - avg, v <- momentum v + D (v = D at first), w <- w - lr v."""
    w, velocity, models = dict(GLOBAL), None, []
    for _ in range(rounds):
        step = {k: -u for k, u in clipped_mean_update(w).items()}
        velocity = step if velocity is None else {k: momentum * velocity[k] + step[k] for k in w}
        w = {k: w[k] - lr * velocity[k] for k in w}
        models.append(w)
    return models


def fedadam_by_hand(
    rounds: int, eta: float, beta_1: float, beta_2: float, tau: float
) -> list[dict[str, np.ndarray]]:
    """Flower's FedAdam: delta = avg - w, m and v its moments, w <- w + eta_t m / (sqrt(v) + tau)
    with eta_t = eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1)) in server round t."""
    w = dict(GLOBAL)
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    models = []
    for t in range(1, rounds + 1):
        delta = clipped_mean_update(w)
        m = {k: beta_1 * m[k] + (1 - beta_1) * delta[k] for k in w}
        v = {k: beta_2 * v[k] + (1 - beta_2) * delta[k] ** 2 for k in w}
        eta_t = eta * np.sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1))
        w = {k: w[k] + eta_t * m[k] / (np.sqrt(v[k]) + tau) for k in w}
        models.append(w)
    return models


def secure_rounds(
    strategy: ContractStrategy, options: SecAggOptions, rounds: int
) -> list[dict[str, np.ndarray]]:
    """``rounds`` secure rounds of ``strategy`` over the in-process Grid; each round's model."""
    grid = DroppingGrid(make_app([]), {})
    secure = SecureAggregation(strategy, options, stage_timeout=30.0)
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    models = []
    for server_round in range(1, rounds + 1):
        instructions = secure.configure_train(server_round, arrays, ConfigRecord({"seed": 0}), grid)
        new, _ = secure.aggregate_train(server_round, grid.send_and_receive(instructions))
        assert new is not None
        arrays = new
        models.append({k: v.numpy() for k, v in arrays.items()})
    return models


def test_fedavgm_under_secaggplus_steps_as_the_clipped_plain_rounds_within_quantisation() -> None:
    options = SecAggOptions(max_weight=100.0, clip_norm=CLIP)
    strategy = FedAvgM(server_learning_rate=0.7, server_momentum=0.9, **BOUNDS_OFF)
    secure = secure_rounds(strategy, options, 3)
    expected = fedavgm_by_hand(3, lr=0.7, momentum=0.9)
    without_momentum = fedavgm_by_hand(3, lr=0.7, momentum=0.0)[-1]
    for got, want in zip(secure, expected, strict=True):
        for key in GLOBAL:
            # A round's mean update is within N quanta; momentum and the next rounds' clip
            # carry it on, a few times over by round 3.
            np.testing.assert_allclose(got[key], want[key], atol=8 * quanta(options))
    assert np.abs(expected[-1]["w"] - without_momentum["w"]).max() > 0.05  # momentum matters


def test_fedadam_under_secaggplus_steps_as_the_clipped_plain_rounds_within_quantisation() -> None:
    options = SecAggOptions(max_weight=100.0, clip_norm=CLIP)
    adam: dict[str, Any] = {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 0.01}
    secure = secure_rounds(FedAdam(**adam, **BOUNDS_OFF), options, 3)
    expected = fedadam_by_hand(3, **adam)
    # Adam's step m / (sqrt(v) + tau) changes by at most (1 - beta_1) / tau = 10 times the
    # change of the mean update, so the quantisation error is 10x FedAvg's in each round.
    tolerance = 3 * 10 * quanta(options)
    for got, want in zip(secure, expected, strict=True):
        for key in GLOBAL:
            np.testing.assert_allclose(got[key], want[key], atol=tolerance)
    plain_mean = {k: GLOBAL[k] + u for k, u in clipped_mean_update(GLOBAL).items()}
    assert np.abs(expected[0]["w"] - plain_mean["w"]).max() > 100 * tolerance  # not FedAvg


def test_the_aggregation_receives_masked_vectors_and_the_unmasked_sum_only() -> None:
    options = SecAggOptions(max_weight=100.0)
    secure, grid, _, seen = run_round(FedAvg(**BOUNDS_OFF), options)
    # The wrapped train function got the model and config, never a secret of the stages.
    assert all(SECURE_RECORD not in content for content in seen)
    for reply in grid.aggregated_inputs:
        assert set(reply.content.keys()) == {MASKED_RECORD, SECURE_RECORD}  # no model, no metrics
        assert not reply.content.metric_records
    inputs = secure.last_sum_inputs
    assert set(inputs) == {"masked", "sum"}
    # Each masked vector is unlike the node's own quantised vector: it differs from it in
    # almost every value (the masks are uniform modulo 2^64), while their sum is exact.
    from beyond_averaging.strategies.secure import secure_layout
    from beyond_averaging.tasks.secure_aggregation import client_vector

    layout = secure_layout(FedAvg(**BOUNDS_OFF), GLOBAL)
    total = np.zeros_like(inputs["sum"])
    for node, masked in inputs["masked"].items():
        model, examples, records = client_reply(node)
        own = client_vector(
            layout,
            GLOBAL,
            model,
            records,
            {"train-loss": 0.25},
            examples,
            options.for_cohort(NUM_NODES),
        )
        assert np.mean(masked == own) < 0.01
        total += own
    assert inputs["sum"].tolist() == total.tolist()


def test_a_node_dropping_after_sharing_keys_leaves_the_round_to_the_others() -> None:
    options = SecAggOptions(max_weight=100.0)
    dropped = ALL[2]
    secure, _, new, _ = run_round(FedAvg(**BOUNDS_OFF), options, {"collect": {dropped}})
    survivors = [n for n in ALL if n != dropped]
    expected = plain("fedavg", survivors)
    for key in GLOBAL:
        np.testing.assert_allclose(new[key], expected[key], atol=quanta(options))
    figures = secure.aggregation_metrics[1]
    assert figures["secure-dropped-after-keys"] == 1
    assert sorted(secure.last_sum_inputs["masked"]) == survivors
    statuses = {r["node-id"]: r["status"] for r in secure.last_client_records}
    assert statuses[dropped] == "dropped"


def test_a_ring_of_neighbours_with_a_dropout_and_a_node_lost_before_sharing_still_unmasks() -> None:
    options = SecAggOptions(max_weight=100.0, neighbours=2)
    lost, dropped = ALL[0], ALL[3]
    _, _, new, _ = run_round(
        ElasticAggregation(tau=0.5, **BOUNDS_OFF),
        options,
        {"share-keys": {lost}, "collect": {dropped}},
    )
    expected = plain("elastic", [n for n in ALL if n not in (lost, dropped)])
    for key in GLOBAL:
        np.testing.assert_allclose(new[key], expected[key], atol=quanta(options))


def test_below_the_threshold_the_round_fails_with_an_error_that_says_how_to_resume() -> None:
    options = SecAggOptions(max_weight=100.0, threshold=0.9)  # every holder is needed
    with pytest.raises(SecureAggregationError, match="resume-from"):
        run_round(FedAvg(**BOUNDS_OFF), options, {"unmask": {ALL[1]}})


def test_rules_and_options_that_need_each_reply_are_refused_naming_secure_aggregation() -> None:
    with pytest.raises(ValueError, match=r"update_norm_factor = 10\.0"):
        SecureAggregation(FedAvg(), SecAggOptions())
    with pytest.raises(ValueError, match="robust_aggregation = 'median'"):
        SecureAggregation(FedAvg(**BOUNDS_OFF, robust_aggregation="median"), SecAggOptions())
    with pytest.raises(ValueError, match="FedLAW"):
        SecureAggregation(FedLAW.__new__(FedLAW), SecAggOptions())


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"strategy": "fedlaw"}, "strategy = 'fedlaw'"),
        ({"robust-aggregation": "krum"}, "robust-aggregation = 'krum'"),
        ({"robust-aggregation": "flame"}, "robust-aggregation = 'flame'"),
        ({"robust-aggregation": "fltrust"}, "robust-aggregation = 'fltrust'"),
        ({"pre-aggregation": "nnm"}, "pre-aggregation = 'nnm'"),
        ({"update-clip-factor": 3.0}, "update-clip-factor = 3.0"),
        ({"max-claim-factor": 4.0}, "max-claim-factor = 4.0"),
        ({"diagnostics": True}, "diagnostics = True"),
        ({"client-backend": "vectorized"}, "client-backend = 'vectorized'"),
        ({"secure-quantization-bits": 61}, "secure-quantization-bits = 61"),
        (
            {"secure-modulus-bits": 32, "secure-quantization-bits": 30},
            "secure-quantization-bits = 30",
        ),
    ],
)
def test_the_run_configuration_refuses_in_one_line_what_secure_aggregation_cannot_run(
    overrides: dict[str, Any], named: str
) -> None:
    problems = config_problems({"secure-aggregation": "secaggplus", **overrides})
    assert len(problems) == 1, problems
    assert "secure-aggregation = 'secaggplus'" in problems[0]
    assert named in problems[0]


def test_the_run_configuration_accepts_the_defaults_and_server_side_defences_under_it() -> None:
    assert config_problems({"secure-aggregation": "secaggplus"}) == []
    assert (
        config_problems(
            {
                "secure-aggregation": "secaggplus",
                "strategy": "elastic",
                "server-noise-std": 0.001,
                "backdoor-defence": "trigger-unlearning",
                "secure-clip-norm": 2.0,
            }
        )
        == []
    )


def secure_start_notes(caplog: pytest.LogCaptureFixture, settings: dict[str, Any]) -> list[str]:
    """The INFO lines about the bounds that building the run's strategy logs."""
    config = parse_run_config(
        {"dataset": "digits", "model": "mlp", "num-clients": 3, "device": "cpu", **settings}
    )
    probe = LabeledData(np.zeros((10, 1, 8, 8), np.float32), np.arange(10), 10)
    model = build_model(config.model, probe.input_shape, probe.num_classes, seed=0)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        build_strategy(config, ServerResources(model, probe, torch.device("cpu")))
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "per-reply bounds" in r.getMessage()
    ]


def test_a_secure_run_names_at_its_start_the_bounds_it_turns_off_and_what_replaces_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (note,) = secure_start_notes(caplog, {"secure-aggregation": "secaggplus"})
    for bound in (
        "update-norm-factor = 10.0",
        "update-clip-factor = 2.0",
        "direction-outlier-factor = 2.0",
        "max-claim-factor = 10.0",
    ):
        assert bound in note
    assert "secure-clip-norm = 0.0 leaves each client's update unclipped" in note
    assert "secure-max-weight = 10000.0" in note
    (note,) = secure_start_notes(
        caplog,
        {
            "secure-aggregation": "secaggplus",
            "update-clip-factor": 0.0,
            "secure-clip-norm": 2.5,
            "secure-max-weight": 500.0,
        },
    )
    assert "update-clip-factor" not in note  # off already: not turned off by secure aggregation
    assert "direction-outlier-factor = 2.0" in note
    assert "clips its update to L2 norm secure-clip-norm = 2.5" in note
    assert "secure-max-weight = 500.0" in note
    assert secure_start_notes(caplog, {}) == []  # a plain run keeps its bounds, says nothing


def test_server_noise_reads_only_the_aggregate_and_still_runs_under_it() -> None:
    options = SecAggOptions(max_weight=100.0)
    secure, _, new, _ = run_round(FedAvg(server_noise_std=0.01, **BOUNDS_OFF), options)
    expected = plain("fedavg", ALL)
    difference = np.concatenate([(new[k] - expected[k]).ravel() for k in GLOBAL])
    assert secure.aggregation_metrics[1]["server-noise-std"] == 0.01
    assert 0.005 < float(difference.std()) < 0.02  # the noise, not the quantisation


# ------------------------------------------------------------------ the real app, in process
REPO = Path(__file__).resolve().parents[1]
APP_SETTINGS: dict[str, Any] = {
    "strategy": "fedavg",
    "num-clients": 3,
    "num-server-rounds": 3,
    "local-epochs": 1,
    "device": "cpu",
    "seed": 3,
    "secure-aggregation": "secaggplus",
}


def test_a_run_failed_below_the_threshold_resumes_to_the_uninterrupted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_inprocess(REPO, {**APP_SETTINGS, "output-dir": str(tmp_path), "run-name": "whole"})
    whole = torch.load(tmp_path / "whole" / "final_model.pt")

    def no_shares_in_round_2(config: ConfigRecord, context: Context) -> ConfigRecord:
        if config["server-round"] == 2:
            raise RuntimeError("node lost before unmasking")
        return unmask(config, context)

    unmask = client_secure._unmask
    monkeypatch.setattr(client_secure, "_unmask", no_shares_in_round_2)
    with pytest.raises(SecureAggregationError, match="resume-from"):
        run_inprocess(REPO, {**APP_SETTINGS, "output-dir": str(tmp_path), "run-name": "cut"})
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["status"] == "failed"
    monkeypatch.setattr(client_secure, "_unmask", unmask)
    run_inprocess(REPO, {**APP_SETTINGS, "resume-from": str(tmp_path / "cut")})
    resumed = torch.load(tmp_path / "cut" / "final_model.pt")
    # Masks cancel exactly and quantisation rounds the same way: the same model, bit for bit.
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


def test_a_node_given_no_neighbour_refuses_to_share_its_keys() -> None:
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    options = SecAggOptions().for_cohort(2)
    setup = ConfigRecord({**options.to_config(), "stage": "setup", "server-round": 1})
    message = instruction_message(RecordDict({SECURE_RECORD: setup}), node_id=5)
    secure_aggregation_mod(message, context, lambda m, c: m)
    lonely = ConfigRecord(
        {
            "stage": "share-keys",
            "server-round": 1,
            "ids": [],
            "channel-publics": [],
            "mask-publics": [],
        }
    )
    with pytest.raises(client_secure.SecureStageError, match="no neighbour"):
        secure_aggregation_mod(
            instruction_message(RecordDict({SECURE_RECORD: lonely}), node_id=5),
            context,
            lambda m, c: m,
        )


def test_the_default_quantisation_is_the_finest_the_federation_fits() -> None:
    from beyond_averaging.server.config import parse_run_config

    on = {"secure-aggregation": "secaggplus"}
    assert parse_run_config(on).secure_modulus_bits == 64
    assert parse_run_config(on).resolved_quantization_bits == 60  # 10 clients, 2^64
    assert parse_run_config({**on, "num-clients": 100}).resolved_quantization_bits == 57
    assert parse_run_config({**on, "num-clients": 1000}).resolved_quantization_bits == 54
    narrow = {**on, "secure-modulus-bits": 32}
    assert parse_run_config(narrow).resolved_quantization_bits == 28
    assert parse_run_config({**narrow, "num-clients": 1000}).resolved_quantization_bits == 22
    assert parse_run_config({**on, "secure-quantization-bits": 20}).resolved_quantization_bits == 20


# ------------------------------------------- the default levels: the plain mean to float32
#: A float32 model of a digits MLP's layer sizes, and updates of a trained round's size.
FLOAT32_GLOBAL = {
    "w": np.random.default_rng(10).normal(scale=0.1, size=(64, 32)).astype(np.float32),
    "b": np.random.default_rng(11).normal(scale=0.01, size=32).astype(np.float32),
}


def float32_reply(node: int) -> tuple[dict[str, np.ndarray], float]:
    """Node ``node``'s float32 model (updates of about 1e-3) and its example count (40 to 199:
    each client weighs r = n / 10,000, far below 1, as a digits client under the defaults)."""
    rng = np.random.default_rng(1000 + node)
    model = {
        k: (v + rng.normal(scale=1e-3, size=v.shape)).astype(np.float32)
        for k, v in FLOAT32_GLOBAL.items()
    }
    return model, float(rng.integers(40, 200))


def float32_app() -> ClientApp:
    app = ClientApp()

    @app.train(mods=[secure_aggregation_mod])
    def train(message: Message, context: Context) -> Message:
        model, examples = float32_reply(message.metadata.dst_node_id)
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                "metrics": MetricRecord({"num-examples": examples, "train-loss": 0.5}),
            }
        )
        return Message(content=content, reply_to=message)

    return app


def secure_float32_mean(clients: int, modulus: int) -> dict[str, np.ndarray]:
    """One secure FedAvg round of ``clients`` float32 replies at the run's defaults (W = 10,000,
    the levels the cohort fits modulo 2^``modulus``); SecAgg+'s ring of 8 above 10 clients."""
    rule = FedAvg(**{**BOUNDS_OFF, "min_train_nodes": clients, "min_available_nodes": clients})
    options = SecAggOptions(
        max_weight=10_000.0, modulus_bits=modulus, neighbours=8 if clients > 10 else 0
    )
    secure = SecureAggregation(rule, options, stage_timeout=30.0)
    grid = InProcessGrid(float32_app(), clients, {})
    arrays = ArrayRecord({k: Array(v) for k, v in FLOAT32_GLOBAL.items()})
    instructions = secure.configure_train(1, arrays, ConfigRecord({"seed": 0}), grid)
    new, _ = secure.aggregate_train(1, grid.send_and_receive(instructions))
    assert new is not None
    return {k: v.numpy() for k, v in new.items()}


def float32_plain_mean(clients: int) -> dict[str, np.ndarray]:
    """w + sum n_k (theta_k - w) / sum n_k in float64, rounded once to float32: the plain
    weighted mean, written out here."""
    replies = [float32_reply(node) for node in range(FIRST_NODE_ID, FIRST_NODE_ID + clients)]
    total = sum(n for _, n in replies)
    return {
        key: (
            value.astype(np.float64)
            + sum(n * (m[key].astype(np.float64) - value) for m, n in replies) / total
        ).astype(np.float32)
        for key, value in FLOAT32_GLOBAL.items()
    }


@pytest.mark.parametrize("clients", [10, 100])
def test_the_default_secure_mean_is_the_plain_float32_mean_to_its_rounding(clients: int) -> None:
    secure = secure_float32_mean(clients, 64)
    plain_mean = float32_plain_mean(clients)
    for key, want in plain_mean.items():
        assert secure[key].dtype == np.float32
        # The mean is off by at most 5.6e-13 (SecAggOptions.mean_error_bound at 100 clients),
        # below half a float32 spacing of these values: the same float32, or the neighbour
        # where the exact mean lies that close to a rounding midpoint.
        np.testing.assert_array_max_ulp(secure[key], want, maxulp=1)
        assert np.mean(secure[key] == want) > 0.999
    if clients == 10:
        # Modulo 2^32 (28-bit levels, 6e-8 on weighted values of about 1e-5) the same round
        # is many float32 spacings away: what the wider modulus buys.
        narrow = secure_float32_mean(clients, 32)
        spacing = np.spacing(np.abs(plain_mean["w"]))
        assert np.max(np.abs(narrow["w"] - plain_mean["w"]) / spacing) > 100


def half_precision_app() -> ClientApp:
    """Replies with a float16 model near the global one, and float16 records the rule asks for."""
    app = ClientApp()

    @app.train(mods=[secure_aggregation_mod])
    def train(message: Message, context: Context) -> Message:
        rng = np.random.default_rng(message.metadata.dst_node_id)
        start = {k: v.numpy() for k, v in message.content["arrays"].items()}
        model = {
            k: (v + rng.normal(scale=1e-2, size=v.shape)).astype(np.float16)
            for k, v in start.items()
        }
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                "metrics": MetricRecord({"num-examples": 50, "train-loss": 0.5}),
            }
        )
        requested = str(message.content["config"].get("request-records", ""))
        for name in filter(None, requested.split(",")):
            noise = {k: rng.normal(size=v.shape).astype(np.float16) for k, v in model.items()}
            content[name] = ArrayRecord({k: Array(v) for k, v in noise.items()})
        return Message(content=content, reply_to=message)

    return app


def test_a_half_precision_models_masked_replies_fit_the_secure_byte_limit() -> None:
    # Modulo 2^64 each value travels as 8 bytes, four times a float16 value: FedGMA's masked
    # update, gradient and signs (12 x the model's bytes) outgrow the rule's own limit (4 x the
    # model's bytes per record sent back, + 1 MiB), here at 200,000 values; a deployment pulls
    # a reply up to 1.25 x the limit, so from about a million values every reply was refused.
    rule = FedGMA(**BOUNDS_OFF)
    grid = DroppingGrid(half_precision_app(), {})
    secure = SecureAggregation(rule, SecAggOptions(), stage_timeout=30.0)
    arrays = ArrayRecord({"w": Array(np.zeros((400, 500), np.float16))})
    instructions = secure.configure_train(1, arrays, ConfigRecord({"seed": 0}), grid)
    replies = list(grid.send_and_receive(instructions))
    sizes = [reply_bytes(reply.content) for reply in replies]
    assert len(sizes) == NUM_NODES
    assert min(sizes) > rule.reply_byte_limit  # what the rule alone would have let through
    assert max(sizes) <= secure.reply_byte_limit
    new, _ = secure.aggregate_train(1, replies)
    assert new is not None
    assert secure.reply_byte_limit == rule.reply_byte_limit  # after the round: the rule's again
