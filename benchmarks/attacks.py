"""Byzantine clients against every rule and defence: the attack tables of docs/reliability.md.

A run is an in-process federation (:func:`benchmarks.harness.federation`) whose first
``attackers`` nodes collude: an :class:`AttackGrid` rewrites their honest replies (:data:`ATTACKS`),
or they train on poisoned data (flipped labels, a backdoor trigger). The attackers are omniscient:
they see every honest update of the round and know the published default bounds, so the
adaptive attacks (min-max, min-sum, IPM, the norm-aware update, the boosted backdoor) are their
best responses to the defaults. docs/reliability.md ("The attack table", "Adaptive attacks")
defines the attacks and gives the commands; every table is a spec of the runner whose
``runtime`` is :func:`run_attacked`. Every round records the server's test accuracy and
``backdoor-success``: the share of triggered test images whose true label is not the target that
the global model classifies as the target (:func:`backdoor_success`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies

from benchmarks.harness import Federation, federation
from benchmarks.report import markdown_table, read_run
from benchmarks.spec import load_spec
from benchmarks.triggers import (
    ADAPTIVE_CANDIDATES,
    BACKDOOR_TARGET,
    TRIGGERS,
    choose_trigger,
    poison_half,
    with_trigger,
)
from beyond_averaging.client import app as client_module
from beyond_averaging.server.app import chance_accuracy, client_task, data_spec, round_alarms
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.pull import DelegatingGrid
from beyond_averaging.server.runs.folder import COMPLETED_WITH_ALARMS
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.strategy_factory import build_strategy, trigger_unlearning
from beyond_averaging.strategies import ContractStrategy
from beyond_averaging.strategies.defences.trigger_unlearning import (
    TriggerUnlearning,
    backdoor_alarms,
)
from beyond_averaging.strategies.replies.bounds import (
    DEFAULT_MAX_CLAIM_FACTOR,
    DEFAULT_UPDATE_CLIP_FACTOR,
)
from beyond_averaging.strategies.replies.influence import DIRECTION_FLOOR
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData, evaluate
from beyond_averaging.tasks.federation import DataSpec, load_server_splits
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
)

Update = dict[str, npt.NDArray[np.float64]]


# ----------------------------------------------------------------------------- attacks
def alie_z(num_clients: int, num_attackers: int) -> float:
    """z of "a little is enough": s = floor(n/2 + 1) - m, z = Phi^-1((n - s) / n)."""
    supporters = math.floor(num_clients / 2 + 1) - num_attackers
    return statistics.NormalDist().inv_cdf((num_clients - supporters) / num_clients)


@dataclass(frozen=True)
class RoundView:
    """What the colluding attackers know in one round: every sampled client's honest update."""

    updates: Sequence[Update]  # one per reply, in reply order (float64, floating keys)
    attacker_positions: Sequence[int]
    rng: np.random.Generator

    @property
    def benign(self) -> list[Update]:
        """The updates of the clients that do not attack (the honest ones the server sees)."""
        return [u for i, u in enumerate(self.updates) if i not in self.attacker_positions]


#: ``attack(view, position) -> malicious update`` for the attacker at ``position``.
ModelAttack = Callable[[RoundView, int], Update]


def _scaled(factor: float) -> ModelAttack:
    def attack(view: RoundView, position: int) -> Update:
        return {key: factor * value for key, value in view.updates[position].items()}

    return attack


def _noise(factor: float) -> ModelAttack:
    def attack(view: RoundView, position: int) -> Update:
        own = view.updates[position]
        direction = {key: view.rng.standard_normal(value.shape) for key, value in own.items()}
        scale = factor * _norm(own) / max(_norm(direction), 1e-30)
        return {key: scale * value for key, value in direction.items()}

    return attack


