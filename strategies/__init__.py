"""Aggregation rules: pure math functions plus thin Flower strategies on one contract base."""

from .arguments import FlowerOptions, ProjectOptions, StrategyOptions
from .base import ClientReply, ContractStrategy, MissingRecordError
from .elastic import ElasticAggregation, aggregate_elastic
from .fedavg import FedAdam, FedAvg, FedAvgM, aggregate_fedavg
from .fedgma import FedGMA, FedGMASoft, aggregate_fedgma, and_mask
from .fedlaw import FedLAW, aggregate_fedlaw, learn_aggregation_weights
from .metrics import aggregate_metrics
from .proxy_data import ProxySetError
from .server_optimizer import ServerOptimizer
from .tracking import track
from .trigger_unlearning import TriggerUnlearning

__all__ = [
    "ClientReply",
    "ContractStrategy",
    "ElasticAggregation",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedGMA",
    "FedGMASoft",
    "FedLAW",
    "FlowerOptions",
    "MissingRecordError",
    "ProjectOptions",
    "ProxySetError",
    "ServerOptimizer",
    "StrategyOptions",
    "TriggerUnlearning",
    "aggregate_elastic",
    "aggregate_fedavg",
    "aggregate_fedgma",
    "aggregate_fedlaw",
    "aggregate_metrics",
    "and_mask",
    "learn_aggregation_weights",
    "track",
]
