"""Systems figures of every aggregation rule, measured side by side in one run.

1. **Server aggregation** of K = 20 clients of an ad-hoc MLP with >= 10 million parameters
   (3072-2048-2048-10, float32, 10.5 M parameters): seconds of each rule's ``aggregate_train`` on
   the same replies (Messages holding serialized ArrayRecords, as the SuperLink delivers them),
   next to Flower's built-in ``flwr.serverapp.strategy.FedAvg.aggregate_train`` on identical
   ``arrays`` (the ratio; target <= 1.5). The time of the rule's math alone (our strategies'
   ``aggregation-seconds`` metric, i.e. ``aggregate()`` without unpacking and validation) is shown
   too, and so is the client-diagnostics observer on the same replies.
2. **Peak server memory** of each rule while aggregating those replies, measured in a fresh
   subprocess per rule (so that one rule's peak never hides another's): ``tracemalloc``'s peak of
   Python/NumPy allocations during ``aggregate_train`` (NumPy reports its buffers to tracemalloc;
   torch does not, which matters for FedLAW) and the growth of the process's peak resident set
   during ``aggregate_train`` (Linux ``VmHWM`` after the kernel's peak mark was reset to the
   current RSS through ``/proc/self/clear_refs``, minus the RSS before; it counts torch too). Both
   are given in model sizes (one float32 copy of the model, 40 MiB). Per client: the larger of the
   two, minus what Flower's FedAvg itself needs (its accumulator and serialized result), divided by
   K; target: at most one extra model-sized buffer per client.
3. **Bytes uploaded per client per round**: the sum of ``len(Array.data)`` over every ArrayRecord
   of a reply (the serialized .npy payloads; protobuf framing adds a few bytes per tensor), for the
   big MLP and for a real client reply of the task model.
4. **Client seconds per round** of the real ClientApp (this project's ``client.app.train``, in this
   process) on a task partition, for every strategy's train instruction: Elastic's sensitivity pass
   shows as the difference to FedAvg; the pass alone (``compute_sensitivity``) is timed as well.

Usage (writes ``benchmarks/results/systems/`` and, with ``--publish``, ``docs/results/``)::

    .venv/bin/python -m benchmarks.systems --publish
    .venv/bin/python -m benchmarks.systems --clients 20 --repeats 5 --fedlaw-epochs 100
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from beyond_averaging.client.app import app as client_app
from beyond_averaging.client.sensitivity import compute_sensitivity
from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.inprocess import FIRST_NODE_ID, InProcessGrid
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import (
    ContractStrategy,
    ElasticAggregation,
    FedAvg,
    FedGMA,
    FedGMASoft,
    FedLAW,
)
from beyond_averaging.strategies.diagnostics import ClientDiagnostics
from beyond_averaging.tasks.batching import shuffled_batches
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.federation import load_client_partition, load_server_splits
from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results" / "systems"
DOCS_DIR = REPO / "docs" / "results"

#: The ad-hoc big model: 3072 * 2048 + 2048 * 2048 + 2048 * 10 weights + biases = 10,510,346.
BIG_LAYERS = (3072, 2048, 2048, 10)
BIG_CLASSES = BIG_LAYERS[-1]
#: Spread of the synthetic client updates around the global model (the figures do not depend on it).
UPDATE_SCALE = 1e-2
TARGET_TIME_RATIO = 1.5
TARGET_BUFFERS_PER_CLIENT = 1.0
FLOWER = "flower-fedavg"
DIAGNOSTICS = "diagnostics"
MEBIBYTE = float(1 << 20)
MMAP_THRESHOLD_BYTES = 128 * 1024

#: Rules of the server figures: name -> (extra records the replies carry, sensitivity dtype).
RULE_RECORDS: dict[str, tuple[tuple[str, ...], str]] = {
    FLOWER: ((), "float32"),
    "fedavg": ((), "float32"),
    "fedadam": ((), "float32"),
    "elastic": ((SENSITIVITY_RECORD,), "float32"),
    "elastic-f16": ((SENSITIVITY_RECORD,), "float16"),
    "fedgma": ((GRADIENT_RECORD,), "float32"),
    "fedgma-soft": ((), "float32"),
    "fedlaw": ((), "float32"),
    DIAGNOSTICS: ((), "float32"),
}


# ----------------------------------------------------------------------------- replies
def big_model(seed: int = 0) -> nn.Module:
    """The >= 10 M parameter MLP of the server figures."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten()]
    for index, (inputs, outputs) in enumerate(itertools.pairwise(BIG_LAYERS)):
        layers.append(nn.Linear(inputs, outputs))
        if index < len(BIG_LAYERS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def reply_metadata(node_id: int) -> Metadata:
    """Metadata of a reply as the SuperLink delivers it (a Message built outside a run needs it)."""
    return Metadata(
        run_id=1,
        message_id=f"reply-{node_id}",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id=f"instruction-{node_id}",
        group_id="1",
        created_at=time.time(),
        ttl=3600.0,
        message_type="train",
    )


def synthetic_replies(
    global_arrays: Mapping[str, np.ndarray[Any, Any]],
    clients: int,
    records: Sequence[str],
    sensitivity_dtype: str,
    seed: int,
) -> list[Message]:
    """K train replies: theta_k = w + noise, plus the requested records, serialized at once.

    Each client's arrays are drawn, serialized into Flower Arrays and dropped one tensor at a
    time, so building them never holds more than one tensor of scratch memory.
    """
    rng = np.random.default_rng(seed)
    replies = []
    for node in range(1, clients + 1):
        content = RecordDict()
        model: dict[str, Array] = {}
        extra: dict[str, dict[str, Array]] = {name: {} for name in records}
        for key, value in global_arrays.items():
            noise = rng.standard_normal(value.shape, dtype=np.float32) * np.float32(UPDATE_SCALE)
            model[key] = Array(value + noise)
            if SENSITIVITY_RECORD in extra:
                extra[SENSITIVITY_RECORD][key] = Array(np.abs(noise).astype(sensitivity_dtype))
            if GRADIENT_RECORD in extra:
                extra[GRADIENT_RECORD][key] = Array(noise)
        content["arrays"] = ArrayRecord(model)
        content["metrics"] = MetricRecord({"num-examples": int(rng.integers(50, 500))})
        for name, arrays in extra.items():
            content[name] = ArrayRecord(arrays)
        replies.append(
            Message(content=content, metadata=reply_metadata(node))  # type: ignore[call-overload]
        )
    return replies


def upload_bytes(message: Message) -> int:
    """Serialized payload of a reply: sum of ``len(Array.data)`` over all its ArrayRecords."""
    return sum(
        len(array.data)
        for record in message.content.array_records.values()
        for array in record.values()
    )


def random_proxy_set(samples_per_class: int, seed: int) -> LabeledData:
    """A class-balanced random proxy set for FedLAW on the big MLP (content does not matter)."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(BIG_CLASSES, dtype=np.int64), samples_per_class)
    features = rng.standard_normal((labels.size, BIG_LAYERS[0]), dtype=np.float32)
    return LabeledData(features, labels, BIG_CLASSES)


# ----------------------------------------------------------------------------- server rules
def make_rule(
    name: str, model: nn.Module, options: argparse.Namespace
) -> Callable[[int, list[Message]], Any]:
    """``aggregate(server_round, replies)`` of a rule, its global model already set."""
    defaults = parse_run_config({})  # RunConfig: the single source of the strategies' defaults
    global_arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    base: dict[str, Any] = {"min_train_replies": 2, "seed": 0}
    strategy: ContractStrategy
    if name == FLOWER:
        flower = FlowerFedAvg()
        return flower.aggregate_train
    if name == "fedavg":
        strategy = FedAvg(**base)
    elif name == "fedadam":
        strategy = FedAvg(
            server_optimizer="adam",
            server_lr=defaults.server_lr,
            server_beta1=defaults.server_beta1,
            server_beta2=defaults.server_beta2,
            server_eps=defaults.server_eps,
            **base,
        )
    elif name in ("elastic", "elastic-f16"):
        strategy = ElasticAggregation(
            tau=defaults.elastic_tau,
            parameter_keys=[n for n, p in model.named_parameters() if p.requires_grad],
            sensitivity_dtype=RULE_RECORDS[name][1],  # type: ignore[arg-type]
            **base,
        )
    elif name == "fedgma":
        strategy = FedGMA(
            threshold=defaults.gma_threshold, server_lr=defaults.gma_server_lr, **base
        )
    elif name == "fedgma-soft":
        strategy = FedGMASoft(
            threshold=defaults.gma_threshold, server_lr=defaults.gma_server_lr, **base
        )
    elif name == "fedlaw":
        strategy = FedLAW(
            model=model,
            proxy_set=random_proxy_set(defaults.proxy_per_class, seed=0),
            device=torch.device("cpu"),
            epochs=options.fedlaw_epochs,
            lr=defaults.fedlaw_lr,
            batch_size=defaults.fedlaw_batch_size,
            lr_step=defaults.fedlaw_lr_step,
            lr_gamma=defaults.fedlaw_lr_gamma,
            **base,
        )
    elif name == DIAGNOSTICS:
        return diagnostics_only(model, global_arrays, defaults.diagnostics_mi_coordinates)
    else:
        raise ValueError(f"unknown rule {name!r}: use one of {sorted(RULE_RECORDS)}")
    strategy.global_arrays = global_arrays

    def aggregate(server_round: int, replies: list[Message]) -> Any:
        result = strategy.aggregate_train(server_round, replies)
        aggregate.math_seconds = strategy.last_aggregation_seconds  # type: ignore[attr-defined]
        return result

    return aggregate


def diagnostics_only(
    model: nn.Module, global_arrays: dict[str, np.ndarray[Any, Any]], coordinates: int
) -> Callable[[int, list[Message]], Any]:
    """The diagnostics observer alone on already validated replies (what it adds per round)."""
    observer = ClientDiagnostics(
        [n for n, p in model.named_parameters() if p.requires_grad], mi_coordinates=coordinates
    )
    unpacker = FedAvg(min_train_replies=2)
    unpacker.global_arrays = global_arrays

    def run(server_round: int, replies: list[Message]) -> Any:
        valid = [unpacker.validate_reply(message) for message in replies]
        weights = np.array([r.num_examples for r in valid], dtype=np.float64)
        started = time.perf_counter()
        metrics = observer(server_round, global_arrays, valid, weights / weights.sum())
        run.math_seconds = time.perf_counter() - started  # type: ignore[attr-defined]
        return metrics

    return run


def replies_for(rule: str, model: nn.Module, clients: int) -> list[Message]:
    """The replies a rule aggregates (same seed: identical ``arrays`` for every rule)."""
    records, dtype = RULE_RECORDS[rule]
    global_arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return synthetic_replies(global_arrays, clients, records, dtype, seed=1)


@dataclass
class ServerFigure:
    """One rule's server figures."""

    rule: str
    seconds: float
    math_seconds: float | None
    upload_bytes: int
    peak_traced_bytes: int | None = None
    peak_rss_growth_bytes: int | None = None


def time_rules(options: argparse.Namespace) -> list[ServerFigure]:
    """Median seconds of each rule's aggregation on identical replies (one process, in turn)."""
    model = big_model()
    figures = []
    for rule in options.rules:
        replies = replies_for(rule, model, options.clients)
        aggregate = make_rule(rule, model, options)
        repeats = 1 if rule == "fedlaw" else options.repeats
        seconds, math_seconds = [], []
        for repeat in range(repeats):
            started = time.perf_counter()
            aggregate(repeat + 1, replies)
            seconds.append(time.perf_counter() - started)
            math_seconds.append(getattr(aggregate, "math_seconds", float("nan")))
        figures.append(
            ServerFigure(
                rule,
                statistics.median(seconds),
                None if rule == FLOWER else statistics.median(math_seconds),
                upload_bytes(replies[0]),
            )
        )
        print(f"[systems] {rule}: {figures[-1].seconds:.3f} s (median of {repeats})", flush=True)
        del replies, aggregate
    return figures


def process_memory_bytes(field_name: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``: now, ``VmHWM``: peak) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) * 1024  # the kernel writes kB
    raise RuntimeError(f"/proc/self/status has no {field_name} line (not Linux?)")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0); False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_probe(rule: str, options: argparse.Namespace) -> dict[str, int]:
    """In this (fresh) process: build the replies, then aggregate once under tracemalloc."""
    model = big_model()
    replies = replies_for(rule, model, options.clients)
    aggregate = make_rule(rule, model, options)
    gc.collect()
    # The peak-RSS mark (VmHWM; ru_maxrss would carry the parent's peak across fork and exec) is
    # reset to the current RSS, so its growth is the aggregation's own peak.
    reset = reset_peak_rss()
    rss_before = process_memory_bytes("VmRSS")
    peak_before = process_memory_bytes("VmHWM")
    tracemalloc.start()
    start_traced = tracemalloc.get_traced_memory()[0]
    aggregate(1, replies)
    peak_traced = tracemalloc.get_traced_memory()[1] - start_traced
    tracemalloc.stop()
    peak_after = process_memory_bytes("VmHWM")
    return {
        "peak_traced_bytes": int(peak_traced),
        "peak_rss_growth_bytes": int(max(peak_after - (rss_before if reset else peak_before), 0)),
        "rss_before_bytes": rss_before,
    }


