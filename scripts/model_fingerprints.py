"""Fingerprints of the final models of short seeded runs, to show a refactoring changed no result.

What it checks, and why: the folders' modules are moving into sub-packages (the launcher of
``server/`` into ``server/runtime/``, the robust rules of ``strategies/`` into
``strategies/defences/`` and the like). Such a move must leave every run's model bit for bit
unchanged. This script runs a list of short seeded cases (digits, the MLP, 6 clients, 3 rounds), one
per aggregation rule at its defaults and one or two per defence (robust aggregations,
pre-aggregations, trigger unlearning, server noise, the weight cap and claim bound, an IID partition
that keeps the direction check on), each with ``ba-run --runtime inprocess`` in a fresh process, and
records per case

- the SHA-256 of the final model's arrays (``final_model.pt``, a torch state dict; per key, in
  sorted order: the key, dtype, shape and raw bytes), and of the checkpoint's model;
- the sorted file names of the run folder;
- the checkpoint's (``checkpoint.pt``) top-level keys and, for each that holds a mapping, its keys;
- the run's status (``summary.json``).

It reads only what a run writes (``ba-run``'s options and the run folder's files, loaded by name
with ``torch.load(weights_only=True)``) and imports nothing of the library, so the same script
runs unchanged before and after the move. Recorded before the move (commit 8e20987) on a shared
2-core CPU machine, where the 38 cases ran three times with equal hashes, bit for bit (once two
at a time, ``--jobs 2``), in 2.5-6 minutes a pass by the machine's load. Bit-for-bit equality is
only to be expected with the same Python, torch and NumPy on the same kind of CPU (the file's
``environment`` says which). Reproduce, from the repository's root::

    .venv/bin/python scripts/model_fingerprints.py --check docs/results/model-fingerprints.json
    .venv/bin/python scripts/model_fingerprints.py --check docs/results/model-fingerprints.json \\
        --cases fedavg,fedavg-krum
    .venv/bin/python scripts/model_fingerprints.py --write docs/results/model-fingerprints.json

``--check`` exits 1 and lists each case whose fingerprint differs (and each entry that does);
``--write`` records them; with neither, the fingerprints are printed; ``--list`` shows the cases.
Each case is ``ba-run`` as the tree's pyproject.toml names it (``[project.scripts]``), started by
the running Python with the tree first on ``PYTHONPATH``: the code checked is this tree's, even
where another tree of the project is the one installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: The repository's root: the Flower app folder that ``ba-run --app`` runs.
REPO = Path(__file__).resolve().parent.parent
#: Where the fingerprints recorded before the sub-package move are kept.
DEFAULT_FILE = REPO / "docs" / "results" / "model-fingerprints.json"
#: The run folder's final model (a torch state dict) and its checkpoint (a dict of the run's
#: state), by the names server/runs/folder.py gives them.
FINAL_MODEL_FILE = "final_model.pt"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"
#: Run options every case shares: small and fast, every client sampled, seeded.
COMMON_OPTIONS = (
    'dataset="digits" model="mlp" num-clients=6 num-server-rounds=3 seed=0 device="cpu"'
)
#: ``ba-run`` exit codes of a run that ran every round: completed, completed with alarms.
FINISHED_EXIT_CODES = (0, 4)
#: Seconds one case may take before it is stopped as hung.
CASE_TIMEOUT_S = 600.0

_ROBUST = ("trimmed-mean", "median", "krum", "multi-krum", "flame", "fltrust", "proxy-weights")
_PRE = ("nnm", "bucketing", "centered-clipping")
#: The defences whose number f of assumed Byzantine clients is floor(trim-fraction x replies).
_USES_F = ("trimmed-mean", "krum", "multi-krum", "nnm")
#: Trigger unlearning cut short (50 patch-search steps per class, one unlearning pass) and with a
#: light L1 weight, so that patches that work are found and unlearned in these few steps (all ten
#: in round 3 of ``fedavg-trigger-unlearning``; with the default weight 6.4 none is, and the model
#: would be plain FedAvg's).
_UNLEARNING = (
    'backdoor-defence="trigger-unlearning" unlearning-l1=0.01 unlearning-steps=50 '
    "unlearning-epochs=1"
)


def _cases() -> dict[str, str]:
    """Case name -> its run options (on top of :data:`COMMON_OPTIONS`)."""
    cases = {
        # Every rule at its defaults.
        "fedavg": 'strategy="fedavg"',
        "fedavgm": 'strategy="fedavg" server-optimizer="momentum"',
        "fedadam": 'strategy="fedavg" server-optimizer="adam"',
        "elastic": 'strategy="elastic"',
        "fedlaw": 'strategy="fedlaw"',
        "fedgma-hard": 'strategy="fedgma" gma-mask="hard"',
        "fedgma-soft": 'strategy="fedgma" gma-mask="soft"',
    }
    # FedAvg under every defence, and Elastic or hard FedGMA (alternately) under the same.
    # The rules that assume f = floor(trim-fraction x replies) Byzantine clients get
    # trim-fraction = 0.2 (f = 1 of 6): at the default 0.1, f = 0 and Multi-Krum keeps every
    # reply (its model was plain FedAvg's, bit for bit), the trimmed mean cuts nothing.
    # max-client-weight = 0.2 binds (the largest of the 6 partitions holds 29 % of the data);
    # 0.3 left FedAvg's model bit for bit unchanged.
    defences = {
        **{method: f'robust-aggregation="{method}"' for method in _ROBUST},
        **{method: f'pre-aggregation="{method}"' for method in _PRE},
        "trigger-unlearning": _UNLEARNING,
        "server-noise": "server-noise-std=0.001",
        "max-client-weight": "max-client-weight=0.2",
        "max-claim-factor": "max-claim-factor=1.0",
        "iid": 'partition="iid"',
    }
    for defence in _USES_F:
        defences[defence] += " trim-fraction=0.2"
    for index, (defence, options) in enumerate(defences.items()):
        cases[f"fedavg-{defence}"] = f'strategy="fedavg" {options}'
        other = ("elastic", "fedgma-hard")[index % 2]
        cases[f"{other}-{defence}"] = f"{cases[other]} {options}"
    # Hard FedGMA behind FLTrust is the alternation's ``fedgma-hard-fltrust``; FedLAW behind FLAME:
    cases["fedlaw-flame"] = f'{cases["fedlaw"]} robust-aggregation="flame"'
    return cases


#: Case name -> run options, in the order they run.
CASES: dict[str, str] = _cases()


@dataclass
class CaseResult:
    """One case's fingerprint and how long its run took."""

    name: str
    fingerprint: dict[str, Any]
    seconds: float


