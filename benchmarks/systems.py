"""Systems figures of every aggregation rule in one run: server seconds of ``aggregate_train``
against Flower's FedAvg on the same replies, peak server memory (a fresh process per rule),
upload bytes, and the ClientApp's seconds per round. docs/benchmarks.md ("Systems figures")
defines every column and gives the commands. ``--cohort-memory``: the peak memory of one round
of the vectorized cohort backend instead (docs/runtimes.md, "Memory").
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from benchmarks.harness import Stopwatch, command, save
from benchmarks.spec import REPO
from benchmarks.speed import SETTINGS
from beyond_averaging.client import vectorized
from beyond_averaging.client.memory import alive_at_peak, peak_above_start, torch_allocations
from beyond_averaging.client.sensitivity import compute_sensitivity
from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.deploy.resources import MIB, PeakSampler, reset_peak_rss, status_bytes
from beyond_averaging.server.interactive import federation
from beyond_averaging.server.runs.provenance import hardware_line
from beyond_averaging.server.runtime.inprocess import FIRST_NODE_ID
from beyond_averaging.server.strategy_factory import ServerResources, build_rule
from beyond_averaging.server.sweep.report import markdown_table, shown
from beyond_averaging.strategies import FedAvg
from beyond_averaging.strategies.diagnostics import ClientDiagnostics
from beyond_averaging.tasks.batching import shuffled_batches
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.federation import load_client_partition
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import SENSITIVITY_RECORD

BIG_LAYERS = (3072, 2048, 2048, 10)
UPDATE_SCALE = 1e-2  # spread of the synthetic updates (the figures do not depend on it)
TARGET_TIME_RATIO = 1.5
#: Rules whose own math reads every reply more than once (Elastic's sensitivities, FedGMA's
#: gradients and sign votes) may take up to this many times Flower's FedAvg (issue 23).
TARGET_TIME_RATIOS = {"elastic": 3.0, "elastic-f16": 3.0, "fedgma": 3.0, "fedgma-soft": 3.0}
TARGET_BUFFERS_PER_CLIENT = 1.0
FLOWER, DIAGNOSTICS = "flower-fedavg", "diagnostics"
SERVER_HEADER = (
    "rule | aggregate_train s | math s | x Flower FedAvg | x Flower FedAvg, CPU"
    " | CPU within target (1.5x; Elastic, FedGMA 3x)"
    " | upload / client (MiB) | traced peak (models) | RSS peak growth (models)"
    " | extra buffers / client | <= 1 buffer / client"
)
#: glibc maps every buffer of at least this size on its own and unmaps it when freed, so the
#: resident set follows the live buffers (the default threshold grows and hides later ones).
MMAP_THRESHOLD_BYTES = 128 * 1024
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
#: Each rule as run-config overrides: the server figures and the client figures share them.
RULES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "fedadam": {"strategy": "fedavg", "server-optimizer": "adam"},
    "elastic": {"strategy": "elastic"},
    "elastic-f16": {"strategy": "elastic", "sensitivity-dtype": "float16"},
    "fedgma": {"strategy": "fedgma"},
    "fedgma-soft": {"strategy": "fedgma", "gma-mask": "soft"},
    "fedlaw": {"strategy": "fedlaw"},
}
#: The defences beyond the defaults (server figures only: their clients are the rules' own).
DEFENCE_RULES: dict[str, dict[str, Any]] = {
    f"{rule}-{method}": {**RULES[rule], "robust-aggregation": method}
    for method in ("fltrust", "flame")
    for rule in ("fedavg", "elastic", "fedgma", "fedlaw")
}
SERVER_RULES = (FLOWER, *RULES, DIAGNOSTICS)


def big_model(seed: int = 0) -> nn.Module:
    """The >= 10 M parameter MLP of the server figures."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten()]
    for inputs, outputs in pairwise(BIG_LAYERS):
        layers += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no activation after the output layer


