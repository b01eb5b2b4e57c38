"""The user's experience: the library built as a wheel, installed into a clean virtual environment
beside Flower, and used by two Flower apps written the way users write them, with the recipes
copied by this test from the docs pages.

- ``tests/apps/quickstart``: the shape of Flower's examples/quickstart-pytorch (its own package
  ``qsapp`` with ``task.py``, ``client_app.py``, ``server_app.py``; dict batches {"img", "label"}).
- ``tests/apps/flat``: the older flat shape (``client.py``, ``server.py`` and a ``tasks/``
  package: the top-level names that collided with the library before it had one import name);
  (x, y) tuple batches.

Each app runs every rule for 2 rounds in Flower simulation (``flwr run`` against a simulation
SuperLink of the clean environment, 4 SuperNodes). A rule's server recipe (``<!-- recipe:
NAME-server -->`` in docs/) replaces the app's strategy lines and its client recipe, where it has
one, the app's train function, verbatim: when a docs page changes, these runs use the change.

The clean environment: ``python3.11 -m venv`` (no system site-packages), then the wheel and
``flwr[simulation]>=1.27`` (what Flower's quickstart asks for) under constraints.txt, so torch
comes from the local wheel cache at the project's tested version. uv installs when the project's
environment has it (seconds from its cache), pip otherwise. Marked ``userapp``: `.ci/run` runs them
in a line of their own (`pytest -m userapp`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from beyond_averaging.server.launch import (
    LAUNCH_MARKER,
    flower_environment,
    free_port,
    stop_process_tree,
    write_connection,
)

REPO = Path(__file__).resolve().parent.parent
APPS = REPO / "tests" / "apps"
DOCS = REPO / "docs"
#: What the wheel is built from: the package's metadata files and the folders it maps.
WHEEL_SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "beyond_averaging",
    *("strategies", "server", "client", "tasks"),
)
#: Flower's examples/quickstart-pytorch requires flwr[simulation]>=1.27 beside torch.
QUICKSTART_FLOWER = "flwr[simulation]>=1.27"
#: The quickstart's own pins, which the library must resolve beside (torch is what it pins).
QUICKSTART_PINS = ("torch==2.8.0", "torchvision==0.23.0", "flwr-datasets[vision]>=0.6.0")
RUN_TIMEOUT_S = 420
#: Ray gives its raylet a fixed 30 s to register; on a heavily loaded machine that start fails
#: before any of the app's code runs. Such a run (and only such a run) is started again.
RAY_START_TIMEOUT = "The current node timed out during startup"
RAY_START_ATTEMPTS = 3
NUM_SUPERNODES = 4

_RECIPE = re.compile(r"^<!-- recipe: ([\w-]+) -->\n```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Rule:
    """A rule as a user swaps it in: the recipes it needs and the class it must run."""

    name: str
    strategy_class: str
    server_recipe: str
    client_recipe: str | None


RULES = (
    Rule("fedavg", "FedAvg", "fedavg-server", None),
    Rule("elastic", "ElasticAggregation", "elastic-server", "elastic-client"),
    Rule("fedlaw", "FedLAW", "fedlaw-server", None),
    Rule("fedgma", "FedGMA", "fedgma-server", "fedgma-client"),
    Rule("fedgma-soft", "FedGMASoft", "fedgma-soft-server", None),
)


@dataclass(frozen=True)
class AppShape:
    """Where an app's server strategy lines and client train function live."""

    name: str
    server_module: str
    client_module: str


SHAPES = (
    AppShape("quickstart", "qsapp/server_app.py", "qsapp/client_app.py"),
    AppShape("flat", "server.py", "client.py"),
)