def _alie(view: RoundView, position: int) -> Update:
    z = alie_z(len(view.updates), len(view.attacker_positions))
    stacked = {key: np.stack([update[key] for update in view.updates]) for key in view.updates[0]}
    return {key: value.mean(axis=0) - z * value.std(axis=0) for key, value in stacked.items()}


def _norm(update: Mapping[str, npt.NDArray[Any]]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in update.values()))


def _dot(first: Mapping[str, npt.NDArray[Any]], second: Mapping[str, npt.NDArray[Any]]) -> float:
    return sum(float(np.vdot(first[key], second[key])) for key in first)


def _mean(updates: Sequence[Update]) -> Update:
    return {key: np.mean([u[key] for u in updates], axis=0) for key in updates[0]}


#: The attackers' margin below each published bound: a norm of 0.99 x the clip bound, a claim of
#: 0.99 x the claim bound, a cosine of 0.01 above the direction check's floor.
BOUND_MARGIN = 0.99


def clip_bound(view: RoundView) -> float:
    """Just under the default clip bound, 2 x the round's median norm: the median of the benign
    updates' norms (the round's median, attackers' replies on top, is at least that)."""
    norms = [_norm(update) for update in view.benign]
    return BOUND_MARGIN * DEFAULT_UPDATE_CLIP_FACTOR * float(np.median(norms))


def shejwalkar_gamma(updates: Sequence[Update], perturbation: Update, objective: str) -> float:
    """The largest gamma for which mu + gamma p stays as close to the benign updates g_i as
    they are to each other (Shejwalkar & Houmansadr, NDSS 2021, the AGR-agnostic attacks).

    ``min-max``: max_i ||m - g_i|| <= max_{i,j} ||g_i - g_j||; ``min-sum``:
    sum_i ||m - g_i||^2 <= max_i sum_j ||g_i - g_j||^2. With m = mu + gamma p each
    ||m - g_i||^2 = ||p||^2 gamma^2 + 2 <p, mu - g_i> gamma + ||mu - g_i||^2 is a quadratic in
    gamma, so the largest feasible gamma is solved exactly (the paper halves a step from
    gamma = 10 until it converges to the same value). 0 when even gamma = 0 breaks the bound.
    """
    mu = _mean(updates)
    offsets = [{key: mu[key] - g[key] for key in mu} for g in updates]
    count = len(updates)
    gram = np.array([[_dot(updates[i], updates[j]) for j in range(count)] for i in range(count)])
    diagonal = np.diag(gram)
    pairwise = np.maximum(diagonal[:, None] + diagonal[None, :] - 2.0 * gram, 0.0)
    a = _dot(perturbation, perturbation)
    b = np.array([2.0 * _dot(perturbation, offset) for offset in offsets])
    c = np.array([_dot(offset, offset) for offset in offsets])
    if objective == "min-max":
        bound = float(pairwise.max())
        terms = [(a, float(b_i), float(c_i) - bound) for b_i, c_i in zip(b, c, strict=True)]
    else:
        bound = float(pairwise.sum(axis=1).max())
        terms = [(count * a, float(b.sum()), float(c.sum()) - bound)]
    roots = []
    for quadratic, linear, constant in terms:
        if constant > 0.0 or quadratic <= 0.0:
            return 0.0
        roots.append((-linear + math.sqrt(linear**2 - 4.0 * quadratic * constant)) / quadratic / 2)
    return max(0.0, min(roots))


def _shejwalkar(objective: str) -> ModelAttack:
    """mu + gamma (-sigma): the benign mean moved against the benign per-coordinate standard
    deviation ("std" perturbation), gamma from :func:`shejwalkar_gamma`; all attackers send it."""

    def attack(view: RoundView, position: int) -> Update:
        mu = _mean(view.updates)
        perturbation = {
            key: -np.std([u[key] for u in view.updates], axis=0) for key in view.updates[0]
        }
        gamma = shejwalkar_gamma(view.updates, perturbation, objective)
        return {key: mu[key] + gamma * perturbation[key] for key in mu}

    return attack