def measure_memory(options: argparse.Namespace, figures: list[ServerFigure]) -> None:
    """Run :func:`memory_probe` for each rule in a fresh interpreter and attach its figures."""
    for figure in figures:
        command = [
            sys.executable,
            "-m",
            "benchmarks.systems",
            "--memory-probe",
            figure.rule,
            "--clients",
            str(options.clients),
            "--fedlaw-epochs",
            str(options.fedlaw_epochs),
        ]
        # A fixed mmap threshold: glibc then maps every buffer >= 128 KiB on its own and unmaps
        # it when freed, so the resident set follows the live buffers (the default threshold
        # grows after frees and keeps later buffers in the heap, hiding them from the RSS).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}
        completed = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, check=False, env=env
        )
        if completed.returncode != 0:
            print(f"[systems] memory probe of {figure.rule} failed:\n{completed.stderr[-2000:]}")
            continue
        probe = json.loads(completed.stdout.strip().splitlines()[-1])
        figure.peak_traced_bytes = probe["peak_traced_bytes"]
        figure.peak_rss_growth_bytes = probe["peak_rss_growth_bytes"]
        print(
            f"[systems] {figure.rule}: traced peak "
            f"{probe['peak_traced_bytes'] / MEBIBYTE:.0f} MiB, maxrss growth "
            f"{probe['peak_rss_growth_bytes'] / MEBIBYTE:.0f} MiB",
            flush=True,
        )


