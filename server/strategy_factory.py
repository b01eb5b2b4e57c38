"""Build the strategy a run configuration names, with the server-side resources it needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from logging import INFO
from typing import Any

import torch
from flwr.common import log

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
from beyond_averaging.strategies.secure import RunStrategy, SecAggOptions, SecureAggregation
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
    """The reply bounds' options (:mod:`strategies.replies.bounds`) the run configuration sets:
    all off under secure aggregation, where no reply is seen alone (the configuration refuses one
    set on explicitly; the clients' clip and weight bound take their place)."""
    if config.secure_aggregation != "none":
        return BoundsOptions(
            max_client_weight=1.0,
            update_norm_factor=0.0,
            update_clip_factor=0.0,
            direction_outlier_factor=0.0,
            max_claim_factor=0.0,
        )
    return BoundsOptions(
        max_client_weight=config.max_client_weight,
        update_norm_factor=config.update_norm_factor,
        update_clip_factor=config.update_clip_factor,
        direction_outlier_factor=config.direction_outlier_factor,
        max_claim_factor=config.max_claim_factor,
    )


#: The per-reply bounds that read each reply, off under secure aggregation.
PER_REPLY_BOUNDS = (
    "update_norm_factor",
    "update_clip_factor",
    "direction_outlier_factor",
    "max_claim_factor",
)


def secure_bounds_note(config: RunConfig) -> str:
    """The line a secure run logs at its start: which per-reply bounds its configuration left on
    (their defaults) are off, and the clients' own clip and weight bound that take their place."""
    off = [
        f"{name.replace('_', '-')} = {getattr(config, name)!r}"
        for name in PER_REPLY_BOUNDS
        if getattr(config, name) != 0.0
    ]
    clip = (
        f"each client clips its update to L2 norm secure-clip-norm = {config.secure_clip_norm!r}"
        if config.secure_clip_norm > 0.0
        else "secure-clip-norm = 0.0 leaves each client's update unclipped (set it > 0 to bound it)"
    )
    return (
        "secure aggregation: the server sees no reply alone, so the per-reply bounds "
        f"{', '.join(off) if off else '(all set to 0 already)'} are off; in their place {clip}, "
        f"and no client counts for more than secure-max-weight = {config.secure_max_weight!r} "
        "examples"
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
        input_bound=config.unlearning_input_bound,
        memory_rounds=config.unlearning_memory,
    )


def secure_options(config: RunConfig) -> SecAggOptions:
    """Secure aggregation's options (:mod:`tasks.secure_aggregation`) the run configuration sets."""
    return SecAggOptions(
        clip_norm=config.secure_clip_norm,
        max_weight=config.secure_max_weight,
        quantization_bits=config.resolved_quantization_bits,
        modulus_bits=config.secure_modulus_bits,
        neighbours=config.secure_neighbours,
        threshold=config.secure_threshold,
    )


def build_strategy(config: RunConfig, resources: ServerResources) -> RunStrategy:
    """The configured strategy, validated and ready to start; under ``secure-aggregation`` the
    rule inside SecAgg+'s driver (:class:`strategies.secure.SecureAggregation`)."""
    rule = build_rule(config, resources)
    if config.secure_aggregation == "none":
        return rule
    log(INFO, secure_bounds_note(config))
    return SecureAggregation(rule, secure_options(config), stage_timeout=config.round_timeout)


def build_rule(config: RunConfig, resources: ServerResources) -> ContractStrategy:
    """The configured rule with its defences, validated."""
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
