"""The user's experience: Flower's own quickstart-pytorch with a rule's recipe pasted in from the
docs, and the library installed from its wheel beside the Flower the user has.

The apps (``tests/apps/``):

- ``quickstart``: Flower's examples/quickstart-pytorch, its ``server_app.py`` and
  ``client_app.py`` line for line, ``task.py`` too but for synthetic data in CIFAR-10's shapes
  (dict batches ``{"img", "label"}``);
- ``flat``: the older flat layout (``server.py``, ``client.py``, a ``tasks/`` package: module
  names that once collided with the library), the same ServerApp and ClientApp lines, (x, y) tuple
  batches.

A recipe is a ``diff`` block after ``<!-- recipe: NAME -->`` in docs/: hunks of context (`` ``),
removed (``-``) and added (``+``) lines, separated by ``@@`` lines, that must match the app's file
exactly once. A rule is a server recipe and, where the rule needs something from clients, a client
recipe; each may add or replace at most 3 lines of a file, measured by diffing the patched file
against the unpatched app. When a docs page changes, every test here uses the change.

Default suite (seconds): the recipes are in the docs once, apply to both apps within the line
budget, and each rule runs 2 rounds of both patched apps in process (server/runtime/inprocess.py).

Marked ``userapp`` (their own line of ``.ci/run``, through ``scripts/flower_matrix.py``): the
library's wheel in a clean virtual environment per Flower release, installed with the release
and torch only (no constraints.txt), then both apps x every rule for 2 rounds in Flower's
simulation (``flwr run`` against one simulation SuperLink per release, 4 virtual SuperNodes), one
run on a local deployment (SuperLink + 4 SuperNode processes), and ``flwr run`` with Flower's
defaults, which install the app's dependencies with ``uv sync``. The releases come from
``BA_USERAPP_FLWR`` (default ``oldest 1.39.0 newest``: ``oldest`` is the floor in pyproject.toml,
``newest`` the newest below 2 on the package index), the Python from ``BA_USERAPP_PYTHON``
(default 3.11) and torch from ``BA_USERAPP_TORCH`` (default ``torch==2.13.0``, the local CPU
wheel). ``BA_USERAPP_REPORT`` names a JSON-lines file each run is recorded in (the matrix command
turns it into the table of docs/install.md, "Flower versions").
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import shutil
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flwr.serverapp.strategy import Strategy
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.deploy.warm_executor import READY
from beyond_averaging.server.pull import PollingGrid
from beyond_averaging.server.runtime import inprocess
from tests.flower_runtime import (
    FlowerInstall,
    FlowerLink,
    RunOutcome,
    checked,
    clean_log,
    ray_failed_to_start,
)

REPO = Path(__file__).resolve().parent.parent
APPS = REPO / "tests" / "apps"
DOCS = REPO / "docs"
#: What the wheel is built from: the package's metadata files and the folders it maps.
WHEEL_SOURCES = (
    "pyproject.toml",
    "README.index.md",  # the readme pyproject.toml names (README.md with absolute links)
    "LICENSE",
    "beyond_averaging",
    *("strategies", "server", "client", "tasks"),
)
#: Flower's examples/quickstart-pytorch requires these beside flwr[simulation]>=1.27.
QUICKSTART_FLOWER = "flwr[simulation]>=1.27"
QUICKSTART_PINS = ("torch==2.8.0", "torchvision==0.23.0", "flwr-datasets[vision]>=0.6.0")
#: Lines a recipe may add, and lines it may remove, in each file of the app.
LINE_BUDGET = 3
ROUNDS = 2
NUM_SUPERNODES = 4
RUN_TIMEOUT_S = 600

_BLOCK = re.compile(r"^<!-- recipe: ([\w-]+) -->\n```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


# ------------------------------------------------------------------------------------ recipes
@dataclass(frozen=True)
class Hunk:
    """Lines to find (context and removed) and what replaces them (context and added)."""

    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True)
class Recipe:
    """A docs recipe: a change to one file of Flower's quickstart, as diff hunks."""

    name: str
    hunks: tuple[Hunk, ...]

    @classmethod
    def parse(cls, name: str, diff: str) -> Recipe:
        hunks: list[Hunk] = []
        old: list[str] = []
        new: list[str] = []
        for line in [*diff.splitlines(), "@@"]:
            if line.startswith("@@"):
                if old or new:
                    hunks.append(Hunk(tuple(old), tuple(new)))
                old, new = [], []
            elif line[:1] in ("-", "+", " ") or not line:
                marker, text = line[:1], line[1:]
                if marker != "+":
                    old.append(text)
                if marker != "-":
                    new.append(text)
            else:
                raise ValueError(f"recipe {name}: {line!r} is not a diff line (' ', '-', '+', @@)")
        return cls(name, tuple(hunks))

    def apply(self, source: str, where: str) -> str:
        """``source`` with every hunk applied; each hunk's lines must occur exactly once."""
        lines = source.splitlines()
        for hunk in self.hunks:
            width = len(hunk.old)
            starts = [
                i for i in range(len(lines) - width + 1) if tuple(lines[i : i + width]) == hunk.old
            ]
            if len(starts) != 1:
                raise ValueError(
                    f"recipe {self.name}: the lines\n" + "\n".join(hunk.old) + f"\noccur "
                    f"{len(starts)} times in {where}; a recipe's lines must occur exactly once"
                )
            lines[starts[0] : starts[0] + width] = hunk.new
        return "\n".join(lines) + "\n"


