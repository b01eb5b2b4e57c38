"""Model attacks: what colluding Byzantine clients send instead of their honest updates.

Each :data:`ModelAttack` maps a :class:`RoundView` (every sampled client's honest update of the
round, which these omniscient attackers see) and the attacker's position to the update it sends:
scaled and noise updates, "a little is enough" (ALIE), Shejwalkar and Houmansadr's min-max and
min-sum, inner-product manipulation (IPM), the norm-aware update and the backdoor boosts. The
adaptive ones are best responses to the published default bounds (docs/reliability.md, "Adaptive
attacks"): just under the clip bound (:func:`clip_bound`), the claim bound (:func:`claim_bound`)
and the direction check's floor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from beyond_averaging.strategies.replies.bounds import (
    DEFAULT_MAX_CLAIM_FACTOR,
    DEFAULT_UPDATE_CLIP_FACTOR,
)
from beyond_averaging.strategies.replies.influence import DIRECTION_FLOOR

Update = dict[str, npt.NDArray[np.float64]]


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


def scaled(factor: float) -> ModelAttack:
    """The attacker's own update times ``factor``: -5 a sign flip, 5 a boost."""

    def attack(view: RoundView, position: int) -> Update:
        return {key: factor * value for key, value in view.updates[position].items()}

    return attack


def noise(factor: float) -> ModelAttack:
    """Gaussian noise of ``factor`` times the attacker's own update's norm."""

    def attack(view: RoundView, position: int) -> Update:
        own = view.updates[position]
        direction = {key: view.rng.standard_normal(value.shape) for key, value in own.items()}
        scale = factor * _norm(own) / max(_norm(direction), 1e-30)
        return {key: scale * value for key, value in direction.items()}

    return attack


def alie(view: RoundView, position: int) -> Update:
    """ "A little is enough" (Baruch et al., NeurIPS 2019): every coordinate at the mean less
    z standard deviations of all the round's updates, z from :func:`alie_z`."""
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


def shejwalkar(objective: str) -> ModelAttack:
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


def ipm(epsilon: float) -> ModelAttack:
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


def norm_aware(cosine: float, colluding: bool = False) -> ModelAttack:
    """Just inside every published bound: cosine ``cosine`` with the benign replies' mean as the
    direction check forms it, the norm 0.99 x the clip bound, the claim 0.99 x the claim bound
    (:func:`claim_bound`); the rest of the update is the component of -sign(mean) orthogonal to
    the mean, which pushes every coordinate against the benign direction with equal weight.
    With :data:`NORM_AWARE_COSINE` it passes the direction check; with :data:`MIX_COSINE` it
    keeps a positive root-set trust while its signs (and its gradient record's, built the same
    way) vote against the benign ones on most coordinates: a sign-flipped mix aimed at FedGMA's
    mask. ``colluding``: both bounds as the server computes them (:func:`colluding_along`)."""

    def attack(view: RoundView, position: int) -> Update:
        return _norm_aware_update(view, cosine, colluding)

    return attack


def colluding_along(cosine: float, others: float) -> float:
    """c, the share along the benign reference B of a unit update x = c B/|B| + sqrt(1 - c^2) e
    (e orthogonal to B) whose cosine with B + others x/|B| (the server's reference: the other
    colluders' identical replies inside it) is ``cosine`` < 0: the root of
    (c + p) = t sqrt(1 - c^2), t = cosine / sqrt(1 - cosine^2), p = ``others``, with c + p <= 0;
    -1 from p >= 1 on, where even the negated reference keeps a cosine >= 0."""
    t2 = cosine**2 / (1.0 - cosine**2)
    return -1.0 if others >= 1.0 else (-others - math.sqrt(t2 * (1 + t2 - others**2))) / (1 + t2)


def _norm_aware_update(view: RoundView, cosine: float, colluding: bool = False) -> Update:
    length = clip_bound(view)
    # The reference the server compares with: the other replies, each scaled down to the
    # round's median norm (strategies.replies.influence.direction_cosines), the attackers' at
    # `length`.
    norms = [_norm(update) for update in view.benign]
    median = float(np.median(norms + [length] * len(view.attacker_positions)))
    if colluding:  # the clip bound of the round's own median, the attackers' norms in it
        length = BOUND_MARGIN * DEFAULT_UPDATE_CLIP_FACTOR * median
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
    if colluding:  # the other colluders' replies, scaled to the median, enter the reference
        others = (len(view.attacker_positions) - 1) * median / _norm(mean) / len(view.benign)
        cosine = colluding_along(cosine, others)
    return {
        key: length * (cosine * unit[key] + math.sqrt(1.0 - cosine**2) * side[key]) for key in unit
    }


def _at_clip_bound(view: RoundView, update: Update) -> Update:
    """``update`` scaled to just under the round's clip bound (:func:`clip_bound`)."""
    scale = clip_bound(view) / max(_norm(update), 1e-30)
    return {key: scale * value for key, value in update.items()}


def to_clip_bound(view: RoundView, position: int) -> Update:
    """The attacker's own (poisoned) update boosted to just under the clip bound: model
    replacement (Bagdasaryan et al., AISTATS 2020) as far as the defaults let it go."""
    return _at_clip_bound(view, view.updates[position])


#: The blended backdoor's cosine with the benign mean: the lowest of the range the red team found
#: to keep a positive root-set trust while carrying most of the backdoor (0.4-0.9).
BLENDED_COSINE = 0.4


def blended_backdoor(view: RoundView, position: int) -> Update:
    """The attacker's own poisoned update blended into the benign mean, the best response to
    root-set trust: cosine :data:`BLENDED_COSINE` with the benign mean (the best estimate of the
    server's root update the attackers have), the rest along the part of its own update
    orthogonal to that mean (where the backdoor lives), at just under the clip bound. An update
    already closer to the mean is only boosted."""
    own, mean = view.updates[position], _mean(view.benign)
    unit = {key: value / max(_norm(mean), 1e-30) for key, value in mean.items()}
    along = _dot(own, unit)
    if along >= BLENDED_COSINE * _norm(own):
        return to_clip_bound(view, position)
    side = {key: own[key] - along * unit[key] for key in own}
    side = {key: value / max(_norm(side), 1e-30) for key, value in side.items()}
    mix = math.sqrt(1.0 - BLENDED_COSINE**2)
    return {key: clip_bound(view) * (BLENDED_COSINE * unit[key] + mix * side[key]) for key in own}


#: Neurotoxin's share of the coordinates the attacker writes to: the ones the benign replies
#: change least (the authors' ``gradmask_ratio`` of 0.95 in their README's runs).
NEUROTOXIN_KEEP = 0.95


def neurotoxin(view: RoundView, position: int) -> Update:
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