def _ipm(epsilon: float) -> ModelAttack:
    """Inner-product manipulation (Xie, Koyejo, Gupta, UAI 2019): -epsilon x the benign mean."""

    def attack(view: RoundView, position: int) -> Update:
        return {key: -epsilon * value for key, value in _mean(view.benign).items()}

    return attack


#: The norm-aware update's cosine with the benign mean: just above the direction check's floor
#: (it drops only below -DIRECTION_FLOOR).
NORM_AWARE_COSINE = -(DIRECTION_FLOOR - 0.01)
#: The sign-flipped mix's cosine: just above root-set trust's drop threshold (FLTrust drops a
#: reply whose cosine with the server's update is <= 0; the attackers aim at the benign mean, the
#: best estimate of that update they have), so it keeps a small positive trust.
MIX_COSINE = 0.05


def _norm_aware(cosine: float) -> ModelAttack:
    """Just inside every published bound: cosine ``cosine`` with the benign replies' mean as the
    direction check forms it, the norm 0.99 x the clip bound, the claim 0.99 x the claim bound
    (:func:`claim_bound`); the rest of the update is the component of -sign(mean) orthogonal to
    the mean, which pushes every coordinate against the benign direction with equal weight.
    With :data:`NORM_AWARE_COSINE` it passes the direction check; with :data:`MIX_COSINE` it
    keeps a positive root-set trust while its signs (and its gradient record's, built the same
    way) vote against the benign ones on most coordinates: a sign-flipped mix aimed at FedGMA's
    mask."""

    def attack(view: RoundView, position: int) -> Update:
        return _norm_aware_update(view, cosine)

    return attack


def _norm_aware_update(view: RoundView, cosine: float) -> Update:
    length = clip_bound(view)
    # The reference the server compares with: the other replies, each scaled down to the
    # round's median norm (strategies.replies.influence.direction_cosines), the attackers' at
    # `length`.
    norms = [_norm(update) for update in view.benign]
    median = float(np.median(norms + [length] * len(view.attacker_positions)))
    mean = _mean(
        [
            {key: min(1.0, median / max(norm, 1e-30)) * value for key, value in update.items()}
            for update, norm in zip(view.benign, norms, strict=True)
        ]
    )
    unit = {key: value / max(_norm(mean), 1e-30) for key, value in mean.items()}
    against = {key: -np.sign(value) for key, value in mean.items()}
    along = _dot(against, unit)
    side = {key: against[key] - along * unit[key] for key in unit}
    side = {key: value / max(_norm(side), 1e-30) for key, value in side.items()}
    return {
        key: length * (cosine * unit[key] + math.sqrt(1.0 - cosine**2) * side[key]) for key in unit
    }


def _at_clip_bound(view: RoundView, update: Update) -> Update:
    """``update`` scaled to just under the round's clip bound (:func:`clip_bound`)."""
    scale = clip_bound(view) / max(_norm(update), 1e-30)
    return {key: scale * value for key, value in update.items()}


def _to_clip_bound(view: RoundView, position: int) -> Update:
    """The attacker's own (poisoned) update boosted to just under the clip bound: model
    replacement (Bagdasaryan et al., AISTATS 2020) as far as the defaults let it go."""
    return _at_clip_bound(view, view.updates[position])


#: The blended backdoor's cosine with the benign mean: the lowest of the range the red team found
#: to keep a positive root-set trust while carrying most of the backdoor (0.4-0.9).
BLENDED_COSINE = 0.4


