"""Byzantine clients in a real federation (the attack set of server/attacks/, digits, in process).

One of four IID clients sends w - 5 (theta - w), its honest update sign-flipped and five times
as long, with its true number of examples: under the default run options every rule ends within
0.05 of its honest run, and with the bounds off the same attacker drives every rule to about
chance (so the test fails when the defaults stop holding). Claiming 1e12 examples as well,
``robust-aggregation = "median"`` holds it for every rule.

The attackers' best responses to the defaults (docs/reliability.md, "Adaptive attacks"): the
norm-aware update (just inside every bound) and the boosted backdoor beat the defaults (FedAvg:
to chance, and a backdoor that succeeds on most triggered images), and ``robust-aggregation =
"fltrust"`` holds both for every rule: the norm-aware attacker costs at most 5 points of the
rule's honest run under the defaults, the backdoor at most 2 points of clean accuracy, and it
succeeds on at most 10 % of the triggered images (mean of seeds 0-2: single runs of this
setting move by several points). Three of four clients sign-flipping (a Sybil majority) take the
defaults to chance; root-set trust holds them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from benchmarks.attacks import run_attacked
from beyond_averaging.server.attacks import ATTACKS, AttackGrid, RoundView, alie_z
from beyond_averaging.server.runtime.inprocess import InProcessGrid
from tests.conftest import reply_message

FEDERATION = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": 4,
    "partition": "iid",
    "num-server-rounds": 8,
    "device": "cpu",
    "attackers": 1,
}
BOUNDS_OFF = {"update-clip-factor": 0.0, "direction-outlier-factor": 0.0, "max-claim-factor": 0.0}
RULES = ["fedavg", "elastic", "fedlaw", "fedgma"]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Small models on a shared CPU: more threads only add contention (as the runner's runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def final_round(folder: Path, name: str, **settings: Any) -> dict[str, Any]:
    run_attacked({**FEDERATION, **settings, "output-dir": str(folder), "run-name": name})
    rounds = (folder / name / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return dict(json.loads(rounds[-1]))


def final_accuracy(folder: Path, name: str, **settings: Any) -> float:
    return float(final_round(folder, name, **settings)["test-accuracy"])


@pytest.fixture(scope="module")
def honest_accuracy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """Each rule's honest run under the defaults, shared by the tests of this module."""
    folder = tmp_path_factory.mktemp("honest")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {rule: final_accuracy(folder, rule, strategy=rule, attack="none") for rule in RULES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_holds_a_sign_flipping_client_under_the_defaults(
    rule: str, tmp_path: Path, honest_accuracy: dict[str, float]
) -> None:
    honest = honest_accuracy[rule]
    defended = final_accuracy(tmp_path, "defaults", strategy=rule, attack="sign-flip")
    undefended = final_accuracy(tmp_path, "off", strategy=rule, attack="sign-flip", **BOUNDS_OFF)
    assert defended >= honest - 0.05, (rule, honest, defended)
    assert undefended < 0.3, (rule, undefended)  # the attack is real


@pytest.mark.parametrize("rule", RULES)
def test_the_median_form_of_every_rule_holds_a_sign_flipping_client_claiming_1e12_examples(
    rule: str, tmp_path: Path, honest_accuracy: dict[str, float]
) -> None:
    attacked = final_accuracy(
        tmp_path,
        "median",
        strategy=rule,
        attack="sign-flip-1e12",
        **{"robust-aggregation": "median"},
    )
    assert attacked >= honest_accuracy[rule] - 0.05, (rule, honest_accuracy[rule], attacked)


FLTRUST = {"robust-aggregation": "fltrust"}


def test_the_norm_aware_attacker_and_the_boosted_backdoor_beat_the_defaults(
    tmp_path: Path, honest_accuracy: dict[str, float]
) -> None:
    norm_aware = final_accuracy(tmp_path, "norm-aware", strategy="fedavg", attack="norm-aware")
    backdoor = final_round(tmp_path, "backdoor", strategy="fedavg", attack="backdoor")
    assert norm_aware < 0.3, norm_aware
    assert backdoor["backdoor-success"] > 0.5, backdoor
    assert backdoor["test-accuracy"] >= honest_accuracy["fedavg"] - 0.02  # it hides: no cost


@pytest.mark.parametrize("rule", RULES)
def test_root_set_trust_holds_the_norm_aware_attacker_and_the_backdoor_for_every_rule(
    rule: str, tmp_path: Path, honest_accuracy: dict[str, float]
) -> None:
    honest = honest_accuracy[rule]  # the rule's honest run under the defaults
    norm_aware = final_accuracy(
        tmp_path, "norm-aware", strategy=rule, attack="norm-aware", **FLTRUST
    )
    assert norm_aware >= honest - 0.05, (rule, honest, norm_aware)
    backdoors = [
        final_round(
            tmp_path, f"backdoor{seed}", strategy=rule, attack="backdoor", seed=seed, **FLTRUST
        )
        for seed in (0, 1, 2)
    ]
    assert backdoors[0]["test-accuracy"] >= honest - 0.02, (rule, honest, backdoors[0])
    success = float(np.mean([run["backdoor-success"] for run in backdoors]))
    assert success <= 0.10, (rule, [run["backdoor-success"] for run in backdoors])


def test_fedgmas_trusted_mask_holds_the_sign_flipped_mix_that_keeps_a_small_trust(
    tmp_path: Path,
) -> None:
    # Seed 1, where one vote per trusted reply let the mix (cosine +0.05, a small positive
    # trust) take FedGMA with root-set trust from 95.4 to 88.3 % (docs/reliability.md, "FedGMA's
    # mask under root-set trust"); the trust-weighted mask keeps it within 5 points.
    settings = {"strategy": "fedgma", "seed": 1, **FLTRUST}
    honest = final_accuracy(tmp_path, "honest", attack="none", **settings)
    mixed = final_accuracy(tmp_path, "mix", attack="norm-aware-mix", **settings)
    assert mixed >= honest - 0.05, (honest, mixed)


def test_root_set_trust_holds_a_sybil_majority_that_takes_the_defaults_to_chance(
    tmp_path: Path,
) -> None:
    # Three of four clients sign-flipping: the direction check sides with them and drops the
    # honest reply, so the defaults end at chance; the root set trusts the honest one alone.
    sybils = {"attackers": 3, "attack": "sign-flip", "strategy": "fedavg"}
    assert final_accuracy(tmp_path, "defaults", **sybils) < 0.2
    assert final_accuracy(tmp_path, "fltrust", **sybils, **FLTRUST) > 0.85


class Replies:
    """A Grid stand-in that answers every train message with fixed replies."""

    def __init__(self, replies: list[Message]) -> None:
        self.replies = replies

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        return self.replies


def test_the_attacker_sends_its_honest_update_sign_flipped_five_times_and_claims_1e12(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for attribute in ("_run_id", "_node_id", "_task_id"):  # a ServerApp's identity, to send
        monkeypatch.setattr(TaskIdentity, attribute, 1 if attribute == "_run_id" else 0)
    global_model = {"w": np.array([1.0, 2.0], np.float32)}
    models = [np.array([2.0, 2.0], np.float32), np.array([1.0, 4.0], np.float32)]
    replies = []
    for node, model in enumerate(models, start=1):
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(model)}),
                "metrics": MetricRecord({"num-examples": 10}),
            }
        )
        replies.append(reply_message(content, node_id=node))
    request = Message(
        content=RecordDict({"arrays": ArrayRecord({"w": Array(global_model["w"])})}),
        message_type="train",
        dst_node_id=1,
    )
    grid = AttackGrid(Replies(replies), [1], ATTACKS["sign-flip-1e12"], seed=0)  # type: ignore[arg-type]
    out = list(grid.send_and_receive([request]))
    np.testing.assert_allclose(out[0].content["arrays"]["w"].numpy(), [1.0 - 5.0, 2.0])
    assert out[0].content["metrics"]["num-examples"] == 1e12
    np.testing.assert_allclose(out[1].content["arrays"]["w"].numpy(), models[1])  # honest