def docs_blocks() -> dict[str, list[tuple[str, str]]]:
    """Every marked block in docs/*.md: name -> [(language, code)], a list to catch doubles."""
    found: dict[str, list[tuple[str, str]]] = {}
    for page in sorted(DOCS.glob("*.md")):
        for name, language, code in _BLOCK.findall(page.read_text(encoding="utf-8")):
            found.setdefault(name, []).append((language, code))
    return found


def recipe(name: str) -> Recipe:
    """The ``diff`` recipe ``name`` from docs/."""
    blocks = docs_blocks().get(name, [])
    assert len(blocks) == 1, f"recipe {name!r} is in docs/ {len(blocks)} times"
    language, code = blocks[0]
    assert language == "diff", f"recipe {name!r} is a {language} block, not a diff"
    return Recipe.parse(name, code)


def dependency_line(wheel: Path) -> str:
    """The requirement docs/install.md tells a user to list, pointing at ``wheel``."""
    blocks = docs_blocks()["app-dependency"]
    match = re.search(r'"(beyond-averaging @ file://(/\S+))"', blocks[0][1])
    assert match is not None, "the app-dependency block names no file:// wheel"
    assert Path(match.group(2)).name == wheel.name, "the docs name another wheel than the build"
    return match.group(1).replace(match.group(2), str(wheel))


@dataclass(frozen=True)
class Rule:
    """A rule as a user swaps it in: its recipes and the strategy class it must run."""

    name: str
    strategy_class: str
    server_recipe: str
    client_recipe: str | None
    #: Optional recipes applied to the server file after ``server_recipe`` (outside its budget).
    server_extras: tuple[str, ...] = ()
    #: Optional recipes applied to the client file after ``client_recipe`` (outside its budget).
    client_extras: tuple[str, ...] = ()


RULES = (
    Rule("fedavg", "FedAvg", "fedavg-server", None),
    Rule("elastic", "ElasticAggregation", "elastic-server", "elastic-client"),
    Rule("fedlaw", "FedLAW", "fedlaw-server", None),
    Rule("fedgma", "FedGMA", "fedgma-server", "fedgma-client"),
    Rule("fedgma-soft", "FedGMASoft", "fedgma-soft-server", None),
)
#: The line each rule logs every round about what it did (strategies/replies/reporting.py), for
#: round ``{round}``; its page's recipe shows one
#: (test_each_rule_page_shows_the_line_its_rule_logs).
ROUND_LINES = {
    "FedAvg": r"round {round}: FedAvg \| \d+/\d+ replies kept, \d+ clipped, \d+ dropped",
    "ElasticAggregation": r"round {round}: ElasticAggregation \| zeta mean \d\.\d{{4}}, "
    r"min \d\.\d{{4}}, sensitivity on \d+ tensors \| \d+/\d+ replies kept",
    "FedLAW": r"round {round}: FedLAW \| gamma \d+\.\d{{4}}, lambda \[[\d., ]+\], "
    r"data weights \[[\d., ]+\] \| \d+/\d+ replies kept",
    "FedGMA": r"round {round}: FedGMA \| coordinates kept \d+\.\d% \| \d+/\d+ replies kept",
    "FedGMASoft": r"round {round}: FedGMASoft \| mean mask \d\.\d{{3}} \| \d+/\d+ replies kept",
}
#: The page whose recipe shows each rule's line.
RULE_PAGES = {
    "FedAvg": "library.md",
    "ElasticAggregation": "elastic.md",
    "FedLAW": "fedlaw.md",
    "FedGMA": "fedgma.md",
    "FedGMASoft": "fedgma.md",
}


def round_line_problems(log: str, strategy_class: str) -> list[str]:
    """The rounds whose line about the rule (:data:`ROUND_LINES`) is not in ``log``."""
    pattern = ROUND_LINES[strategy_class]
    return [
        f"no line 'round {r}: {strategy_class} | ...' about the rule in the log"
        for r in range(1, ROUNDS + 1)
        if not re.search(pattern.format(round=r), log)
    ]


