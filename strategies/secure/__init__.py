"""Secure aggregation (SecAgg+) for the rules whose server needs only sums: FedAvg, Elastic, FedGMA.

:mod:`.driver` runs the four stages from a Message API strategy; :mod:`.sums` says what each rule
sums and makes its new model from the sums; the protocol math both sides share is
:mod:`tasks.secure_aggregation`, and the client's side is :mod:`client.secure`.
"""

from beyond_averaging.tasks.secure_aggregation import SecAggOptions

from .driver import (
    BOUNDS_OFF,
    RunStrategy,
    SecureAggregation,
    SecureAggregationError,
    individual_reply_options,
)
from .sums import aggregate_from_sums, fedgma_from_sums, secure_layout

__all__ = [
    "BOUNDS_OFF",
    "RunStrategy",
    "SecAggOptions",
    "SecureAggregation",
    "SecureAggregationError",
    "aggregate_from_sums",
    "fedgma_from_sums",
    "individual_reply_options",
    "secure_layout",
]
