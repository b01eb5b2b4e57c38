"""What each rule needs summed under secure aggregation, and its new model from those sums.

Every rule that runs under secure aggregation is linear in weighted sums of what the clients
send, once each client's weight r_k is folded in (:mod:`tasks.secure_aggregation`), with R =
sum_k r_k summed under the mask too:

- FedAvg (FedAvgM, FedAdam): sum_k r_k (theta_k - w). The mean model w + that / R is the
  weighted mean; the rule's own :meth:`aggregate` runs on it as on one reply of weight 1 (the
  server optimizer steps along w minus it, as from K replies).
- Elastic: the same, and sum_k r_k Omega_k: Omega = that / R is the weighted mean sensitivity
  zeta is computed from, so one reply with the mean model and the mean sensitivity gives the
  rule's step exactly.
- FedGMA, hard: the mean model, sum_k r_k g_k (the mean gradient) and, per coordinate, the
  integer vote sum_k sign(g_k): the AND-mask is |votes| >= threshold x K
  (:func:`strategies.fedgma.vote_mask`). Soft: the mean update and sum_k r_k sign(w - theta_k),
  the weighted sign agreement A x R (:func:`strategies.fedgma.agreement_mask`).

The train loss is summed as sum_k r_k loss_k: the round's weighted mean loss, no client's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from beyond_averaging.strategies.aggregate import NDArrayDict, scaled_mean
from beyond_averaging.strategies.base import ContractStrategy
from beyond_averaging.strategies.elastic import ElasticAggregation
from beyond_averaging.strategies.fedavg import FedAvg
from beyond_averaging.strategies.fedgma import (
    FedGMA,
    GMAStep,
    agreement_mask,
    is_stepped,
    vote_mask,
)
from beyond_averaging.strategies.replies.wire import ClientReply
from beyond_averaging.strategies.server_optimizer import ServerOptimizer
from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD, TRAIN_LOSS_KEY
from beyond_averaging.tasks.secure_aggregation import WEIGHT_ENTRY

#: The rules that run on sums, by class (subclasses included: FedAvgM, FedAdam, FedGMASoft).
SUPPORTED_RULES: tuple[type[ContractStrategy], ...] = (FedAvg, ElasticAggregation, FedGMA)


def check_rule(strategy: ContractStrategy) -> None:
    """Raise a ValueError naming the rule when it does not run on sums."""
    if not isinstance(strategy, SUPPORTED_RULES):
        raise ValueError(
            f"secure aggregation cannot run {type(strategy).__name__}: the server sees only the "
            "sum of the clients' vectors, and that rule needs each client's own model (FedLAW "
            "learns one weight per client on the proxy set); use FedAvg, Elastic or FedGMA"
        )


def stepped_keys(
    strategy: ContractStrategy, global_arrays: Mapping[str, npt.NDArray[Any]]
) -> list[str]:
    """The tensors a record (sensitivity, gradient) covers: Elastic's parameter keys where it
    knows them, else the model's floating parameters (not normalisation buffers)."""
    known = getattr(strategy, "parameter_keys", None)
    if known:
        return [key for key in global_arrays if key in known]
    return [key for key, value in global_arrays.items() if is_stepped(key, np.asarray(value))]


def secure_layout(
    strategy: ContractStrategy,
    global_arrays: Mapping[str, npt.NDArray[Any]],
    metrics: Sequence[str] = (TRAIN_LOSS_KEY,),
) -> list[str]:
    """The entries (``kind|record|key``) each client sends for this rule, in order: its weight,
    its weighted ``metrics``, its weighted update and the records the rule sums."""
    check_rule(strategy)
    layout = [
        WEIGHT_ENTRY,
        *(f"metric||{name}" for name in metrics),
        *(f"update||{key}" for key in global_arrays),
    ]
    keys = stepped_keys(strategy, global_arrays)
    if isinstance(strategy, ElasticAggregation):
        layout += [f"weighted|{SENSITIVITY_RECORD}|{key}" for key in keys]
    elif isinstance(strategy, FedGMA) and strategy.mask_variant == "hard":
        layout += [f"weighted|{GRADIENT_RECORD}|{key}" for key in keys]
        layout += [f"signs|{GRADIENT_RECORD}|{key}" for key in keys]
    elif isinstance(strategy, FedGMA):
        layout += [f"update-signs||{key}" for key in keys]
    return layout


def total_weight(sums: Mapping[str, npt.NDArray[np.float64]]) -> float:
    """R = sum_k r_k, checked > 0 (every client's weight is > 0 before quantisation)."""
    weight = float(sums[WEIGHT_ENTRY])
    if not weight > 0.0:
        raise ValueError(f"the summed weight is {weight}: no client's weight reached the sum")
    return weight


