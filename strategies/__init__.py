"""Aggregation rules: pure math functions plus thin Flower strategies on one contract base."""

from beyond_averaging.strategies.defences.profiles import defence_profile
from beyond_averaging.strategies.defences.proxy_data import ProxySetError
from beyond_averaging.strategies.defences.trigger_unlearning import TriggerUnlearning
from beyond_averaging.strategies.replies.metrics import aggregate_metrics
from beyond_averaging.strategies.replies.wire import ClientReply

from .arguments import FlowerOptions, ProjectOptions, StrategyOptions
from .base import ContractStrategy, MissingRecordError
from .elastic import ElasticAggregation, aggregate_elastic
from .fedavg import FedAdam, FedAvg, FedAvgM, aggregate_fedavg
from .fedgma import FedGMA, FedGMASoft, aggregate_fedgma, and_mask
from .fedlaw import FedLAW, aggregate_fedlaw
from .law_weights import learn_aggregation_weights
from .server_optimizer import ServerOptimizer
from .tracking import track

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
    "defence_profile",
    "learn_aggregation_weights",
    "track",
]
