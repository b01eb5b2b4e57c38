"""Backdoor removal on the server's root set: trigger inversion and unlearning (Neural Cleanse).

Wang et al., "Neural Cleanse: Identifying and Mitigating Backdoor Attacks in Neural Networks"
(IEEE S&P 2019), find a backdoor's trigger by optimisation and remove it by fine-tuning. For each
class c the smallest input patch that sends clean inputs to c is found: a mask m in [0, 1] over
the input's positions and a pattern p, inputs x' = (1 - m) x + m p, minimising

    CE(f(x'), c) + lambda ||m||_1 / P                       (Neural Cleanse, eq. 3; P below)

over the clean inputs of other classes. A class a backdoor targets has a much smaller such patch
than the others; their anomaly index is the MAD-scaled distance of the smallest ||m||_1 below the
median. Unlearning fine-tunes the model on clean inputs, 20 % of them stamped with the recovered
patch, all labelled with their true classes (section VI-C), which breaks the trigger's link to the
target; here every step's loss gives the stamped copies that share (``patched_share``).

Federated use (docs/reliability.md, "Backdoors under label skew"): the server holds a small
class-balanced root set (the proxy set FedLAW and FLTrust use), so after every aggregation it
inverts a patch for every class on the new model and unlearns every patch that flips at least
``min_success`` of the root inputs, whatever the anomaly index says: under label skew a backdoor
and a class that few clients hold look alike by any per-client statistic, but not by what the
model has learned, which is what inversion reads. What differs from the paper, and why:

- The paper unlearns only the flagged class's patch (anomaly index > 2) once, after training.
  Here the attackers re-inject the backdoor every round and the index is noisy on a 100-sample
  root set, so every patch that works is unlearned, every round; on an honest model that is a
  short fine-tuning on the balanced root set, a fifth of it on stamped copies (what it costs
  or, under label skew, gains is in the honest rows of the tables).
- The paper's Adam-with-schedule search for lambda is replaced by a fixed lambda
  (``l1_weight``) and step count: a round must take a bounded time. So that one lambda fits
  inputs of any size, the L1 norm is divided by the number of positions the mask covers, P
  (64 on 8 x 8 digits, 784 on 28 x 28 images): lambda weighs the share of the input the patch
  covers, not its pixel count.
- With ``memory_rounds`` the triggers unlearned in the last rounds are unlearned again each
  round (:class:`TriggerMemory`): the paper's one removal meets a backdoor written once, the
  federation's attackers write theirs back every round, and the search recovers it only in the
  rounds the model holds it strongly.
- The model is fine-tuned in ``eval()`` mode, so normalisation statistics stay those the
  federation computed; every parameter is trained.

Everything here is a pure function of the model, the root set and the options; it runs on the
root set's device and draws no random numbers (the patches start from fixed values and the
unlearning visits the root set in its order), so a run is reproducible.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from beyond_averaging.strategies.aggregate import NDArrayDict, as_numpy, is_floating

#: The mask's starting logit: sigmoid(-3) = 0.05, a faint patch everywhere.
MASK_START_LOGIT = -3.0
#: Adam's step for the mask and pattern logits (Neural Cleanse's own learning rate).
INVERSION_LR = 0.1
#: A MAD is scaled by this to estimate a standard deviation (Neural Cleanse's consistency constant).
MAD_CONSISTENCY = 1.4826
CROSS_ENTROPY = nn.CrossEntropyLoss()


@dataclasses.dataclass(frozen=True)
class TriggerUnlearning:
    """The options of trigger inversion and unlearning, each rule's ``trigger_unlearning=``.

    Parameters
    ----------
    l1_weight : float
        lambda of the inversion objective, on the share of the input's positions the mask
        covers (||m||_1 / P): larger finds smaller patches.
    steps : int
        Adam steps of the inversion per class.
    lr : float
        The unlearning's SGD learning rate (momentum 0.9).
    epochs : int
        Passes of the unlearning over the root set, each one full-batch step per patch and one
        more.
    patched_share : float
        The stamped inputs' share of each step's loss, the rest the clean root set's (Neural
        Cleanse's unlearning stamps 20 % of its fine-tuning data).
    min_success : float
        A patch is unlearned when it sends at least this share of the other classes' root
        inputs to its class.
    additive_weight : float
        mu of a second search beside the patches' (0: none): for each class the additive
        perturbation d, x' = clip(x + d) to the root set's range, minimising
        CE(f(x'), c) + mu mean((d / range)^2) (:func:`invert_additive`); those that work are
        unlearned with the patches. It finds whole-image patterns no small mask reproduces.
    dormant_inputs : bool
        Keep the first layer's weights of input positions that hold the root set's smallest
        value in every root input at the last global model's values (:func:`dormant_positions`,
        :func:`freeze_dormant_inputs`): no honest client the server can check writes them, and
        the unlearning gives them no gradient, so an update there is unchecked.
    input_bound : float
        k > 0 bounds each round's change of the first layer's weight column of every input
        position by k x the position's exercise in the root set (:func:`input_exercise`) x the
        round's median change per unit of exercise (:func:`bound_rare_inputs`); 0: no bound. A
        trigger written where the root inputs are seldom lit (a corner patch not blank in every
        root input) moves those columns far more than their exercise supports.
    """

    l1_weight: float = 6.4
    steps: int = 100
    lr: float = 0.02
    epochs: int = 3
    patched_share: float = 0.2
    min_success: float = 0.5
    additive_weight: float = 0.0
    dormant_inputs: bool = False
    input_bound: float = 0.0
    memory_rounds: int = 0

    def __post_init__(self) -> None:
        problems = [
            f"{name} = {value!r} (use a value > 0)"
            for name, value in (("l1_weight", self.l1_weight), ("lr", self.lr))
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0)
        ]
        weight = self.additive_weight
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
            problems.append(f"additive_weight = {weight!r} (use a value >= 0; 0: no search)")
        bound = self.input_bound
        if not (isinstance(bound, int | float) and math.isfinite(bound) and bound >= 0):
            problems.append(f"input_bound = {bound!r} (use a value >= 0; 0: no bound)")
        if not isinstance(self.dormant_inputs, bool):
            problems.append(f"dormant_inputs = {self.dormant_inputs!r} (use True or False)")
        memory = self.memory_rounds
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            problems.append(f"memory_rounds = {memory!r} (use a whole number >= 0; 0: none)")
        problems += [
            f"{name} = {value!r} (use a whole number >= 1)"
            for name, value in (("steps", self.steps), ("epochs", self.epochs))
            if isinstance(value, bool) or not isinstance(value, int) or value < 1
        ]
        problems += [
            f"{name} = {value!r} (use a share in (0, 1])"
            for name, value in (
                ("patched_share", self.patched_share),
                ("min_success", self.min_success),
            )
            if not (isinstance(value, int | float) and 0.0 < value <= 1.0)
        ]
        if problems:
            raise ValueError("TriggerUnlearning: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class InvertedTrigger:
    """The smallest patch found for one class: ``x' = (1 - mask) x + mask pattern``."""

    target: int
    mask: torch.Tensor
    pattern: torch.Tensor
    #: The share of the other classes' root inputs that the patch sends to ``target``.
    success: float

    @property
    def mask_l1(self) -> float:
        """||mask||_1, the patch's size."""
        return float(self.mask.sum())

    def stamp(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` with the patch applied."""
        return (1.0 - self.mask) * features + self.mask * self.pattern

    def to(self, device: torch.device) -> InvertedTrigger:
        """The same patch with its tensors on ``device``."""
        return dataclasses.replace(self, mask=self.mask.to(device), pattern=self.pattern.to(device))


@dataclasses.dataclass(frozen=True)
class AdditiveTrigger:
    """The smallest additive perturbation found for one class: ``x' = clip(x + delta)`` to the
    root set's range ``[low, high]``."""

    target: int
    delta: torch.Tensor
    low: float
    high: float
    #: The share of the other classes' root inputs that the perturbation sends to ``target``.
    success: float

    @property
    def size(self) -> float:
        """mean((delta / range)^2), the perturbation's price in the search."""
        return float(torch.mean((self.delta / max(self.high - self.low, 1e-12)) ** 2))

    def stamp(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` with the perturbation added, clipped to the range."""
        return torch.clamp(features + self.delta, self.low, self.high)

    def to(self, device: torch.device) -> AdditiveTrigger:
        """The same perturbation with its tensor on ``device``."""
        return dataclasses.replace(self, delta=self.delta.to(device))


Found = InvertedTrigger | AdditiveTrigger


class TriggerMemory:
    """The triggers unlearned in each of the last ``rounds`` rounds, to unlearn again
    (``TriggerUnlearning.memory_rounds``); a strategy's state between rounds, so a resumed run
    recalls what the interrupted one found (:meth:`state_dict`)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self._past: collections.deque[list[Found]] = collections.deque(maxlen=max(rounds, 1))

    def recall(self, device: torch.device) -> list[Found]:
        """Every remembered trigger, oldest round first, on ``device``."""
        return [trigger.to(device) for found in self._past for trigger in found]

    def remember(self, found: Sequence[Found]) -> None:
        """Keep ``found`` (a round's unlearned triggers, moved to the CPU), forgetting the oldest
        round beyond ``rounds``."""
        if self.rounds > 0:
            self._past.append([trigger.to(torch.device("cpu")) for trigger in found])

    def state_dict(self) -> list[list[dict[str, Any]]]:
        """The remembered triggers as NumPy arrays and numbers, a list per round."""
        return [[_trigger_state(trigger) for trigger in found] for found in self._past]

    def load_state_dict(self, state: Sequence[Sequence[Mapping[str, Any]]]) -> None:
        """Recall what :meth:`state_dict` wrote."""
        self._past.clear()
        for found in state:
            self._past.append([_trigger_from_state(trigger) for trigger in found])


def _trigger_state(trigger: Found) -> dict[str, Any]:
    if isinstance(trigger, InvertedTrigger):
        return {
            "kind": "patch",
            "target": trigger.target,
            "mask": trigger.mask.numpy(),
            "pattern": trigger.pattern.numpy(),
            "success": trigger.success,
        }
    return {
        "kind": "additive",
        "target": trigger.target,
        "delta": trigger.delta.numpy(),
        "low": trigger.low,
        "high": trigger.high,
        "success": trigger.success,
    }


def _trigger_from_state(state: Mapping[str, Any]) -> Found:
    def tensor(key: str) -> torch.Tensor:
        return torch.from_numpy(np.array(state[key], dtype=np.float32))

    if state["kind"] == "patch":
        return InvertedTrigger(
            int(state["target"]), tensor("mask"), tensor("pattern"), float(state["success"])
        )
    return AdditiveTrigger(
        int(state["target"]),
        tensor("delta"),
        float(state["low"]),
        float(state["high"]),
        float(state["success"]),
    )


def invert_additive(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    target: int,
    options: TriggerUnlearning,
) -> AdditiveTrigger:
    """The smallest additive perturbation d (of one input's shape, |d| <= the range) that sends
    ``features`` not of class ``target`` to ``target``: Adam on
    CE(f(clip(x + d)), target) + ``options.additive_weight`` mean((d / range)^2), d = range
    tanh(u) from u = 0, ``options.steps`` steps; ``model`` is not changed."""
    others = features[labels != target]
    low, high = float(features.min()), float(features.max())
    scale = max(high - low, 1e-12)
    logit = torch.zeros(features.shape[1:], device=features.device, requires_grad=True)
    optimizer = torch.optim.Adam([logit], lr=INVERSION_LR)
    wanted = torch.full((len(others),), target, dtype=torch.long, device=features.device)
    for _ in range(options.steps):
        delta = scale * torch.tanh(logit)
        logits = model(torch.clamp(others + delta, low, high))
        price = torch.mean(torch.tanh(logit) ** 2)
        loss = CROSS_ENTROPY(logits, wanted) + options.additive_weight * price
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        delta = scale * torch.tanh(logit)
        hits = model(torch.clamp(others + delta, low, high)).argmax(dim=1) == target
        success = float(hits.float().mean()) if len(others) else 0.0
    return AdditiveTrigger(target, delta.detach(), low, high, success)


def dormant_positions(features: torch.Tensor) -> torch.Tensor:
    """The input features (flattened, one per position and channel) that hold the root set's
    smallest value in every root input: where the root set is blank."""
    flat = features.reshape(len(features), -1)
    return torch.all(flat == flat.min(), dim=0)


def first_layer_key(model: nn.Module, num_inputs: int) -> str | None:
    """The state key of ``model``'s first ``Linear`` weight, when that layer reads the
    flattened input (``in_features == num_inputs``) before any other layer with weights;
    None otherwise (e.g. a convolution first)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            return f"{name}.weight" if module.in_features == num_inputs else None
        if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.Embedding):
            return None
    return None


#: A round whose aggregate update on the dormant inputs' weights is at least this share of its
#: update on the other inputs' (root mean squares, :func:`dormant_update_ratio`) is flagged
#: (``unlearning-dormant-flagged``): honest clients' data are as blank there as the root set's, so
#: only weight decay writes them (docs/reliability.md, "Alarms over the attack tables").
DORMANT_ALARM_RATIO = 0.2
#: The ``backdoor-suspected`` alarm is raised from the run's third flagged round on. Chosen on the
#: 164 dormant-input runs of 2026-12-06: honest runs flag at most 2 rounds, both early (rounds 2-3,
#: while the model still moves a lot; IID data light positions a small root set leaves blank),
#: every backdoor at or above 20 % flagged 3 rounds or more; a write in one or two rounds is
#: undone anyway (the dormant weights keep the last model's values).
DORMANT_ALARM_ROUNDS = 3


def dormant_update_ratio(
    previous: NDArrayDict, new: NDArrayDict, key: str, dormant: npt.NDArray[np.bool_]
) -> float:
    """RMS of the update of weight ``key`` on the columns ``dormant`` over its RMS on the other
    columns (0 when either set is empty or the others did not move). The update is
    ``new - previous`` less its projection on ``previous``: a rescaling of the whole layer
    (weight decay, FedLAW's shrink factor) moves dormant weights too, and says nothing of
    them."""
    before = as_numpy(previous[key]).astype(np.float64)
    update = as_numpy(new[key]).astype(np.float64) - before
    scale = float(np.vdot(before, before))
    if scale > 0:
        update = update - float(np.vdot(update, before)) / scale * before
    if not dormant.any() or dormant.all():
        return 0.0
    active = float(np.sqrt(np.mean(np.square(update[:, ~dormant]))))
    return float(np.sqrt(np.mean(np.square(update[:, dormant])))) / active if active > 0 else 0.0


def dormant_flagged(metrics: Mapping[str, Any]) -> bool:
    """Whether a round's metrics show the dormant inputs' check fired
    (``unlearning-dormant-update`` at least :data:`DORMANT_ALARM_RATIO`)."""
    return float(metrics.get("unlearning-dormant-update", 0.0)) >= DORMANT_ALARM_RATIO


def backdoor_alarms(metrics: Mapping[str, Any], flagged_before: int) -> dict[str, str]:
    """The run alarm a round's metrics call for: ``backdoor-suspected`` when the dormant inputs'
    check fired this round (:func:`dormant_flagged`) and, with the ``flagged_before`` earlier
    rounds of the run that it fired in, in :data:`DORMANT_ALARM_ROUNDS` rounds or more; the
    message names the figure and the count."""
    if not dormant_flagged(metrics) or flagged_before + 1 < DORMANT_ALARM_ROUNDS:
        return {}
    ratio = float(metrics["unlearning-dormant-update"])
    return {
        "backdoor-suspected": (
            f"the aggregate update on the weights of inputs blank in the whole root set was "
            f"{ratio:.2f} x its size elsewhere (flagged at {DORMANT_ALARM_RATIO}; "
            f"{flagged_before + 1} rounds of this run flagged, alarm from "
            f"{DORMANT_ALARM_ROUNDS}): a trigger there is likely; check the replies' clients and "
            "test the model with triggers"
        )
    }


def freeze_dormant_inputs(
    previous: NDArrayDict, new: NDArrayDict, key: str, dormant: npt.NDArray[np.bool_]
) -> NDArrayDict:
    """``new`` with the columns ``dormant`` of weight ``key`` (out, in) set back to
    ``previous``'s: the aggregate update on weights only dormant inputs feed, zeroed."""
    weight = np.array(as_numpy(new[key]), copy=True)
    weight[:, dormant] = as_numpy(previous[key])[:, dormant]
    return {**new, key: weight}


def input_exercise(features: torch.Tensor) -> torch.Tensor:
    """Each input feature's (flattened) exercise in the root set: the root mean square over the
    root inputs of its value's height above the set's smallest value, as a share of the set's
    range (0: blank in every root input, a dormant position; 1: at the maximum in every one)."""
    flat = features.reshape(len(features), -1).to(torch.float64)
    low, high = float(flat.min()), float(flat.max())
    height = (flat - low) / max(high - low, 1e-12)
    return torch.sqrt(torch.mean(height**2, dim=0))


def bound_rare_inputs(
    previous: NDArrayDict,
    new: NDArrayDict,
    key: str,
    exercise: npt.NDArray[np.float64],
    factor: float,
) -> tuple[NDArrayDict, int]:
    """``new`` with the change of every column j of weight ``key`` (out, in) from ``previous``
    scaled down to at most ``factor`` x ``exercise[j]`` x r, where r is the median over the
    exercised columns (``exercise > 0``) of a column's change norm over its exercise; and how
    many columns were scaled down.

    An honest update of a first-layer column is a sum of input values times back-propagated
    errors, so its size follows how much the data exercise the input: the bound lets every
    column move as far as the typical column does for its exercise, ``factor`` times over, and
    a column no root input exercises not at all (what :func:`freeze_dormant_inputs` does)."""
    before = as_numpy(previous[key]).astype(np.float64)
    update = as_numpy(new[key]).astype(np.float64) - before
    norms = np.linalg.norm(update, axis=0)
    exercised = exercise > 0
    if not exercised.any():
        return new, 0
    per_unit = float(np.median(norms[exercised] / exercise[exercised]))
    cap = factor * exercise * per_unit
    over = norms > cap
    scale = np.where(over, cap / np.where(norms > 0, norms, 1.0), 1.0)
    bounded = (before + update * scale).astype(as_numpy(new[key]).dtype)
    return {**new, key: bounded}, int(over.sum())


def mask_shape(features: torch.Tensor) -> tuple[int, ...]:
    """The positions a patch covers: (H, W) of image batches (N, C, H, W), shared by the
    channels as in Neural Cleanse; every feature of flat batches (N, D)."""
    return tuple(features.shape[2:] if features.dim() == 4 else features.shape[1:])


def invert_trigger(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    target: int,
    options: TriggerUnlearning,
) -> InvertedTrigger:
    """The smallest patch (Neural Cleanse eq. 3) that sends ``features`` not of class ``target``
    to ``target``; ``model`` is used as it is (its parameters are not changed)."""
    others = features[labels != target]
    low, high = float(features.min()), float(features.max())
    mask_logit = torch.full(mask_shape(features), MASK_START_LOGIT, device=features.device)
    pattern_logit = torch.zeros(features.shape[1:], device=features.device)
    mask_logit.requires_grad_(True)
    pattern_logit.requires_grad_(True)
    optimizer = torch.optim.Adam([mask_logit, pattern_logit], lr=INVERSION_LR)
    per_position = options.l1_weight / mask_logit.numel()
    wanted = torch.full((len(others),), target, dtype=torch.long, device=features.device)

    def patch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sigmoid(mask_logit), low + (high - low) * torch.sigmoid(pattern_logit)

    for _ in range(options.steps):
        mask, pattern = patch()
        logits = model((1.0 - mask) * others + mask * pattern)
        loss = CROSS_ENTROPY(logits, wanted) + per_position * mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        mask, pattern = patch()
        hits = model((1.0 - mask) * others + mask * pattern).argmax(dim=1) == target
        success = float(hits.float().mean()) if len(others) else 0.0
    return InvertedTrigger(target, mask.detach(), pattern.detach(), success)


def anomaly_index(mask_l1: Sequence[float]) -> float:
    """Neural Cleanse's anomaly index of the smallest patch: how many MAD-estimated standard
    deviations its ||m||_1 lies below the median of all classes' (> 2: a likely backdoor)."""
    sizes = np.asarray(mask_l1, dtype=np.float64)
    median = float(np.median(sizes))
    mad = MAD_CONSISTENCY * float(np.median(np.abs(sizes - median)))
    return (median - float(sizes.min())) / mad if mad > 0.0 else 0.0


def unlearn(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    triggers: Sequence[Found],
    options: TriggerUnlearning,
) -> None:
    """Fine-tune ``model`` in place on ``features`` as they are and stamped with each of
    ``triggers``, always with their true ``labels`` (Neural Cleanse's unlearning), in ``eval()``
    mode: ``options.epochs`` passes of ``len(triggers) + 1`` full-batch SGD steps, each on

        (1 - s) CE(f(x), y) + s mean_t CE(f(stamp_t(x)), y),    s = options.patched_share

    Each step sees the clean root set as well as every patch: an earlier form, one step per
    patch on its stamped inputs alone, was an adversarial fine-tuning that capped digits runs
    near 85 % (docs/reliability.md)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9)
    stamped = torch.cat([trigger.stamp(features) for trigger in triggers]) if triggers else None
    stamped_labels = labels.repeat(len(triggers))
    for _ in range(options.epochs * (len(triggers) + 1)):
        loss = CROSS_ENTROPY(model(features), labels)
        if stamped is not None:
            patched = CROSS_ENTROPY(model(stamped), stamped_labels)
            loss = (1.0 - options.patched_share) * loss + options.patched_share * patched
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def unlearn_triggers(
    model: nn.Module,
    arrays: NDArrayDict,
    features: torch.Tensor,
    labels: torch.Tensor,
    options: TriggerUnlearning,
    memory: TriggerMemory | None = None,
) -> tuple[NDArrayDict, dict[str, float | int | list[float]]]:
    """``arrays`` (a model's state) with every working patch inverted on the root set
    (``features``, ``labels``, on ``model``'s device) and unlearned, and the figures of it:
    ``unlearning-patches`` (how many were unlearned), ``unlearning-anomaly`` (Neural Cleanse's
    anomaly index), ``unlearning-mask-l1`` (per class) and ``unlearning-success`` (per class).
    With a ``memory``, the triggers it recalls are unlearned too (``unlearning-remembered``:
    how many) and the round's own are remembered.

    ``model`` is a scratch module of the arrays' architecture: it is overwritten. Tensors that
    are not floating point (counters) are returned as they came.
    """
    model.load_state_dict(
        {key: torch.from_numpy(np.array(as_numpy(value))) for key, value in arrays.items()}
    )
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    classes = sorted(int(c) for c in torch.unique(labels).tolist())
    triggers = [invert_trigger(model, features, labels, c, options) for c in classes]
    used: list[Found] = [trigger for trigger in triggers if trigger.success >= options.min_success]
    additive: list[AdditiveTrigger] = []
    if options.additive_weight > 0:
        additive = [invert_additive(model, features, labels, c, options) for c in classes]
        used += [trigger for trigger in additive if trigger.success >= options.min_success]
    recalled = memory.recall(features.device) if memory is not None else []
    if used or recalled:
        unlearn(model, features, labels, used + recalled, options)
    if memory is not None:
        memory.remember(used)
    state = model.state_dict()
    new_arrays = {
        key: (
            state[key].detach().to("cpu").numpy().astype(as_numpy(value).dtype)
            if is_floating(as_numpy(value))
            else value
        )
        for key, value in arrays.items()
    }
    figures: dict[str, float | int | list[float]] = {
        "unlearning-patches": len(used),
        "unlearning-anomaly": anomaly_index([trigger.mask_l1 for trigger in triggers]),
        "unlearning-mask-l1": [trigger.mask_l1 for trigger in triggers],
        "unlearning-success": [trigger.success for trigger in triggers],
    }
    if memory is not None:
        figures["unlearning-remembered"] = len(recalled)
    if additive:
        figures["unlearning-additive-size"] = [trigger.size for trigger in additive]
        figures["unlearning-additive-success"] = [trigger.success for trigger in additive]
    return new_arrays, figures