def _blended_backdoor(view: RoundView, position: int) -> Update:
    """The attacker's own poisoned update blended into the benign mean, the best response to
    root-set trust: cosine :data:`BLENDED_COSINE` with the benign mean (the best estimate of the
    server's root update the attackers have), the rest along the part of its own update
    orthogonal to that mean (where the backdoor lives), at just under the clip bound. An update
    already closer to the mean is only boosted."""
    own, mean = view.updates[position], _mean(view.benign)
    unit = {key: value / max(_norm(mean), 1e-30) for key, value in mean.items()}
    along = _dot(own, unit)
    if along >= BLENDED_COSINE * _norm(own):
        return _to_clip_bound(view, position)
    side = {key: own[key] - along * unit[key] for key in own}
    side = {key: value / max(_norm(side), 1e-30) for key, value in side.items()}
    mix = math.sqrt(1.0 - BLENDED_COSINE**2)
    return {key: clip_bound(view) * (BLENDED_COSINE * unit[key] + mix * side[key]) for key in own}


#: Neurotoxin's share of the coordinates the attacker writes to: the ones the benign replies
#: change least (the authors' ``gradmask_ratio`` of 0.95 in their README's runs).
NEUROTOXIN_KEEP = 0.95


def _neurotoxin(view: RoundView, position: int) -> Update:
    """The attacker's own poisoned update with the top 1 - :data:`NEUROTOXIN_KEEP` of the
    coordinates, by the benign mean's magnitude over the whole model, set to zero, boosted to just
    under the clip bound: the backdoor is written where benign training, and a server's
    fine-tuning on clean data, rarely write, so it outlasts both (Zhang et al., "Neurotoxin:
    Durable Backdoors in Federated Learning", ICML 2022). The paper projects every local step
    onto the mask built from the previous round's global update; here the finished update is
    masked once, with the current round's benign mean, which these attackers see."""
    own, mean = view.updates[position], _mean(view.benign)
    magnitudes = np.concatenate([np.abs(value).ravel() for value in mean.values()])
    cut = float(np.quantile(magnitudes, NEUROTOXIN_KEEP))
    masked = {key: np.where(np.abs(mean[key]) <= cut, value, 0.0) for key, value in own.items()}
    return _at_clip_bound(view, masked)


def claim_bound(claims: Sequence[float]) -> float:
    """Just under the default claim bound: the whole number of examples below 0.99 x 10 x the
    median claim of the benign replies."""
    return float(math.floor(BOUND_MARGIN * DEFAULT_MAX_CLAIM_FACTOR * float(np.median(claims))))


#: ``claim(benign claims) -> the attacker's claimed number of examples``.
ClaimAttack = Callable[[Sequence[float]], float]


@dataclass(frozen=True)
class Attack:
    """One attack: a model map, a claimed weight (fixed or from the benign claims), and the
    data the attacker trains on (flipped labels, or a backdoor trigger on half of it)."""

    model: ModelAttack | None = None
    num_examples: float | ClaimAttack | None = None
    flip_labels: bool = False
    backdoor: bool = False
    #: The backdoor's trigger: a name of :data:`benchmarks.triggers.TRIGGERS`, or
    #: ``"adaptive"``: the one :func:`benchmarks.triggers.choose_trigger` picks at the run's start.
    trigger: str = "patch"
    #: A distributed backdoor (DBA): each attacker stamps one band of the patch's rows.
    distributed: bool = False


