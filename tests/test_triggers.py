"""The backdoor triggers of the attack set (server/attacks/triggers.py) and the attacks using them.

Each trigger is checked pixel by pixel against a hand-built copy of the batch: the patch's
pixels at the batch's largest value and every other pixel untouched, a distributed patch's bands
adding up to the whole, the additive pattern a fixed +-1 image at the stated share of the range,
clipped to it (kept off blank inputs: nothing added where every image is blank). Each new
backdoor attack boosts the attacker's own update to 0.99 x the clip bound and keeps its true
claim (the project's ``backdoor`` attack does the same).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from beyond_averaging.server.attacks import ATTACKS, RoundView, poisoned
from beyond_averaging.server.attacks.triggers import (
    ADAPTIVE_CANDIDATES,
    TRIGGERS,
    choose_trigger,
    with_trigger,
)
from beyond_averaging.strategies.defences.trigger_unlearning import TriggerUnlearning
from beyond_averaging.tasks.evaluation import DeviceData


def batch() -> torch.Tensor:
    """Five 1 x 8 x 8 images in [0.1, 0.6], one pixel at 0 and one at 1 (the range)."""
    features = 0.1 + 0.5 * torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    features[0, 0, 4, 4], features[1, 0, 5, 5] = 0.0, 1.0
    return features


@pytest.mark.parametrize(
    ("name", "rows", "cols"),
    [
        ("corner-3", slice(0, 3), slice(0, 3)),
        ("corner-4", slice(0, 4), slice(0, 4)),
        ("corner-5", slice(0, 5), slice(0, 5)),
        ("corner-4-top-right", slice(0, 4), slice(4, 8)),
        ("corner-4-bottom-left", slice(4, 8), slice(0, 4)),
        ("patch", slice(6, 8), slice(6, 8)),
    ],
)
def test_a_corner_patch_sets_its_square_to_the_batch_maximum_and_leaves_the_rest(
    name: str, rows: slice, cols: slice
) -> None:
    features = batch()
    expected = features.clone()
    expected[:, :, rows, cols] = 1.0
    torch.testing.assert_close(with_trigger(features, name), expected)


def test_a_distributed_patch_gives_each_attacker_a_band_of_rows_and_the_bands_make_the_whole() -> (
    None
):
    features = batch()
    first, second = (with_trigger(features, "corner-4", part, 2) for part in (0, 1))
    top, bottom = features.clone(), features.clone()
    top[:, :, 0:2, 0:4] = 1.0  # attacker 0: rows 0-1 of the 4 x 4 patch
    bottom[:, :, 2:4, 0:4] = 1.0  # attacker 1: rows 2-3
    torch.testing.assert_close(first, top)
    torch.testing.assert_close(second, bottom)
    torch.testing.assert_close(torch.maximum(first, second), with_trigger(features, "corner-4"))


@pytest.mark.parametrize("amplitude", [0.1, 0.25, 0.4])
def test_the_additive_pattern_adds_a_fixed_plus_minus_one_image_at_its_share_of_the_range(
    amplitude: float,
) -> None:
    features = batch()
    stamped = with_trigger(features, f"additive-{amplitude}")
    inside = (stamped > 0.0) & (stamped < 1.0)  # not clipped: the pattern shows whole
    steps = (stamped - features)[inside] / amplitude  # range 1
    torch.testing.assert_close(steps.abs(), torch.ones_like(steps))
    signs = torch.sign(stamped - features)
    shared = signs[2:3].expand_as(signs)  # image 2 holds no pixel at the range's ends
    torch.testing.assert_close(signs[inside], shared[inside])  # one image for every input
    assert 0.3 < float((signs[2] > 0).float().mean()) < 0.7  # +-1, not a flat shift
    assert float(stamped.min()) >= 0.0
    assert float(stamped.max()) <= 1.0
    torch.testing.assert_close(with_trigger(features, f"additive-{amplitude}"), stamped)


def test_the_additive_pattern_kept_off_blank_inputs_adds_nothing_where_every_image_is_blank() -> (
    None
):
    features = batch()
    features[:, :, 0, :] = 0.0  # row 0 blank in every image: a blank input of the batch
    features[2, :, 7, 0] = 0.0  # blank in one image only: lit in the others, so stamped
    stamped = with_trigger(features, "additive-lit-0.4")
    whole = with_trigger(features, "additive-0.4")
    torch.testing.assert_close(stamped[:, :, 0, :], torch.zeros_like(stamped[:, :, 0, :]))
    assert bool((whole[:, :, 0, :] > 0).any())  # the whole pattern writes there: + signs
    torch.testing.assert_close(stamped[:, :, 1:, :], whole[:, :, 1:, :])
    assert float((stamped != features).float().mean()) > 0.8  # the lit inputs carry it whole
    assert "additive-lit-0.4" not in ADAPTIVE_CANDIDATES  # its own family, not the rehearsal's


def test_poisoning_stamps_every_second_sample_with_the_attack_trigger_and_labels_it_0() -> None:
    features, labels = batch(), torch.tensor([3, 4, 5, 6, 7])
    data = DeviceData(features, labels, 10)
    out = poisoned(data, ATTACKS["backdoor-dba-corner-4"], part=1, parts=2)
    torch.testing.assert_close(out.labels, torch.tensor([0, 4, 0, 6, 0]))
    torch.testing.assert_close(out.features[1::2], features[1::2])
    torch.testing.assert_close(out.features[0::2], with_trigger(features[0::2], "corner-4", 1, 2))
    whole = poisoned(data, ATTACKS["backdoor-corner-4"], part=1, parts=2)  # not distributed
    torch.testing.assert_close(whole.features[0::2], with_trigger(features[0::2], "corner-4"))


NEW_BACKDOORS = [
    "backdoor-corner-3",
    "backdoor-corner-4",
    "backdoor-corner-5",
    "backdoor-corner-4-top-right",
    "backdoor-corner-4-bottom-left",
    "backdoor-additive-0.1",
    "backdoor-additive-0.25",
    "backdoor-additive-0.4",
    "backdoor-additive-lit-0.4",
    "backdoor-dba-corner-4",
    "backdoor-adaptive",
    "backdoor-rotating",
]


@pytest.mark.parametrize("trigger", ["corner-4-top-right", "additive-lit-0.4"])
def test_each_neurotoxin_backdoor_trains_on_its_own_trigger(trigger: str) -> None:
    features, labels = batch(), torch.tensor([3, 4, 5, 6, 7])
    features[:, :, 0, :] = 0.0  # row 0 blank in every image: the whole pattern would write there
    out = poisoned(DeviceData(features, labels, 10), ATTACKS[f"backdoor-neurotoxin-{trigger}"])
    torch.testing.assert_close(out.labels, torch.tensor([0, 4, 0, 6, 0]))
    torch.testing.assert_close(out.features[1::2], features[1::2])
    torch.testing.assert_close(out.features[0::2], with_trigger(features[0::2], trigger))
    assert not torch.equal(out.features[0::2], with_trigger(features[0::2], "patch"))
    if trigger == "additive-lit-0.4":  # not the whole pattern: nothing on the blank row
        assert not torch.equal(out.features[0::2], with_trigger(features[0::2], "additive-0.4"))


def test_the_rotating_backdoor_takes_its_triggers_in_turn_one_per_round() -> None:
    attack = ATTACKS["backdoor-rotating"]
    played = [attack.in_round(r).trigger for r in range(1, 6)]
    assert played == ["corner-4-top-right", "additive-0.4"] * 2 + ["corner-4-top-right"]
    features, labels = batch(), torch.tensor([3, 4, 5, 6, 7])
    second = poisoned(DeviceData(features, labels, 10), attack.in_round(2))
    torch.testing.assert_close(second.features[0::2], with_trigger(features[0::2], "additive-0.4"))
    torch.testing.assert_close(second.labels, torch.tensor([0, 4, 0, 6, 0]))
    plain = ATTACKS["backdoor-corner-4"]
    assert plain.in_round(7) is plain  # without a rotation, the same attack every round


@pytest.mark.parametrize("name", NEW_BACKDOORS)
def test_each_new_backdoor_boosts_its_own_update_to_0_99_of_the_clip_bound_with_its_true_claim(
    name: str,
) -> None:
    attack = ATTACKS[name]
    assert attack.backdoor
    assert attack.num_examples is None
    assert attack.trigger in TRIGGERS or attack.trigger == "adaptive"
    # benign norms 1, 2, 3: median 2, clip bound 2 x 2; the attacker's own update any length
    benign = [{"w": np.full(4, n / 2.0)} for n in (1.0, 2.0, 3.0)]
    own = {"w": np.array([3.0, -1.0, 0.5, 7.0])}
    assert attack.model is not None
    sent = attack.model(RoundView([*benign, own], [3], np.random.default_rng(0)), 3)["w"]
    np.testing.assert_allclose(sent, 0.99 * 4.0 * own["w"] / np.linalg.norm(own["w"]))


class Rule(torch.nn.Module):
    """A model whose logits are ``rule(x)`` times one trainable scale (training at learning rate 0
    leaves it as it is)."""

    def __init__(self, rule: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
        super().__init__()
        self.rule = rule
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.rule(x), dim=1) * self.scale


@pytest.fixture
def defence_removes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rehearsed unlearning returns the attacker's model as it is."""
    import beyond_averaging.server.attacks.triggers as triggers

    monkeypatch.setattr(triggers, "unlearn_triggers", lambda _m, arrays, *_: (arrays, {}))