def upload_bytes(message: Message) -> int:
    """Serialized payload of a reply: sum of ``len(Array.data)`` over all its ArrayRecords."""
    records = message.content.array_records.values()
    return sum(len(array.data) for record in records for array in record.values())


def rule_config(rule: str, fedlaw_epochs: int) -> Any:
    """The run configuration of a server rule (Flower's FedAvg and diagnostics: FedAvg's)."""
    settings = {"min-train-replies": 2, "fedlaw-epochs": fedlaw_epochs}
    overrides = {**RULES, **DEFENCE_RULES}.get(rule, RULES["fedavg"])
    return parse_run_config({**settings, **overrides})


def synthetic_replies(model: nn.Module, clients: int, rule: str) -> list[Message]:
    """K train replies theta_k = w + d + noise_k with the records the rule asks for, serialized
    one tensor at a time (never more than one tensor of scratch memory); the same ``arrays`` for
    every rule (one seed). The direction d that all replies share makes them agree as honest IID
    clients do (median cosine with the others' mean about 0.7), so the direction check, which a
    run turns off where clients disagree from the first round, runs in every repeat."""
    config = rule_config(rule, 1)
    records = list(build_rule(config, resources(model)).required_records)
    rng = np.random.default_rng(1)
    global_arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    shared = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in global_arrays.items()}
    replies = []
    for node in range(1, clients + 1):
        content, model_arrays = RecordDict(), {}
        extra: dict[str, dict[str, Array]] = {name: {} for name in records}
        for key, value in global_arrays.items():
            noise = rng.standard_normal(value.shape, dtype=np.float32)
            update = (shared[key] + noise) * np.float32(UPDATE_SCALE)
            model_arrays[key] = Array(value + update)
            for name in records:  # a sensitivity is non-negative, a gradient the update
                sensitivity = name == SENSITIVITY_RECORD
                array = np.abs(update).astype(config.sensitivity_dtype) if sensitivity else update
                extra[name][key] = Array(array)
        content["arrays"] = ArrayRecord(model_arrays)
        content["metrics"] = MetricRecord({"num-examples": int(rng.integers(50, 500))})
        for name, arrays in extra.items():
            content[name] = ArrayRecord(arrays)
        # As the SuperLink delivers a reply (run, ids, source, destination, replied-to, group).
        ids = (1, f"reply-{node}", node, 0, f"instruction-{node}", "1")
        metadata = Metadata(*ids, time.time(), 3600.0, "train")
        replies.append(Message(content=content, metadata=metadata))  # type: ignore[call-overload]
    return replies


def resources(model: nn.Module) -> ServerResources:
    """The server's resources for the big MLP: a random class-balanced proxy set for FedLAW."""
    rng = np.random.default_rng(0)
    classes, per_class = BIG_LAYERS[-1], parse_run_config({}).proxy_per_class
    labels = np.repeat(np.arange(classes, dtype=np.int64), per_class)
    features = rng.standard_normal((labels.size, BIG_LAYERS[0]), dtype=np.float32)
    return ServerResources(model, LabeledData(features, labels, classes), torch.device("cpu"))


