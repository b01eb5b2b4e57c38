"""How far honest clients' replies spread, per round: max / median norm ratios in an in-process
federation with the norm filter off (the default ``update-norm-factor`` rests on them).
docs/reliability.md ("Honest norm ratios") defines every figure and gives the commands.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from beyond_averaging.server.interactive import federation
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


def measure(settings: dict[str, Any]) -> list[dict[str, float]]:
    """Run the federation in this process, the norm filter off; one dict of ratios per round."""
    fed = federation({**settings, "update-norm-factor": 0.0})
    per_round = []
    for server_round in range(1, fed.config.num_server_rounds + 1):
        sent = {k: a.numpy().astype(np.float64) for k, a in fed.arrays.items()}
        contents = [reply.content for reply in fed.round(server_round)]
        replied = [{k: a.numpy() for k, a in c.array_records["arrays"].items()} for c in contents]
        updates = update_norms(sent, replied)
        counts = [float(c.metric_records["metrics"]["num-examples"]) for c in contents]  # type: ignore[arg-type]
        floating = [{k: v for k, v in sent.items() if np.issubdtype(v.dtype, np.floating)}]
        figures = {"update": _ratio(updates), "weight-share": max(counts) / sum(counts)}
        # What an all-zero model would score: ||0 - w|| / median honest update norm.
        figures["zero-model"] = float(record_norms(floating)[0] / np.median(updates))
        for name in ("sensitivity", "gradient"):
            records = [c.array_records[name] for c in contents if name in c.array_records]
            if records:
                norms = record_norms([{k: a.numpy() for k, a in r.items()} for r in records])
                figures[name] = _ratio(norms)
        per_round.append(figures)
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--fraction-train", type=float, default=1.0, help="share sampled")
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
