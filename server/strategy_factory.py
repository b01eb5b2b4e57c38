"""Build the strategy a run configuration names, with the server-side resources it needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tasks.datasets import LabeledData

from server.config import RunConfig
from strategies import ContractStrategy, FedAvg


@dataclass(frozen=True)
class ServerResources:
    """What a strategy may need from the server beyond its options."""

    model: torch.nn.Module
    proxy_set: LabeledData
    device: torch.device


def build_strategy(config: RunConfig, resources: ServerResources) -> ContractStrategy:
    """The configured strategy, validated and ready to start."""
    base = {
        "fraction_train": config.fraction_train,
        "fraction_evaluate": config.fraction_evaluate,
        "min_train_replies": config.min_train_replies,
        "min_available_nodes": config.min_train_replies,
        "seed": config.seed,
    }
    server_update = {
        "server_lr": config.server_lr,
        "server_optimizer": config.server_optimizer,
        "server_momentum": config.server_momentum,
        "server_beta1": config.server_beta1,
        "server_beta2": config.server_beta2,
        "server_eps": config.server_eps,
    }
    if config.strategy == "fedavg":
        return FedAvg(**server_update, **base)
    raise ValueError(f"strategy {config.strategy!r} is not available in this build")