def docs_recipes() -> dict[str, list[str]]:
    """Every marked recipe block in docs/*.md, by name (a list, to catch doubled markers)."""
    found: dict[str, list[str]] = {}
    for page in sorted(DOCS.glob("*.md")):
        for name, code in _RECIPE.findall(page.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(code)
    return found


def _replace_region(source: str, marker: str, replacement: str, indent: str) -> str:
    """Replace the lines between ``# >>> marker`` and ``# <<< marker`` (markers kept)."""
    pattern = re.compile(
        rf"^(?P<indent>[ ]*)# >>> {marker}\n.*?^[ ]*# <<< {marker}\n", re.MULTILINE | re.DOTALL
    )
    match = pattern.search(source)
    if match is None:
        raise AssertionError(f"no '# >>> {marker}' ... '# <<< {marker}' region to replace")
    body = "".join(
        f"{indent}{line}\n" if line.strip() else "\n" for line in replacement.splitlines()
    )
    region = f"{indent}# >>> {marker}\n{body}{indent}# <<< {marker}\n"
    return source[: match.start()] + region + source[match.end() :]


def write_app(shape: AppShape, rule: Rule, destination: Path) -> Path:
    """A copy of the app with the rule's recipes from docs/ in place of its FedAvg code."""
    shutil.copytree(APPS / shape.name, destination, ignore=shutil.ignore_patterns("__pycache__"))
    recipes = docs_recipes()
    server = destination / shape.server_module
    server.write_text(
        _replace_region(
            server.read_text(encoding="utf-8"), "strategy", recipes[rule.server_recipe][0], "    "
        ),
        encoding="utf-8",
    )
    if rule.client_recipe is not None:
        client = destination / shape.client_module
        client.write_text(
            _replace_region(
                client.read_text(encoding="utf-8"), "train", recipes[rule.client_recipe][0], ""
            ),
            encoding="utf-8",
        )
    return destination


def test_every_recipe_the_apps_copy_is_in_the_docs_exactly_once() -> None:
    recipes = docs_recipes()
    wanted = {r.server_recipe for r in RULES} | {r.client_recipe for r in RULES if r.client_recipe}
    assert {name: len(recipes.get(name, [])) for name in sorted(wanted)} == dict.fromkeys(
        sorted(wanted), 1
    )


def test_a_rule_s_recipes_replace_the_app_s_fedavg_code(tmp_path: Path) -> None:
    recipes = docs_recipes()
    app = write_app(SHAPES[0], RULES[1], tmp_path / "app")
    server = (app / SHAPES[0].server_module).read_text(encoding="utf-8")
    client = (app / SHAPES[0].client_module).read_text(encoding="utf-8")
    assert "    strategy = ElasticAggregation(" in server
    assert "FedAvg(" not in server
    assert recipes["elastic-client"][0].splitlines()[-1] in client
    assert client.count("@app.train()") == 1
    compile(server, "server_app.py", "exec")
    compile(client, "client_app.py", "exec")


# --- the clean environment -------------------------------------------------------------------


@dataclass(frozen=True)
class CleanEnvironment:
    python: Path
    bin_dir: Path
    wheel: Path
    installer: str
    install_seconds: float


def _install(python: Path, requirements: list[str], *extra: str) -> tuple[str, list[str]]:
    """The installer used and its command: uv from the project's environment, else pip."""
    uv = Path(sys.executable).parent / "uv"
    constraints = ["-c", str(REPO / "constraints.txt")]
    if uv.is_file():
        links = [
            a for d in os.environ.get("PIP_FIND_LINKS", "").split() for a in ("--find-links", d)
        ]
        command = [str(uv), "pip", "install", "--quiet", "--python", str(python), *links]
        return "uv", [*command, *constraints, *extra, *requirements]
    return "pip", [str(python), "-m", "pip", "install", "-q", *constraints, *extra, *requirements]


def _checked(command: list[str], timeout: float, **kwargs: object) -> str:
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )
    assert completed.returncode == 0, f"{' '.join(command)} failed:\n{completed.stderr[-4000:]}"
    return str(completed.stdout)


@pytest.fixture(scope="module")
def clean_environment(tmp_path_factory: pytest.TempPathFactory) -> CleanEnvironment:
    python311 = shutil.which("python3.11")
    if python311 is None:
        pytest.skip("python3.11 is not on PATH: the clean environment needs it")
    root = tmp_path_factory.mktemp("userapp")
    source = root / "source"
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name,
                source / name,
                symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        else:
            shutil.copy2(REPO / name, source / name)
    started = time.monotonic()
    _checked(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        timeout=300,
    )
    wheel = next((root / "dist").glob("beyond_averaging-*.whl"))
    wheel_seconds = time.monotonic() - started
    started = time.monotonic()
    _checked([python311, "-m", "venv", str(root / "venv")], timeout=120)
    python = root / "venv" / "bin" / "python"
    installer, command = _install(python, [str(wheel), QUICKSTART_FLOWER])
    _checked(command, timeout=900)
    install_seconds = time.monotonic() - started
    print(
        f"\n[userapp] wheel built in {wheel_seconds:.1f} s; clean venv + wheel + "
        f"{QUICKSTART_FLOWER} installed with {installer} in {install_seconds:.1f} s"
    )
    return CleanEnvironment(python, python.parent, wheel, installer, install_seconds)


