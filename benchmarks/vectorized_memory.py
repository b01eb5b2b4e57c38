"""Peak memory of one vectorized round, in copies of the cohort's parameters.

Target (issue 11): a round of the Table 3 setting (Fashion-MNIST, the 784-200-200-10 MLP, 20
clients, E = 3, batch 128, momentum 0.9) holds at most 2 copies of the cohort's parameters beyond
the data.

Two measures, each of one round after a first round (so the cohort's data, concatenated on the
device and kept across rounds, and torch's one-off allocations are in the baseline):

- **resident size** (round 2): ``/proc/self/statm`` sampled every millisecond by a thread while
  :func:`client.vectorized.train_cohort` runs. The process runs with ``MALLOC_MMAP_THRESHOLD_``
  set so that every large block is its own mapping, returned to the system when freed, and
  ``malloc_trim`` is called before the baseline is read: the resident size then follows the live
  blocks. It sees everything the round allocates, torch's tensors and the replies' NumPy bytes.
  Also by phase: before each pass's local training (received models stacked, step plans,
  Elastic's sensitivity pass), that local training, and after the last one (replies built).
- **torch's allocator** (round 3, under :mod:`torch.profiler` with ``profile_memory``): every CPU
  tensor allocation and free with the allocator's running total, so the peak is exact, not
  sampled; and the tensors alive at that peak, named by the operator that allocated them. It does
  not see the replies (NumPy/Python bytes).

Both are reported as (peak - baseline) / (clients x parameters x 4 bytes).

Usage::

    .venv/bin/python -m benchmarks.vectorized_memory            # Table 3 setting, FedAvg
    .venv/bin/python -m benchmarks.vectorized_memory --strategy elastic
    .venv/bin/python -m benchmarks.vectorized_memory --clients-per-pass 5   # 4 passes of 5

``--clients-per-pass`` (the run option ``vectorized-clients-per-pass``) trains the cohort in
passes of that many clients (longest first): each client's arithmetic is the same, memory holds
one pass's training state, and the round takes more steps on fewer clients each. The round's
seconds (wall and process CPU, round 2) are printed to show that trade; they are not a speed
benchmark (``benchmarks/speed.py`` is).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from benchmarks.fedlaw_table3 import TABLE3_SETTING
from beyond_averaging.client import vectorized
from beyond_averaging.client.vectorized import train_cohort
from beyond_averaging.server.app import client_task
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.tasks.models import build_model

SETTING: dict[str, Any] = {**TABLE3_SETTING, "dirichlet-alpha": 0.1, "seed": 8, "device": "cpu"}
#: Extra records each strategy asks the clients for.
REQUESTS = {"fedavg": "", "elastic": "sensitivity", "fedgma": "gradient"}
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
_PAGE = os.sysconf("SC_PAGE_SIZE")
_Result = TypeVar("_Result")


def resident_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * _PAGE


class PeakSampler(threading.Thread):
    """Samples the resident size every millisecond until stopped; keeps the largest.

    ``peak`` is the largest over the whole run; :meth:`mark` closes a phase and returns the
    largest since the previous mark.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = self._phase_peak = resident_bytes()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self._sample()
            time.sleep(0.001)

    def _sample(self) -> int:
        now = resident_bytes()
        self.peak, self._phase_peak = max(self.peak, now), max(self._phase_peak, now)
        return now

    def mark(self) -> int:
        """The largest resident size since the previous mark (or the start); starts a phase."""
        now = self._sample()
        phase_peak, self._phase_peak = self._phase_peak, now
        return phase_peak

    def stop(self) -> int:
        self._done.set()
        self.join()
        self._sample()
        return self.peak


@dataclass(frozen=True)
class Allocation:
    """One event of torch's CPU allocator: ``size`` bytes taken (> 0) or given back (< 0).

    ``total`` is the allocator's running count of live bytes right after the event; ``operator``
    names the innermost profiled operators that ran it, outer to inner, up to three ("" outside
    any).
    """

    time: float
    size: int
    total: int
    address: int
    operator: str