#: Each node of the fixed app below moves the model by its own delta and claims its own count.
DELTAS = [
    np.array([1.0, -2.0], np.float32),
    np.array([0.5, 0.5], np.float32),
    np.array([-1.0, 3.0], np.float32),
]
CLAIMS = [10, 20, 30]
fixed_app = ClientApp()


@fixed_app.train()
def fixed_train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    weights = msg.content["arrays"]["w"].numpy()
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(weights + DELTAS[partition])}),
            "metrics": MetricRecord({"num-examples": CLAIMS[partition]}),
        }
    )
    return Message(content=content, reply_to=msg)


def test_the_attack_grid_drops_into_flowers_own_fedavg_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A user's ServerApp keeps its strategy and strategy.start; only the Grid is wrapped. The
    # first node sign-flips its update five times, so Flower's FedAvg returns the claims-weighted
    # mean of w + delta_i with delta_0 replaced by -5 delta_0 (computed here by hand).
    for attribute in ("_run_id", "_node_id", "_task_id"):  # a ServerApp's identity, to send
        monkeypatch.setattr(TaskIdentity, attribute, 1 if attribute == "_run_id" else 0)
    grid = InProcessGrid(fixed_app, 3, {})
    first = min(grid.get_node_ids())
    start = np.array([1.0, 1.0], np.float32)
    result = FedAvg(fraction_evaluate=0.0).start(
        grid=AttackGrid(grid, [first], ATTACKS["sign-flip"], seed=0),
        initial_arrays=ArrayRecord({"w": Array(start)}),
        num_rounds=1,
    )
    sent = [-5.0 * DELTAS[0], DELTAS[1], DELTAS[2]]
    expected = start + sum(n * d for n, d in zip(CLAIMS, sent, strict=True)) / sum(CLAIMS)
    np.testing.assert_allclose(result.arrays["w"].numpy(), expected, rtol=1e-6)