def arrays_sha256(state: Mapping[str, Any]) -> str:
    """SHA-256 of a state dict's arrays, independent of its key order.

    Parameters
    ----------
    state
        Key -> tensor (or array), as ``torch.load`` reads a state dict.

    Returns
    -------
    str
        The hex digest of, per key in sorted order, the key, the dtype, the shape and the raw
        bytes (C order) of its array, each entry length-prefixed.
    """
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        for part in (str(key), str(tensor.dtype), json.dumps(list(tensor.shape))):
            encoded = part.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little") + encoded)
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.hexdigest()


def checkpoint_keys(checkpoint: Mapping[str, Any]) -> dict[str, list[str] | None]:
    """A checkpoint's top-level keys, each with its own keys where it holds a mapping.

    Parameters
    ----------
    checkpoint
        The dict ``torch.load`` reads from ``checkpoint.pt``.

    Returns
    -------
    dict
        Top-level key -> the sorted keys (as text) one level down, or None for a value that is
        not a mapping.
    """
    return {
        str(key): sorted(str(inner) for inner in value) if isinstance(value, Mapping) else None
        for key, value in sorted(checkpoint.items(), key=lambda item: str(item[0]))
    }


def fingerprint(run_dir: Path) -> dict[str, Any]:
    """What a run folder holds, reduced to what a refactoring must not change.

    Parameters
    ----------
    run_dir
        A finished run's folder.

    Returns
    -------
    dict
        ``model-sha256`` (:func:`arrays_sha256` of ``final_model.pt``),
        ``checkpoint-model-sha256`` (of the checkpoint's ``model``), ``checkpoint-keys``
        (:func:`checkpoint_keys`), ``files`` (the folder's sorted file names) and ``status``
        (``summary.json``'s).
    """
    final_model = torch.load(run_dir / FINAL_MODEL_FILE, map_location="cpu", weights_only=True)
    checkpoint = torch.load(run_dir / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    summary = json.loads((run_dir / SUMMARY_FILE).read_text("utf-8"))
    return {
        "model-sha256": arrays_sha256(final_model),
        "checkpoint-model-sha256": arrays_sha256(checkpoint["model"]),
        "checkpoint-keys": checkpoint_keys(checkpoint),
        "files": sorted(path.name for path in run_dir.iterdir()),
        "status": summary.get("status"),
    }


def ba_run_command() -> list[str]:
    """``ba-run`` as this tree's pyproject.toml defines it, run by the running Python.

    The console script's target (``[project.scripts]``) is read from the tree, not taken from an
    installed ``bin/ba-run``: that wrapper names the target of whichever tree was installed last,
    which before and after a move of its module are different modules.
    """
    project = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))
    module, _, function = project["project"]["scripts"]["ba-run"].partition(":")
    code = (
        "import importlib, operator, sys; sys.argv[0] = 'ba-run'; "
        f"main = operator.attrgetter({function!r})(importlib.import_module({module!r})); "
        "sys.exit(main())"
    )
    return [sys.executable, "-c", code]