def torch_allocations(fn: Callable[[], _Result]) -> tuple[_Result, list[Allocation]]:
    """Run ``fn`` under :mod:`torch.profiler` with ``profile_memory``; its CPU allocator events.

    Read from the profiler's Chrome trace (its public output): ``[memory]`` instant events carry
    the size, address and running total of live bytes; each is attributed to the innermost
    operator span of its thread that contains it. Blocks allocated before ``fn`` and freed inside
    it are not counted as freed, so the totals are an upper bound of what ``fn`` adds.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
        result = fn()
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
                at,
                int(args["Bytes"]),
                int(args["Total Allocated"]),
                int(args["Addr"]),
                " > ".join(span[2] for span in stack[-3:]),
            )
        )
    return result, allocations


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


def instructions(
    server_round: int, requests: str, clients_per_pass: int = 0
) -> tuple[list[Message], list[Context], int]:
    """The round's train messages and node contexts; and the model's parameter count."""
    config = parse_run_config(SETTING)
    model = build_model(config.model, (1, 28, 28), 10, seed=config.seed)
    arrays = ArrayRecord({k: v.detach() for k, v in model.state_dict().items()})
    task = ConfigRecord(
        {
            **client_task(config).to_config(),
            "server-round": server_round,
            "request-records": requests,
        }
    )
    messages, contexts = [], []
    for node in range(1, config.num_clients + 1):
        metadata = Metadata(
            run_id=1,
            message_id=f"{server_round}-{node}",
            src_node_id=0,
            dst_node_id=node,
            reply_to_message_id="",
            group_id=str(server_round),
            created_at=time.time(),
            ttl=3600.0,
            message_type="train",
        )
        content = RecordDict({"arrays": arrays, "config": task})
        messages.append(Message(metadata=metadata, content=content))  # type: ignore[call-overload]
        contexts.append(
            Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": node - 1, "num-partitions": config.num_clients},
                state=RecordDict(),
                run_config={"vectorized-clients-per-pass": clients_per_pass},
            )
        )
    return messages, contexts, sum(p.numel() for p in model.parameters())


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the peak of round 2 in cohort-parameter copies."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=list(REQUESTS), default="fedavg")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clients-per-pass", type=int, default=0, help="run option vectorized-clients-per-pass"
    )
    args = parser.parse_args(argv)
    if _MMAP_ENV not in os.environ:  # re-run with every large allocation its own mapping
        os.environ[_MMAP_ENV] = "65536"
        os.execv(
            sys.executable, [sys.executable, "-m", "benchmarks.vectorized_memory", *sys.argv[1:]]
        )
    torch.set_num_threads(args.threads)
    messages, contexts, parameters = instructions(1, REQUESTS[args.strategy], args.clients_per_pass)

    def train_round(messages: list[Message]) -> list[Message]:
        return train_cohort(messages, contexts)

    train_round(messages)  # round 1: data, caches, torch's one-off allocations
    messages, _, _ = instructions(2, REQUESTS[args.strategy])
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = resident_bytes()
    sampler = PeakSampler()
    phases: dict[str, int] = {}
    train_stacked = vectorized.train_stacked

    def timed_train_stacked(*args: Any, **kwargs: Any) -> Any:
        number = sum(phase.startswith("local training") for phase in phases) + 1
        phases[f"before local training (pass {number})"] = sampler.mark()
        result = train_stacked(*args, **kwargs)
        phases[f"local training (pass {number})"] = sampler.mark()
        return result

    vectorized.train_stacked = timed_train_stacked
    sampler.start()
    wall, cpu = time.perf_counter(), time.process_time()
    replies = train_round(messages)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    phases["after the last local training (replies built and held)"] = sampler.mark()
    round_peak = sampler.stop()
    cohort_bytes = len(messages) * parameters * 4
    print(
        f"strategy {args.strategy}: {len(messages)} clients x {parameters} parameters = "
        f"{cohort_bytes / 2**20:.1f} MiB per cohort copy (float32); replies held: {len(replies)}"
    )
    width = args.clients_per_pass or len(messages)
    print(
        f"passes of {width} clients; round 2 took {wall:.1f} s wall, {cpu:.1f} s process CPU "
        f"({args.threads} torch thread(s))"
    )
    print(
        f"resident size, round 2: peak {(round_peak - baseline) / 2**20:.1f} MiB above the "
        f"baseline = {(round_peak - baseline) / cohort_bytes:.2f} copies; by phase:"
    )
    for phase, peak in phases.items():
        print(
            f"  {phase}: {(peak - baseline) / 2**20:.1f} MiB above the "
            f"baseline = {(peak - baseline) / cohort_bytes:.2f} copies"
        )
    vectorized.train_stacked = train_stacked
    del replies
    messages, _, _ = instructions(3, REQUESTS[args.strategy])
    _, allocations = torch_allocations(lambda: train_round(messages))
    peak = peak_above_start(allocations)
    print(
        f"torch's allocator, round 3: peak {peak / 2**20:.1f} MiB above the start = "
        f"{peak / cohort_bytes:.2f} copies; alive at the peak, by allocating operator:"
    )
    for operator, size in alive_at_peak(allocations).most_common():
        if size >= cohort_bytes // 1000:
            print(f"  {size / cohort_bytes:5.2f} copies  {operator}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
