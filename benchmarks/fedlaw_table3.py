"""FedLAW's Table 3, FashionMNIST columns (FedAvg, FedLAW, FedLAW (SWA); MLP and LeNet), reproduced.

The paper's setting (Li et al., ICML 2023, section 6.2 and appendix D): 20 clients, all taking part
every round, Dirichlet(alpha) label skew, E = 3 local epochs of SGD (lr 0.08 x 0.99 per round,
momentum 0.9, weight decay 5e-4), the 784-200-200-10 MLP, a 100-sample class-balanced proxy set
drawn from the test set (10 per class) and removed from it, accuracy = mean test accuracy of the
last 10 rounds, 200 rounds, seeds 8, 9, 10. The client batch size is the authors' code default,
128 (the paper does not state it). ``--models lenet5`` runs the LeNet column (same setting),
``--strategies fedlaw-swa`` the FedLAW (SWA) row (``fedlaw-swa = true``).

Every run is this project's app, in one process: ``server.inprocess.run_inprocess`` runs the real
ServerApp (``server.app``: the same ``metrics.jsonl`` as ``ba-run`` writes, with the strategy's
``aggregation-seconds``) and hands each message to the real ClientApp of its node through the
in-process Grid, exactly what ``ba-run --runtime inprocess`` does. Flower's Ray simulation does the
same work but costs minutes per round on a small shared CPU machine; here nothing but the
transport differs. ``--client-backend vectorized`` trains each round's cohort as one batched
program (docs/runtimes.md).

Outputs:

- ``benchmarks/results/fedlaw/runs/<run>/``: each run's ``metrics.jsonl`` and ``summary.json``;
- ``benchmarks/results/fedlaw/<run>.json``: accuracy per round, gamma per round, the last-10
  accuracy, mean server aggregation seconds, wall time (a run whose JSON exists is not redone);
- the report, beside the runs in ``--results`` unless ``--publish [DIR]`` (``docs/results`` when
  no DIR is named) puts it there: ``fedlaw_table3.md`` (paper vs ours, hardware, command, wall
  time, server seconds per round) and ``fedlaw_table3.png`` (accuracy and gamma per round). A
  trial run thus never overwrites the published table.

Usage::

    .venv/bin/python -m benchmarks.fedlaw_table3 --rounds 20 --seeds 8
    .venv/bin/python -m benchmarks.fedlaw_table3 --rounds 200 --seeds 8 9 10   # the paper's
    .venv/bin/python -m benchmarks.fedlaw_table3 --rounds 200 --seeds 8 9 10 --report-only \
        --publish   # its table into docs/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt
import numpy as np
import torch

from benchmarks.run_lock import claim_run
from benchmarks.seed_stats import mean_sd
from beyond_averaging.server.inprocess import run_inprocess
from beyond_averaging.server.launch import parse_overrides

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "fedlaw"
PUBLISH = REPO / "docs" / "results"
LAST_ROUNDS = 10  # the paper's metric: mean test accuracy of the last 10 rounds

#: Paper, Table 3, FashionMNIST: (model, alpha, method) -> top-1 test accuracy (%).
PAPER_TABLE3 = {
    ("mlp", 100.0, "fedavg"): 89.29,
    ("mlp", 100.0, "fedlaw"): 88.51,
    ("mlp", 100.0, "fedlaw-swa"): 88.27,
    ("mlp", 0.1, "fedavg"): 85.11,
    ("mlp", 0.1, "fedlaw"): 86.30,
    ("mlp", 0.1, "fedlaw-swa"): 86.89,
    ("lenet5", 100.0, "fedavg"): 90.54,
    ("lenet5", 100.0, "fedlaw"): 90.66,
    ("lenet5", 100.0, "fedlaw-swa"): 90.51,
    ("lenet5", 0.1, "fedavg"): 88.08,
    ("lenet5", 0.1, "fedlaw"): 88.26,
    ("lenet5", 0.1, "fedlaw-swa"): 88.18,
}

#: The rows of the table as run-config overrides.
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "fedlaw": {"strategy": "fedlaw"},
    "fedlaw-swa": {"strategy": "fedlaw", "fedlaw-swa": True},
}

#: The Table 3 setting as run-config overrides (everything else: the RunConfig defaults).
TABLE3_SETTING: dict[str, Any] = {
    "dataset": "fashion-mnist",
    "model": "mlp",
    "num-clients": 20,
    "fraction-train": 1.0,
    "min-train-replies": 20,
    "partition": "dirichlet",
    "local-epochs": 3,
    "batch-size": 128,
    "learning-rate": 0.08,
    "lr-decay": 0.99,
    "momentum": 0.9,
    "weight-decay": 5e-4,
    "proxy-per-class": 10,  # FedAvg too: every method is tested on the same remaining test set
    # The norm filter off, so that the paper's algorithm runs unchanged: at this setting a
    # client's local training diverges in a few rounds (updates up to 227x the median), the default
    # filter drops such a reply, and with every client required the round would keep the model
    # (docs/reliability.md; ``--set update-norm-factor=10.0 min-train-replies=2`` runs it on).
    "update-norm-factor": 0.0,
}


def summarise_run(
    run_dir: Path, alpha: float, strategy: str, seed: int, wall: float, model: str
) -> dict[str, Any]:
    """The figures of one run from its metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    rounds = [json.loads(line) for line in lines if line.strip()]
    trained = [entry for entry in rounds if entry["round"] > 0]
    accuracy = [100.0 * entry["test-accuracy"] for entry in rounds]
    ratios = [e["update-norm-ratio"] for e in trained if "update-norm-ratio" in e]
    return {
        "model": model,
        "alpha": alpha,
        "strategy": strategy,
        "seed": seed,
        "rounds": len(trained),
        "accuracy-per-round": accuracy,
        "last-10-accuracy": float(np.mean(accuracy[-LAST_ROUNDS:])),
        "gamma-per-round": [entry.get("fedlaw-gamma") for entry in trained],
        # A round that kept the model (too few valid replies) has no aggregation time.
        "aggregation-seconds-mean": float(
            np.mean([e["aggregation-seconds"] for e in trained if "aggregation-seconds" in e])
        ),
        "rounds-not-aggregated": sum(1 for e in trained if e.get("aggregated") == 0),
        # Largest honest update norm / round median: what update-norm-factor would compare.
        "update-norm-ratio-per-round": ratios,
        "update-norm-ratio-max": max(ratios) if ratios else None,
        "round-seconds-mean": float(np.mean([e["round-seconds"] for e in trained])),
        "wall-seconds": wall,
        "run-dir": str(run_dir.relative_to(REPO)) if run_dir.is_relative_to(REPO) else str(run_dir),
    }