ATTACKS: dict[str, Attack] = {
    "none": Attack(),
    "sign-flip": Attack(model=_scaled(-5.0)),
    "sign-flip-1e12": Attack(model=_scaled(-5.0), num_examples=1e12),
    "noise": Attack(model=_noise(3.0)),
    "boost": Attack(model=_scaled(5.0)),
    "alie": Attack(model=_alie),
    "label-flip": Attack(flip_labels=True),
    # the attackers' best responses to the published defaults (docs/reliability.md)
    "min-max": Attack(model=_shejwalkar("min-max")),
    "min-sum": Attack(model=_shejwalkar("min-sum")),
    "ipm-0.1": Attack(model=_ipm(0.1)),
    "ipm-0.5": Attack(model=_ipm(0.5)),
    "ipm-3": Attack(model=_ipm(3.0)),
    "norm-aware": Attack(model=_norm_aware(NORM_AWARE_COSINE), num_examples=claim_bound),
    "norm-aware-mix": Attack(model=_norm_aware(MIX_COSINE), num_examples=claim_bound),
    "backdoor": Attack(model=_to_clip_bound, backdoor=True),
    "backdoor-claim": Attack(model=_to_clip_bound, num_examples=claim_bound, backdoor=True),
    # the best response to trigger unlearning, whose patch search favours small patches: a
    # trigger spread over the whole image (Chen et al. 2017's blended injection)
    "backdoor-blended-trigger": Attack(model=_to_clip_bound, backdoor=True, trigger="blend"),
    # the best response to root-set trust: the backdoor blended into the benign direction
    "backdoor-blended-update": Attack(model=_blended_backdoor, backdoor=True),
    # the best response to removal by fine-tuning (trigger unlearning): the backdoor written only
    # where the benign replies change least
    "backdoor-neurotoxin": Attack(model=_neurotoxin, backdoor=True),
    # triggers a masked-patch search misses (issue 45): patches where clean digits are mostly
    # blank, several sizes and corners; a +-1 whole-image pattern added at several amplitudes; a
    # distributed 4 x 4 patch (each attacker one band of rows); and the attacker that rehearses
    # the server's published defence on its poisoned model and keeps the trigger it misses
    **{
        f"backdoor-{name}": Attack(model=_to_clip_bound, backdoor=True, trigger=name)
        for name in TRIGGERS
        if name.startswith(("corner-", "additive-"))
    },
    "backdoor-dba-corner-4": Attack(
        model=_to_clip_bound, backdoor=True, trigger="corner-4", distributed=True
    ),
    "backdoor-adaptive": Attack(model=_to_clip_bound, backdoor=True, trigger="adaptive"),
}


class AttackGrid(DelegatingGrid):
    """Rewrites the train replies of ``attackers`` (node ids) from the round's honest replies."""

    def __init__(self, inner: Grid, attackers: Iterable[int], attack: Attack, seed: int) -> None:
        super().__init__(inner)
        self.attackers = frozenset(attackers)
        self.attack = attack
        self.rng = np.random.default_rng(seed)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """The inner Grid's replies, the attackers' train replies rewritten in place."""
        messages = list(messages)
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if not train or (self.attack.model is None and self.attack.num_examples is None):
            return replies
        honest = [reply for reply in replies if not reply.has_error()]
        rows = [i for i, reply in enumerate(honest) if reply.metadata.src_node_id in self.attackers]
        if not rows:
            return replies
        claim = self.attack.num_examples
        if callable(claim):
            claim = claim(
                [
                    float(reply.content.metric_records[METRICS_RECORD][NUM_EXAMPLES_KEY])  # type: ignore[arg-type]
                    for i, reply in enumerate(honest)
                    if i not in rows
                ]
            )
        # Every train message of a round carries the same global model.
        global_arrays = {
            k: v.numpy() for k, v in train[0].content.array_records[ARRAYS_RECORD].items()
        }
        floating = [k for k, v in global_arrays.items() if np.issubdtype(v.dtype, np.floating)]

        def view(record: str, relative: bool) -> RoundView:
            """Every honest reply's ``record`` in float64, less the global model if ``relative``."""
            base = global_arrays if relative else {}
            records = [reply.content.array_records[record] for reply in honest]
            updates = [
                {k: r[k].numpy().astype(np.float64) - base.get(k, 0.0) for k in r if k in floating}
                for r in records
            ]
            return RoundView(updates, rows, self.rng)

        models = view(ARRAYS_RECORD, relative=True)
        has_gradient = GRADIENT_RECORD in honest[0].content.array_records
        gradients = view(GRADIENT_RECORD, relative=False) if has_gradient else None
        for row in rows:
            content = honest[row].content
            if self.attack.model is not None:
                bad = self.attack.model(models, row)
                arrays = {k: v.numpy() for k, v in content.array_records[ARRAYS_RECORD].items()}
                for key, update in bad.items():
                    arrays[key] = (global_arrays[key] + update).astype(arrays[key].dtype)
                content[ARRAYS_RECORD] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
                if gradients is not None:
                    gradient = self.attack.model(gradients, row)
                    content[GRADIENT_RECORD] = ArrayRecord(
                        {key: Array(value.astype(np.float32)) for key, value in gradient.items()}
                    )
            if claim is not None:
                metrics = dict(content.metric_records[METRICS_RECORD])
                metrics[NUM_EXAMPLES_KEY] = claim
                content[METRICS_RECORD] = MetricRecord(metrics)
        return replies