# ----------------------------------------------------------------------------- client side
@dataclass
class ClientFigure:
    """One strategy's client figures on the task model."""

    strategy: str
    seconds: float
    upload_bytes: int
    records: str


CLIENT_STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "elastic": {"strategy": "elastic"},
    "elastic-f16": {"strategy": "elastic", "sensitivity-dtype": "float16"},
    "fedgma": {"strategy": "fedgma"},
    "fedgma-soft": {"strategy": "fedgma", "gma-mask": "soft"},
    "fedlaw": {"strategy": "fedlaw"},
}


@dataclass
class ClientSetup:
    """One strategy's train instruction to the node of partition 0, and its in-process Grid."""

    config: Any
    message_of: Callable[[int], Message]
    grid: InProcessGrid


def client_setup(label: str, options: argparse.Namespace) -> ClientSetup:
    """Build the strategy of ``label`` and a function giving its train instruction to partition 0.

    The instruction goes through the one in-process Grid (server.inprocess), so the ClientApp
    sees it as in ``ba-run --runtime inprocess``; the node's Context (Elastic's moving average)
    persists across repeats.
    """
    config = parse_run_config({**client_settings(options), **CLIENT_STRATEGIES[label]})
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model_for(config, test_set)
    strategy = build_strategy(config, ServerResources(model, proxy_set, torch.device("cpu")))
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    task = ConfigRecord({**client_task(config).to_config()})
    grid = InProcessGrid(client_app, config.num_clients, config.to_run_config())

    def message_of(repeat: int) -> Message:
        # All nodes of the federation are sampled (fraction-train 1).
        instructions = strategy.configure_train(1, arrays, task, grid)
        return next(m for m in instructions if m.metadata.dst_node_id == FIRST_NODE_ID)

    return ClientSetup(config, message_of, grid)


