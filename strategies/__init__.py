"""Aggregation rules: pure math functions plus thin Flower strategies on one contract base."""

from .base import ClientReply, ContractStrategy, MissingRecordError
from .elastic import ElasticAggregation, aggregate_elastic
from .fedavg import FedAvg, aggregate_fedavg
from .fedgma import FedGMA, FedGMASoft, aggregate_fedgma, and_mask
from .fedlaw import (
    FedLAW,
    ProxySetError,
    aggregate_fedlaw,
    learn_aggregation_weights,
)
from .server_optimizer import ServerOptimizer

__all__ = [
    "ClientReply",
    "ContractStrategy",
    "ElasticAggregation",
    "FedAvg",
    "FedGMA",
    "FedGMASoft",
    "FedLAW",
    "MissingRecordError",
    "ProxySetError",
    "ServerOptimizer",
    "aggregate_elastic",
    "aggregate_fedavg",
    "aggregate_fedgma",
    "aggregate_fedlaw",
    "and_mask",
    "learn_aggregation_weights",
]