# ----------------------------------------------------------------------------- poisoned data
def poisoned(data: DeviceData, attack: Attack, part: int = 0, parts: int = 1) -> DeviceData:
    """The attacker's training data: labels C - 1 - y (label flipping), or every second sample
    with the trigger and relabelled to BACKDOOR_TARGET (the backdoor), the rest as they are; a
    distributed backdoor's attacker ``part`` of ``parts`` stamps its band of the patch only."""
    if attack.flip_labels:
        return replace(data, labels=data.num_classes - 1 - data.labels)
    if not attack.distributed:
        part, parts = 0, 1
    return poison_half(data, attack.trigger, part, parts)


@contextlib.contextmanager
def poisoned_partitions(partitions: frozenset[int], attack: Attack) -> Iterator[None]:
    """While the block runs, the ClientApp trains ``partitions`` on :func:`poisoned` data.

    The ClientApp reads its partition through ``client.app.device_partition``; for the
    ``partitions`` the replacement returns the poisoned copy.
    """
    honest = client_module.device_partition

    order = sorted(partitions)

    def partition(spec: Any, partition_id: int, device: torch.device) -> DeviceData:
        data = honest(spec, partition_id, device)
        if partition_id not in partitions:
            return data
        return poisoned(data, attack, order.index(partition_id), len(order))

    client_module.device_partition = partition  # type: ignore[assignment]
    try:
        yield
    finally:
        client_module.device_partition = honest


def backdoor_test_set(test_set: LabeledData, trigger: str = "patch") -> LabeledData:
    """The test images whose true label is not BACKDOOR_TARGET, with the ``trigger``, all
    labelled BACKDOOR_TARGET: the accuracy on it is the backdoor's success."""
    keep = test_set.labels != BACKDOOR_TARGET
    features = with_trigger(torch.from_numpy(test_set.features[keep]), trigger).numpy()
    labels = np.full(int(keep.sum()), BACKDOOR_TARGET, dtype=np.int64)
    return LabeledData(features, labels, test_set.num_classes)


def backdoor_success(fed: Federation, triggered: LabeledData) -> float:
    """The share of ``triggered`` (:func:`backdoor_test_set`) the current global model puts in
    the target class."""
    fed.model.load_state_dict(fed.arrays.to_torch_state_dict())
    cpu = torch.device("cpu")
    return evaluate(fed.model, DeviceData.from_labeled(triggered, cpu), cpu)[1]


# ----------------------------------------------------------------------------- one run
def adaptive_attack(
    fed: Federation, config: RunConfig, attack: Attack, attackers: range
) -> tuple[Attack, dict[str, Any]]:
    """``attack`` with the trigger :func:`benchmarks.triggers.choose_trigger` picks against the
    run's own trigger unlearning (where it has none, the documented setting, 6 passes),
    rehearsed on the attackers' pooled
    partitions from the initial model with the server's root set as the search's inputs
    (omniscient, as the table's other attackers); and the round-0 figures of the choice."""
    cpu, task = torch.device("cpu"), client_task(config)
    spec = DataSpec.from_task(task, config.num_clients)
    parts = [client_module.device_partition(spec, pid, cpu) for pid in attackers]
    pooled = [torch.cat([getattr(part, key) for part in parts]) for key in ("features", "labels")]
    root = DeviceData.from_labeled(load_server_splits(data_spec(config))[1], cpu)
    fed.model.load_state_dict(fed.arrays.to_torch_state_dict())
    defence = trigger_unlearning(config) or TriggerUnlearning(epochs=6)
    best, survived = choose_trigger(
        fed.model, DeviceData(pooled[0], pooled[1], parts[0].num_classes), root, defence,
        learning_rate=task.learning_rate, batch_size=task.batch_size, seed=config.seed,
    )  # fmt: skip
    figures = {
        "adaptive-trigger": ADAPTIVE_CANDIDATES.index(best),
        "adaptive-survival": [survived[name] for name in ADAPTIVE_CANDIDATES],
    }
    return replace(attack, trigger=best), figures