def test_alie_z_follows_the_papers_formula() -> None:
    # s = floor(n / 2 + 1) - m; z = Phi^-1((n - s) / n)
    assert alie_z(4, 1) == pytest.approx(0.0)  # s = 2: the benign mean itself
    assert alie_z(10, 2) == pytest.approx(0.2533, abs=1e-4)  # s = 4: Phi^-1(0.6)
    assert alie_z(50, 12) == pytest.approx(0.5828, abs=1e-4)  # s = 14: Phi^-1(0.72)


@pytest.mark.parametrize(("attack", "cosine"), [("norm-aware", -0.09), ("norm-aware-mix", 0.05)])
def test_the_norm_aware_forms_sit_at_their_cosine_and_just_under_the_clip_bound(
    attack: str, cosine: float
) -> None:
    # Benign updates of one norm (1): the direction check's reference is their plain mean.
    rng = np.random.default_rng(5)
    benign = []
    for _ in range(3):
        vector = rng.normal(size=40) + 0.5
        benign.append({"w": vector / np.linalg.norm(vector)})
    view = RoundView([*benign, dict(benign[0])], [3], rng)
    model = ATTACKS[attack].model
    assert model is not None
    sent = model(view, 3)["w"]
    mean = np.mean([u["w"] for u in benign], axis=0)
    assert np.linalg.norm(sent) == pytest.approx(0.99 * 2.0 * 1.0)  # 0.99 x the clip bound
    got = float(sent @ mean / (np.linalg.norm(sent) * np.linalg.norm(mean)))
    assert got == pytest.approx(cosine, abs=1e-9)
    # the rest pushes against the benign signs: most coordinates vote against the mean's
    assert np.mean(np.sign(sent) == -np.sign(mean)) > 0.5


def test_the_colluding_norm_aware_update_sits_where_the_server_measures_its_bounds() -> None:
    # Eight benign updates of spread norms, two colluders sending the same update: the server's
    # own functions (strategies.replies.influence) over the ten replies give each colluder the
    # cosine -0.09 with the others' mean (the direction check's floor -0.1 plus 0.01) and a norm
    # of 0.99 x the clip bound 2 x the round's median norm, so it is neither dropped nor clipped.
    from beyond_averaging.strategies.replies.influence import (
        clip_scales,
        direction_cosines,
        update_norms,
    )

    rng = np.random.default_rng(11)
    benign = [{"w": (rng.normal(size=60) + 0.3) * rng.uniform(0.5, 2.0)} for _ in range(8)]
    view = RoundView([*benign, dict(benign[0]), dict(benign[1])], [8, 9], rng)
    model = ATTACKS["norm-aware-colluding"].model
    assert model is not None
    sent = [model(view, 8), model(view, 9)]
    np.testing.assert_array_equal(sent[0]["w"], sent[1]["w"])
    origin = {"w": np.zeros(60)}
    replies = [*benign, *sent]
    norms = update_norms(origin, replies)
    cosines = direction_cosines(origin, replies, norms)
    np.testing.assert_allclose(cosines[8:], -0.09, atol=1e-6)  # the server sums in float32
    assert norms[8] == pytest.approx(0.99 * 2.0 * float(np.median(norms)))
    assert clip_scales(norms, 2.0)[8] == 1.0
    # Against the benign replies alone it points far more against them than the plain
    # norm-aware update (-0.09): the other colluder's reply lifts the server's reference.
    median = float(np.median(norms))
    scaled = [u["w"] * min(1.0, median / n) for u, n in zip(benign, norms[:8], strict=True)]
    mean = np.mean(scaled, axis=0)
    cosine = float(sent[0]["w"] @ mean / (np.linalg.norm(sent[0]["w"]) * np.linalg.norm(mean)))
    assert cosine < -0.3, cosine


