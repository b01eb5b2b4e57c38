"""Elastic aggregation vs FedAvg, and FedAdam with and without it: test accuracy per round.

Setting: Dirichlet(0.1) label skew over 10 clients, half of them sampled each round
(fraction-train 0.5), the default mlp and local training of the run configuration (2 local epochs,
SGD lr 0.05, momentum 0.9), elastic tau 0.5 and sensitivity decay 0.9 (the paper's). Four variants:

- ``fedavg``: plain averaging;
- ``elastic``: elastic aggregation, server lr 1 (the paper's rule);
- ``fedadam``: FedAvg's mean update through the Adam server optimizer (server lr ``--adam-lr``);
- ``fedadam+elastic``: the zeta-scaled update through the same Adam optimizer.

Two runtimes, chosen with ``--runtime`` (``server.launch.launch_runtime``, what ``ba-run
--runtime`` runs; docs/runtimes.md):

- ``simulation``: the app under Flower's Ray simulation. On the 2 shared cores this was measured
  at about 4.5 minutes for one 30-round digits run, mostly Flower/Ray messaging and start-up, far
  too slow for a sweep.
- ``inprocess`` (default): the same ServerApp and ClientApp in this process through
  ``server.inprocess`` (one Flower ``Context`` per node, kept across rounds, so the sensitivity
  moving average persists as in a deployment). Only Ray, gRPC and the SuperLink are left out. Node
  ids are in partition order, so the sampled cohorts differ from a Flower simulation's (whose node
  ids are random) but are the same for every method of one seed.

Both read the centralised test accuracy after every round from the run's metrics.jsonl.

One JSON per run goes to
``benchmarks/results/elastic/`` (git-ignored; existing ones are reused, so an interrupted sweep
resumes), and the report (a Markdown table and a PNG plot of mean accuracy per round with a band
of +/- one sample standard deviation over seeds) to ``benchmarks/results/elastic/`` and, with
``--publish``, to ``docs/results/``.

The paper's kind of setting (Elastic combined with FedAvgM, FedAdam and FedProx, several taus, the
``cnn``, rounds to a target accuracy) is a named sweep: ``--name`` keeps its runs in
``benchmarks/results/elastic/<name>/`` and its report in ``elastic_<name>.{md,png}``; ``--bases``
picks the base optimizers (each run alone and with Elastic), ``--taus`` the Elastic taus,
``--model`` the model and ``--target`` the accuracy of the rounds-to-target column.

Usage (from the repository root)::

    .venv/bin/python benchmarks/elastic_evidence.py --publish
    .venv/bin/python benchmarks/elastic_evidence.py --report-only --publish  # redraw from JSON
    .venv/bin/python benchmarks/elastic_evidence.py --name paper_setting --model cnn \
        --datasets digits --rounds digits=50 --bases fedavg fedavgm fedadam fedprox \
        --taus 0.2 0.5 0.8 --target 80 --publish
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

import torch  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402

from benchmarks.seed_stats import band, mean_sd  # noqa: E402
from beyond_averaging.server.launch import (  # noqa: E402
    RUNTIMES,
    LaunchError,
    launch_runtime,
    run_config_argument,
)
from beyond_averaging.tasks.models import build_model  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results" / "elastic"
DOCS_DIR = REPO / "docs" / "results"
REPORT_STEM = "elastic_evidence"

#: The federation every run shares (keys of the run configuration).
COMMON: dict[str, Any] = {
    "partition": "dirichlet",
    "dirichlet-alpha": 0.1,
    "num-clients": 10,
    "fraction-train": 0.5,
    "model": "mlp",
    "device": "cpu",
}


#: Base federated optimizers of the paper-setting sweep (``--bases``), as run-config overrides.
#: FedAvgM: server momentum 0.9 at server lr 0.1 (an effective step of 1 on a steady update,
#: FedAvg's); FedProx: proximal mu 0.01 on the clients; FedAdam: ``--adam-lr``.
def base_optimizers(adam_lr: float) -> dict[str, dict[str, Any]]:
    """Run-configuration overrides of each base optimizer that Elastic is combined with."""
    return {
        "fedavg": {"strategy": "fedavg"},
        "fedavgm": {"strategy": "fedavg", "server-optimizer": "momentum", "server-lr": 0.1},
        "fedadam": {"strategy": "fedavg", "server-optimizer": "adam", "server-lr": adam_lr},
        "fedprox": {"strategy": "fedavg", "proximal-mu": 0.01},
    }


def elastic_name(base: str, tau: float | None) -> str:
    """``elastic`` / ``<base>+elastic`` (the run config's tau) or ``...-tau<tau>``."""
    name = "elastic" if base == "fedavg" else f"{base}+elastic"
    return name if tau is None else f"{name}-tau{tau:g}"


def variants(
    adam_lr: float,
    bases: Sequence[str] = ("fedavg", "fedadam"),
    taus: Sequence[float] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run-configuration overrides of each compared method: every base with and without Elastic.

    ``taus`` None runs Elastic at the run configuration's tau (0.5) under the names ``elastic`` /
    ``<base>+elastic``; otherwise once per tau, named ``...-tau<tau>``.
    """
    optimizers = base_optimizers(adam_lr)
    compared: dict[str, dict[str, Any]] = {}
    for base in bases:
        compared[base] = optimizers[base]
        for tau in [None] if taus is None else list(taus):
            extra = {} if tau is None else {"elastic-tau": tau}
            compared[elastic_name(base, tau)] = {
                **optimizers[base],
                "strategy": "elastic",
                **extra,
            }
    return compared


def baseline_of(variant: str) -> str | None:
    """What a method is compared with: Elastic with its own base optimizer, a base with FedAvg."""
    if "elastic" not in variant:
        return None if variant == "fedavg" else "fedavg"
    return variant.split("+", 1)[0] if "+" in variant else "fedavg"


def use_sweep(name: str) -> None:
    """Keep a named sweep's runs and report apart from the default one's."""
    global RESULTS_DIR, REPORT_STEM
    RESULTS_DIR = RESULTS_DIR / name
    REPORT_STEM = f"elastic_{name}"


def upload_bytes() -> str:
    """Markdown: bytes of the ``sensitivity`` record in float32 and float16, next to ``arrays``.

    Two measures per record: the .npy payloads (sum of ``len(Array.data)``) and the size of the
    ArrayRecord's protobuf message, which is what the reply carries over gRPC.
    """
    from flwr.common.serde import array_record_to_proto

    from beyond_averaging.client.sensitivity import compute_sensitivity, to_upload
    from beyond_averaging.tasks.datasets import load_dataset

    digits_shape = load_dataset("digits", seed=0)[0].input_shape
    rows = [
        "| model | parameters | arrays (protobuf B) | sensitivity float32: npy / protobuf B | "
        "sensitivity float16: npy / protobuf B | float16 / float32 |",
        "|---|---|---|---|---|---|",
    ]
    for label, shape in (
        (f"mlp on digits {digits_shape}", digits_shape),
        ("mlp 784-200-200-10", (784,)),
    ):
        model = build_model("mlp", shape, 10, seed=0)
        sensitivity = compute_sensitivity(model, [torch.randn(4, *shape)])
        arrays = ArrayRecord({k: v.detach() for k, v in model.state_dict().items()})
        sizes = {}
        for dtype in ("float32", "float16"):
            record = to_upload(sensitivity, dtype)
            payload = sum(len(array.data) for array in record.values())
            sizes[dtype] = (payload, array_record_to_proto(record).ByteSize())
        count = sum(value.numel() for value in sensitivity.values())
        rows.append(
            f"| {label} | {count:,} | {array_record_to_proto(arrays).ByteSize():,} | "
            f"{sizes['float32'][0]:,} / {sizes['float32'][1]:,} | "
            f"{sizes['float16'][0]:,} / {sizes['float16'][1]:,} | "
            f"{sizes['float16'][1] / sizes['float32'][1]:.3f} |"
        )
    return "\n".join(rows) + "\n"


def run_one(
    dataset: str,
    variant: str,
    overrides: Mapping[str, Any],
    seed: int,
    rounds: int,
    client_cpus: int,
    runs_dir: Path,
    runtime: str,
) -> dict[str, Any]:
    """One run (in this process or through ``launch``) and its per-round record."""
    settings = {
        **COMMON,
        **overrides,
        "dataset": dataset,
        "seed": seed,
        "num-server-rounds": rounds,
        "output-dir": str(runs_dir),
        "run-name": f"{dataset}-{variant.replace('+', '-')}-seed{seed}",
    }
    started, started_cpu = time.perf_counter(), time.process_time()
    run_dir = launch_runtime(
        runtime,
        REPO,
        [run_config_argument(settings)],
        # in process: keep the torch threads that --threads set
        client_cpus=client_cpus if runtime == "simulation" else torch.get_num_threads(),
    )
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    accuracy = [json.loads(line)["test-accuracy"] for line in lines if line.strip()]
    return {
        "dataset": dataset,
        "variant": variant,
        "seed": seed,
        "runtime": runtime,
        "settings": settings,
        "wall-seconds": time.perf_counter() - started,
        "cpu-seconds-this-process": time.process_time() - started_cpu,
        "accuracy": accuracy,
    }


def result_path(dataset: str, variant: str, seed: int) -> Path:
    """Where one run's JSON lives."""
    return RESULTS_DIR / f"{dataset}-{variant.replace('+', '-')}-seed{seed}.json"


def load_results() -> list[dict[str, Any]]:
    """Every saved run."""
    return [json.loads(path.read_text()) for path in sorted(RESULTS_DIR.glob("*-seed*.json"))]


#: Rounds averaged for the "late accuracy" (less noisy than the last round alone).
TAIL_ROUNDS = 5


def curves_by_seed(results: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[int, Any]]:
    """Accuracy curves (percent) per (dataset, variant), keyed by seed."""
    grouped: dict[tuple[str, str], dict[int, Any]] = {}
    for result in results:
        curve = np.asarray(result["accuracy"], dtype=np.float64) * 100.0
        grouped.setdefault((result["dataset"], result["variant"]), {})[result["seed"]] = curve
    return grouped


def group(results: Sequence[dict[str, Any]]) -> dict[tuple[str, str], np.ndarray[Any, Any]]:
    """Accuracy curves stacked over seeds, per (dataset, variant); curves cut to the shortest."""
    stacked = {}
    for key, by_seed in curves_by_seed(results).items():
        length = min(len(curve) for curve in by_seed.values())
        stacked[key] = np.array([by_seed[seed][:length] for seed in sorted(by_seed)])
    return stacked


def rounds_to_target(curve: np.ndarray[Any, Any], target: float) -> int | None:
    """First round whose accuracy (percent) reaches ``target``; None if none does."""
    reached = np.flatnonzero(curve[1:] >= target)
    return int(reached[0]) + 1 if reached.size else None


def describe_rounds_to_target(curves: np.ndarray[Any, Any], target: float) -> str:
    """Mean (over the seeds that got there) rounds to ``target`` and how many seeds got there."""
    hits = [rounds_to_target(curve, target) for curve in curves]
    reached = [hit for hit in hits if hit is not None]
    if not reached:
        return f"never (0/{len(hits)})"
    return f"{np.mean(reached):.1f} ({len(reached)}/{len(hits)})"


def paired_rounds_to_target(
    own: Mapping[int, Any], baseline: Mapping[int, Any], seeds: Sequence[int], target: float
) -> str:
    """Mean seed-paired difference in rounds to ``target`` (seeds where both got there)."""
    pairs = [
        (rounds_to_target(own[s], target), rounds_to_target(baseline[s], target)) for s in seeds
    ]
    reached = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not reached:
        return f"rounds to {target:g} %: n/a"
    difference = float(np.mean([a - b for a, b in reached]))
    return f"rounds to {target:g} % {difference:+.1f} ({len(reached)} seeds)"


def table(
    results: Sequence[dict[str, Any]], order: Sequence[str], target: float | None = None
) -> str:
    """Markdown: final, late and all-round mean accuracy (mean +/- sample sd over seeds), the
    seed-paired difference in late accuracy against the method's baseline and, with a
    ``target`` (percent), the rounds each seed needed to reach it."""
    by_seed, stacked = curves_by_seed(results), group(results)
    target_column = "" if target is None else f" rounds to {target:g} % (seeds there) |"
    header = (
        f"| dataset | method | seeds | rounds | final acc. (%) | last {TAIL_ROUNDS} rounds (%) | "
        f"all rounds (%) | last {TAIL_ROUNDS} rounds vs baseline (pts) |{target_column}\n"
        f"|---|---|---|---|---|---|---|---|{'' if target is None else '---|'}\n"
    )
    rows = []
    for dataset in dict.fromkeys(result["dataset"] for result in results):
        for variant in order:
            curves = stacked.get((dataset, variant))
            if curves is None:
                continue
            final = curves[:, -1]
            tail = curves[:, -TAIL_ROUNDS:].mean(axis=1)
            overall = curves[:, 1:].mean(axis=1)
            delta = "-"
            baseline_name = baseline_of(variant)
            baseline = by_seed.get((dataset, baseline_name or ""))
            if baseline:
                own = by_seed[(dataset, variant)]
                seeds = sorted(set(own) & set(baseline))
                difference = np.array(
                    [
                        own[s][-TAIL_ROUNDS:].mean() - baseline[s][-TAIL_ROUNDS:].mean()
                        for s in seeds
                    ]
                )
                better = int((difference > 0).sum())
                delta = (
                    f"{difference.mean():+.1f} vs {baseline_name} "
                    f"(better in {better}/{len(seeds)} seeds)"
                )
                if target is not None:
                    delta += "; " + paired_rounds_to_target(own, baseline, seeds, target)
            rows.append(
                f"| {dataset} | {variant} | {len(curves)} | {curves.shape[1] - 1} | "
                f"{mean_sd(final)} | {mean_sd(tail)} | {mean_sd(overall)} | {delta} |"
                + ("" if target is None else f" {describe_rounds_to_target(curves, target)} |")
            )
    return header + "\n".join(rows) + "\n"


def plot(results: Sequence[dict[str, Any]], order: Sequence[str], path: Path) -> None:
    """Mean test accuracy per round, +/- one sample sd band over seeds, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacked = group(results)
    datasets = list(dict.fromkeys(result["dataset"] for result in results))
    figure, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for axis, dataset in zip(axes[0], datasets, strict=True):
        for variant in order:
            curves = stacked.get((dataset, variant))
            if curves is None:
                continue
            mean, std = band(curves)
            rounds = np.arange(curves.shape[1])
            # One colour per base optimizer; a line style per tau (solid: without Elastic).
            base = baseline_of(variant) if "elastic" in variant else variant
            color = BASE_COLORS.get(base or "fedavg", "tab:gray")
            linestyle = "-"
            if "elastic" in variant:
                linestyle = TAU_STYLES.get(variant.rsplit("-tau", 1)[-1], "--")
            seeds = f"{len(curves)} seed{'s' if len(curves) > 1 else ''}"
            axis.plot(rounds, mean, linestyle, color=color, label=f"{variant} ({seeds})")
            axis.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.12)
        axis.set_title(
            f"{dataset}, {COMMON['model']}, Dirichlet({COMMON['dirichlet-alpha']:g}), "
            f"{COMMON['num-clients']} clients, fraction {COMMON['fraction-train']:g} per round"
        )
        axis.set_xlabel("round")
        axis.set_ylabel("test accuracy (%)")
        axis.grid(alpha=0.3)
        axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


BASE_COLORS = {
    "fedavg": "tab:blue",
    "fedavgm": "tab:green",
    "fedadam": "tab:red",
    "fedprox": "tab:purple",
}
TAU_STYLES = {"0.2": ":", "0.5": "--", "0.8": "-."}


def report(
    order: Sequence[str],
    adam_lr: float,
    publish: bool,
    target: float | None = None,
    command: str = "",
) -> None:
    """Write the table and the plot from the saved JSON (and copy them to docs/ if asked)."""
    results = load_results()
    if not results:
        raise SystemExit(f"no results in {RESULTS_DIR}: run without --report-only first")
    wall = sum(result["wall-seconds"] for result in results)
    reproduce = f"\n\nReproduce: `{command}`" if command else ""
    markdown = (
        f"Elastic aggregation evidence ({len(results)} runs, runtime "
        f"{'/'.join(sorted({r.get('runtime', 'flower') for r in results}))}, "
        f"{wall / 60:.1f} min of wall time on a shared 2-core CPU; "
        f"FedAdam server lr {adam_lr}, eps 1e-3, betas 0.9/0.99; FedAvgM server lr 0.1, "
        f"momentum 0.9; FedProx mu 0.01). Accuracy in %, mean ± sample standard deviation over "
        f"seeds.{reproduce}\n\n{table(results, order, target)}"
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{REPORT_STEM}.md").write_text(markdown, encoding="utf-8")
    plot(results, order, RESULTS_DIR / f"{REPORT_STEM}.png")
    print(markdown)
    if publish:
        DOCS_DIR.mkdir(parents=True, exist_ok=True)
        for suffix in (".md", ".png"):
            shutil.copyfile(
                RESULTS_DIR / f"{REPORT_STEM}{suffix}", DOCS_DIR / f"{REPORT_STEM}{suffix}"
            )
        print(f"copied the table and the plot to {DOCS_DIR}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the missing runs of the sweep, then write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--rounds",
        nargs="+",
        default=["digits=30", "fashion-mnist=20"],
        help="server rounds per dataset, as dataset=rounds",
    )
    parser.add_argument(
        "--seeds-for",
        nargs="*",
        default=[],
        help="seeds of one dataset, e.g. fashion-mnist=0,1,2 (overrides --seeds for it)",
    )
    parser.add_argument("--adam-lr", type=float, default=0.03, help="FedAdam server lr")
    parser.add_argument("--variants", nargs="+", default=None, help="subset of the variants")
    parser.add_argument("--runtime", choices=RUNTIMES, default="inprocess")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machine)")
    parser.add_argument(
        "--client-cpus", type=int, default=2, help="CPUs per simulated client (simulation runtime)"
    )
    parser.add_argument("--report-only", action="store_true", help="only redraw from saved JSON")
    parser.add_argument(
        "--upload-bytes", action="store_true", help="only print the sensitivity upload sizes"
    )
    parser.add_argument("--publish", action="store_true", help="copy the report to docs/results")
    parser.add_argument("--model", default=COMMON["model"], help="model of every run (paper: cnn)")
    parser.add_argument(
        "--bases",
        nargs="+",
        choices=["fedavg", "fedavgm", "fedadam", "fedprox"],
        default=["fedavg", "fedadam"],
        help="base optimizers, each run alone and with Elastic",
    )
    parser.add_argument(
        "--taus", nargs="*", type=float, default=None, help="Elastic taus (default: 0.5 only)"
    )
    parser.add_argument(
        "--name",
        default="",
        help="a separate sweep: results in benchmarks/results/elastic/<name>/, report "
        "elastic_<name>.md/.png",
    )
    parser.add_argument(
        "--target", type=float, default=None, help="accuracy (%%) for the rounds-to-target column"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.upload_bytes:
        print(upload_bytes())
        return 0
    if args.name:
        use_sweep(args.name)
    COMMON["model"] = args.model

    all_variants = variants(args.adam_lr, args.bases, args.taus)
    order = args.variants or list(all_variants)
    rounds = {key: int(value) for key, value in (item.split("=") for item in args.rounds)}
    seeds_for = {
        key: [int(s) for s in value.split(",")]
        for key, value in (item.split("=") for item in args.seeds_for)
    }
    if not args.report_only:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        runs_dir = RESULTS_DIR / "runs"
        for dataset in args.datasets:
            for seed in seeds_for.get(dataset, args.seeds):
                for variant in order:
                    path = result_path(dataset, variant, seed)
                    if path.is_file():
                        saved = json.loads(path.read_text(encoding="utf-8"))
                        if saved["settings"]["num-server-rounds"] == rounds[dataset]:
                            continue  # finished before: resume without redoing it
                        print(
                            f"== {path.name} has {saved['settings']['num-server-rounds']} rounds, "
                            f"{rounds[dataset]} asked: running it again",
                            flush=True,
                        )
                    print(f"== {dataset} {variant} seed {seed}", flush=True)
                    try:
                        record = run_one(
                            dataset,
                            variant,
                            all_variants[variant],
                            seed,
                            rounds[dataset],
                            args.client_cpus,
                            runs_dir,
                            args.runtime,
                        )
                    except LaunchError as error:
                        print(f"run failed: {error}", file=sys.stderr)
                        return 1
                    path.write_text(json.dumps(record, indent=1), encoding="utf-8")
                    print(
                        f"   final accuracy {record['accuracy'][-1]:.4f} "
                        f"({record['wall-seconds']:.0f} s)",
                        flush=True,
                    )
    command = " ".join(
        [".venv/bin/python benchmarks/elastic_evidence.py", *(argv or sys.argv[1:])]
    ).replace(" --report-only", "")
    report(order, args.adam_lr, args.publish, args.target, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