#: Flower's strategies the table compares with, by class name.
FLOWER_STRATEGIES = ("FedAvg", "FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan")


def flower_strategy(name: str, attackers: int, config: RunConfig) -> Any:
    """Flower's own strategy ``name``, told the number of attackers where it takes one."""
    if name not in FLOWER_STRATEGIES:
        raise ValueError(f"flower = {name!r}: use one of {FLOWER_STRATEGIES}")
    common: dict[str, Any] = {"fraction_evaluate": 0.0}
    if name == "FedTrimmedAvg":
        common["beta"] = config.trim_fraction
    if name in ("Krum", "MultiKrum", "Bulyan"):
        common["num_malicious_nodes"] = attackers
    if name == "MultiKrum":  # El Mhamdi et al.'s m = n - f; Flower's default 1 is Krum
        common["num_nodes_to_select"] = max(1, config.num_clients - attackers)
    return getattr(flower_strategies, name)(**common)


def run_attacked(settings: Mapping[str, Any]) -> None:
    """One run of the attack table: a federation whose first ``attackers`` nodes are Byzantine.

    ``settings`` is a run configuration (``run-name`` and ``output-dir`` name the run folder)
    plus ``attack`` (a name of :data:`ATTACKS`), ``attackers`` (how many of the first nodes
    attack; 0 or attack ``none``: an honest run) and optionally ``flower`` (a class of
    :data:`FLOWER_STRATEGIES` in place of the configured rule) and ``attackers-at``
    (``"last"``: the last nodes and partitions attack instead of the first).

    Raises
    ------
    ValueError
        An unknown attack or Flower strategy, or a run configuration the app refuses.
    """
    attack_name = str(settings.get("attack", "none"))
    if attack_name not in ATTACKS:
        raise ValueError(f"attack = {attack_name!r}: use one of {sorted(ATTACKS)}")
    attack, flower = ATTACKS[attack_name], str(settings.get("flower", ""))
    ours = ("attack", "attackers", "flower", "attackers-at")
    run_settings = {k: v for k, v in settings.items() if k not in ours}
    last = settings.get("attackers-at", "first") == "last"
    config = parse_run_config(run_settings)
    told = int(settings.get("attackers", 0))  # what Krum and Bulyan assume, even in honest runs
    attackers = 0 if attack_name == "none" else told
    recorder = RunRecorder(
        config.output_dir,
        config.run_name,
        {**config.to_run_config(), "attack": attack_name, "attackers": attackers, "flower": flower},
    )
    poisoning = attack.flip_labels or attack.backdoor
    first = config.num_clients - attackers if last else 0
    poisoned_ids = frozenset(range(first, first + attackers) if poisoning else ())
    try:
        rule = build_strategy if not flower else lambda c, _: flower_strategy(flower, told, c)
        fed = federation(run_settings, rule)
        chosen: dict[str, Any] = {}
        if attack.trigger == "adaptive" and attackers:
            attack, chosen = adaptive_attack(fed, config, attack, range(first, first + attackers))
        triggered = backdoor_test_set(fed.test_set, attack.trigger)
        node_ids = sorted(fed.grid.get_node_ids())
        fed.grid = AttackGrid(fed.grid, node_ids[first : first + attackers], attack, config.seed)
        chance = chance_accuracy(fed.test_set.labels)
        loss, accuracy = fed.evaluate()
        history = [(accuracy, loss)]  # the ServerApp's alarms, judged as it judges them
        recorder.log_round(
            {
                "round": 0,
                "test-accuracy": accuracy,
                "test-loss": loss,
                "backdoor-success": backdoor_success(fed, triggered),
                **chosen,
            }
        )
        for server_round in range(1, config.num_server_rounds + 1):
            started, sent = time.perf_counter(), fed.arrays
            with poisoned_partitions(poisoned_ids, attack):
                fed.round(server_round)
            loss, accuracy = fed.evaluate()
            figures: dict[str, Any] = {}
            if isinstance(fed.strategy, ContractStrategy):  # Flower's keep no round metrics
                figures = dict(fed.strategy.last_round_metrics)
            last = server_round == config.num_server_rounds
            alarms = round_alarms(history, accuracy, loss, chance, last=last)
            alarms |= backdoor_alarms(figures)
            history.append((accuracy, loss))
            recorder.log_round(
                {
                    **figures,
                    "round": server_round,
                    "test-accuracy": accuracy,
                    "test-loss": loss,
                    "backdoor-success": backdoor_success(fed, triggered),
                    "round-seconds": time.perf_counter() - started,
                    "aggregated": int(fed.arrays is not sent),
                },
                alarms,
            )
    except BaseException as error:
        recorder.write_summary("failed", error=f"{type(error).__name__}: {error}")
        raise
    recorder.write_summary(COMPLETED_WITH_ALARMS if recorder.alarm_summary() else "completed")


