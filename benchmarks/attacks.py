"""Byzantine clients against every rule and defence: the attack table of docs/reliability.md.

A run is an in-process federation (:func:`benchmarks.harness.federation`) whose first
``attackers`` nodes collude: an :class:`AttackGrid` rewrites their honest replies (:data:`ATTACKS`),
or they train on flipped labels. docs/reliability.md ("The attack table") defines the attacks and
gives the commands; the table is a spec of the runner whose ``runtime`` is :func:`run_attacked`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies

from benchmarks.harness import federation
from benchmarks.report import markdown_table, read_run
from benchmarks.spec import load_spec
from beyond_averaging.client import app as client_module
from beyond_averaging.server.bounded_pull import DelegatingGrid
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.recorder import RunRecorder
from beyond_averaging.server.strategy_factory import build_strategy
from beyond_averaging.strategies import ContractStrategy
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
)

Update = dict[str, npt.NDArray[np.float64]]


# ----------------------------------------------------------------------------- attacks
def alie_z(num_clients: int, num_attackers: int) -> float:
    """z of "a little is enough": s = floor(n/2 + 1) - m, z = Phi^-1((n - s) / n)."""
    supporters = math.floor(num_clients / 2 + 1) - num_attackers
    return statistics.NormalDist().inv_cdf((num_clients - supporters) / num_clients)


@dataclass(frozen=True)
class RoundView:
    """What the colluding attackers know in one round: every sampled client's honest update."""

    updates: Sequence[Update]  # one per reply, in reply order (float64, floating keys)
    attacker_positions: Sequence[int]
    rng: np.random.Generator


#: ``attack(view, position) -> malicious update`` for the attacker at ``position``.
ModelAttack = Callable[[RoundView, int], Update]


def _scaled(factor: float) -> ModelAttack:
    def attack(view: RoundView, position: int) -> Update:
        return {key: factor * value for key, value in view.updates[position].items()}

    return attack


def _noise(factor: float) -> ModelAttack:
    def attack(view: RoundView, position: int) -> Update:
        own = view.updates[position]
        direction = {key: view.rng.standard_normal(value.shape) for key, value in own.items()}
        scale = factor * _norm(own) / max(_norm(direction), 1e-30)
        return {key: scale * value for key, value in direction.items()}

    return attack


def _alie(view: RoundView, position: int) -> Update:
    z = alie_z(len(view.updates), len(view.attacker_positions))
    stacked = {key: np.stack([update[key] for update in view.updates]) for key in view.updates[0]}
    return {key: value.mean(axis=0) - z * value.std(axis=0) for key, value in stacked.items()}


def _norm(update: Mapping[str, npt.NDArray[Any]]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in update.values()))


@dataclass(frozen=True)
class Attack:
    """One attack: a model map, a claimed weight, or label flipping at the client."""

    model: ModelAttack | None = None
    num_examples: float | None = None
    flip_labels: bool = False


ATTACKS: dict[str, Attack] = {
    "none": Attack(),
    "sign-flip": Attack(model=_scaled(-5.0)),
    "sign-flip-1e12": Attack(model=_scaled(-5.0), num_examples=1e12),
    "noise": Attack(model=_noise(3.0)),
    "boost": Attack(model=_scaled(5.0)),
    "alie": Attack(model=_alie),
    "label-flip": Attack(flip_labels=True),
}


class AttackGrid(DelegatingGrid):
    """Rewrites the train replies of ``attackers`` (node ids) from the round's honest replies."""

    def __init__(self, inner: Grid, attackers: Iterable[int], attack: Attack, seed: int) -> None:
        super().__init__(inner)
        self.attackers = frozenset(attackers)
        self.attack = attack
        self.rng = np.random.default_rng(seed)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """The inner Grid's replies, the attackers' train replies rewritten in place."""
        messages = list(messages)
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if not train or (self.attack.model is None and self.attack.num_examples is None):
            return replies
        honest = [reply for reply in replies if not reply.has_error()]
        rows = [i for i, reply in enumerate(honest) if reply.metadata.src_node_id in self.attackers]
        if not rows:
            return replies
        # Every train message of a round carries the same global model.
        global_arrays = {
            k: v.numpy() for k, v in train[0].content.array_records[ARRAYS_RECORD].items()
        }
        floating = [k for k, v in global_arrays.items() if np.issubdtype(v.dtype, np.floating)]

        def view(record: str, relative: bool) -> RoundView:
            """Every honest reply's ``record`` in float64, less the global model if ``relative``."""
            base = global_arrays if relative else {}
            records = [reply.content.array_records[record] for reply in honest]
            updates = [
                {k: r[k].numpy().astype(np.float64) - base.get(k, 0.0) for k in r if k in floating}
                for r in records
            ]
            return RoundView(updates, rows, self.rng)

        models = view(ARRAYS_RECORD, relative=True)
        has_gradient = GRADIENT_RECORD in honest[0].content.array_records
        gradients = view(GRADIENT_RECORD, relative=False) if has_gradient else None
        for row in rows:
            content = honest[row].content
            if self.attack.model is not None:
                bad = self.attack.model(models, row)
                arrays = {k: v.numpy() for k, v in content.array_records[ARRAYS_RECORD].items()}
                for key, update in bad.items():
                    arrays[key] = (global_arrays[key] + update).astype(arrays[key].dtype)
                content[ARRAYS_RECORD] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
                if gradients is not None:
                    gradient = self.attack.model(gradients, row)
                    content[GRADIENT_RECORD] = ArrayRecord(
                        {key: Array(value.astype(np.float32)) for key, value in gradient.items()}
                    )
            if self.attack.num_examples is not None:
                metrics = dict(content.metric_records[METRICS_RECORD])
                metrics[NUM_EXAMPLES_KEY] = self.attack.num_examples
                content[METRICS_RECORD] = MetricRecord(metrics)
        return replies


