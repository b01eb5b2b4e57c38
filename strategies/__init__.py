"""Aggregation rules: pure math functions plus thin Flower strategies on one contract base."""

from strategies.base import ClientReply, ContractStrategy, MissingRecordError
from strategies.fedavg import FedAvg, aggregate_fedavg
from strategies.server_optimizer import ServerOptimizer

__all__ = [
    "ClientReply",
    "ContractStrategy",
    "FedAvg",
    "MissingRecordError",
    "ServerOptimizer",
    "aggregate_fedavg",
]
