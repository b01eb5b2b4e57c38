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
import numpy.typing as npt
from flwr.app import Message

from benchmarks.harness import federation
from beyond_averaging.strategies.influence import max_over_median, record_norms, update_norms

#: The strategies whose replies are measured, as run-config overrides.
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "elastic": {"strategy": "elastic"},
    "fedgma": {"strategy": "fedgma", "gma-mask": "hard"},
}
#: The federation (Dirichlet label skew; alpha, seed and rounds are the command's).
SETTING = {"dataset": "digits", "partition": "dirichlet", "num-clients": 10, "device": "cpu"}


def _ratio(values: npt.NDArray[np.float64]) -> float:
    ratio = max_over_median(values)  # the ratio the strategies log and filter on
    return float("nan") if ratio is None else ratio


def round_figures(
    global_arrays: dict[str, np.ndarray[Any, Any]], replies: Sequence[Message]
) -> dict[str, float]:
    """The ratios of one round's honest replies (docs/reliability.md, "Honest norm ratios"),
    from the norms the strategies' filter computes."""
    contents = [reply.content for reply in replies]
    replied = [{k: a.numpy() for k, a in c.array_records["arrays"].items()} for c in contents]
    updates = update_norms(global_arrays, replied)
    metrics = [c.metric_records["metrics"] for c in contents]
    counts = [float(m["num-examples"]) for m in metrics]  # type: ignore[arg-type]
    floating = {k: v for k, v in global_arrays.items() if np.issubdtype(v.dtype, np.floating)}
    figures = {
        "update": _ratio(updates),
        "weight-share": max(counts) / sum(counts),
        # What an all-zero model would score: ||0 - w|| / median honest update norm.
        "zero-model": float(record_norms([floating])[0] / np.median(updates)),
    }
    for name in ("sensitivity", "gradient"):
        records = [c.array_records[name] for c in contents if name in c.array_records]
        if records:
            norms = record_norms([{k: a.numpy() for k, a in r.items()} for r in records])
            figures[name] = _ratio(norms)
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
