"""What a run ran on, for its ``summary.json``: versions, the checkout's commit, the command line,
the host, its CPU and GPU.

Everything here is read once, when a run starts (:class:`server.runs.recorder.RunRecorder`), and is
never the reason a run fails: a fact that cannot be read (no git, no checkout, an unreadable
``/proc/cpuinfo``) is recorded as ``None``.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from contextlib import suppress
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: Set by ``ba-run`` for every process of a launch: its own command line (shell-quoted). The
#: ServerApp runs in a process of its own under Flower's simulation, whose argv is Flower's.
COMMAND_LINE_ENV = "BA_COMMAND_LINE"
#: The packages whose versions a run records (distribution names).
PACKAGES = ("flwr", "torch", "numpy")
#: Seconds a git query may take before the commit is recorded as unknown.
GIT_TIMEOUT = 10.0


def package_versions() -> dict[str, str | None]:
    """Python's, flwr's, torch's, numpy's and this package's versions (None: not installed)."""
    from beyond_averaging import __version__

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    versions["beyond-averaging"] = __version__
    return versions


def source_checkout() -> Path | None:
    """The git checkout this package's code runs from (an unbuilt tree or an editable install),
    or None for an installed wheel: site-packages is never taken for a checkout, even inside a
    repository's virtual environment."""
    import beyond_averaging

    root = Path(beyond_averaging.__file__).resolve().parent.parent
    return root if (root / ".git").exists() and (root / "pyproject.toml").is_file() else None


def _git(checkout: Path, *arguments: str) -> str | None:
    try:
        completed = subprocess.run(
            ["git", "-C", str(checkout), *arguments],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine, or a hung one
        return None
    return completed.stdout if completed.returncode == 0 else None


def git_state(checkout: Path | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty", "checkout"}`` of the checkout the code runs from; None where there
    is none (an installed package) or git cannot read it. ``dirty``: tracked files differ from
    the commit, or files git does not ignore are untracked."""
    checkout = source_checkout() if checkout is None else checkout
    if checkout is None:
        return None
    commit = _git(checkout, "rev-parse", "HEAD")
    status = _git(checkout, "status", "--porcelain")
    if commit is None:
        return None
    return {
        "commit": commit.strip(),
        "dirty": None if status is None else bool(status.strip()),
        "checkout": str(checkout),
    }


def cpu_description() -> dict[str, Any]:
    """The CPU model (``/proc/cpuinfo``, else the platform's name), its family and model numbers
    (None where ``/proc/cpuinfo`` has none), the vector instructions torch's kernels use, its
    cores and those this process may use.

    Two machines with the same model name may differ in the numbers and the instructions, and
    torch's float kernels with them, so a run's last digits do too (docs/benchmarks.md, "The
    runner")."""
    model = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if not key.strip():  # the first processor's block ends at a blank line
                break
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name", model)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": model,
        "family": fields.get("cpu family"),
        "model-number": fields.get("model"),
        "vector-instructions": _cpu_capability(),
        "cores": os.cpu_count(),
        "usable-cores": usable,
    }


def _cpu_capability() -> str | None:
    """The widest vector instructions torch dispatches its CPU kernels to (``"AVX2"``,
    ``"AVX512"``, ...), or None where torch cannot say."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old or broken torch must not stop the run
        return None


def gpu_description() -> list[str]:
    """The names of the CUDA devices torch sees (empty: none)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver must not stop the run
        return []


def hardware_line() -> str:
    """The machine in one line, as a sweep's page and the benchmarks print it: CPU model (with its
    family and model numbers and vector instructions), cores this process may use, GPU, torch and
    its threads, Python."""
    import torch

    cpu = cpu_description()
    gpus = gpu_description()
    numbers = [
        f"{name} {cpu[key]}"
        for name, key in (("family", "family"), ("model", "model-number"))
        if cpu[key] is not None
    ]
    if cpu["vector-instructions"]:
        numbers.append(cpu["vector-instructions"])
    detail = f" ({', '.join(numbers)})" if numbers else ""
    return (
        f"{cpu['model']}{detail}, {cpu['usable-cores'] or cpu['cores']} cores visible, "
        f"{gpus[0] if gpus else 'no GPU'}, torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads), Python {platform.python_version()}"
    )


def command_line() -> str:
    """The command that started the run: ``ba-run``'s (:data:`COMMAND_LINE_ENV`), else this
    process's own."""
    return os.environ.get(COMMAND_LINE_ENV) or shlex.join([sys.executable, *sys.argv])


def run_environment() -> dict[str, Any]:
    """Everything above, as ``summary.json``'s ``environment``."""
    return {
        "versions": package_versions(),
        "git": git_state(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_description(),
        "gpu": gpu_description(),
    }
