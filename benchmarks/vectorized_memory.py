"""Peak memory of one vectorized round at FedLAW's Table 3 setting, in copies of the cohort's
parameters: round 2's resident peak (also by phase) and round 3's allocator peak above a baseline
taken after round 1. docs/runtimes.md ("Memory") defines the figures and gives the command.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import Message

from benchmarks.harness import Stopwatch, status_bytes
from benchmarks.speed import SETTINGS
from beyond_averaging.client import vectorized
from beyond_averaging.server.interactive import federation
from beyond_averaging.server.resources import MIB, PeakSampler

#: FedLAW's Table 3 setting, one round at a time, trained by the cohort backend.
SETTING = {**SETTINGS["table3"], "device": "cpu", "client-backend": "vectorized"}
STRATEGIES = ("fedavg", "elastic", "fedgma")  # no extra record, a sensitivity, a gradient
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


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


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the peaks of rounds 2 and 3 in cohort-parameter copies."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", choices=STRATEGIES, default="fedavg")
    parser.add_argument("--threads", type=int, default=1)
    per_pass = "the run option vectorized-clients-per-pass"
    parser.add_argument("--clients-per-pass", type=int, default=0, help=per_pass)
    args = parser.parse_args(argv)
    if _MMAP_ENV not in os.environ:  # re-run with every large allocation its own mapping
        os.environ[_MMAP_ENV] = "65536"
        os.execv(
            sys.executable, [sys.executable, "-m", "benchmarks.vectorized_memory", *sys.argv[1:]]
        )
    torch.set_num_threads(args.threads)
    fed = federation(
        {**SETTING, "strategy": args.strategy, "vectorized-clients-per-pass": args.clients_per_pass}
    )
    parameters = sum(p.numel() for p in fed.model.parameters())

    def instructions(server_round: int) -> list[Message]:
        # In node order: the strategy samples the cohort in a new order every round, and the
        # backend's cohort-data cache is keyed on that order (so a real round re-concatenates the
        # data, 12 cohort copies here); the target is the training state beyond the data.
        return sorted(fed.instructions(server_round), key=lambda m: m.metadata.dst_node_id)

    fed.grid.send_and_receive(instructions(1))  # data, caches, torch's one-off allocations
    messages = instructions(2)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = status_bytes("VmRSS")
    phases: dict[str, float] = {}
    train_stacked = vectorized.train_stacked
    with PeakSampler(lambda: {"rss": status_bytes("VmRSS")}, 0.001) as sampler:

        def marked_train_stacked(*args: Any, **kwargs: Any) -> Any:
            number = sum(phase.startswith("local training") for phase in phases) + 1
            phases[f"before local training (pass {number})"] = sampler.mark()["rss"]
            result = train_stacked(*args, **kwargs)
            phases[f"local training (pass {number})"] = sampler.mark()["rss"]
            return result

        vectorized.train_stacked = marked_train_stacked
        with Stopwatch() as clock:
            replies = list(fed.grid.send_and_receive(messages))
        phases["after the last local training (replies built and held)"] = sampler.mark()["rss"]
    vectorized.train_stacked = train_stacked
    copy = len(messages) * parameters * 4
    print(
        f"strategy {args.strategy}: {len(messages)} clients x {parameters} parameters = "
        f"{copy / MIB:.1f} MiB per cohort copy (float32); replies held: {len(replies)}\n"
        f"passes of {args.clients_per_pass or len(messages)} clients; round 2 took "
        f"{clock.wall:.1f} s wall, {clock.cpu:.1f} s process CPU ({args.threads} torch thread(s))"
    )
    for phase, peak in {"round 2": sampler.peaks["rss"], **phases}.items():
        above = peak - baseline
        print(
            f"  {phase}: peak {above / MIB:.1f} MiB above the baseline = {above / copy:.2f} copies"
        )
    del replies
    messages = instructions(3)
    allocations = torch_allocations(lambda: fed.grid.send_and_receive(messages))
    peak = peak_above_start(allocations)
    print(
        f"torch's allocator, round 3: peak {peak / MIB:.1f} MiB above the start = "
        f"{peak / copy:.2f} copies; alive at the peak, by allocating operator:"
    )
    for operator, size in alive_at_peak(allocations).most_common():
        if size >= copy // 1000:
            print(f"  {size / copy:5.2f} copies  {operator}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
