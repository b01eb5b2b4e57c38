"""Byzantine clients against every rule and defence: the attack tables of docs/reliability.md.

A run is an in-process federation (:func:`benchmarks.harness.federation`) whose first
``attackers`` nodes collude: the product's :class:`~beyond_averaging.server.attacks.AttackGrid`
rewrites their honest replies (:data:`~beyond_averaging.server.attacks.ATTACKS`), or they train
on poisoned data (flipped labels, a backdoor trigger). The attackers are omniscient: they see
every honest update of the round and know the published default bounds, so the adaptive attacks
(min-max, min-sum, IPM, the norm-aware update, the boosted backdoor) are their best responses to
the defaults. docs/reliability.md ("The attack table", "Adaptive attacks") defines the attacks
and gives the commands; every table is a spec of the runner whose ``runtime`` is
:func:`run_attacked`. Every round records the server's test accuracy and ``backdoor-success``:
the share of triggered test images whose true label is not the target that the global model
classifies as the target (:func:`~beyond_averaging.server.attacks.backdoor_success`).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.serverapp import strategy as flower_strategies

from benchmarks.harness import Federation, federation
from benchmarks.report import markdown_table, read_run
from benchmarks.spec import load_spec
from beyond_averaging.client import app as client_module
from beyond_averaging.server.app import chance_accuracy, client_task, data_spec, round_alarms
from beyond_averaging.server.attacks import (
    ADAPTIVE_CANDIDATES,
    ATTACKS,
    Attack,
    AttackGrid,
    backdoor_success,
    backdoor_test_set,
    choose_trigger,
    poisoned,
)
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.runs.folder import COMPLETED_WITH_ALARMS
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.strategy_factory import build_strategy, trigger_unlearning
from beyond_averaging.strategies import ContractStrategy
from beyond_averaging.strategies.defences.trigger_unlearning import (
    TriggerUnlearning,
    backdoor_alarms,
    dormant_flagged,
)
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.federation import DataSpec, load_server_splits


@contextlib.contextmanager
def poisoned_partitions(partitions: frozenset[int], attack: Attack) -> Iterator[None]:
    """While the block runs, the ClientApp trains ``partitions`` on :func:`poisoned` data.

    The ClientApp reads its partition through ``client.app.device_partition``; for the
    ``partitions`` the replacement returns the poisoned copy."""
    honest = client_module.device_partition

    order = sorted(partitions)

    def partition(spec: Any, partition_id: int, device: torch.device) -> DeviceData:
        data = honest(spec, partition_id, device)
        if partition_id not in partitions:
            return data
        return poisoned(data, attack, order.index(partition_id), len(order))

    client_module.device_partition = partition  # type: ignore[assignment]
    try:
        yield
    finally:
        client_module.device_partition = honest


# ----------------------------------------------------------------------------- one run
def adaptive_attack(
    fed: Federation, config: RunConfig, attack: Attack, attackers: range
) -> tuple[Attack, dict[str, Any]]:
    """``attack`` with the trigger :func:`~beyond_averaging.server.attacks.choose_trigger`
    picks against the run's own trigger unlearning (where it has none, the documented setting,
    6 passes), rehearsed on the attackers' pooled partitions from the initial model with the
    server's root set as the search's inputs (omniscient, as the table's other attackers); and
    the round-0 figures of the choice."""
    cpu, task = torch.device("cpu"), client_task(config)
    spec = DataSpec.from_task(task, config.num_clients)
    parts = [client_module.device_partition(spec, pid, cpu) for pid in attackers]
    pooled = [torch.cat([getattr(part, key) for part in parts]) for key in ("features", "labels")]
    root = DeviceData.from_labeled(load_server_splits(data_spec(config))[1], cpu)
    fed.model.load_state_dict(fed.arrays.to_torch_state_dict())
    defence = trigger_unlearning(config) or TriggerUnlearning(epochs=6)
    best, survived, probability = choose_trigger(
        fed.model, DeviceData(pooled[0], pooled[1], parts[0].num_classes), root, defence,
        learning_rate=task.learning_rate, batch_size=task.batch_size, seed=config.seed,
    )  # fmt: skip
    figures = {"adaptive-trigger": ADAPTIVE_CANDIDATES.index(best)} | {
        f"adaptive-{key}": [values[name] for name in ADAPTIVE_CANDIDATES]
        for key, values in (("survival", survived), ("target-probability", probability))
    }
    return replace(attack, trigger=best), figures


#: Flower's strategies the table compares with, by class name.
FLOWER_STRATEGIES = ("FedAvg", "FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan")


def flower_strategy(name: str, attackers: int, config: RunConfig) -> Any:
    """Flower's own strategy ``name``, told the number of attackers where it takes one."""
    if name not in FLOWER_STRATEGIES:
        raise ValueError(f"flower = {name!r}: use one of {FLOWER_STRATEGIES}")
    common: dict[str, Any] = {"fraction_evaluate": 0.0}
    if name == "FedTrimmedAvg":
        common["beta"] = config.trim_fraction
    if name in ("Krum", "MultiKrum", "Bulyan"):
        common["num_malicious_nodes"] = attackers
    if name == "MultiKrum":  # El Mhamdi et al.'s m = n - f; Flower's default 1 is Krum
        common["num_nodes_to_select"] = max(1, config.num_clients - attackers)
    return getattr(flower_strategies, name)(**common)


def run_attacked(settings: Mapping[str, Any]) -> None:
    """One run of the attack table: a federation whose first ``attackers`` nodes are Byzantine.

    ``settings`` is a run configuration (``run-name`` and ``output-dir`` name the run folder)
    plus ``attack`` (a name of :data:`ATTACKS`), ``attackers`` (how many of the first nodes
    attack; 0 or attack ``none``: an honest run) and optionally ``flower`` (a class of
    :data:`FLOWER_STRATEGIES` in place of the configured rule) and ``attackers-at``
    (``"last"``: the last nodes and partitions attack instead of the first).

    Raises
    ------
    ValueError
        An unknown attack or Flower strategy, or a run configuration the app refuses."""
    attack_name = str(settings.get("attack", "none"))
    if attack_name not in ATTACKS:
        raise ValueError(f"attack = {attack_name!r}: use one of {sorted(ATTACKS)}")
    attack, flower = ATTACKS[attack_name], str(settings.get("flower", ""))
    ours = ("attack", "attackers", "flower", "attackers-at")
    run_settings = {k: v for k, v in settings.items() if k not in ours}
    last = settings.get("attackers-at", "first") == "last"
    config = parse_run_config(run_settings)
    told = int(settings.get("attackers", 0))  # what Krum and Bulyan assume, even in honest runs
    attackers = 0 if attack_name == "none" else told
    recorder = RunRecorder(
        config.output_dir,
        config.run_name,
        {**config.to_run_config(), "attack": attack_name, "attackers": attackers, "flower": flower},
    )
    poisoning = attack.flip_labels or attack.backdoor
    first = config.num_clients - attackers if last else 0
    poisoned_ids = frozenset(range(first, first + attackers) if poisoning else ())
    try:
        rule = build_strategy if not flower else lambda c, _: flower_strategy(flower, told, c)
        fed = federation(run_settings, rule)
        chosen: dict[str, Any] = {}
        if attack.trigger == "adaptive" and attackers:
            attack, chosen = adaptive_attack(fed, config, attack, range(first, first + attackers))
        triggered = backdoor_test_set(fed.test_set, attack.in_round(1).trigger)
        node_ids = sorted(fed.grid.get_node_ids())
        fed.grid = AttackGrid(fed.grid, node_ids[first : first + attackers], attack, config.seed)
        chance = chance_accuracy(fed.test_set.labels)
        loss, accuracy = fed.evaluate()
        history, flagged = [(accuracy, loss)], 0  # the ServerApp's alarms, judged as it does
        recorder.log_round(
            {
                "round": 0,
                "test-accuracy": accuracy,
                "test-loss": loss,
                "backdoor-success": backdoor_success(fed, triggered),
                **chosen,
            }
        )
        for server_round in range(1, config.num_server_rounds + 1):
            started, sent = time.perf_counter(), fed.arrays
            with poisoned_partitions(poisoned_ids, played := attack.in_round(server_round)):
                fed.round(server_round)
            loss, accuracy = fed.evaluate()
            if attack.rotation:  # measured with the round's own trigger
                triggered = backdoor_test_set(fed.test_set, played.trigger)
            figures: dict[str, Any] = {}
            if isinstance(fed.strategy, ContractStrategy):  # Flower's keep no round metrics
                figures = dict(fed.strategy.last_round_metrics)
            last = server_round == config.num_server_rounds
            alarms = round_alarms(history, accuracy, loss, chance, last=last)
            alarms |= backdoor_alarms(figures, flagged)
            history.append((accuracy, loss))
            flagged += dormant_flagged(figures)
            recorder.log_round(
                {
                    **figures,
                    "round": server_round,
                    "test-accuracy": accuracy,
                    "test-loss": loss,
                    "backdoor-success": backdoor_success(fed, triggered),
                    "round-seconds": time.perf_counter() - started,
                    "aggregated": int(fed.arrays is not sent),
                },
                alarms,
            )
    except BaseException as error:
        recorder.write_summary("failed", error=f"{type(error).__name__}: {error}")
        raise
    recorder.write_summary(COMPLETED_WITH_ALARMS if recorder.alarm_summary() else "completed")


# ----------------------------------------------------------------------------- condensed table
def condensed_table(
    spec_path: Path, metric_rounds: int = 1, key: str = "test-accuracy", baseline: str = ""
) -> str:
    """Per federation, one row per method and one column per attack: the round metric ``key``
    (%) of the final round (``metric_rounds`` > 1: the mean of that many last rounds), seeds
    averaged, and the largest loss against the method's own honest run (``baseline``: against
    that method's honest run instead). From the spec's run folders."""
    spec = load_spec(spec_path)
    cells: dict[tuple[str, ...], list[float]] = {}
    for data in filter(None, map(read_run, spec.runs())):
        curve = list(data.curve(key).values())
        cell = tuple(data.run.labels[axis] for axis in ("federation", "method", "attack"))
        cells.setdefault(cell, []).append(100.0 * float(np.mean(curve[-metric_rounds:])))
    axes = {axis.name: axis.labels for axis in spec.axes}
    lines = []
    for setting in axes["federation"]:
        rows = []
        for method in axes["method"]:
            values = {a: cells.get((setting, method, a)) for a in axes["attack"]}
            honest = cells.get((setting, baseline, "none")) if baseline else values.get("none")
            attacked = [v for a, v in values.items() if v and a != "none"]
            losses = [np.mean(honest) - np.mean(v) for v in attacked] if honest else []
            shown = [f"{np.mean(v):.1f}" if v else "-" for v in values.values()]
            rows.append([method, *shown, f"{max(losses):.1f}" if losses else "-"])
        header = ["method", *axes["attack"], "worst loss (pts)"]
        lines += [f"**{setting}**", "", markdown_table(header, rows)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the condensed table of an attack spec from its run folders."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attacks", description=__doc__)
    parser.add_argument("spec", type=Path, help="benchmarks/specs/attacks*.toml")
    parser.add_argument("--last", type=int, default=1, help="mean of this many last rounds")
    parser.add_argument("--key", default="test-accuracy", help="the round metric shown")
    parser.add_argument(
        "--baseline", default="", help="losses against this method's honest run (e.g. fedavg)"
    )
    options = parser.parse_args(argv)
    print(condensed_table(options.spec, options.last, options.key, options.baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
