"""How far honest clients' replies spread: the default of ``update-norm-factor`` rests on this.

An in-process federation (``benchmarks.harness.federation``) with the norm filter off; per round,
max / median ratios of the honest replies' norms. docs/reliability.md ("Honest norm ratios")
defines every figure and gives the commands (about a minute per run on one core).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import Message

from benchmarks.harness import federation
from beyond_averaging.strategies.influence import max_over_median

#: The strategies whose replies are measured, as run-config overrides.
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "elastic": {"strategy": "elastic"},
    "fedgma": {"strategy": "fedgma", "gma-mask": "hard"},
}
#: The federation (Dirichlet label skew; alpha, seed and rounds are the command's).
SETTING = {"dataset": "digits", "partition": "dirichlet", "num-clients": 10, "device": "cpu"}


def _norm(arrays: dict[str, np.ndarray[Any, Any]], keys: Sequence[str]) -> float:
    return float(np.sqrt(sum(np.sum(np.square(arrays[k], dtype=np.float64)) for k in keys)))


def _ratio(values: Sequence[float]) -> float:
    ratio = max_over_median(values)  # the ratio the strategies log and filter on
    return float("nan") if ratio is None else ratio


def round_figures(
    global_arrays: dict[str, np.ndarray[Any, Any]], replies: Sequence[Message]
) -> dict[str, float]:
    """The ratios of one round's honest replies (docs/reliability.md, "Honest norm ratios")."""
    float_keys = [k for k, v in global_arrays.items() if np.issubdtype(v.dtype, np.floating)]
    updates, counts = [], []
    records: dict[str, list[float]] = {"sensitivity": [], "gradient": []}
    for reply in replies:
        content = reply.content
        arrays = {k: a.numpy() for k, a in content.array_records["arrays"].items()}
        diff = {k: arrays[k].astype(np.float64) - global_arrays[k] for k in float_keys}
        updates.append(_norm(diff, float_keys))
        counts.append(float(content.metric_records["metrics"]["num-examples"]))  # type: ignore[arg-type]
        for name, norms in records.items():
            if name in content.array_records:
                record = {k: a.numpy() for k, a in content.array_records[name].items()}
                norms.append(_norm(record, list(record)))
    figures = {
        "update": _ratio(updates),
        "weight-share": max(counts) / sum(counts),
        # What an all-zero model would score: ||0 - w|| / median honest update norm.
        "zero-model": _norm(global_arrays, float_keys) / float(np.median(updates)),
    }
    figures.update({name: _ratio(norms) for name, norms in records.items() if norms})
    return figures


def measure(settings: dict[str, Any]) -> list[dict[str, float]]:
    """Run the federation in this process, the norm filter off; one dict of ratios per round."""
    fed = federation({**settings, "update-norm-factor": 0.0})
    per_round = []
    for server_round in range(1, fed.config.num_server_rounds + 1):
        sent = {k: a.numpy().astype(np.float64) for k, a in fed.arrays.items()}
        per_round.append(round_figures(sent, fed.round(server_round)))
    return per_round


def summarise(per_round: Sequence[dict[str, float]], /, **labels: Any) -> dict[str, Any]:
    """``labels``, then the max, median and min of every figure over the given rounds."""
    summary: dict[str, Any] = dict(labels)
    for key in per_round[0]:
        values = np.array([r[key] for r in per_round])
        extremes = {"max": np.nanmax(values), "median": np.nanmedian(values)}
        extremes["min"] = np.nanmin(values)
        summary[key] = {name: round(float(value), 3) for name, value in extremes.items()}
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every (strategy, alpha, seed): a JSON line per run, then one per strategy/alpha."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument(
        "--fraction-train", type=float, default=1.0, help="share of the 10 clients sampled"
    )
    args = parser.parse_args(argv)
    for name in args.strategies:
        for alpha in args.alphas:
            labels = {"strategy": name, "dirichlet-alpha": alpha}
            rounds: list[dict[str, float]] = []
            for seed in args.seeds:
                settings = {**SETTING, **STRATEGIES[name], "dirichlet-alpha": alpha, "seed": seed}
                settings |= {
                    "fraction-train": args.fraction_train,
                    "num-server-rounds": args.rounds,
                }
                measured = measure(settings)
                rounds += measured
                # One line per run as well, so that an interrupted sweep keeps what it measured.
                line = summarise(measured, **labels, seeds=[seed], rounds=args.rounds)
                print(json.dumps(line), flush=True)
            line = summarise(rounds, **labels, seeds=args.seeds, rounds=args.rounds)
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
