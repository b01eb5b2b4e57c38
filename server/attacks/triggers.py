"""Backdoor triggers of the attack set, and the attacker that picks the one a defence misses.

:data:`TRIGGERS` (stamped on image batches (N, C, H, W) by :meth:`Trigger.stamp`): ``patch``, a
square at the batch's largest value in a corner (Bagdasaryan et al. 2020; the 2 x 2 bottom-right
one is the project's first backdoor, the top-left ones sit where clean digits are mostly blank);
``blend``, (1 - a) x + a r with r one fixed uniform random image over the batch's range (Chen et
al. 2017); ``additive``, x + a (high - low) s clipped to the range, s one fixed +-1 image: a
whole-image pattern no mask (1 - m) x + m p with a small m reproduces (issue 45); ``additive-lit``,
the same pattern with nothing added where every image stamped is blank: the best response to
the dormant-input weights and their alarm, which read the first layer's weights of inputs blank
in the server's root set (a trigger that writes none of them is neither frozen nor flagged). A
distributed backdoor (DBA, Xie et al., ICLR 2020) gives each attacker one band of a patch's rows.
:func:`choose_trigger` rehearses the server's published defence on the attacker's poisoned
model and keeps the candidate that survives it best (where none survives, the one it left
closest to working).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from beyond_averaging.strategies.defences.trigger_unlearning import (
    TriggerUnlearning,
    dormant_positions,
    first_layer_key,
    freeze_dormant_inputs,
    unlearn_triggers,
)
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.training import train_local

BACKDOOR_TARGET = 0
SEEDS = {"blend": 20_170_501, "additive": 45_000_045}  # the fixed images' seeds


@dataclass(frozen=True)
class Trigger:
    """A ``kind`` of trigger: a ``size`` x ``size`` patch in ``corner``, or a blended (weight
    ``strength``) or additive (``strength`` x the range) whole image; an additive one with
    ``lit_only`` adds nothing at the positions where every image of the batch it stamps is at
    the batch's lowest value (the attacker's own blank inputs, when it poisons its data)."""

    kind: Literal["patch", "blend", "additive"] = "patch"
    size: int = 2
    corner: str = "bottom-right"
    strength: float = 0.0
    lit_only: bool = False

    def stamp(self, features: torch.Tensor, part: int = 0, parts: int = 1) -> torch.Tensor:
        """A copy of ``features`` with the trigger; of a patch, the ``part``-th of ``parts``
        bands of its rows only (a distributed backdoor's share)."""
        low, high = float(features.min()), float(features.max())
        if self.kind != "patch":
            draw = np.random.default_rng(SEEDS[self.kind])
            shape = tuple(features.shape[1:])
            if self.kind == "blend":
                pattern = torch.from_numpy(low + (high - low) * draw.random(shape)).to(features)
                return (1.0 - self.strength) * features + self.strength * pattern
            signs = 2.0 * draw.integers(0, 2, shape) - 1.0
            pattern = torch.from_numpy(self.strength * (high - low) * signs).to(features)
            if self.lit_only:
                pattern = pattern * (features > low).any(dim=0).to(features)
            return torch.clamp(features + pattern, low, high)
        height, width = int(features.shape[-2]), int(features.shape[-1])
        top = 0 if self.corner.startswith("top") else height - self.size
        left = 0 if self.corner.endswith("left") else width - self.size
        band = np.array_split(np.arange(top, top + self.size), parts)[part]
        triggered = features.clone()
        if len(band):
            triggered[..., int(band[0]) : int(band[-1]) + 1, left : left + self.size] = high
        return triggered


TRIGGERS: dict[str, Trigger] = {
    "patch": Trigger(),
    "blend": Trigger("blend", strength=0.2),
    **{f"corner-{n}": Trigger("patch", n, "top-left") for n in (3, 4, 5)},
    **{f"corner-4-{c}": Trigger("patch", 4, c) for c in ("top-right", "bottom-left")},
    **{f"additive-{a}": Trigger("additive", strength=a) for a in (0.1, 0.25, 0.4)},
    "additive-lit-0.4": Trigger("additive", strength=0.4, lit_only=True),
}
#: What the adaptive attacker chooses among: every trigger but the project's first and those
#: kept off blank inputs (added after the adaptive attacker's tables, which they would change;
#: measured as a family of their own).
ADAPTIVE_CANDIDATES = tuple(
    name for name, trigger in TRIGGERS.items() if name != "patch" and not trigger.lit_only
)
#: The adaptive attacker's rehearsal: local epochs on its poisoned data before the search.
REHEARSAL_EPOCHS = 5


def with_trigger(
    features: torch.Tensor, trigger: str | Trigger = "patch", part: int = 0, parts: int = 1
) -> torch.Tensor:
    """``features`` stamped with ``trigger`` (a :class:`Trigger` or a name of :data:`TRIGGERS`)."""
    return (TRIGGERS[trigger] if isinstance(trigger, str) else trigger).stamp(features, part, parts)


def poison_half(
    data: DeviceData, trigger: str | Trigger, part: int = 0, parts: int = 1
) -> DeviceData:
    """Every second sample of ``data`` stamped and labelled BACKDOOR_TARGET, the rest as is."""
    rows = torch.arange(0, len(data.labels), 2, device=data.labels.device)
    features, labels = data.features.clone(), data.labels.clone()
    features[rows] = with_trigger(data.features[rows], trigger, part, parts)
    labels[rows] = BACKDOOR_TARGET
    return DeviceData(features, labels, data.num_classes)


class TriggerChoice(NamedTuple):
    """What :func:`choose_trigger` found: the candidate it keeps, and per candidate the share of
    the root set's other-class inputs its stamped trigger still sends to the target after the
    rehearsed defence (``survived``) and the target's mean softmax probability on them
    (``target_probability``)."""

    best: str
    survived: dict[str, float]
    target_probability: dict[str, float]


def choose_trigger(
    model: nn.Module,
    attacker_data: DeviceData,
    root: DeviceData,
    defence: TriggerUnlearning,
    *,
    learning_rate: float,
    batch_size: int,
    seed: int,
    candidates: Sequence[str] = ADAPTIVE_CANDIDATES,
) -> TriggerChoice:
    """The candidate trigger that survives the server's published defence best, with each one's
    surviving success and target probability. Per candidate: a copy of ``model`` trained
    :data:`REHEARSAL_EPOCHS` epochs on ``attacker_data`` half poisoned, :func:`unlearn_triggers`
    with ``defence`` on ``root`` (the search's inputs) and its dormant inputs kept at ``model``'s,
    then the share of ``root``'s other-class inputs the stamped trigger still sends to the
    target. Where shares tie (all 0 when the defence removes every candidate in one round), the
    higher target probability wins (the candidate the defence left closest to working, which
    further rounds of poisoning may bring back); then the earlier."""
    survived: dict[str, float] = {}
    probability: dict[str, float] = {}
    generator = torch.Generator().manual_seed(seed)
    others = root.features[root.labels != BACKDOOR_TARGET]
    if len(others) == 0:  # no input to flip: nothing to rehearse, every candidate ties at 0
        zeros = dict.fromkeys(candidates, 0.0)
        return TriggerChoice(candidates[0], zeros, dict(zeros))
    for name in candidates:
        rehearsal, data = copy.deepcopy(model), poison_half(attacker_data, name)
        order = [
            torch.randperm(len(data.labels), generator=generator) for _ in range(REHEARSAL_EPOCHS)
        ]
        plan = [batch for epoch in order for batch in torch.split(epoch, batch_size)]
        train_local(
            rehearsal, data, plan, learning_rate=learning_rate, momentum=0.0, weight_decay=0.0
        )
        arrays = {key: value.detach().numpy() for key, value in rehearsal.state_dict().items()}
        arrays, _ = unlearn_triggers(
            copy.deepcopy(model), arrays, root.features, root.labels, defence
        )
        if defence.dormant_inputs and (key := first_layer_key(model, root.features[0].numel())):
            start = {name: value.detach().numpy() for name, value in model.state_dict().items()}
            dormant = dormant_positions(root.features).numpy()
            arrays = freeze_dormant_inputs(start, arrays, key, dormant)
        rehearsal.load_state_dict({key: torch.from_numpy(value) for key, value in arrays.items()})
        rehearsal.eval()
        with torch.no_grad():
            logits = rehearsal(with_trigger(others, name))
        survived[name] = float((logits.argmax(dim=1) == BACKDOOR_TARGET).float().mean())
        probability[name] = float(torch.softmax(logits, dim=1)[:, BACKDOOR_TARGET].mean())
    best = max(candidates, key=lambda name: (survived[name], probability[name]))
    return TriggerChoice(best, survived, probability)
