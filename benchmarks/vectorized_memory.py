"""Peak memory of one vectorized round, in copies of the cohort's parameters.

Target (issue 11): a round of the Table 3 setting (Fashion-MNIST, the 784-200-200-10 MLP, 20
clients, E = 3, batch 128, momentum 0.9) holds at most 2 copies of the cohort's parameters beyond
the data.

How it is measured: the resident set size (``/proc/self/statm``), sampled every millisecond by a
thread while :func:`client.vectorized.train_cohort` runs round 2. Round 1 runs first, so the
cohort's data (concatenated on the device and kept across rounds) and torch's one-off allocations
are in the baseline; the process runs with ``MALLOC_MMAP_THRESHOLD_`` set so that every large
tensor is its own mapping, returned to the system when freed, and ``malloc_trim`` is called before
the baseline is read: the resident size then follows the live tensors. The reported figure is
(peak - baseline) / (clients x parameters x 4 bytes), which includes everything the round
allocates: the received models, the stacked parameters, momentum, gradients, batches, activations
and the reply records handed back.

Usage::

    .venv/bin/python -m benchmarks.vectorized_memory            # Table 3 setting, FedAvg
    .venv/bin/python -m benchmarks.vectorized_memory --strategy elastic
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

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


def resident_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * _PAGE


class PeakSampler(threading.Thread):
    """Samples the resident size every millisecond until stopped; keeps the largest."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = resident_bytes()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, resident_bytes())


def instructions(server_round: int, requests: str) -> tuple[list[Message], list[Context], int]:
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
                run_config={},
            )
        )
    return messages, contexts, sum(p.numel() for p in model.parameters())


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the peak of round 2 in cohort-parameter copies."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=list(REQUESTS), default="fedavg")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if _MMAP_ENV not in os.environ:  # re-run with every large allocation its own mapping
        os.environ[_MMAP_ENV] = "65536"
        os.execv(
            sys.executable, [sys.executable, "-m", "benchmarks.vectorized_memory", *sys.argv[1:]]
        )
    torch.set_num_threads(args.threads)
    messages, contexts, parameters = instructions(1, REQUESTS[args.strategy])
    train_cohort(messages, contexts)  # round 1: data, caches, torch's one-off allocations
    messages, _, _ = instructions(2, REQUESTS[args.strategy])
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = resident_bytes()
    sampler = PeakSampler()
    phases: dict[str, int] = {}
    train_stacked = vectorized.train_stacked

    def timed_train_stacked(*args: Any, **kwargs: Any) -> Any:
        phases["start of local training"] = sampler.peak
        result = train_stacked(*args, **kwargs)
        phases["end of local training"] = max(sampler.peak, resident_bytes())
        return result

    vectorized.train_stacked = timed_train_stacked
    sampler.start()
    replies = train_cohort(messages, contexts)
    phases["end of the round (replies built)"] = sampler.stop()
    cohort_bytes = len(messages) * parameters * 4
    print(
        f"strategy {args.strategy}: {len(messages)} clients x {parameters} parameters = "
        f"{cohort_bytes / 2**20:.1f} MiB per cohort copy (float32); replies held: {len(replies)}"
    )
    for phase, peak in phases.items():
        print(
            f"  peak up to the {phase}: {(peak - baseline) / 2**20:.1f} MiB above the "
            f"baseline = {(peak - baseline) / cohort_bytes:.2f} copies"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