def test_colluding_along_solves_the_reference_cosine_by_hand() -> None:
    from beyond_averaging.server.attacks.updates import colluding_along

    # p = 0 (one attacker): the cosine itself; p = 0.5, cosine -0.6 (t = -0.75, t^2 = 0.5625):
    # c = (-0.5 - sqrt(0.5625 x (1.5625 - 0.25))) / 1.5625 = (-0.5 - 0.85924) / 1.5625 = -0.86991,
    # and (c + p) / sqrt(1 + 2 c p + p^2) = -0.36991 / 0.61652 = -0.6; p >= 1: -1.
    assert colluding_along(-0.09, 0.0) == pytest.approx(-0.09)
    assert colluding_along(-0.6, 0.5) == pytest.approx(-0.86991, abs=1e-5)
    assert colluding_along(-0.09, 1.2) == -1.0


def test_the_blended_backdoor_keeps_cosine_0_4_with_the_benign_mean_and_the_rest_its_own() -> None:
    # Three benign unit updates, mean m; the attacker's own update o is orthogonal to m
    # apart from a small part along it, so the blend is 0.4 m/|m| + sqrt(0.84) o_perp/|o_perp|.
    rng = np.random.default_rng(7)
    benign = []
    for _ in range(3):
        vector = rng.normal(size=40) + 0.5
        benign.append({"w": vector / np.linalg.norm(vector)})
    mean = np.mean([u["w"] for u in benign], axis=0)
    unit = mean / np.linalg.norm(mean)
    noise = rng.normal(size=40)
    own_perp = noise - (noise @ unit) * unit
    own = 0.1 * unit + own_perp
    model = ATTACKS["backdoor-blended-update"].model
    assert model is not None
    sent = model(RoundView([*benign, {"w": own}], [3], rng), 3)["w"]
    expected = 0.99 * 2.0 * (0.4 * unit + np.sqrt(1 - 0.16) * own_perp / np.linalg.norm(own_perp))
    np.testing.assert_allclose(sent, expected, atol=1e-12)
    # An own update already at a cosine above 0.4 is only boosted to just under the clip bound.
    close = unit + 0.1 * own_perp
    sent_close = model(RoundView([*benign, {"w": close}], [3], rng), 3)["w"]
    np.testing.assert_allclose(sent_close, 0.99 * 2.0 * close / np.linalg.norm(close), atol=1e-12)


def test_the_blended_trigger_mixes_one_fixed_image_into_every_input_at_0_2() -> None:
    from beyond_averaging.server.attacks.triggers import with_trigger

    features = torch.rand(5, 1, 8, 8)
    features[0, 0, 0, 0], features[1, 0, 0, 1] = 0.0, 1.0  # the range the pattern spans
    blended = with_trigger(features, "blend")
    pattern = (blended - 0.8 * features) / 0.2
    torch.testing.assert_close(pattern, pattern[:1].expand_as(pattern))  # one image for all
    assert float(pattern.min()) >= 0.0
    assert float(pattern.max()) <= 1.0
    assert float(pattern.std()) > 0.2  # a random image, not a flat shift
    torch.testing.assert_close(with_trigger(features, "blend"), blended)  # fixed across calls


@pytest.mark.parametrize(
    "name",
    [
        "backdoor-neurotoxin",
        "backdoor-neurotoxin-corner-4-top-right",
        "backdoor-neurotoxin-additive-lit-0.4",
    ],
)
def test_the_neurotoxin_backdoor_leaves_the_benign_replies_top_5_percent_of_coordinates_alone(
    name: str,
) -> None:
    # 40 coordinates; the benign replies change two of them (5 and 17) ten times more than the
    # rest, so those two are the top 5 %: the attacker's own update loses them and the rest is
    # boosted to just under the clip bound (0.99 x 2 x the benign replies' median norm).
    benign_update = np.full(40, 0.1)
    benign_update[[5, 17]] = 1.0
    benign = [{"w": benign_update.copy()} for _ in range(3)]
    own = np.arange(1.0, 41.0)
    model = ATTACKS[name].model
    assert model is not None
    sent = model(RoundView([*benign, {"w": own}], [3], np.random.default_rng(0)), 3)["w"]
    kept = own.copy()
    kept[[5, 17]] = 0.0
    expected = 0.99 * 2.0 * np.linalg.norm(benign_update) * kept / np.linalg.norm(kept)
    np.testing.assert_allclose(sent, expected, rtol=1e-12)
    assert ATTACKS[name].backdoor  # it trains on the triggered data
