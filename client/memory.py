"""What a call allocates on torch's CPU allocator, read from :mod:`torch.profiler`: every
allocation and free with the running count of live bytes and the operator that made it.

The peak is exact and the same on any machine (no sampling, no timing), so it bounds memory in
tests (tests/test_vectorized_memory.py bounds the cohort backend's local training by its
optimiser state) and tells where a round's memory goes (``benchmarks.systems --cohort-memory``;
docs/runtimes.md, "Memory")::

    allocations = torch_allocations(lambda: train_stacked(...))
    peak_above_start(allocations)  # bytes
    alive_at_peak(allocations).most_common(3)  # [(operator, bytes), ...]
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Allocation:
    """One event of torch's CPU allocator: ``size`` bytes taken (> 0) or given back (< 0).

    ``total`` is the allocator's running count of live bytes right after the event; ``operator``
    names the innermost profiled operators that ran it, outer to inner, up to three ("" outside
    any).
    """

    size: int
    total: int
    address: int
    operator: str


def torch_allocations(fn: Callable[[], object]) -> list[Allocation]:
    """Run ``fn`` under :mod:`torch.profiler` with ``profile_memory``; its CPU allocator events.

    Read from the profiler's Chrome trace (its public output): ``[memory]`` instant events carry
    the size, address and running total of live bytes; each is attributed to the innermost
    operator span of its thread that contains it. Blocks allocated before ``fn`` and freed inside
    it are not counted as freed, so the totals are an upper bound of what ``fn`` adds.

    Parameters
    ----------
    fn : callable
        The work to account for, called once with no arguments (its result is dropped).

    Returns
    -------
    list of Allocation
        Every CPU allocator event of the call, in time order.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    spans: dict[Any, list[tuple[float, float, str]]] = {}
    memory: list[dict[str, Any]] = []
    for event in events:
        if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0:
            memory.append(event)
        elif event.get("ph") == "X" and event.get("cat") == "cpu_op":
            start = float(event["ts"])
            spans.setdefault(event["tid"], []).append((start, start + event["dur"], event["name"]))
    for thread_spans in spans.values():
        thread_spans.sort(key=lambda span: (span[0], -span[1]))  # outer span first
    open_spans: dict[Any, list[tuple[float, float, str]]] = {tid: [] for tid in spans}
    next_span = dict.fromkeys(spans, 0)
    allocations = []
    for event in sorted(memory, key=lambda event: float(event["ts"])):
        at, tid = float(event["ts"]), event["tid"]
        stack, thread_spans = open_spans.get(tid, []), spans.get(tid, [])
        while next_span.get(tid, 0) < len(thread_spans) and thread_spans[next_span[tid]][0] <= at:
            span = thread_spans[next_span[tid]]
            while stack and stack[-1][1] < span[0]:  # spans nest: ended ones leave first
                stack.pop()
            stack.append(span)
            next_span[tid] += 1
        while stack and stack[-1][1] < at:
            stack.pop()
        args = event["args"]
        allocations.append(
            Allocation(
                int(args["Bytes"]),
                int(args["Total Allocated"]),
                int(args["Addr"]),
                " > ".join(span[2] for span in stack[-3:]),
            )
        )
    return allocations


def peak_above_start(allocations: Sequence[Allocation]) -> int:
    """Most live bytes above the count before the first event (0 when nothing was allocated)."""
    if not allocations:
        return 0
    start = allocations[0].total - allocations[0].size
    return max(0, max(event.total for event in allocations) - start)


def alive_at_peak(allocations: Sequence[Allocation]) -> Counter[str]:
    """Bytes of the blocks alive at the peak, by the operator that allocated them."""
    if not allocations:
        return Counter()
    peak = max(range(len(allocations)), key=lambda index: allocations[index].total)
    alive: dict[int, Allocation] = {}
    for event in allocations[: peak + 1]:
        if event.size > 0:
            alive[event.address] = event
        else:
            alive.pop(event.address, None)
    by_operator: Counter[str] = Counter()
    for event in alive.values():
        by_operator[event.operator or "(outside any operator)"] += event.size
    return by_operator