#: FedLAW with its proxy samples also kept out of global_evaluate (docs/fedlaw.md): in process.
FEDLAW_HOLDOUT = Rule("fedlaw-holdout", "FedLAW", "fedlaw-server", None, ("fedlaw-holdout",))
#: FedAvg inside Flower's server-side DP wrapper (docs/library.md): in process, on the
#: quickstart's own federation, so that the wrapper's client count is checked against it.
PRIVATE_FEDAVG = Rule("dp", "DifferentialPrivacyServerSideFixedClipping", "dp-server", None)
#: Elastic with the ServerApp's Grid wrapped by ``polling`` (docs/library.md, "Waiting for
#: replies"): in process and on a local deployment of every release (the matrix's Elastic cell).
POLLED_ELASTIC = Rule(
    "elastic", "ElasticAggregation", "elastic-server", "elastic-client", ("polling-server",)
)


@dataclass(frozen=True)
class AppShape:
    """An app of tests/apps/ and the files a rule's recipes change."""

    name: str
    server_module: str
    client_module: str
    #: The app's own top-level modules (removed from sys.modules between in-process runs).
    modules: tuple[str, ...]


SHAPES = (
    AppShape(
        "quickstart",
        "pytorchexample/server_app.py",
        "pytorchexample/client_app.py",
        ("pytorchexample",),
    ),
    AppShape("flat", "server.py", "client.py", ("server", "client", "tasks")),
)


def patched_files(shape: AppShape, rule: Rule) -> dict[str, tuple[str, str]]:
    """File -> (unpatched, patched) for the files the rule's recipes change."""
    changes = {
        shape.server_module: (rule.server_recipe, *rule.server_extras),
        shape.client_module: ((rule.client_recipe,) if rule.client_recipe else ())
        + rule.client_extras,
    }
    files = {}
    for module, names in changes.items():
        if names:
            before = patched = (APPS / shape.name / module).read_text(encoding="utf-8")
            for name in names:
                patched = recipe(name).apply(patched, f"{shape.name}/{module}")
            files[module] = (before, patched)
    return files


def add_dependency(pyproject: Path, requirement: str) -> None:
    """Append ``requirement`` to ``[project].dependencies``, as a user edits the file."""
    text = pyproject.read_text(encoding="utf-8")
    head, found, rest = text.partition("dependencies = [\n")
    assert found, f"{pyproject} has no multi-line dependencies list"
    listing, end, tail = rest.partition("]\n")
    pyproject.write_text(f'{head}{found}{listing}    "{requirement}",\n{end}{tail}', "utf-8")


def write_app(
    shape: AppShape, rule: Rule, destination: Path, dependency: str | None = None
) -> Path:
    """A copy of the app with the rule's recipes from docs/ applied (and ``dependency`` listed)."""
    shutil.copytree(APPS / shape.name, destination, ignore=shutil.ignore_patterns("__pycache__"))
    for module, (_, patched) in patched_files(shape, rule).items():
        (destination / module).write_text(patched, encoding="utf-8")
    if dependency is not None:
        add_dependency(destination / "pyproject.toml", dependency)
    return destination


def changed_lines(before: str, after: str) -> tuple[int, int]:
    """(added, removed) lines between two versions of a file, by difflib."""
    diff = list(difflib.unified_diff(before.splitlines(), after.splitlines(), n=0, lineterm=""))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    return added, removed


def test_every_recipe_the_apps_copy_is_in_the_docs_exactly_once() -> None:
    blocks = docs_blocks()
    wanted = {r.server_recipe for r in RULES} | {r.client_recipe for r in RULES if r.client_recipe}
    wanted |= {"app-dependency", *FEDLAW_HOLDOUT.server_extras, PRIVATE_FEDAVG.server_recipe}
    wanted |= set(POLLED_ELASTIC.server_extras)
    assert {name: len(blocks.get(name, [])) for name in sorted(wanted)} == dict.fromkeys(
        sorted(wanted), 1
    )


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_a_rule_changes_at_most_three_lines_of_each_file_of_the_app(
    shape: AppShape, rule: Rule
) -> None:
    files = patched_files(shape, rule)
    assert shape.server_module in files
    for module, (before, after) in files.items():
        added, removed = changed_lines(before, after)
        assert 0 < added <= LINE_BUDGET, f"{module}: {added} lines added"
        assert removed <= LINE_BUDGET, f"{module}: {removed} lines removed"
        compile(after, module, "exec")
    server = files[shape.server_module][1]
    assert f"from beyond_averaging import {rule.strategy_class}\n" in server
    assert "from flwr.serverapp.strategy import FedAvg" not in server


@pytest.mark.parametrize("strategy_class", sorted(RULE_PAGES))
def test_each_rule_page_shows_the_line_its_rule_logs(strategy_class: str) -> None:
    page = (DOCS / RULE_PAGES[strategy_class]).read_text(encoding="utf-8")
    pattern = ROUND_LINES[strategy_class].format(round=r"\d+")
    assert re.search(pattern, page), f"docs/{RULE_PAGES[strategy_class]} shows no line {pattern}"
    assert "aggregation_metrics" in page