def make_rule(
    rule: str, model: nn.Module, fedlaw_epochs: int
) -> Callable[[int, list[Message]], Any]:
    """``aggregate(server_round, replies)`` of a rule, its global model set; after each call its
    ``math_seconds`` holds the rule's math alone (the strategy's ``aggregation-seconds``)."""
    if rule == FLOWER:
        return FlowerFedAvg().aggregate_train
    global_arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = rule_config(rule, fedlaw_epochs)
    if rule == DIAGNOSTICS:  # the observer alone on validated replies: what it adds per round
        keys = [n for n, p in model.named_parameters() if p.requires_grad]
        observer = ClientDiagnostics(keys, mi_coordinates=config.diagnostics_mi_coordinates)
        unpacker = FedAvg(min_train_replies=2)
        unpacker.global_arrays = global_arrays

        def observe(server_round: int, replies: list[Message]) -> Any:
            valid = [unpacker.validate_reply(message) for message in replies]
            weights = np.array([r.num_examples for r in valid], dtype=np.float64)
            with Stopwatch() as clock:
                metrics = observer(server_round, global_arrays, valid, weights / weights.sum())
            observe.math_seconds = clock.wall  # type: ignore[attr-defined]
            return metrics

        return observe
    strategy = build_rule(config, resources(model))
    # As the ServerApp, the instructions first (fltrust reads the clients' task there), once:
    # every repeat aggregates against the same global model.
    task = ConfigRecord(client_task(config).to_config())
    nodes = SimpleNamespace(get_node_ids=lambda: list(range(1, 1 + config.num_clients)))
    arrays = ArrayRecord({k: Array(v) for k, v in global_arrays.items()})
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # to address them
    strategy.configure_train(1, arrays, task, nodes)  # type: ignore[arg-type]
    strategy.global_arrays = global_arrays

    def aggregate(server_round: int, replies: list[Message]) -> Any:
        result = strategy.aggregate_train(server_round, replies)
        aggregate.math_seconds = strategy.last_aggregation_seconds  # type: ignore[attr-defined]
        figures = strategy.aggregation_metrics[server_round]
        aggregate.root_seconds = figures.get("fltrust-seconds")  # type: ignore[attr-defined]
        return result

    return aggregate


@dataclass
class ServerFigure:
    """One rule's server figures."""

    rule: str
    seconds: float
    math_seconds: float | None
    upload_bytes: int
    #: Median over the repeats of this rule's seconds over Flower's FedAvg's on the same
    #: replies, timed right before it: a load that changes during the run changes both.
    ratio: float = 1.0
    #: The same for process CPU seconds (every thread's): what the rule costs the server's
    #: cores, which a load that takes cores away from this process changes far less than wall.
    cpu_ratio: float = 1.0
    peak_traced_bytes: int | None = None
    peak_rss_growth_bytes: int | None = None
    #: fltrust: the seconds of the server's own update on its root set (of ``math_seconds``).
    root_seconds: float | None = None

    @property
    def peaks(self) -> tuple[int | None, int | None]:
        """Traced and resident peak (None: not measured)."""
        return self.peak_traced_bytes, self.peak_rss_growth_bytes

    @property
    def peak_bytes(self) -> int | None:
        """The larger peak: tracemalloc misses torch's buffers, the resident set shared pages."""
        return max((p for p in self.peaks if p is not None), default=None)


def time_rules(options: argparse.Namespace) -> list[ServerFigure]:
    """Median seconds of each rule's aggregation on identical replies (one process, in turn),
    each repeat paired with Flower's FedAvg on the same replies' ``arrays``."""
    model, figures = big_model(), []
    flower = make_rule(FLOWER, model, options.fedlaw_epochs)
    for rule in options.rules:
        replies = synthetic_replies(model, options.clients, rule)
        plain = [model_only(message) for message in replies]  # what Flower's FedAvg accepts
        aggregate = make_rule(rule, model, options.fedlaw_epochs)
        seconds, math_seconds, ratios, cpu_ratios, root_seconds = [], [], [], [], []
        for repeat in range(1 if rule.startswith("fedlaw") else options.repeats):
            with Stopwatch() as yardstick:
                flower(repeat + 1, plain)
            with Stopwatch() as clock:
                aggregate(repeat + 1, replies)
            seconds.append(clock.wall)
            ratios.append(clock.wall / yardstick.wall)
            cpu_ratios.append(clock.cpu / yardstick.cpu)
            math_seconds.append(getattr(aggregate, "math_seconds", float("nan")))
            root_seconds.append(getattr(aggregate, "root_seconds", None))
        math = None if rule == FLOWER else statistics.median(math_seconds)
        figure = ServerFigure(rule, statistics.median(seconds), math, upload_bytes(replies[0]))
        if None not in root_seconds:
            figure.root_seconds = statistics.median(root_seconds)  # type: ignore[type-var]
        if rule != FLOWER:
            figure.ratio, figure.cpu_ratio = (
                statistics.median(ratios),
                statistics.median(cpu_ratios),
            )
        figures.append(figure)
        ratios_text = f"{figure.ratio:.2f} x Flower (CPU {figure.cpu_ratio:.2f} x)"
        print(f"[systems] {rule}: {figure.seconds:.3f} s, {ratios_text}", flush=True)
        del replies, plain, aggregate
    return figures


