"""Client metrics aggregated as Flower's strategies aggregate them, and plain-Python metric values.

Flower's ``FedAvg`` averages every entry of the replies' MetricRecords weighted by the entry
``weighted_by_key`` (``num-examples``) and drops that entry from the result
(``flwr.serverapp.strategy.strategy_utils.aggregate_metricrecords``). It first requires every reply
to carry the same keys and stops the run when one does not. :func:`aggregate_metrics` gives the
same numbers when the keys agree and, instead of stopping, averages a key that only some replies
carry over those replies (their weights renormalised), so one client's extra metric never
breaks a round.

A strategy's own figures (replies received, dropped, aggregation time, a rule's parameters) are
not client metrics: :class:`~strategies.base.ContractStrategy` keeps them apart (its
``aggregation_metrics``), so ``Result.train_metrics_clientapp`` holds only what the ClientApps sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import MetricRecord, RecordDict

from beyond_averaging.tasks.protocol import METRICS_RECORD

#: Flower's metric aggregation signature: ``fn(reply_contents, weighted_by_key) -> MetricRecord``.
MetricsAggregationFn = Callable[[list[RecordDict], str], MetricRecord]

MetricValue = int | float | list[int] | list[float]


def reply_metric_record(content: RecordDict) -> MetricRecord | None:
    """The MetricRecord a reply reports: the one named ``metrics``, else its only MetricRecord.

    Flower's strategies read a reply's single MetricRecord whatever its name; this project's
    ClientApp names it ``metrics``. None when the reply has no MetricRecord, or several and none
    named ``metrics``.
    """
    records = content.metric_records
    if METRICS_RECORD in records:
        return records[METRICS_RECORD]
    if len(records) == 1:
        return next(iter(records.values()))
    return None


def reply_weight(record: MetricRecord | None, weighted_by_key: str) -> float | None:
    """The reply's weight ``record[weighted_by_key]`` when it is a finite number > 0, else None."""
    if record is None:
        return None
    value = record.get(weighted_by_key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    weight = float(value)
    return weight if math.isfinite(weight) and weight > 0.0 else None


def aggregate_metrics(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Weighted mean of every metric the replies report, as Flower's ``aggregate_metricrecords``.

    Each reply's metrics are its :func:`reply_metric_record`, weighted by their entry
    ``weighted_by_key``; that entry is left out of the result. A key some replies lack is averaged
    over the replies that carry it. List metrics are averaged element-wise when every list of that
    key has the same length; a key whose lists differ in length is left out. Replies without a
    positive weight are skipped. Values are plain Python floats.

    Parameters
    ----------
    records : list of RecordDict
        The contents of the replies to aggregate.
    weighted_by_key : str
        The metric holding each reply's weight (Flower's ``weighted_by_key``).

    Returns
    -------
    MetricRecord
        One entry per metric key (empty when no reply has a positive weight).
    """
    weighted: list[tuple[float, MetricRecord]] = []
    for content in records:
        record = reply_metric_record(content)
        weight = reply_weight(record, weighted_by_key)
        if record is not None and weight is not None:
            weighted.append((weight, record))
    keys = sorted({key for _, record in weighted for key in record if key != weighted_by_key})
    result: dict[str, MetricValue] = {}
    for key in keys:
        present = [(weight, record[key]) for weight, record in weighted if key in record]
        total = math.fsum(weight for weight, _ in present)
        values = [value for _, value in present]
        if all(isinstance(value, list) for value in values):
            lengths = {len(value) for value in values}  # type: ignore[arg-type]
            if len(lengths) != 1:
                continue
            result[key] = [
                math.fsum(weight * float(value[index]) for weight, value in present) / total  # type: ignore[index]
                for index in range(lengths.pop())
            ]
        elif not any(isinstance(value, list) for value in values):
            result[key] = (
                math.fsum(weight * float(value) for weight, value in present) / total  # type: ignore[arg-type]
            )
    return MetricRecord(result)


def plain_value(value: Any) -> Any:
    """A numpy scalar or array as the Python number or list it holds; other values unchanged."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [plain_value(item) for item in value]
    return value


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with every numpy value turned into plain Python (``0.5``, not ``np.float64``)."""
    return {key: plain_value(value) for key, value in metrics.items()}