# ----------------------------------------------------------------------------- condensed table
def condensed_table(
    spec_path: Path, metric_rounds: int = 1, key: str = "test-accuracy", baseline: str = ""
) -> str:
    """Per federation, one row per method and one column per attack: the round metric ``key``
    (%) of the final round (``metric_rounds`` > 1: the mean of that many last rounds), seeds
    averaged, and the largest loss against the method's own honest run (``baseline``: against
    that method's honest run instead). From the spec's run folders."""
    spec = load_spec(spec_path)
    cells: dict[tuple[str, ...], list[float]] = {}
    for data in filter(None, map(read_run, spec.runs())):
        curve = list(data.curve(key).values())
        cell = tuple(data.run.labels[axis] for axis in ("federation", "method", "attack"))
        cells.setdefault(cell, []).append(100.0 * float(np.mean(curve[-metric_rounds:])))
    axes = {axis.name: axis.labels for axis in spec.axes}
    lines = []
    for setting in axes["federation"]:
        rows = []
        for method in axes["method"]:
            values = {a: cells.get((setting, method, a)) for a in axes["attack"]}
            honest = cells.get((setting, baseline, "none")) if baseline else values.get("none")
            attacked = [v for a, v in values.items() if v and a != "none"]
            losses = [np.mean(honest) - np.mean(v) for v in attacked] if honest else []
            shown = [f"{np.mean(v):.1f}" if v else "-" for v in values.values()]
            rows.append([method, *shown, f"{max(losses):.1f}" if losses else "-"])
        header = ["method", *axes["attack"], "worst loss (pts)"]
        lines += [f"**{setting}**", "", markdown_table(header, rows)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the condensed table of an attack spec from its run folders."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attacks", description=__doc__)
    parser.add_argument("spec", type=Path, help="benchmarks/specs/attacks*.toml")
    parser.add_argument("--last", type=int, default=1, help="mean of this many last rounds")
    parser.add_argument("--key", default="test-accuracy", help="the round metric shown")
    parser.add_argument(
        "--baseline", default="", help="losses against this method's honest run (e.g. fedavg)"
    )
    options = parser.parse_args(argv)
    print(condensed_table(options.spec, options.last, options.key, options.baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