def model_only(message: Message) -> Message:
    """The reply with its ``arrays`` and ``metrics`` records only (the same objects)."""
    content = RecordDict({"arrays": message.content["arrays"]})
    content["metrics"] = message.content["metrics"]
    reply: Message = Message(content=content, metadata=message.metadata)  # type: ignore[call-overload]
    return reply


def memory_probe(rule: str, options: argparse.Namespace) -> dict[str, int]:
    """In this (fresh) process: build the replies, then aggregate once under tracemalloc."""
    model = big_model()
    replies = synthetic_replies(model, options.clients, rule)
    aggregate = make_rule(rule, model, options.fedlaw_epochs)
    gc.collect()
    reset = reset_peak_rss()  # the peak mark, reset to the current RSS: its growth is our peak
    rss_before, peak_before = status_bytes("VmRSS"), status_bytes("VmHWM")
    tracemalloc.start()
    start_traced = tracemalloc.get_traced_memory()[0]
    aggregate(1, replies)
    peak_traced = tracemalloc.get_traced_memory()[1] - start_traced
    tracemalloc.stop()
    growth = status_bytes("VmHWM") - (rss_before if reset else peak_before)
    return {"peak_traced_bytes": int(peak_traced), "peak_rss_growth_bytes": max(growth, 0)}


def measure_memory(options: argparse.Namespace, figures: list[ServerFigure]) -> None:
    """Run :func:`memory_probe` for each rule in a fresh interpreter; attach its figures."""
    env = {**os.environ, MMAP_ENV: str(MMAP_THRESHOLD_BYTES)}
    for figure in figures:
        command = [sys.executable, "-m", "benchmarks.systems", "--memory-probe", figure.rule]
        command += [f"--clients={options.clients}", f"--fedlaw-epochs={options.fedlaw_epochs}"]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"[systems] memory probe of {figure.rule} failed:\n{done.stderr[-2000:]}")
            continue
        probe = json.loads(done.stdout.strip().splitlines()[-1])
        figure.peak_traced_bytes = probe["peak_traced_bytes"]
        figure.peak_rss_growth_bytes = probe["peak_rss_growth_bytes"]
        print(f"[systems] {figure.rule}: {probe}", flush=True)