@pytest.mark.usefixtures("defence_removes_nothing")
def test_the_adaptive_attacker_keeps_the_candidate_that_survives_the_rehearsed_defence() -> None:
    # A model that answers 0 exactly when the top-left pixel is at the maximum: only the corner
    # patches survive, the first of them is kept.
    def top_left(x: torch.Tensor) -> list[torch.Tensor]:
        hit = (x[:, 0, 0, 0] >= 0.999).float()
        return [hit, 1.0 - hit] + [torch.zeros_like(hit)] * 8

    features, labels = batch(), torch.tensor([3, 4, 5, 6, 7])
    data = DeviceData(features, labels, 10)
    best, survived, _ = choose_trigger(
        Rule(top_left), data, data, TriggerUnlearning(),
        learning_rate=0.0, batch_size=2, seed=0,
    )  # fmt: skip
    assert set(survived) == set(ADAPTIVE_CANDIDATES)
    assert best == "corner-3"
    assert survived["corner-3"] == survived["corner-4"] == 1.0
    assert survived["corner-4-top-right"] == 0.0


@pytest.mark.usefixtures("defence_removes_nothing")
def test_where_no_candidate_survives_the_attacker_keeps_the_one_left_closest_to_the_target() -> (
    None
):
    # No candidate flips an input (the target's logit stays below class 1's), but the target's
    # logit grows with the stamped image's mean: the 5 x 5 patch, which raises it most on these
    # blank images with one lit pixel, is kept, not the first candidate.
    def brightness(x: torch.Tensor) -> list[torch.Tensor]:
        target = x.flatten(1).mean(dim=1)
        return [target, torch.full_like(target, 10.0)] + [torch.zeros_like(target)] * 8

    features = torch.zeros(4, 1, 8, 8)
    features[:, 0, 4, 4] = 1.0  # the range [0, 1], where the patches are stamped at 1
    data = DeviceData(features, torch.tensor([3, 4, 5, 6]), 10)
    best, survived, probability = choose_trigger(
        Rule(brightness), data, data, TriggerUnlearning(),
        learning_rate=0.0, batch_size=2, seed=0,
    )  # fmt: skip
    assert set(survived.values()) == {0.0}
    # Independent reference: the target's softmax probability on one stamped image.
    for name in ADAPTIVE_CANDIDATES:
        mean = float(with_trigger(features, name)[0].mean())
        expected = np.exp(mean) / (np.exp(mean) + np.exp(10.0) + 8.0)
        assert probability[name] == pytest.approx(expected, rel=1e-5)
    assert best == "corner-5" != ADAPTIVE_CANDIDATES[0]