def mean_reply(
    global_arrays: Mapping[str, npt.NDArray[Any]],
    sums: Mapping[str, npt.NDArray[np.float64]],
) -> ClientReply:
    """The weighted means as one reply of weight 1: the mean model w + sum r (theta - w) / R, and
    each weighted record's mean sum r x / R."""
    weight = total_weight(sums)
    arrays = {
        key: _like(np.asarray(value, dtype=np.float64) + sums[f"update||{key}"] / weight, value)
        for key, value in global_arrays.items()
    }
    records: dict[str, NDArrayDict] = {}
    for entry, total in sums.items():
        kind, record, key = entry.split("|")
        if kind == "weighted":
            records.setdefault(record, {})[key] = total / weight
    return ClientReply(node_id=0, arrays=arrays, num_examples=1.0, metrics={}, records=records)


def _like(mean: npt.NDArray[np.float64], template: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The mean model's tensor in the global tensor's dtype, as a client's reply carries it
    (an integer counter rounded)."""
    dtype = np.asarray(template).dtype
    if np.issubdtype(dtype, np.floating):
        return mean.astype(dtype)
    return np.rint(mean).astype(dtype)


def mean_metrics(sums: Mapping[str, npt.NDArray[np.float64]]) -> dict[str, float]:
    """The round's weighted mean of each summed metric, sum r m / R (no client's own)."""
    weight = total_weight(sums)
    return {
        entry.split("|")[2]: float(total) / weight
        for entry, total in sums.items()
        if entry.startswith("metric|")
    }


def fedgma_from_sums(
    global_arrays: Mapping[str, npt.NDArray[Any]],
    sums: Mapping[str, npt.NDArray[np.float64]],
    voters: int,
    *,
    threshold: float,
    server_lr: float,
    mask: str,
) -> GMAStep:
    """FedGMA's step (:func:`strategies.fedgma.fedgma_step`) from the round's sums.

    Hard: the mean model, then w_avg - server_lr x (mask * mean gradient), the mask from the
    summed signs of the ``voters`` clients. Soft: w - server_lr x (m * mean update) on the
    floating parameters, m from the weighted sign agreement, the buffers averaged.
    """
    weight = total_weight(sums)
    reply = mean_reply(global_arrays, sums)
    global_np = {key: np.asarray(value) for key, value in global_arrays.items()}
    if mask == "hard":
        average = scaled_mean(global_np, [reply.arrays], np.ones(1), None)
        masks = {
            key: vote_mask(sums[f"signs|{GRADIENT_RECORD}|{key}"], voters, threshold)
            for key in reply.records.get(GRADIENT_RECORD, {})
        }
        grad = {key: reply.records[GRADIENT_RECORD][key] * kept for key, kept in masks.items()}
        stepped = ServerOptimizer("sgd", server_lr).step(average, grad)
        new = {**average, **stepped}
        kept_share = sum(int(m.sum()) for m in masks.values()) / max(
            sum(m.size for m in masks.values()), 1
        )
        return GMAStep({key: new[key] for key in global_np}, kept_share)
    keys = [entry.split("|")[2] for entry in sums if entry.startswith("update-signs|")]
    buffers = [key for key in global_np if key not in set(keys)]
    average = (
        scaled_mean({k: global_np[k] for k in buffers}, [reply.arrays], np.ones(1), None)
        if buffers
        else {}
    )
    soft = {key: agreement_mask(sums[f"update-signs||{key}"] / weight, threshold) for key in keys}
    update = {key: -(sums[f"update||{key}"] / weight) * soft[key] for key in keys}
    stepped = {**average, **ServerOptimizer("sgd", server_lr).step(global_np, update)}
    mask_mean = sum(float(m.sum()) for m in soft.values()) / max(
        sum(m.size for m in soft.values()), 1
    )
    return GMAStep({key: stepped[key] for key in global_np}, mask_mean)


def aggregate_from_sums(
    strategy: ContractStrategy,
    server_round: int,
    global_arrays: NDArrayDict,
    sums: Mapping[str, npt.NDArray[np.float64]],
    voters: int,
) -> NDArrayDict:
    """The rule's new model from the round's sums, through the defences that read only the
    aggregate (server noise, trigger unlearning: ``defended_model``)."""
    check_rule(strategy)
    reply = mean_reply(global_arrays, sums)
    if isinstance(strategy, FedGMA):
        strategy.defended_replies(server_round, global_arrays, [reply])  # the round's figures
        result = fedgma_from_sums(
            global_arrays,
            sums,
            voters,
            threshold=strategy.threshold,
            server_lr=strategy.server_lr,
            mask=strategy.mask_variant,
        )
        strategy.last_mask_mean = result.mask_mean
        return strategy.defended_model(server_round, result.arrays)
    return strategy.aggregate(server_round, global_arrays, [reply])