def test_a_recipe_whose_lines_are_not_in_the_file_says_which_and_where() -> None:
    client_recipe = recipe("elastic-client")
    server = (APPS / "quickstart" / "pytorchexample" / "server_app.py").read_text("utf-8")
    with pytest.raises(
        ValueError,
        match=r"elastic-client: the lines\nfrom flwr.clientapp import ClientApp\noccur 0 times in "
        r"server_app.py",
    ):
        client_recipe.apply(server, "server_app.py")


def test_the_docs_dependency_line_is_a_direct_reference_to_the_wheel_of_this_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]["version"]
    wheel = Path("/somewhere/dist") / f"beyond_averaging-{version}-py3-none-any.whl"
    assert dependency_line(wheel) == f"beyond-averaging @ file://{wheel}"


# ------------------------------------------------------------------------------ in process
def forget_modules(top_level: tuple[str, ...]) -> None:
    """Drop the app's modules from sys.modules, so the next app's files are imported afresh."""
    for name in [n for n in sys.modules if n.split(".")[0] in top_level]:
        del sys.modules[name]


#: The quickstart with every rule (FedLAW with its hold-out line too, which also applies the
#: 3-line recipe) and the flat app with the rules whose client helpers read its tuple batches; the
#: userapp matrix runs every pair. FedLAW's learning (100 epochs a round) is the slow one.
IN_PROCESS = [
    *[(SHAPES[0], rule) for rule in RULES if rule.name != "fedlaw"],
    (SHAPES[0], FEDLAW_HOLDOUT),
    *[(SHAPES[1], rule) for rule in RULES if rule.client_recipe],
]


def run_patched_in_process(
    shape: AppShape, rule: Rule, num_nodes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Strategy, Any]:
    """Run the app patched with the rule's recipes in process for ``ROUNDS`` rounds on
    ``num_nodes`` nodes: the strategy its ServerApp started, and Flower's Result."""
    # Flower's loader imports the app's modules by name, from the app's folder first on sys.path;
    # the repository's own folders share the flat app's names (client, server, tasks).
    for name in [n for n in sys.modules if n.split(".")[0] in shape.modules]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)  # the quickstart's ServerApp saves final_model.pt here
    for task_field in ("_run_id", "_node_id", "_task_id"):  # run_inprocess sets them
        monkeypatch.setattr(inprocess.TaskIdentity, task_field, None)
    app = write_app(shape, rule, tmp_path / "app")
    started: list[tuple[Strategy, Any]] = []
    flower_start = Strategy.start

    def recording_start(self: Strategy, *args: Any, **kwargs: Any) -> Any:
        result = flower_start(self, *args, **kwargs)
        started.append((self, result))
        return result

    monkeypatch.setattr(Strategy, "start", recording_start)
    try:
        inprocess.run_inprocess(app, {"num-server-rounds": ROUNDS}, num_nodes=num_nodes)
    finally:
        forget_modules(shape.modules)
    [(strategy, result)] = started
    assert type(strategy).__name__ == rule.strategy_class
    assert sorted(result.evaluate_metrics_serverapp) == list(range(ROUNDS + 1))
    assert (tmp_path / "final_model.pt").is_file()
    return strategy, result


def test_the_polling_recipe_hands_the_strategy_a_polling_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grids: list[Any] = []
    flower_start = Strategy.start

    def spying_start(self: Strategy, *args: Any, **kwargs: Any) -> Any:
        grids.append(kwargs["grid"])
        return flower_start(self, *args, **kwargs)

    monkeypatch.setattr(Strategy, "start", spying_start)
    run_patched_in_process(SHAPES[0], POLLED_ELASTIC, NUM_SUPERNODES, tmp_path, monkeypatch)
    [grid] = grids
    assert isinstance(grid, PollingGrid)


