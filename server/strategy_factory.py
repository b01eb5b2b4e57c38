"""Build the strategy a run configuration names, with the server-side resources it needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from beyond_averaging.strategies import (
    ContractStrategy,
    ElasticAggregation,
    FedAvg,
    FedGMA,
    FedGMASoft,
    FedLAW,
    TriggerUnlearning,
)
from beyond_averaging.strategies.defences.root_set import root_set_use
from beyond_averaging.strategies.replies.bounds import BoundsOptions
from beyond_averaging.tasks.datasets import LabeledData

from .config import ConfigError, RunConfig
from .proxy import resolve_proxy_set


@dataclass(frozen=True)
class ServerResources:
    """What a strategy may need from the server beyond its options."""

    model: torch.nn.Module
    proxy_set: LabeledData
    device: torch.device
    #: The server's test split: FedLAW warns when proxy samples (e.g. from proxy-dir) are in it.
    test_set: LabeledData | None = None


def reply_bounds(config: RunConfig) -> BoundsOptions:
    """The reply bounds' options (:mod:`strategies.replies.bounds`) the run configuration sets."""
    return BoundsOptions(
        max_client_weight=config.max_client_weight,
        update_norm_factor=config.update_norm_factor,
        update_clip_factor=config.update_clip_factor,
        direction_outlier_factor=config.direction_outlier_factor,
        max_claim_factor=config.max_claim_factor,
    )


def trigger_unlearning(config: RunConfig) -> TriggerUnlearning | None:
    """Trigger unlearning's options (:mod:`strategies.defences.trigger_unlearning`), when the run's
    ``backdoor-defence`` asks for it."""
    if config.backdoor_defence != "trigger-unlearning":
        return None
    return TriggerUnlearning(
        l1_weight=config.unlearning_l1,
        steps=config.unlearning_steps,
        lr=config.unlearning_lr,
        epochs=config.unlearning_epochs,
        patched_share=config.unlearning_patched_share,
        additive_weight=config.unlearning_additive,
        dormant_inputs=config.unlearning_dormant_inputs,
    )


def build_strategy(config: RunConfig, resources: ServerResources) -> ContractStrategy:
    """The configured strategy, validated and ready to start."""
    # The run option min-train-replies is also the fewest nodes a round samples, as before the
    # strategies took Flower's min_*_nodes; fraction-evaluate is passed as the run's own default.
    base: dict[str, Any] = {
        "fraction_train": config.fraction_train,
        "fraction_evaluate": config.fraction_evaluate,
        "min_train_nodes": config.min_train_replies,
        "min_evaluate_nodes": config.min_train_replies,
        "min_train_replies": config.min_train_replies,
        "min_available_nodes": config.min_train_replies,
        "seed": config.seed,
        **asdict(reply_bounds(config)),
        "robust_aggregation": config.robust_aggregation,
        "trim_fraction": config.trim_fraction,
        "pre_aggregation": config.pre_aggregation,
        "bucket_size": config.bucket_size,
        "max_reply_bytes": config.max_reply_bytes,
        "server_noise_std": config.server_noise_std,
        "flame_noise_lambda": config.flame_noise_lambda,
        "trigger_unlearning": trigger_unlearning(config),
    }
    server_update: dict[str, Any] = {  # keyword arguments of several strategies
        "server_lr": config.resolved_server_lr,
        "server_optimizer": config.server_optimizer,
        "server_momentum": config.server_momentum,
        "server_beta1": config.server_beta1,
        "server_beta2": config.server_beta2,
        "server_eps": config.server_eps,
    }
    root_set = root_set_use(config.robust_aggregation, base["trigger_unlearning"] is not None)
    if root_set is not None and config.strategy != "fedlaw":
        # The root set of FLTrust, of the proxy weights and of trigger unlearning: the proxy set
        # FedLAW learns on (FedLAW builds its own from it).
        base["model"], base["device"] = resources.model, resources.device
        base["proxy_set"] = resolve_proxy_set(config, resources.proxy_set)[0]
    if config.strategy == "fedavg":
        return FedAvg(**server_update, **base)
    if config.strategy == "elastic":
        return ElasticAggregation(
            tau=config.elastic_tau,
            sensitivity_decay=config.sensitivity_decay,
            sensitivity_dtype=config.sensitivity_dtype,
            parameter_keys=[
                name for name, p in resources.model.named_parameters() if p.requires_grad
            ],
            **server_update,
            **base,
        )
    if config.strategy == "fedgma":
        # The hard AND-mask needs the clients' last-step gradients; the soft mask does not.
        gma = FedGMA if config.gma_mask == "hard" else FedGMASoft
        return gma(threshold=config.gma_threshold, server_lr=config.gma_server_lr, **base)
    if config.strategy == "fedlaw":
        proxy_set, proxy_source = resolve_proxy_set(config, resources.proxy_set)
        try:  # the proxy set and the option combination are checked here, before round 1
            return FedLAW(
                model=resources.model,
                proxy_set=proxy_set,
                device=resources.device,
                learn=config.fedlaw_learn,
                epochs=config.fedlaw_epochs,
                lr=config.fedlaw_lr,
                batch_size=config.fedlaw_batch_size,
                lr_step=config.fedlaw_lr_step,
                lr_gamma=config.fedlaw_lr_gamma,
                swa=config.fedlaw_swa,
                bn=config.fedlaw_bn,
                proxy_source=proxy_source,
                test_set=resources.test_set,
                **base,
            )
        except ValueError as error:
            raise ConfigError(f"Invalid FedLAW configuration: {error}") from None
    raise ValueError(f"strategy {config.strategy!r} is not available in this build")