def time_clients(options: argparse.Namespace) -> tuple[list[ClientFigure], dict[str, Any]]:
    """Seconds and upload bytes of one client's train round per strategy, on partition 0.

    The strategies take turns within each repeat (round -1 warms up, untimed), so that a burst
    of load from elsewhere on the machine spreads over all of them instead of hitting one.
    """
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    setups = {label: client_setup(label, options) for label in CLIENT_STRATEGIES}
    seconds: dict[str, list[float]] = {label: [] for label in setups}
    replies: dict[str, Message] = {}
    for repeat in range(-1, options.repeats):
        for label, setup in setups.items():
            message = setup.message_of(repeat)
            started = time.perf_counter()
            (replies[label],) = setup.grid.send_and_receive([message])
            if repeat >= 0:
                seconds[label].append(time.perf_counter() - started)
    figures = [
        ClientFigure(
            label,
            statistics.median(seconds[label]),
            upload_bytes(replies[label]),
            ", ".join(sorted(replies[label].content.array_records)),
        )
        for label in setups
    ]
    for figure in figures:
        print(f"[systems] client {figure.strategy}: {figure.seconds:.3f} s", flush=True)
    config = setups["fedavg"].config
    setting = {
        "dataset": config.dataset,
        "model": config.model,
        "partition": config.partition
        + (f" alpha {config.dirichlet_alpha}" if config.partition == "dirichlet" else ""),
        "clients": config.num_clients,
        "local-epochs": config.local_epochs,
        "batch-size": config.batch_size,
        "partition-0-examples": len(load_client_partition(client_spec(config), 0)),
        "sensitivity-pass-seconds": time_sensitivity_pass(options),
    }
    return figures, setting