def tree_environment() -> dict[str, str]:
    """This process's environment with the tree first on ``PYTHONPATH``: its code is what runs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), env.get("PYTHONPATH", "")) if part
    )
    return env


def run_case(name: str, options: str, output_dir: Path) -> CaseResult:
    """Run one case with ``ba-run --runtime inprocess`` and fingerprint its folder.

    Parameters
    ----------
    name
        The case's name, also its run name.
    options
        Its run options (``key=value`` pairs, on top of :data:`COMMON_OPTIONS`).
    output_dir
        The folder its run folder is written in.

    Returns
    -------
    CaseResult
        Its fingerprint and wall time.

    Raises
    ------
    RuntimeError
        The run did not run every round (its exit code and the end of its output are named).
    """
    overrides = f'{COMMON_OPTIONS} {options} run-name="{name}" output-dir="{output_dir}"'
    command = [*ba_run_command(), "--app", str(REPO), "--runtime", "inprocess", "-c", overrides]
    started = time.perf_counter()
    done = subprocess.run(
        command,
        cwd=REPO,
        env=tree_environment(),
        capture_output=True,
        text=True,
        timeout=CASE_TIMEOUT_S,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode not in FINISHED_EXIT_CODES:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"case {name}: ba-run exited {done.returncode}\n{tail}")
    return CaseResult(name, fingerprint(output_dir / name), seconds)


def run_cases(names: Sequence[str], jobs: int) -> dict[str, CaseResult]:
    """Run the named cases (``jobs`` at a time) in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="model-fingerprints-") as temporary:
        output_dir = Path(temporary)

        def one(name: str) -> CaseResult:
            result = run_case(name, CASES[name], output_dir)
            print(f"{name:34s} {result.seconds:6.1f} s  {result.fingerprint['model-sha256']}")
            return result

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return {result.name: result for result in pool.map(one, names)}


def same_models(results: Mapping[str, CaseResult]) -> list[list[str]]:
    """Groups of cases whose final models are equal: a defence there changed nothing."""
    groups: dict[str, list[str]] = {}
    for name, result in results.items():
        groups.setdefault(result.fingerprint["model-sha256"], []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def environment() -> dict[str, str]:
    """What the hashes depend on besides the code: Python, torch, NumPy, the machine."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "system": platform.system(),
    }


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per entry of a case's fingerprint that differs (``key: recorded -> now``)."""
    keys = sorted(set(recorded) | set(current))
    return [
        f"{key}: {recorded.get(key)!r} -> {current.get(key)!r}"
        for key in keys
        if recorded.get(key) != current.get(key)
    ]


def check(path: Path, results: Mapping[str, CaseResult]) -> int:
    """Compare the cases run with those recorded in ``path``; 1 when any differs."""
    record = json.loads(path.read_text("utf-8"))
    recorded_cases: dict[str, Any] = record["cases"]
    failed = []
    for name, result in results.items():
        if name not in recorded_cases:
            failed.append(name)
            print(f"DIFFERS {name}: not recorded in {path}")
            continue
        lines = differences(recorded_cases[name]["fingerprint"], result.fingerprint)
        if recorded_cases[name]["options"] != CASES[name]:
            lines.insert(0, f"options: {recorded_cases[name]['options']!r} -> {CASES[name]!r}")
        if lines:
            failed.append(name)
            print(f"DIFFERS {name}:\n  " + "\n  ".join(lines))
    if record.get("environment") != environment():
        print(f"note: recorded on {record.get('environment')}, this is {environment()}")
    print(f"{len(results) - len(failed)} of {len(results)} cases as recorded in {path}")
    if failed:
        print("differing cases: " + ", ".join(failed))
    return 1 if failed else 0


def write(path: Path, results: Mapping[str, CaseResult]) -> None:
    """Record the cases' fingerprints in ``path`` (no timings: the file is reproducible)."""
    record = {
        "about": (
            "Final-model fingerprints of short seeded ba-run cases (scripts/model_fingerprints.py"
            "): a refactoring must leave every one bit for bit unchanged."
        ),
        "check": f"python scripts/model_fingerprints.py --check {DEFAULT_FILE.relative_to(REPO)}",
        "common-options": COMMON_OPTIONS,
        "environment": environment(),
        "cases": {
            name: {"options": CASES[name], "fingerprint": results[name].fingerprint}
            for name in CASES
            if name in results
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", "utf-8")
    print(f"wrote {len(record['cases'])} cases to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases; print, write or check their fingerprints.

    Parameters
    ----------
    argv
        Command-line arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0; 1 when ``--check`` found a case that differs.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="FILE", help="record the fingerprints")
    action.add_argument("--check", type=Path, metavar="FILE", help="compare with a record")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    parser.add_argument("--list", action="store_true", help="list the cases and their options")
    args = parser.parse_args(argv)
    if args.list:
        for name, options in CASES.items():
            print(f"{name:34s} {options}")
        return 0
    names = [name for name in args.cases.split(",") if name] or list(CASES)
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if args.write is not None and len(names) != len(CASES):
        parser.error("--write records every case: leave out --cases")
    started = time.perf_counter()
    results = run_cases(names, max(1, args.jobs))
    print(f"{len(results)} cases in {time.perf_counter() - started:.0f} s")
    for names in same_models(results):
        print(f"note: one final model from {', '.join(names)}: an option changed nothing")
    if args.check is not None:
        return check(args.check, results)
    if args.write is not None:
        write(args.write, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
