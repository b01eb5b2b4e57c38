"""Alarms true both ways: false alarms and misses of :func:`server.app.round_alarms` over a
spec's runs (docs/reliability.md, "Runs").

Every finished run of the given specs is replayed through the ServerApp's alarm rule, round by
round, from its recorded test accuracy and loss (so a run recorded before a change of the rule is
judged by the rule as it is now). Then, per spec:

- a **false alarm** is an honest run (``attack = "none"``, or no attack axis) that raises any
  alarm;
- a **miss** is a run whose last model is within ``CHANCE_MARGIN`` of chance, that learned less
  than its honest twin (the run of the same labels with ``attack = "none"``; a run with no twin
  counts), and that raises no alarm: it would end plain ``completed``;
- a **missed backdoor** is a run whose last ``backdoor-success`` is at least ``BACKDOOR_MISS``
  and that raises no alarm (``backdoor-suspected``, replayed from the recorded figures, counts).

Chance is the share of the test split's most frequent label, as the ServerApp computes it::

    .venv/bin/python -m benchmarks.alarms benchmarks/specs/attacks-adaptive.toml
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.report import RunData, read_run
from benchmarks.spec import load_spec
from beyond_averaging.server.app import CHANCE_MARGIN, chance_accuracy, data_spec, round_alarms
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.strategies.defences import trigger_unlearning as unlearning
from beyond_averaging.tasks.federation import DataSpec, load_server_splits

HONEST_ATTACK = "none"
#: A backdoor that succeeds on this share of triggered images is one the user must hear of (issue
#: 45's target holds each trigger family at or below it).
BACKDOOR_MISS = 0.2


def replayed_alarms(rounds: Sequence[Mapping[str, Any]], chance: float) -> dict[str, list[int]]:
    """Alarm kind -> the rounds that raise it, judged by :func:`round_alarms` and
    ``backdoor_alarms`` as the ServerApp judges them: each round against the rounds before it
    (round 0 first), the last as the last."""
    figures = [(float(r["test-accuracy"]), float(r["test-loss"])) for r in rounds]
    raised: dict[str, list[int]] = {}
    flagged = 0  # rounds whose dormant-inputs check fired (the strategy's recorded figure)
    for index in range(1, len(figures)):
        last = index == len(figures) - 1
        kinds = round_alarms(figures[:index], *figures[index], chance, last=last)
        kinds |= unlearning.backdoor_alarms(rounds[index], flagged)
        flagged += unlearning.dormant_flagged(rounds[index])
        for kind in kinds:
            raised.setdefault(kind, []).append(int(rounds[index]["round"]))
    return raised


@cache
def _chance(spec: DataSpec) -> float:
    test_set, _ = load_server_splits(spec)
    return chance_accuracy(test_set.labels)


def run_chance(data: RunData) -> float:
    """Chance of the run's test split (cached per data specification)."""
    return _chance(data_spec(parse_run_config(data.run.settings)))


@dataclass(frozen=True)
class Judged:
    """One run, replayed: its name, whether it is honest, its final accuracy, its twin's, chance
    and the alarms it raises."""

    name: str
    honest: bool
    final: float
    twin_final: float | None
    chance: float
    alarms: dict[str, list[int]]
    backdoor: float = 0.0  # the last round's backdoor-success

    @property
    def missed_backdoor(self) -> bool:
        """A backdoor at or above ``BACKDOOR_MISS`` and no alarm."""
        return not self.honest and self.backdoor >= BACKDOOR_MISS and not self.alarms

    @property
    def ends_at_chance(self) -> bool:
        """The last model is within ``CHANCE_MARGIN`` of chance."""
        return self.final <= self.chance + CHANCE_MARGIN

    @property
    def missed(self) -> bool:
        """Ends at chance, learned less than its honest twin, and raises no alarm."""
        below_twin = self.twin_final is None or self.final < self.twin_final
        return self.ends_at_chance and below_twin and not self.alarms


def judge(runs: Sequence[RunData]) -> list[Judged]:
    """Every run of one spec, replayed (:func:`replayed_alarms`) beside its honest twin."""
    finals = {data.run.name: float(data.rounds[-1]["test-accuracy"]) for data in runs}

    def twin(data: RunData) -> str:
        labels = {**data.run.labels, "attack": HONEST_ATTACK}
        names = [d.run.name for d in runs if d.run.labels == labels]
        return names[0] if names else ""

    judged = []
    for data in runs:
        honest = data.run.labels.get("attack", HONEST_ATTACK) == HONEST_ATTACK
        chance = run_chance(data)
        judged.append(
            Judged(
                data.run.name,
                honest,
                finals[data.run.name],
                None if honest else finals.get(twin(data)),
                chance,
                replayed_alarms(data.rounds, chance),
                float(data.rounds[-1].get("backdoor-success", 0.0)),
            )
        )
    return judged


def count_report(spec_paths: Sequence[Path]) -> str:
    """Per spec: runs, honest runs, false alarms, runs ending at chance, misses, with names."""
    lines = []
    for path in spec_paths:
        runs = [data for data in map(read_run, load_spec(path).runs()) if data is not None]
        judged = judge(runs)
        honest = [j for j in judged if j.honest]
        false_alarms = [j for j in honest if j.alarms]
        at_chance = [j for j in judged if not j.honest and j.ends_at_chance]
        misses = [j for j in judged if not j.honest and j.missed]
        alarmed = [j for j in judged if not j.honest and j.alarms]
        backdoors = [j for j in judged if not j.honest and j.backdoor >= BACKDOOR_MISS]
        lines.append(
            f"{path}: {len(judged)} finished runs; honest {len(honest)}, false alarms "
            f"{len(false_alarms)}; attacked {len(judged) - len(honest)}, with alarms "
            f"{len(alarmed)}, ending within {CHANCE_MARGIN:g} of chance {len(at_chance)}, "
            f"misses {len(misses)}; backdoors >= {BACKDOOR_MISS:g} {len(backdoors)}, missed "
            f"{sum(j.missed_backdoor for j in backdoors)}"
        )
        for j in false_alarms:
            lines.append(f"  false alarm: {j.name} ({j.final:.3f}): {j.alarms}")
        for j in misses:
            lines.append(f"  miss: {j.name} ends at {j.final:.3f}, chance {j.chance:.3f}")
        lines += [
            f"  missed backdoor: {j.name} ({j.backdoor:.3f})"
            for j in backdoors
            if j.missed_backdoor
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the false alarms and misses of each spec's finished runs."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.alarms", description=__doc__)
    parser.add_argument("specs", type=Path, nargs="+", help="benchmarks/specs/*.toml")
    print(count_report(parser.parse_args(argv).specs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