@pytest.mark.userapp
def test_the_wheel_installs_nothing_but_its_own_package(
    clean_environment: CleanEnvironment,
) -> None:
    listing = _checked(
        [
            str(clean_environment.python),
            "-c",
            "import importlib.metadata as m; print('\\n'.join(m.distribution("
            "'beyond-averaging').read_text('top_level.txt').split()))",
        ],
        timeout=120,
    )
    assert listing.split() == ["beyond_averaging"]
    generic = _checked(
        [
            str(clean_environment.python),
            "-c",
            "import importlib.util as u; print([n for n in ('client', 'server', 'strategies', "
            "'tasks') if u.find_spec(n)])",
        ],
        timeout=120,
        cwd=clean_environment.python.parent,
    )
    assert generic.strip() == "[]"


@pytest.mark.userapp
def test_the_wheel_resolves_beside_the_quickstart_s_own_pins(
    clean_environment: CleanEnvironment,
) -> None:
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        pytest.skip("a dry-run resolution needs uv in the project's environment")
    completed = subprocess.run(
        [
            str(uv),
            "pip",
            "install",
            "--dry-run",
            "--python",
            str(clean_environment.python),
            str(clean_environment.wheel),
            QUICKSTART_FLOWER,
            *QUICKSTART_PINS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if completed.returncode != 0 and re.search(
        r"(?i)network|connect|dns|timed out", completed.stderr
    ):
        pytest.skip(f"no package index to resolve against: {completed.stderr[-300:]}")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "torch==2.8.0" in completed.stderr + completed.stdout


@pytest.fixture(scope="module")
def superlink(
    clean_environment: CleanEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """A simulation SuperLink of the clean environment; stopped with its children by PID."""
    port = free_port()
    flwr_home = tmp_path_factory.mktemp("flwr-home")
    env = flower_environment(flwr_home)
    env["PATH"] = os.pathsep.join([str(clean_environment.bin_dir), env["PATH"]])
    env[LAUNCH_MARKER] = f"userapp-{port}-{uuid.uuid4().hex}"
    env.pop("PYTHONPATH", None)
    env["VIRTUAL_ENV"] = str(clean_environment.bin_dir.parent)
    write_connection(flwr_home, port)
    log = (flwr_home / "superlink.log").open("wb")
    process = subprocess.Popen(
        [
            str(clean_environment.bin_dir / "flower-superlink"),
            "--insecure",
            "--simulation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=flwr_home,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (flwr_home / "superlink.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the SuperLink did not become healthy"
                time.sleep(0.5)
        yield env
    finally:
        stop_process_tree(process, marker=env[LAUNCH_MARKER])
        log.close()


@pytest.mark.userapp
@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_the_app_runs_the_rule_for_two_rounds_from_the_docs_recipes(
    shape: AppShape, rule: Rule, superlink: dict[str, str], tmp_path: Path
) -> None:
    app = write_app(shape, rule, tmp_path / f"{shape.name}-{rule.name}")
    result_file = tmp_path / "result.json"
    command = [
        str(Path(superlink["PATH"].split(os.pathsep)[0]) / "flwr"),
        "run",
        str(app),
        "ba-local",
        "--stream",
        "--run-config",
        f'result-file="{result_file}"',
        "--federation-config",
        f"num-supernodes={NUM_SUPERNODES}",
        "--federation-config",
        "client-resources-num-cpus=1",
    ]
    started = time.monotonic()
    for _attempt in range(RAY_START_ATTEMPTS):
        completed = subprocess.run(
            command,
            env=superlink,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        if result_file.is_file() or RAY_START_TIMEOUT not in completed.stdout + completed.stderr:
            break
    seconds = time.monotonic() - started
    log = (completed.stdout + completed.stderr)[-6000:]
    # `flwr run` exits 0 when the run fails: the ServerApp's result file is the proof it ran.
    assert result_file.is_file(), f"the run wrote no result ({seconds:.0f} s); its log:\n{log}"
    result = json.loads(result_file.read_text(encoding="utf-8"))
    print(f"\n[userapp] {shape.name} x {rule.name}: {seconds:.1f} s")
    assert result["strategy"] == rule.strategy_class
    assert sorted(result["train"]) == ["1", "2"], log
    assert all(0 < m["train_loss"] < 100 for m in result["train"].values())
    assert sorted(result["evaluate"]) == ["1", "2"], log
    assert result["final-model-finite"] is True