def time_clients(options: argparse.Namespace) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds of one train round of partition 0's ClientApp per strategy, and the
    setting with the median seconds of ``compute_sensitivity`` alone over one epoch.

    The strategies take turns within each repeat (round -1 warms up, untimed), so that a burst of
    load from elsewhere spreads over all of them; each node's Context persists across repeats."""
    task = {"dataset": options.dataset, "model": options.model, "partition": options.partition}
    task |= {"num-clients": options.num_clients, "device": "cpu"}
    federations = {rule: federation({**task, **overrides}) for rule, overrides in RULES.items()}
    seconds: dict[str, list[float]] = {rule: [] for rule in RULES}
    for repeat in range(-1, options.repeats):
        for rule, fed in federations.items():
            sent = [m for m in fed.instructions(1) if m.metadata.dst_node_id == FIRST_NODE_ID]
            with Stopwatch() as clock:
                fed.grid.send_and_receive(sent)
            seconds[rule] += [clock.wall] if repeat >= 0 else []
    config = federations["fedavg"].config
    partition = load_client_partition(replace(data_spec(config), proxy_per_class=0), 0)
    data = DeviceData.from_labeled(partition, torch.device("cpu"))
    model = build_model(config.model, data.input_shape, data.num_classes, seed=config.seed)
    pass_seconds = []
    for _ in range(options.repeats):
        plan = shuffled_batches(len(data), config.batch_size, 1, seed=0)
        with Stopwatch() as clock:
            batches = (data.features[positions] for positions in plan)
            compute_sensitivity(model, batches, decay=config.sensitivity_decay)
        pass_seconds.append(clock.wall)
    shown_keys = ("dataset", "model", "partition", "local-epochs", "batch-size")
    setting: dict[str, Any] = {key: config.to_run_config()[key] for key in shown_keys}
    setting |= {"partition-0-examples": len(partition)}
    setting["sensitivity-pass-seconds"] = statistics.median(pass_seconds)
    return {rule: statistics.median(times) for rule, times in seconds.items()}, setting


def server_table(figures: Sequence[ServerFigure], clients: int, model_bytes: int) -> str:
    """Markdown table of the server figures (ratios against Flower's FedAvg of the same run)."""
    flower = next((f for f in figures if f.rule == FLOWER), None)
    flower_peak = (flower.peak_bytes if flower else None) or 0
    paired = flower is not None  # ratios are only measured beside Flower's FedAvg
    rows = []
    for f in figures:
        ratio, cpu = (f.ratio, f.cpu_ratio) if paired else (float("nan"), float("nan"))
        target = TARGET_TIME_RATIOS.get(f.rule, TARGET_TIME_RATIO)
        within = "-" if f.rule in DEFENCE_RULES else "yes" if cpu <= target else "NO"
        models = [shown(None if p is None else p / model_bytes, ".2f") for p in f.peaks]
        # Beyond what Flower's FedAvg itself needs (its accumulator and the serialized result).
        extra = None if f.peak_bytes is None else (f.peak_bytes - flower_peak) / model_bytes
        extra = None if extra is None else extra / clients
        buffers = "-" if extra is None else "yes" if extra <= TARGET_BUFFERS_PER_CLIENT else "NO"
        rows.append(
            [
                *(f.rule, f"{f.seconds:.3f}", shown(f.math_seconds, ".3f"), f"{ratio:.2f}"),
                *(f"{cpu:.2f}", within),
                *(f"{f.upload_bytes / MIB:.1f}", *models, shown(extra, ".2f"), buffers),
            ]
        )
    table = markdown_table(SERVER_HEADER.split(" | "), rows)
    roots = [f for f in figures if f.root_seconds is not None]
    if roots:
        table += "\nOf the math seconds, the server's own update on its root set (fltrust): " + (
            ", ".join(f"{f.rule} {f.root_seconds:.3f} s" for f in roots) + ".\n"
        )
    return table


def client_table(seconds: Mapping[str, float]) -> str:
    """Markdown table of the client seconds (ratios against FedAvg's client of the same run)."""
    rows = [[rule, f"{s:.3f}", f"{s / seconds['fedavg']:.2f}"] for rule, s in seconds.items()]
    return markdown_table(["strategy", "client s / round", "x FedAvg client"], rows)


# ------------------------------------------------------------ the vectorized cohort's memory
#: FedLAW's Table 3 setting, one round at a time, trained by the cohort backend.
COHORT_SETTING = {**SETTINGS["table3"], "device": "cpu", "client-backend": "vectorized"}
COHORT_STRATEGIES = ("fedavg", "elastic", "fedgma")  # no extra record, a sensitivity, a gradient