# ----------------------------------------------------------------------------- label flipping
@contextlib.contextmanager
def flipped_labels(partitions: frozenset[int]) -> Iterator[None]:
    """While the block runs, the ClientApp trains ``partitions`` on labels C - 1 - y.

    The ClientApp reads its partition through ``client.app.device_partition``; for the
    ``partitions`` the replacement returns the same samples with flipped labels.
    """
    honest = client_module.device_partition

    def partition(spec: Any, partition_id: int, device: torch.device) -> DeviceData:
        data = honest(spec, partition_id, device)
        if partition_id not in partitions:
            return data
        return replace(data, labels=data.num_classes - 1 - data.labels)

    client_module.device_partition = partition  # type: ignore[assignment]
    try:
        yield
    finally:
        client_module.device_partition = honest


# ----------------------------------------------------------------------------- one run
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
    :data:`FLOWER_STRATEGIES` in place of the configured rule).

    Raises
    ------
    ValueError
        An unknown attack or Flower strategy, or a run configuration the app refuses.
    """
    attack_name = str(settings.get("attack", "none"))
    if attack_name not in ATTACKS:
        raise ValueError(f"attack = {attack_name!r}: use one of {sorted(ATTACKS)}")
    attack, flower = ATTACKS[attack_name], str(settings.get("flower", ""))
    run_settings = {k: v for k, v in settings.items() if k not in ("attack", "attackers", "flower")}
    config = parse_run_config(run_settings)
    told = int(settings.get("attackers", 0))  # what Krum and Bulyan assume, even in honest runs
    attackers = 0 if attack_name == "none" else told
    recorder = RunRecorder(
        config.output_dir,
        config.run_name,
        {**config.to_run_config(), "attack": attack_name, "attackers": attackers, "flower": flower},
    )
    flipped = frozenset(range(attackers) if attack.flip_labels else ())
    try:
        rule = build_strategy if not flower else lambda c, _: flower_strategy(flower, told, c)
        fed = federation(run_settings, rule)
        node_ids = sorted(fed.grid.get_node_ids())
        fed.grid = AttackGrid(fed.grid, node_ids[:attackers], attack, config.seed)
        loss, accuracy = fed.evaluate()
        recorder.log_round({"round": 0, "test-accuracy": accuracy, "test-loss": loss})
        for server_round in range(1, config.num_server_rounds + 1):
            started, sent = time.perf_counter(), fed.arrays
            with flipped_labels(flipped):
                fed.round(server_round)
            loss, accuracy = fed.evaluate()
            figures: dict[str, Any] = {}
            if isinstance(fed.strategy, ContractStrategy):  # Flower's keep no round metrics
                figures = dict(fed.strategy.last_round_metrics)
            recorder.log_round(
                {
                    **figures,
                    "round": server_round,
                    "test-accuracy": accuracy,
                    "test-loss": loss,
                    "round-seconds": time.perf_counter() - started,
                    "aggregated": int(fed.arrays is not sent),
                }
            )
    except BaseException as error:
        recorder.write_summary("failed", error=f"{type(error).__name__}: {error}")
        raise
    recorder.write_summary("completed")


# ----------------------------------------------------------------------------- condensed table
def condensed_table(spec_path: Path, metric_rounds: int = 1) -> str:
    """Per federation, one row per method and one column per attack: the test accuracy (%) of
    the final round (``metric_rounds`` > 1: the mean of that many last rounds), seeds averaged,
    and the largest loss against the method's own honest run. From the spec's run folders."""
    spec = load_spec(spec_path)
    cells: dict[tuple[str, ...], list[float]] = {}
    for data in filter(None, map(read_run, spec.runs())):
        curve = list(data.curve("test-accuracy").values())
        key = tuple(data.run.labels[axis] for axis in ("federation", "method", "attack"))
        cells.setdefault(key, []).append(100.0 * float(np.mean(curve[-metric_rounds:])))
    axes = {axis.name: axis.labels for axis in spec.axes}
    lines = []
    for setting in axes["federation"]:
        rows = []
        for method in axes["method"]:
            values = {a: cells.get((setting, method, a)) for a in axes["attack"]}
            honest = values.get("none")
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
    options = parser.parse_args(argv)
    print(condensed_table(options.spec, options.last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