@pytest.mark.parametrize(
    ("shape", "rule"), IN_PROCESS, ids=[f"{s.name}-{r.name}" for s, r in IN_PROCESS]
)
def test_the_patched_app_runs_the_rule_for_two_rounds_in_process(
    shape: AppShape,
    rule: Rule,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy, result = run_patched_in_process(
            shape, rule, NUM_SUPERNODES, tmp_path, monkeypatch
        )
    assert round_line_problems(caplog.text, rule.strategy_class) == []
    for server_round in range(1, ROUNDS + 1):
        figures = strategy.aggregation_metrics[server_round]  # type: ignore[attr-defined]
        assert figures["replies-dropped"] == 0
        assert figures["replies-valid"] == NUM_SUPERNODES
        assert math.isfinite(result.train_metrics_clientapp[server_round]["train_loss"])


def test_the_dp_recipe_calibrates_its_noise_for_the_clients_the_quickstart_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # `flwr run .` runs the quickstart (no federation of its own) on Flower's default simulation
    # federation, and its FedAvg trains a fraction_train of it each round. The wrapper's
    # num_sampled_clients must be that count: otherwise Flower warns every round and its noise,
    # noise_multiplier * clipping_norm / num_sampled_clients, is calibrated for other clients.
    nodes = DEFAULT_SIMULATION_CONFIG.num_supernodes
    with caplog.at_level(logging.WARNING):
        wrapper, result = run_patched_in_process(
            SHAPES[0], PRIVATE_FEDAVG, nodes, tmp_path, monkeypatch
        )
    inner = wrapper.strategy  # type: ignore[attr-defined]
    trained = max(int(nodes * inner.fraction_train), inner.min_train_nodes)
    assert wrapper.num_sampled_clients == trained  # type: ignore[attr-defined]
    for server_round in range(1, ROUNDS + 1):
        assert inner.aggregation_metrics[server_round]["replies-valid"] == trained
        assert math.isfinite(result.train_metrics_clientapp[server_round]["train_loss"])
    assert "differs from the number of sampled clients" not in caplog.text


# ------------------------------------------------------------------- clean environments
MATRIX_FLOWER = tuple(os.environ.get("BA_USERAPP_FLWR", "oldest 1.39.0 newest").split())
MATRIX_PYTHON = os.environ.get("BA_USERAPP_PYTHON", "3.11")
MATRIX_TORCH = os.environ.get("BA_USERAPP_TORCH", "torch==2.13.0")
REPORT = os.environ.get("BA_USERAPP_REPORT", "")


def flower_floor() -> str:
    """The lowest flwr the library admits: the ``>=`` bound in pyproject's dependencies."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"flwr\s*>=\s*([\w.]+)\s*,.*", requirement)
        if match:
            return match.group(1)
    raise AssertionError("pyproject.toml's dependencies state no flwr>= floor")


def newest_flower() -> str:
    """The newest flwr release below 2 on the package index (``pip index versions``)."""
    listing = checked([sys.executable, "-m", "pip", "index", "versions", "flwr"], timeout=300)
    match = re.search(r"Available versions: (.*)", listing)
    assert match is not None, listing
    versions = [v.strip() for v in match.group(1).split(",")]
    return next(v for v in versions if re.fullmatch(r"1\.\d+\.\d+", v))


def requested_flower(name: str) -> str:
    """``oldest`` / ``newest`` / a version, as the exact version to install."""
    if name == "oldest":
        return flower_floor()
    if name == "newest":
        return newest_flower()
    return name


def report(**fields: object) -> None:
    """One line of the matrix's record (``BA_USERAPP_REPORT``) and one of pytest's output."""
    print(f"\n[userapp] {json.dumps(fields)}")
    if REPORT:
        with Path(REPORT).open("a", encoding="utf-8") as record:
            record.write(json.dumps(fields) + "\n")


def uv_executable() -> Path | None:
    uv = Path(sys.executable).parent / "uv"
    return uv if uv.is_file() else None


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The library's wheel, built from a copy of the sources it packs."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(REPO / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist")]
    checked([*command, str(source)], timeout=600)
    return next((root / "dist").glob("beyond_averaging-*.whl"))


@pytest.fixture(scope="module", params=MATRIX_FLOWER)
def flower(
    request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> FlowerInstall:
    """A clean venv with the wheel, ``flwr[simulation]==<release>`` and torch, no constraints."""
    version = requested_flower(request.param)
    installed = FlowerInstall.create(
        tmp_path_factory.mktemp(f"flwr-{version}") / "venv",
        requested=request.param,
        flower_requirement=f"flwr[simulation]=={version}",
        wheel=wheel,
        extra_requirements=[MATRIX_TORCH],
        python_version=MATRIX_PYTHON,
        uv=uv_executable(),
    )
    report(
        kind="install",
        requested=request.param,
        flwr=installed.version,
        python=installed.python_version,
        torch=installed.package_version("torch"),
        seconds=round(installed.install_seconds, 1),
        installer="uv" if uv_executable() else "pip",
    )
    return installed


@pytest.fixture(scope="module")
def simulation(
    flower: FlowerInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FlowerLink]:
    """One simulation SuperLink of the release for all its simulation runs."""
    with FlowerLink(flower, tmp_path_factory.mktemp("simulation"), simulation=True) as link:
        yield link


@pytest.fixture(scope="module")
def deployment(
    flower: FlowerInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FlowerLink]:
    """A local deployment of the release: a SuperLink and 4 SuperNode processes, no Ray."""
    with FlowerLink(flower, tmp_path_factory.mktemp("deployment"), simulation=False) as link:
        yield link


def check_run(outcome: RunOutcome, rule: Rule) -> list[str]:
    """What is wrong with a run of a patched app: empty when it trained as the recipe says."""
    problems = []
    if not outcome.completed:
        problems.append(f"status {outcome.status!r}")
    if outcome.strategy() != rule.strategy_class:
        problems.append(f"strategy {outcome.strategy()!r}, not {rule.strategy_class}")
    train = outcome.final_metrics("Aggregated ClientApp-side Train Metrics")
    if sorted(train) != list(range(1, ROUNDS + 1)) or not all(
        0 < m.get("train_loss", math.nan) < 100 for m in train.values()
    ):
        problems.append(f"train metrics {train}")
    central = outcome.final_metrics("ServerApp-side Evaluate Metrics")
    if sorted(central) != list(range(ROUNDS + 1)) or not all(
        math.isfinite(m.get("loss", math.nan)) for m in central.values()
    ):
        problems.append(f"ServerApp-side evaluation {central}")
    if sorted(outcome.final_metrics("Aggregated ClientApp-side Evaluate Metrics")) != list(
        range(1, ROUNDS + 1)
    ):
        problems.append("no ClientApp-side evaluation in every round")
    if "Saving final model to disk" not in outcome.log:
        problems.append("the ServerApp did not reach its end")
    problems.extend(round_line_problems(outcome.log, rule.strategy_class))
    return problems


#: The end of a real run's streamed log (flwr 1.39, quickstart with FedAvg), colour codes kept,
#: with the rule's line of each round (strategies/replies/reporting.py).
RECORDED_LOG = """\
\x1b[92mINFO \x1b[0m:      Starting FedAvg strategy:
\x1b[92mINFO \x1b[0m:      round 1: FedAvg | 4/4 replies kept, 0 clipped, 0 dropped
\x1b[92mINFO \x1b[0m:      round 2: FedAvg | 4/4 replies kept, 0 clipped, 0 dropped
\x1b[92mINFO \x1b[0m:      Final results:
\x1b[92mINFO \x1b[0m:      \t
\x1b[92mINFO \x1b[0m:      \tGlobal Arrays:
\x1b[92mINFO \x1b[0m:      \t\tArrayRecord (0.238 MB)
\x1b[92mINFO \x1b[0m:      \t
\x1b[92mINFO \x1b[0m:      \tAggregated ClientApp-side Train Metrics:
\x1b[92mINFO \x1b[0m:      \t{1: {'train_loss': '2.3140e+00'}, 2: {'train_loss': '2.3006e+00'}}
\x1b[92mINFO \x1b[0m:      \t
\x1b[92mINFO \x1b[0m:      \tAggregated ClientApp-side Evaluate Metrics:
\x1b[92mINFO \x1b[0m:      \t{ 1: {'eval_acc': '1.0000e-01', 'eval_loss': '2.3214e+00'},
\x1b[92mINFO \x1b[0m:      \t  2: {'eval_acc': '1.0000e-01', 'eval_loss': '2.3480e+00'}}
\x1b[92mINFO \x1b[0m:      \t
\x1b[92mINFO \x1b[0m:      \tServerApp-side Evaluate Metrics:
\x1b[92mINFO \x1b[0m:      \t{ 0: {'accuracy': '1.0000e-01', 'loss': '2.3065e+00'},
\x1b[92mINFO \x1b[0m:      \t  1: {'accuracy': '1.0900e-01', 'loss': '2.3029e+00'},
\x1b[92mINFO \x1b[0m:      \t  2: {'accuracy': '1.0100e-01', 'loss': '2.3009e+00'}}
\x1b[92mINFO \x1b[0m:      \t

Saving final model to disk...
"""


def test_a_run_is_judged_by_its_status_and_the_final_results_flower_logs() -> None:
    good = RunOutcome(1, "finished:completed", clean_log(RECORDED_LOG), 1.0)
    assert good.final_metrics("Aggregated ClientApp-side Train Metrics") == {
        1: {"train_loss": 2.314},
        2: {"train_loss": 2.3006},
    }
    assert check_run(good, RULES[0]) == []
    one_round = good.log.replace(", 2: {'train_loss': '2.3006e+00'}", "")
    broken = {
        "status": RunOutcome(1, "finished:failed", good.log, 1.0),
        "strategy": RunOutcome(
            1, "finished:completed", good.log.replace("Starting FedAvg", "Starting X"), 1.0
        ),
        "train metrics": RunOutcome(1, "finished:completed", one_round, 1.0),
        "ServerApp-side": RunOutcome(
            1, "finished:completed", good.log.replace("2.3009e+00", "nan"), 1.0
        ),
        "reach its end": RunOutcome(1, "finished:completed", good.log.replace("Saving", ""), 1.0),
        "round 2": RunOutcome(
            1, "finished:completed", good.log.replace("round 2: FedAvg", "round 2:"), 1.0
        ),
    }
    for expected, outcome in broken.items():
        problems = check_run(outcome, RULES[0])
        assert len(problems) == 1, (expected, problems)
        assert expected in problems[0]


def stand_in_install(root: Path, version: str) -> FlowerInstall:
    """The record of a Flower environment at ``root`` that a test fills itself (nothing installed;
    its ``flwr run`` takes a connection from ``$FLWR_HOME``, as the newer releases' does)."""
    return FlowerInstall(
        requested=version,
        version=version,
        python_version="3.11.7",
        root=root,
        install_seconds=0.0,
        superlink_options=frozenset(),
        run_takes_connection=True,
        fleet_on_http_port=False,
    )


def test_uv_is_told_each_wheel_folder_pip_is_told_about_as_its_own_location(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # pip reads PIP_FIND_LINKS as a space-separated list, uv reads UV_FIND_LINKS as a
    # comma-separated one: joined by spaces, uv sync looks for one folder named "a b".
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels/torch  /wheels/local")
    monkeypatch.delenv("UV_FIND_LINKS", raising=False)
    flower = stand_in_install(tmp_path / "venv", "1.42.0")
    env = FlowerLink(flower, tmp_path, simulation=False)._environment()
    assert env["UV_FIND_LINKS"] == "/wheels/torch,/wheels/local"


FAKE_FLWR = """#!/bin/sh
# A stand-in for `flwr`: the first run's simulation engine crashes because Ray's GCS did not
# start, and the run then hangs as flwr 1.21's does; the second run completes.
calls="$(dirname "$0")/calls"
echo "$*" >> "$calls"
case "$1" in
  run)
    if [ "$(grep -c '^run' "$calls")" = 1 ]; then
      echo "Successfully started run 11"
      echo "RuntimeError: Failed to start GCS.  Last 0 lines of error files:"
      echo "RuntimeError: Simulation Engine crashed."
      exec sleep 600
    fi
    echo "Successfully started run 12"; echo "Saving final model to disk..." ;;
  ls) echo '{"runs": [{"status": "finished:completed"}]}' ;;
esac
"""


def test_a_run_whose_ray_did_not_start_is_stopped_at_once_and_started_again(
    tmp_path: Path,
) -> None:
    # CI once waited 600 s on a flwr 1.21 run whose simulation engine had crashed at its start
    # (Ray's GCS did not come up); the run is now stopped when the engine says it crashed, and
    # a crash of Ray's own start (only that) is retried.
    flower = stand_in_install(tmp_path / "venv", "1.21.0")
    flower.bin_dir.mkdir(parents=True)
    fake = flower.bin_dir / "flwr"
    fake.write_text(FAKE_FLWR, encoding="utf-8")
    fake.chmod(0o755)
    app = tmp_path / "app"
    app.mkdir()
    link = FlowerLink(flower, tmp_path / "link", simulation=True)
    link.workdir.mkdir()
    link.env = {**os.environ, "PATH": f"{flower.bin_dir}{os.pathsep}{os.environ['PATH']}"}
    outcome = link.run(app, {"num-server-rounds": 2}, timeout=300.0)
    calls = (flower.bin_dir / "calls").read_text(encoding="utf-8").splitlines()
    assert [call.split()[0] for call in calls] == ["run", "stop", "run", "ls"]
    assert calls[1].startswith("stop 11")
    assert outcome.run_id == 12
    assert outcome.status == "finished:completed"
    assert "the simulation engine crashed; the run was stopped" in outcome.log
    assert "attempt 2 of 3" in outcome.log


def test_a_crashed_engine_is_not_retried_unless_ray_failed_to_start() -> None:
    assert ray_failed_to_start("RuntimeError: Failed to start GCS.  Last 0 lines")
    assert ray_failed_to_start("The current node timed out during startup. This could happen")
    assert not ray_failed_to_start("ValueError: bad record\nSimulation Engine crashed.")


def run_and_check(
    link: FlowerLink, flower: FlowerInstall, shape: AppShape, rule: Rule, tmp_path: Path
) -> None:
    app = write_app(shape, rule, tmp_path / f"{shape.name}-{rule.name}")
    outcome = link.run(app, {"num-server-rounds": ROUNDS}, timeout=RUN_TIMEOUT_S)
    problems = check_run(outcome, rule)
    report(
        kind="run",
        requested=flower.requested,
        flwr=flower.version,
        python=flower.python_version,
        runtime="simulation" if link.simulation else "deployment",
        app=shape.name,
        rule=rule.name,
        seconds=round(outcome.seconds, 1),
        ok=not problems,
    )
    assert not problems, f"{'; '.join(problems)}\n{outcome.tail()}"


@pytest.mark.userapp
def test_the_wheel_installs_nothing_but_its_own_package(flower: FlowerInstall) -> None:
    listing = checked(
        [
            str(flower.python),
            "-c",
            "import importlib.metadata as m; print(m.distribution('beyond-averaging')"
            ".read_text('top_level.txt'))",
        ],
        timeout=120,
    )
    assert listing.split() == ["beyond_averaging"]
    generic = checked(
        [
            str(flower.python),
            "-c",
            "import importlib.util as u; print([n for n in ('client', 'server', 'strategies', "
            "'tasks') if u.find_spec(n)])",
        ],
        timeout=120,
        cwd=flower.bin_dir,
    )
    assert generic.strip() == "[]"


EVERY_EXPORT = """
import beyond_averaging as library
from flwr.serverapp.strategy import Strategy
missing = [name for name in library.__all__ if not hasattr(library, name)]
assert not missing, missing
for name in ("FedAvg", "FedAvgM", "FedAdam", "ElasticAggregation", "FedGMA", "FedGMASoft"):
    assert isinstance(getattr(library, name)(), Strategy), name
print(library.__version__)
"""


@pytest.mark.userapp
def test_every_export_imports_and_every_strategy_is_a_strategy_of_this_flower(
    flower: FlowerInstall,
) -> None:
    version = checked([str(flower.python), "-c", EVERY_EXPORT], timeout=300, cwd=flower.bin_dir)
    assert (
        version.strip()
        == tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]["version"]
    )


@pytest.mark.userapp
def test_the_wheel_resolves_beside_the_quickstart_s_own_pins(wheel: Path, tmp_path: Path) -> None:
    uv = uv_executable()
    if uv is None:
        pytest.skip("resolving without installing needs uv in the project's environment")
    requirements = tmp_path / "requirements.in"
    requirements.write_text("\n".join([str(wheel), QUICKSTART_FLOWER, *QUICKSTART_PINS]) + "\n")
    resolved = checked(
        [
            str(uv),
            "pip",
            "compile",
            "--quiet",
            "--python-version",
            MATRIX_PYTHON,
            str(requirements),
        ],
        timeout=600,
    )
    assert "torch==2.8.0" in resolved
    assert re.search(r"^flwr==", resolved, re.MULTILINE)


@pytest.mark.userapp
@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_the_app_runs_the_rule_for_two_rounds_in_flower_simulation(
    flower: FlowerInstall, simulation: FlowerLink, shape: AppShape, rule: Rule, tmp_path: Path
) -> None:
    run_and_check(simulation, flower, shape, rule, tmp_path)


@pytest.mark.userapp
def test_the_quickstart_runs_elastic_on_a_local_deployment(
    flower: FlowerInstall, deployment: FlowerLink, tmp_path: Path
) -> None:
    # Elastic's clients keep their sensitivity average in context.state across rounds: on a
    # deployment that state lives in each SuperNode, between ClientApp processes. From flwr
    # 1.39 the SuperNodes run under ba-supernode, their ClientApps forked from the warm
    # executor (docs/deployment.md, "Your own app on the warm executor"). Its ServerApp waits
    # for the replies through polling(grid) (docs/library.md, "Waiting for replies").
    run_and_check(deployment, flower, SHAPES[0], POLLED_ELASTIC, tmp_path)
    logs = [path.read_text(errors="replace") for path in deployment.supernode_logs]
    assert logs
    # The wheel brings ba-supernode, so every release with the executor interface runs warm.
    assert deployment.warm is (FlowerRelease(flower.version).warm_executor_problem() is None)
    assert all((READY in log) is deployment.warm for log in logs)


@pytest.mark.userapp
def test_flower_s_default_flwr_run_installs_the_documented_dependency_line(
    flower: FlowerInstall, wheel: Path, tmp_path: Path
) -> None:
    """With runtime installation on (Flower's default), the plain name fails as docs/install.md
    shows and the documented direct reference to the wheel trains."""
    if not flower.installs_app_dependencies:
        report(
            kind="default-install",
            requested=flower.requested,
            flwr=flower.version,
            python=flower.python_version,
            dependency="none",
            status="no runtime installation",
            seconds=0.0,
        )
        pytest.skip(f"flwr {flower.version} installs no app dependencies at run time")
    torch_pin = f"torch=={flower.package_version('torch')}"  # uv sync: the local wheel, no CUDA
    rule = RULES[0]
    with FlowerLink(flower, tmp_path / "link", simulation=True, install_dependencies=True) as link:
        plain = write_app(SHAPES[0], rule, tmp_path / "plain", dependency="beyond-averaging")
        add_dependency(plain / "pyproject.toml", torch_pin)
        failed = link.run(plain, {"num-server-rounds": ROUNDS}, timeout=RUN_TIMEOUT_S)
        documented = write_app(SHAPES[0], rule, tmp_path / "wheel", dependency_line(wheel))
        add_dependency(documented / "pyproject.toml", torch_pin)
        worked = link.run(documented, {"num-server-rounds": ROUNDS}, timeout=RUN_TIMEOUT_S)
    for name, outcome in (("plain name", failed), ("direct reference", worked)):
        report(
            kind="default-install",
            requested=flower.requested,
            flwr=flower.version,
            python=flower.python_version,
            dependency=name,
            status=outcome.status,
            seconds=round(outcome.seconds, 1),
        )
    assert not failed.completed, failed.tail()
    assert "RuntimeDependencyInstallationError" in failed.log, failed.tail()
    assert "Exit Code: 608" in failed.log, failed.tail()
    words = " ".join(failed.log.split())  # uv wraps its message to the terminal's width
    assert "beyond-averaging was not found in the package registry" in words, failed.tail()
    assert check_run(worked, rule) == [], worked.tail()
    assert re.search(r"Installed: \[.*beyond-averaging==", worked.log), worked.tail()