def build_model_for(config: Any, test_set: LabeledData | DeviceData) -> nn.Module:
    """The task model of a configuration."""
    from beyond_averaging.tasks.models import build_model

    return build_model(config.model, test_set.input_shape, test_set.num_classes, seed=config.seed)


def client_spec(config: Any) -> Any:
    """The DataSpec the ClientApp builds for partition loading (proxy excluded)."""
    from dataclasses import replace

    return replace(data_spec(config), proxy_per_class=0)


def client_settings(options: argparse.Namespace) -> dict[str, Any]:
    """Run-config keys of the client figures' federation."""
    return {
        "dataset": options.dataset,
        "model": options.model,
        "partition": options.partition,
        "num-clients": options.num_clients,
        "device": "cpu",
    }


def time_sensitivity_pass(options: argparse.Namespace) -> float:
    """Median seconds of ``compute_sensitivity`` alone over partition 0's batches."""
    config = parse_run_config(client_settings(options))
    data = DeviceData.from_labeled(
        load_client_partition(client_spec(config), 0), torch.device("cpu")
    )
    model = build_model_for(config, data)
    seconds = []
    for _ in range(options.repeats):
        # The ClientApp's pass: one epoch's index batches of the partition on its device.
        plan = shuffled_batches(len(data), config.batch_size, 1, seed=0)
        started = time.perf_counter()
        batches = (data.features[positions] for positions in plan)
        compute_sensitivity(model, batches, decay=config.sensitivity_decay)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


# ----------------------------------------------------------------------------- report
def _peak(figure: ServerFigure) -> int | None:
    peaks = [p for p in (figure.peak_traced_bytes, figure.peak_rss_growth_bytes) if p is not None]
    return max(peaks) if peaks else None