def hardware() -> str:
    """CPU model, cores and torch threads of this machine, in one line."""
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{model}, {__import__('os').cpu_count()} cores visible, {gpu}, torch "
        f"{torch.__version__} ({torch.get_num_threads()} intra-op threads), Python "
        f"{platform.python_version()}"
    )


def write_report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    """The markdown table (paper vs ours) and the figure."""
    args.publish.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for result in results:
        # Results written before the model column existed are the MLP's.
        # A run with --set options is its own row: the method named with them.
        extra = ", ".join(f"{k}={v}" for k, v in result.get("overrides", {}).items())
        method = f"{result['strategy']} ({extra})" if extra else result["strategy"]
        key = (result.get("model", "mlp"), result["alpha"], method)
        groups.setdefault(key, []).append(result)
    order = {name: index for index, name in enumerate(METHODS)}
    keys = sorted(
        groups, key=lambda k: (k[0] != "mlp", k[0], -k[1], order.get(k[2], len(order)), k[2])
    )
    seeds = sorted({r["seed"] for r in results})
    lines = [
        "# FedLAW Table 3, FashionMNIST: paper vs this project",
        "",
        "Accuracy = mean test accuracy (%) of the last 10 rounds (± sample standard deviation "
        "over seeds). Paper: 200 rounds, seeds 8, 9, 10. Ours: "
        f"**{args.rounds} rounds**, seed(s) {', '.join(map(str, seeds))}, clients training on "
        f"{100 * (1 - args.client_holdout):g} % of their partition (the authors: 70 %), client "
        f"backend `{args.client_backend}`."
        + (
            " With fewer rounds than the paper our absolute numbers sit below a converged run; "
            "the FedAvg-FedLAW difference at equal rounds is the comparable quantity."
            if args.rounds < 200
            else ""
        ),
        "",
        "| model | alpha | method | paper (200 rounds) | ours | seeds | server s/round "
        "(aggregation-seconds) | gamma mean (min-max) | largest update-norm-ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, alpha, strategy in keys:
        runs = groups[(model, alpha, strategy)]
        last = np.array([run["last-10-accuracy"] for run in runs])
        seconds = float(np.mean([run["aggregation-seconds-mean"] for run in runs]))
        gammas = [g for run in runs for g in run["gamma-per-round"] if g is not None]
        gamma = f"{np.mean(gammas):.3f} ({min(gammas):.3f}-{max(gammas):.3f})" if gammas else "-"
        ratios = [r["update-norm-ratio-max"] for r in runs if r.get("update-norm-ratio-max")]
        ratio = f"{max(ratios):.1f} ({len(ratios)} of {len(runs)} runs)" if ratios else "-"
        paper = PAPER_TABLE3.get((model, alpha, strategy))
        paper_text = f"{paper:.2f}" if paper is not None else "-"
        lines.append(
            f"| {model} | {alpha:g} | {strategy} | {paper_text} | {mean_sd(last, digits=2)} | "
            f"{len(runs)} | {seconds:.3f} | {gamma} | {ratio} |"
        )
    lines += ["", "Seed by seed (last-10 accuracy, %):", ""]
    for model, alpha, strategy in keys:
        runs = sorted(groups[(model, alpha, strategy)], key=lambda r: r["seed"])
        lines.append(
            f"- {model}, alpha {alpha:g}, {strategy}: "
            + ", ".join(f"seed {r['seed']} {r['last-10-accuracy']:.2f}" for r in runs)
        )
    # The command that runs what the table shows: a --report-only call names the runs it read.
    arguments = [part for part in sys.argv[1:] if part != "--report-only"]
    command = " ".join(
        shlex.quote(part)
        for part in [".venv/bin/python", "-m", "benchmarks.fedlaw_table3", *arguments]
    )
    lines += [
        "",
        "`update-norm-ratio`: the round's largest client update norm over its median, which the "
        "default norm filter compares with `update-norm-factor` (off in these runs; "
        "docs/reliability.md).",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {hardware()}.",
        "",
        f"Wall time of the runs: {sum(r['wall-seconds'] for r in results) / 60:.1f} min in all, "
        f"CPU time {sum(r.get('cpu-seconds', 0.0) for r in results) / 60:.1f} min ("
        + ", ".join(
            f"{r['strategy']} {r.get('model', 'mlp')} alpha={r['alpha']:g} seed {r['seed']}: "
            f"{r['wall-seconds'] / 60:.1f} min"
            for r in results
        )
        + ").",
        "",
        "![accuracy and gamma per round](fedlaw_table3.png)",
        "",
    ]
    (args.publish / "fedlaw_table3.md").write_text("\n".join(lines), encoding="utf-8")

    panels = sorted({(k[0], k[1]) for k in keys}, key=lambda p: (p[0] != "mlp", p[0], -p[1]))
    colours = {"fedavg": "tab:blue", "fedlaw": "tab:red", "fedlaw-swa": "tab:orange"}
    figure, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 7), squeeze=False)
    for column, (model, alpha) in enumerate(panels):
        for _, _, strategy in (k for k in keys if k[:2] == (model, alpha)):
            runs = groups[(model, alpha, strategy)]
            colour = colours.get(strategy)  # None: matplotlib's next colour (a --set row)
            curves = np.array([run["accuracy-per-round"] for run in runs])
            axes[0][column].plot(curves.mean(0), color=colour, label=strategy)
            paper = PAPER_TABLE3.get((model, alpha, strategy))
            if paper is not None:
                axes[0][column].axhline(paper, color=colour, linestyle=":", linewidth=1)
            if not strategy.startswith("fedavg"):
                gamma_curves = np.array([run["gamma-per-round"] for run in runs], dtype=float)
                rounds = range(1, gamma_curves.shape[1] + 1)
                axes[1][column].plot(rounds, gamma_curves.mean(0), color=colour, label=strategy)
        axes[0][column].set_title(f"FashionMNIST {model}, alpha = {alpha:g} (dotted: paper)")
        axes[0][column].set_xlabel("round")
        axes[0][column].set_ylabel("test accuracy (%)")
        axes[0][column].set_ylim(60, 92)
        axes[0][column].legend()
        axes[1][column].set_xlabel("round")
        axes[1][column].set_ylabel("FedLAW gamma")
    figure.tight_layout()
    figure.savefig(args.publish / "fedlaw_table3.png", dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the missing runs, then write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="paper: 200")
    parser.add_argument("--seeds", type=int, nargs="+", default=[8, 9, 10], help="paper: 8 9 10")
    parser.add_argument("--alphas", type=float, nargs="+", default=[100.0, 0.1])
    parser.add_argument(
        "--strategies", nargs="+", default=["fedavg", "fedlaw"], choices=list(METHODS)
    )
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=["mlp", "lenet5"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--client-backend",
        default="clientapp",
        choices=["clientapp", "vectorized"],
        help="who trains a round's cohort in process (docs/runtimes.md)",
    )
    parser.add_argument(
        "--client-holdout",
        type=float,
        default=0.0,
        help="share of each client's partition not trained on (the authors' code: 0.3)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="run options over the Table 3 setting (e.g. update-norm-factor=10); each run's "
        "name ends with them",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write the report from the runs of these arguments already done",
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--publish",
        type=Path,
        nargs="?",
        const=PUBLISH,
        default=None,
        help="write the report to this folder (docs/results when none is named) instead of "
        "beside the runs in --results",
    )
    args = parser.parse_args(argv)
    if args.publish is None:
        args.publish = args.results
    overrides = parse_overrides(args.overrides)
    suffix = "".join(
        f"-{key}{value:g}" if isinstance(value, float) else f"-{key}{value}"
        for key, value in overrides.items()
    )
    torch.set_num_threads(args.threads)
    args.results.mkdir(parents=True, exist_ok=True)
    results = []
    runs = itertools.product(args.models, args.alphas, args.seeds, args.strategies)
    for model, alpha, seed, strategy in runs:
        name = f"table3-{strategy}-alpha{alpha:g}-seed{seed}-rounds{args.rounds}"
        if args.client_holdout:
            name += f"-holdout{args.client_holdout:g}"
        if model != "mlp":  # the MLP runs keep the names they had before LeNet
            name += f"-{model}"
        name += suffix
        result_path = args.results / f"{name}.json"
        if args.report_only and not result_path.is_file():
            print(f"{name}: not run yet, left out of the report (--report-only)", flush=True)
            continue
        lock = claim_run(args.results / f"{name}.lock")
        if lock is None:
            print(f"{name}: another process is running it now, left out", flush=True)
            continue
        with lock:  # checked under the lock: another process may have just finished it
            if result_path.is_file():
                results.append(json.loads(result_path.read_text(encoding="utf-8")))
                print(f"{name}: done before, reusing {result_path}", flush=True)
                continue
            settings = {
                **TABLE3_SETTING,
                **METHODS[strategy],
                "model": model,
                "dirichlet-alpha": alpha,
                "seed": seed,
                "num-server-rounds": args.rounds,
                "device": args.device,
                "run-name": name,
                "output-dir": str(args.results / "runs"),
                "client-holdout": args.client_holdout,
                **overrides,
            }
            if args.client_backend != "clientapp":  # the key exists from B2's option on
                settings["client-backend"] = args.client_backend
            run_started, cpu_started = time.perf_counter(), time.process_time()
            run_inprocess(REPO, settings)
            run_dir = args.results / "runs" / name
            result = summarise_run(
                run_dir, alpha, strategy, seed, time.perf_counter() - run_started, model
            )
            result["cpu-seconds"] = time.process_time() - cpu_started
            result["overrides"] = overrides
            result_path.write_text(json.dumps(result, indent=2), encoding="utf-8")
            results.append(result)
            print(
                f"{name}: last-10 accuracy {result['last-10-accuracy']:.2f}%, "
                f"{result['wall-seconds'] / 60:.1f} min",
                flush=True,
            )
    if not results:
        print(f"no run of these arguments is in {args.results}: no report", flush=True)
        return 1
    write_report(results, args)
    print(f"report: {args.publish / 'fedlaw_table3.md'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
