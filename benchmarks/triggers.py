"""Backdoor triggers of the attack tables, and the attacker that picks the one a defence misses.

A trigger is stamped on image batches (N, C, H, W) by :meth:`Trigger.stamp`; the attack set
(:data:`benchmarks.attacks.ATTACKS`) names one of :data:`TRIGGERS` per backdoor attack. The
families (issue 45 lists the ones a masked-patch search misses):

- ``patch``: a square at the batch's largest value in one corner (Bagdasaryan et al. 2020; Sun
  et al. 2019); the 2 x 2 bottom-right one is the project's first backdoor, the larger top-left
  ones sit where clean digits are mostly blank (column 0 is 0 in every digit);
- ``blend``: (1 - a) x + a r with r one fixed uniform random image over the batch's range (Chen
  et al. 2017's blended injection);
- ``additive``: x + a (high - low) s, s one fixed +-1 image, clipped to the batch's range: a
  whole-image pattern that no mask of the form (1 - m) x + m p with a small m reproduces.

A distributed backdoor (DBA, Xie et al., ICLR 2020) splits a patch's rows into one band per
attacker (``part`` of ``parts``); the test stamps the whole patch. :func:`choose_trigger` is the
attacker that runs the server's own published defence (trigger inversion and unlearning,
:mod:`strategies.defences.trigger_unlearning`) on its poisoned model and keeps the candidate
trigger that survives it best.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from beyond_averaging.strategies.defences.trigger_unlearning import (
    TriggerUnlearning,
    unlearn_triggers,
)
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.training import train_local

#: The backdoor's target class.
BACKDOOR_TARGET = 0
#: The project's first trigger: a 2 x 2 patch in the bottom-right corner.
TRIGGER_SIZE = 2
#: The blended trigger's weight a (Chen et al. 2017) and its random image's seed.
BLEND_ALPHA = 0.2
BLEND_SEED = 20_170_501
#: The additive pattern's +-1 image's seed.
ADDITIVE_SEED = 45_000_045

Corner = Literal["top-left", "top-right", "bottom-left", "bottom-right"]


@dataclass(frozen=True)
class Trigger:
    """One backdoor trigger.

    Parameters
    ----------
    kind : {"patch", "blend", "additive"}
        A square patch at the batch's largest value; a random image blended in; a +-1 image
        added (see the module's text).
    size : int
        The patch's side in pixels (``patch``).
    corner : str
        Where the patch sits (``patch``).
    strength : float
        ``blend``: the random image's weight a; ``additive``: the pattern's amplitude as a
        share of the batch's range.
    """

    kind: Literal["patch", "blend", "additive"] = "patch"
    size: int = TRIGGER_SIZE
    corner: Corner = "bottom-right"
    strength: float = 0.0

    def region(self, height: int, width: int) -> tuple[slice, slice]:
        """The rows and columns the patch covers in an image of ``height`` x ``width``."""
        rows = (
            slice(0, self.size)
            if self.corner.startswith("top")
            else slice(height - self.size, height)
        )
        cols = (
            slice(0, self.size) if self.corner.endswith("left") else slice(width - self.size, width)
        )
        return rows, cols

    def stamp(self, features: torch.Tensor, part: int = 0, parts: int = 1) -> torch.Tensor:
        """A copy of ``features`` (N, C, H, W) with the trigger; a patch's ``part``-th of
        ``parts`` bands of rows only (a distributed backdoor's share), the whole with
        ``parts = 1``. Blended and additive triggers are not split."""
        low, high = float(features.min()), float(features.max())
        shape = tuple(features.shape[1:])
        if self.kind == "blend":
            noise = np.random.default_rng(BLEND_SEED).random(shape)
            pattern = torch.from_numpy(low + (high - low) * noise).to(features)
            return (1.0 - self.strength) * features + self.strength * pattern
        if self.kind == "additive":
            signs = 2.0 * np.random.default_rng(ADDITIVE_SEED).integers(0, 2, shape) - 1.0
            pattern = torch.from_numpy(self.strength * (high - low) * signs).to(features)
            return torch.clamp(features + pattern, low, high)
        rows, cols = self.region(int(features.shape[-2]), int(features.shape[-1]))
        row_ids = list(range(*rows.indices(int(features.shape[-2]))))
        band = np.array_split(np.asarray(row_ids), parts)[part]
        triggered = features.clone()
        if len(band):
            triggered[..., int(band[0]) : int(band[-1]) + 1, cols] = high
        return triggered


def _corner(size: int, corner: Corner = "top-left") -> Trigger:
    return Trigger("patch", size, corner)


#: Every trigger of the attack set, by name.
TRIGGERS: dict[str, Trigger] = {
    "patch": Trigger(),
    "blend": Trigger("blend", strength=BLEND_ALPHA),
    "corner-3": _corner(3),
    "corner-4": _corner(4),
    "corner-5": _corner(5),
    "corner-4-top-right": _corner(4, "top-right"),
    "corner-4-bottom-left": _corner(4, "bottom-left"),
    "additive-0.1": Trigger("additive", strength=0.1),
    "additive-0.25": Trigger("additive", strength=0.25),
    "additive-0.4": Trigger("additive", strength=0.4),
}
#: What the adaptive attacker chooses among: every trigger but the project's first.
ADAPTIVE_CANDIDATES = tuple(name for name in TRIGGERS if name != "patch")
#: The adaptive attacker's rehearsal: local epochs on its poisoned data before the search.
REHEARSAL_EPOCHS = 5


def with_trigger(
    features: torch.Tensor, trigger: str | Trigger = "patch", part: int = 0, parts: int = 1
) -> torch.Tensor:
    """``features`` stamped with ``trigger`` (a :class:`Trigger` or a name of :data:`TRIGGERS`)."""
    chosen = TRIGGERS[trigger] if isinstance(trigger, str) else trigger
    return chosen.stamp(features, part, parts)


def poison_half(
    data: DeviceData, trigger: str | Trigger, part: int = 0, parts: int = 1
) -> DeviceData:
    """Every second sample of ``data`` stamped (``part`` of ``parts``) and labelled
    BACKDOOR_TARGET, the rest as they are."""
    rows = torch.arange(0, len(data.labels), 2, device=data.labels.device)
    features, labels = data.features.clone(), data.labels.clone()
    features[rows] = with_trigger(data.features[rows], trigger, part, parts)
    labels[rows] = BACKDOOR_TARGET
    return DeviceData(features, labels, data.num_classes)


def trigger_success(
    model: nn.Module, features: torch.Tensor, labels: torch.Tensor, trigger: str
) -> float:
    """The share of ``features`` whose label is not the target that ``model`` puts in the target
    class once stamped with ``trigger``."""
    others = features[labels != BACKDOOR_TARGET]
    model.eval()
    with torch.no_grad():
        hits = model(with_trigger(others, trigger)).argmax(dim=1) == BACKDOOR_TARGET
    return float(hits.float().mean()) if len(others) else 0.0


def choose_trigger(
    model: nn.Module,
    attacker_data: DeviceData,
    root_features: torch.Tensor,
    root_labels: torch.Tensor,
    defence: TriggerUnlearning,
    *,
    learning_rate: float,
    batch_size: int,
    seed: int,
    candidates: Sequence[str] = ADAPTIVE_CANDIDATES,
) -> tuple[str, dict[str, float]]:
    """The candidate trigger that survives the server's published defence best, and each
    candidate's surviving success.

    For each candidate the attacker trains a copy of ``model`` (the global model it received)
    for :data:`REHEARSAL_EPOCHS` epochs on ``attacker_data`` with half of it poisoned, runs the
    server's search and unlearning (:func:`unlearn_triggers` with ``defence``) on it with
    ``root_features`` / ``root_labels`` in place of the server's root set, and measures the
    trigger's success on the root inputs afterwards: the trigger the search misses keeps its
    success. Ties go to the earlier candidate.
    """
    survived: dict[str, float] = {}
    generator = torch.Generator().manual_seed(seed)
    for name in candidates:
        rehearsal = copy.deepcopy(model)
        data = poison_half(attacker_data, name)
        plan = [
            batch
            for _ in range(REHEARSAL_EPOCHS)
            for batch in torch.split(
                torch.randperm(len(data.labels), generator=generator), batch_size
            )
        ]
        train_local(
            rehearsal, data, plan, learning_rate=learning_rate, momentum=0.0, weight_decay=0.0
        )
        arrays = {
            key: value.detach().cpu().numpy() for key, value in rehearsal.state_dict().items()
        }
        unlearned, _ = unlearn_triggers(
            copy.deepcopy(model), arrays, root_features, root_labels, defence
        )
        rehearsal.load_state_dict(
            {key: torch.from_numpy(value) for key, value in unlearned.items()}
        )
        survived[name] = trigger_success(rehearsal, root_features, root_labels, name)
    best = max(candidates, key=lambda name: survived[name])
    return best, survived