def cohort_memory(args: argparse.Namespace) -> None:
    """Print the peaks of rounds 2 and 3 of a vectorized round in cohort-parameter copies:
    round 2's resident peak (also by phase) and round 3's allocator peak above a baseline taken
    after round 1 (docs/runtimes.md, "Memory")."""
    torch.set_num_threads(args.threads)
    per_pass = {"vectorized-clients-per-pass": args.clients_per_pass}
    fed = federation({**COHORT_SETTING, "strategy": args.strategy, **per_pass})
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


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print every figure."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.systems", description=__doc__)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    parser.add_argument("--rules", default=",".join(SERVER_RULES), help="server rules")
    parser.add_argument("--fedlaw-epochs", type=int, default=parse_run_config({}).fedlaw_epochs)
    parser.add_argument("--dataset", default="fashion-mnist", help="task of the client figures")
    parser.add_argument("--model", default="mlp", help="task model of the client figures")
    parser.add_argument("--partition", default="iid", help="partition of the client figures")
    parser.add_argument("--num-clients", type=int, default=20, help="client figures' federation")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-clients", action="store_true")
    parser.add_argument("--publish", action="store_true", help="also write docs/results/")
    parser.add_argument("--page", default="systems", help="the page's name: docs/results/PAGE.md")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    cohort = "only the vectorized cohort's peak memory of one round (Table 3 setting)"
    parser.add_argument("--cohort-memory", action="store_true", help=cohort)
    parser.add_argument("--strategy", choices=COHORT_STRATEGIES, default="fedavg", help="its rule")
    parser.add_argument("--threads", type=int, default=1, help="its torch threads")
    per_pass = "its run option vectorized-clients-per-pass"
    parser.add_argument("--clients-per-pass", type=int, default=0, help=per_pass)
    options = parser.parse_args(argv)
    if options.cohort_memory and MMAP_ENV not in os.environ:
        os.environ[MMAP_ENV] = "65536"  # again, every large allocation its own mapping
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.systems", *sys.argv[1:]])
    if options.cohort_memory:
        cohort_memory(options)
        return 0
    options.rules = [rule.strip() for rule in options.rules.split(",") if rule.strip()]
    if options.memory_probe:
        print(json.dumps(memory_probe(options.memory_probe, options)))
        return 0
    parameters = sum(inputs * outputs + outputs for inputs, outputs in pairwise(BIG_LAYERS))
    model_bytes = 4 * parameters  # float32
    with Stopwatch() as clock:
        server = time_rules(options)
        if not options.skip_memory:
            measure_memory(options, server)
        clients, setting = ({}, {}) if options.skip_clients else time_clients(options)
    # The command names OMP_NUM_THREADS: a run's torch threads change its CPU figures on a loaded
    # machine (spin-waits count).
    text = (
        f"Command: `{command('systems', argv)}`\n\n"
        + f"Machine: {hardware_line()}. Server figures: {options.clients} clients of an MLP "
        f"{'-'.join(map(str, BIG_LAYERS))} ({parameters:,} parameters, {model_bytes / MIB:.1f} "
        f"MiB float32), median of {options.repeats} (FedLAW: 1 run, {options.fedlaw_epochs} "
        f"server epochs). Wall time of this benchmark: {clock.wall:.0f} s.\n\n"
        + server_table(server, options.clients, model_bytes)
    )
    if clients:
        text += (
            f"\nClient figures: this project's ClientApp on {setting['dataset']} / "
            f"{setting['model']}, partition 0 ({setting['partition-0-examples']} examples, "
            f"{setting['partition']}), {setting['local-epochs']} local epochs, batch "
            f"{setting['batch-size']}, median of {options.repeats}. Sensitivity pass alone "
            f"(compute_sensitivity over one epoch of batches): "
            f"{setting['sensitivity-pass-seconds']:.3f} s.\n\n" + client_table(clients)
        )
    raw: dict[str, Any] = {"server": [asdict(f) for f in server], "client-setting": setting}
    raw |= {"client-seconds": clients, "parameters": parameters, "hardware": hardware_line()}
    save("systems", options.page, text, raw, options.publish)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