def server_table(figures: Sequence[ServerFigure], clients: int, model_bytes: int) -> str:
    """Markdown table of the server figures."""
    flower = next((f.seconds for f in figures if f.rule == FLOWER), None)
    flower_peak = next((_peak(f) for f in figures if f.rule == FLOWER), None) or 0
    lines = [
        "| rule | aggregate_train s | math s | x Flower FedAvg | within 1.5x | upload / client "
        "(MiB) | traced peak (models) | maxrss growth (models) | extra buffers / client | "
        "<= 1 buffer / client |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        ratio = f.seconds / flower if flower else float("nan")
        peaks = [p for p in (f.peak_traced_bytes, f.peak_rss_growth_bytes) if p is not None]
        # Beyond what Flower's FedAvg itself needs (its accumulator and the serialized result).
        per_client = (max(peaks) - flower_peak) / model_bytes / clients if peaks else math.nan
        in_models = [
            "-" if p is None else f"{p / model_bytes:.2f}"
            for p in (f.peak_traced_bytes, f.peak_rss_growth_bytes)
        ]
        meets = "-" if not peaks else ("yes" if per_client <= TARGET_BUFFERS_PER_CLIENT else "NO")
        lines.append(
            f"| {f.rule} | {f.seconds:.3f} | "
            f"{'-' if f.math_seconds is None else f'{f.math_seconds:.3f}'} | {ratio:.2f} | "
            f"{'yes' if ratio <= TARGET_TIME_RATIO else 'NO'} | "
            f"{f.upload_bytes / MEBIBYTE:.1f} | {in_models[0]} | {in_models[1]} | "
            f"{'-' if not peaks else f'{per_client:.2f}'} | "
            f"{meets} |"
        )
    return "\n".join(lines) + "\n"


def client_table(figures: Sequence[ClientFigure]) -> str:
    """Markdown table of the client figures."""
    baseline = next((f.seconds for f in figures if f.strategy == "fedavg"), None)
    lines = [
        "| strategy | client s / round | x FedAvg client | upload / client (KiB) | records |",
        "|---|---|---|---|---|",
    ]
    for f in figures:
        ratio = f.seconds / baseline if baseline else float("nan")
        lines.append(
            f"| {f.strategy} | {f.seconds:.3f} | {ratio:.2f} | {f.upload_bytes / 1024:.1f} | "
            f"{f.records} |"
        )
    return "\n".join(lines) + "\n"


def hardware() -> str:
    """One line about the machine."""
    cpu = platform.processor() or platform.machine()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = 0
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {cores} CPU cores available, {gpu}, torch {torch.__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.systems", description=__doc__)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    parser.add_argument(
        "--rules", default=",".join(RULE_RECORDS), help="comma-separated server rules"
    )
    parser.add_argument(
        "--fedlaw-epochs",
        type=int,
        default=parse_run_config({}).fedlaw_epochs,
        help="FedLAW server epochs on the proxy set (RunConfig default)",
    )
    parser.add_argument("--dataset", default="fashion-mnist", help="task of the client figures")
    parser.add_argument("--model", default="mlp", help="task model of the client figures")
    parser.add_argument("--partition", default="iid", help="partition of the client figures")
    parser.add_argument(
        "--num-clients", type=int, default=20, help="federation size of the client figures"
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-clients", action="store_true")
    parser.add_argument("--publish", action="store_true", help="also write docs/results/")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print every figure."""
    options = build_parser().parse_args(argv)
    options.rules = [rule.strip() for rule in options.rules.split(",") if rule.strip()]
    if options.memory_probe:
        print(json.dumps(memory_probe(options.memory_probe, options)))
        return 0
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    started = time.perf_counter()
    model = big_model()
    parameters = sum(p.numel() for p in model.parameters())
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    del model
    server = time_rules(options)
    if not options.skip_memory:
        measure_memory(options, server)
    clients, setting = ([], {}) if options.skip_clients else time_clients(options)
    header = (
        f"Machine: {hardware()}. Server figures: {options.clients} clients of an MLP "
        f"{'-'.join(map(str, BIG_LAYERS))} ({parameters:,} parameters, "
        f"{model_bytes / MEBIBYTE:.1f} MiB float32), median of {options.repeats} "
        f"(FedLAW: 1 run, {options.fedlaw_epochs} server epochs). Wall time of this benchmark: "
        f"{time.perf_counter() - started:.0f} s.\n"
    )
    text = header + "\n" + server_table(server, options.clients, model_bytes)
    if clients:
        text += (
            f"\nClient figures: this project's ClientApp on {setting['dataset']} / "
            f"{setting['model']}, partition 0 ({setting['partition-0-examples']} examples, "
            f"{setting['partition']}), {setting['local-epochs']} local epochs, batch "
            f"{setting['batch-size']}, median of {options.repeats}. Sensitivity pass alone "
            f"(compute_sensitivity over one epoch of batches): "
            f"{setting['sensitivity-pass-seconds']:.3f} s.\n\n" + client_table(clients)
        )
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    raw = {
        "server": [vars(f) for f in server],
        "client": [vars(f) for f in clients],
        "client-setting": setting,
        "parameters": parameters,
        "model-bytes": model_bytes,
        "clients": options.clients,
        "hardware": hardware(),
    }
    (RESULTS_DIR / "systems.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    (RESULTS_DIR / "systems.md").write_text(text, encoding="utf-8")
    if options.publish:
        DOCS_DIR.mkdir(parents=True, exist_ok=True)
        (DOCS_DIR / "systems.md").write_text(text, encoding="utf-8")
        print(f"wrote {DOCS_DIR / 'systems.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
