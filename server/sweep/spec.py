"""A sweep as a TOML spec file: what to run, what to measure, how to report it (``ba-sweep``).

docs/benchmarks.md ("The spec file") defines every key; the repository's ``benchmarks/specs/``
holds its published experiments.
"""

from __future__ import annotations

import difflib
import itertools
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from beyond_averaging.server.config import ConfigError, RunConfig, parse_run_config
from beyond_averaging.server.runtime.launch import RUNTIMES

SPEC_KEYS = ["title", "description", "extends", "runtime", "runs", "report", "name"]
SPEC_KEYS += ["settings", "grid", "methods", "baseline", "columns", "paper", "plot"]
#: How a ``[baseline]`` line reads (a row's method label, then its baseline's), for the errors.
BASELINE_FORM = (
    'each line reads <method label> = "<its baseline\'s label>", e.g. elastic = "fedavg"'
)
MERGED_KEYS = ("settings", "grid", "plot")
#: The run configuration's keys (a function runtime's own settings are the others).
RUN_KEYS = frozenset(field.alias or name for name, field in RunConfig.model_fields.items())
METHOD_AXIS = "method"
SEED_AXIS = "seed"
#: A column's metrics (docs/benchmarks.md, "The spec file"); what each makes of a run is the
#: report's (:data:`beyond_averaging.server.sweep.report.METRICS`, one function per name).
METRIC_NAMES = (
    "final",
    "last",
    "mean",
    "sum",
    "at",
    "peak",
    "peak-round",
    "reach",
    "values",
    "wall-seconds",
    "id-accuracy",
    "paper",
)
#: How a column shows its metric over a row's seeds.
SHOWS = ("mean ± sd", "range", "median", "max")
#: The shows of metric ``values``: every value of every seed pooled.
POOLED_SHOWS = ("range", "median")


class SpecError(ValueError):
    """A spec file is invalid; the message names the file, the bad key and the fix."""


def label_of(value: Any) -> str:
    """How a value names a row and a run: ``100.0`` -> ``100``, ``True`` -> ``true``."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Column:
    """One table column: a metric of each run (:data:`METRIC_NAMES`), summarised over seeds.

    ``show`` is ``mean ± sd`` (sample sd, :func:`beyond_averaging.server.sweep.report.mean_sd`),
    ``range`` or ``median`` (every value of every seed pooled: mean (min-max), or their median)
    or ``max`` (the largest, and how many runs had one).
    ``vs`` shows the seed-paired difference against the row's ``[baseline]`` method instead;
    ``better = "lower"`` counts the seeds where it is lower (rounds to a target).
    """

    title: str
    metric: str = "last"
    key: str = "test-accuracy"
    rounds: int = 10
    round: int = 1
    target: float = 0.0
    scale: float = 1.0
    digits: int = 2
    show: str = "mean ± sd"
    vs: bool = False
    better: str = "higher"


DEFAULT_COLUMNS = (
    Column("final acc. (%)", metric="final", scale=100.0),
    Column("last 10 rounds (%)", metric="last", rounds=10, scale=100.0),
)


@dataclass(frozen=True)
class Axis:
    """A grid axis: labels and the run-config overrides each label stands for."""

    name: str
    labels: tuple[str, ...]
    overrides: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Run:
    """One run of a spec: its name, its label on every axis (and seed), its run configuration,
    and the settings a function runtime takes beyond the run configuration (``extra``)."""

    name: str
    labels: dict[str, str]
    settings: dict[str, Any]
    folder: Path
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Spec:
    """A validated spec (see the module docstring)."""

    path: Path
    title: str
    description: str
    runtime: str
    runs_dir: Path
    report_path: Path
    name: str
    settings: dict[str, Any]
    axes: list[Axis]
    seeds: list[int]
    baseline: dict[str, str] = field(default_factory=dict)
    columns: list[Column] = field(default_factory=lambda: list(DEFAULT_COLUMNS))
    paper: list[dict[str, Any]] = field(default_factory=list)
    plot: dict[str, Any] = field(default_factory=dict)
    #: The Flower app every run of a run-config runtime runs (``ba-sweep --app``).
    app_dir: Path = field(default_factory=Path.cwd)

    def fail(self, problem: str) -> SpecError:
        """A :class:`SpecError` that names this spec file."""
        return SpecError(f"spec {self.path}: {problem}")

    def runs(self) -> list[Run]:
        """Every run: the axes' product, seeds before methods (a seed's rows finish together)."""
        axes = [a for a in self.axes if a.name != METHOD_AXIS]
        axes += [
            Axis(SEED_AXIS, tuple(map(str, self.seeds)), tuple({"seed": s} for s in self.seeds))
        ]
        axes += [a for a in self.axes if a.name == METHOD_AXIS]
        runs = []
        for picks in itertools.product(*(range(len(a.labels)) for a in axes)):
            labels = {a.name: a.labels[i] for a, i in zip(axes, picks, strict=True)}
            settings = dict(self.settings)
            for axis, index in zip(axes, picks, strict=True):
                settings.update(axis.overrides[index])
            # A function runtime takes settings of its own: they pass beside the run configuration.
            own = (
                {}
                if self.runtime in RUNTIMES
                else {k: v for k, v in settings.items() if k not in RUN_KEYS}
            )
            settings = {k: v for k, v in settings.items() if k not in own}
            try:
                fields_ = {**parse_run_config(settings).to_run_config(), **own, **labels}
            except ConfigError as error:
                raise self.fail(f"run {labels}: {error}") from None
            try:
                name = re.sub(r"[^A-Za-z0-9_.-]", "-", self.name.format(**fields_))
            except (KeyError, ValueError, IndexError) as error:
                raise self.fail(
                    f"name = {self.name!r}: {error!r}; use {{axis}} or {{run-config-key}} fields"
                ) from None
            settings |= {"run-name": name, "output-dir": str(self.runs_dir)}
            runs.append(Run(name, labels, settings, self.runs_dir / name, own))
        names = [run.name for run in runs]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise self.fail(
                f"name = {self.name!r} gives several runs the name {twice}: add the fields "
                "that tell them apart, e.g. {seed}"
            )
        return runs


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The spec's TOML with any ``extends`` chain merged in."""
    if path in seen:
        raise SpecError(f"spec {path}: 'extends' loops back to itself")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SpecError(f"spec {path}: cannot be read: {error}") from None
    for key in data:
        if key not in SPEC_KEYS:
            raise SpecError(f"spec {path}: {unknown('key', key, SPEC_KEYS)}")
    if "extends" not in data:
        return data
    base = _read((path.parent / str(data.pop("extends"))).resolve(), (*seen, path))
    for key in MERGED_KEYS:
        data[key] = {**base.get(key, {}), **data.get(key, {})}
    return {**base, **data}


def _axis(spec: Spec, name: str, values: Any) -> Axis:
    if not isinstance(values, list) or not values:
        raise spec.fail(f"grid axis '{name}' = {values!r}: give a non-empty list of values")
    labels, overrides = [], []
    for value in values:
        if isinstance(value, dict):
            label = value.get("label", value.get(name))
            if label is None:
                raise spec.fail(
                    f"grid axis '{name}' value {value}: name it with label = \"...\" (or set "
                    f"'{name}' in it)"
                )
            overrides.append({k: v for k, v in value.items() if k != "label"})
        else:
            label = value
            overrides.append({name: value})
        labels.append(label_of(label))
    return Axis(name, tuple(labels), tuple(overrides))


def unknown(what: str, value: str, allowed: Sequence[str]) -> str:
    """``<what> '<value>' is unknown: use one of [...]``, with the nearest allowed value."""
    near = difflib.get_close_matches(value, allowed, n=1)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return f"{what} '{value}' is unknown: {hint}use one of {sorted(allowed)}"


def _column(spec: Spec, entry: Any) -> Column:
    if not isinstance(entry, dict) or "title" not in entry:
        raise spec.fail(f"column {entry!r}: each [[columns]] entry needs a title")
    defaults = {f.name: f.default for f in fields(Column)} | {"title": ""}
    where = f"column '{entry['title']}'"
    for key, value in entry.items():
        if key not in defaults:
            raise spec.fail(f"{where}: {unknown('field', key, list(defaults))}")
        kind = type(defaults[key])
        if not isinstance(value, kind) and not (kind is float and type(value) is int):
            raise spec.fail(f"{where}: {key} = {value!r} must be a {kind.__name__}")
    column = Column(**entry)
    if column.metric not in METRIC_NAMES:
        raise spec.fail(f"{where}: {unknown('metric', column.metric, METRIC_NAMES)}")
    if column.show not in SHOWS:
        raise spec.fail(f"{where}: {unknown('show', column.show, SHOWS)}")
    if (column.metric == "values") != (column.show in POOLED_SHOWS):
        raise spec.fail(f"{where}: metric 'values' goes with show 'range' or 'median'")
    if column.vs and not spec.baseline:
        raise spec.fail(f"{where} has vs = true: add a [baseline] table ({BASELINE_FORM})")
    return column


@dataclass(frozen=True)
class Layout:
    """Where a spec's run folders and page go when it names none: ``runs`` and ``report`` are
    patterns of the spec file's stem, relative to ``root`` (``ba-sweep``: the app's folder)."""

    root: Path
    runs: str = "sweeps/{stem}/runs"
    report: str = "sweeps/{stem}/{stem}.md"


def load_spec(path: Path | str, runs_dir: Path | None = None, layout: Layout | None = None) -> Spec:
    """Read and validate a spec file (run configurations are checked by the runner); relative
    ``runs`` and ``report`` paths, and the defaults, are under ``layout`` (default: this folder).

    Raises
    ------
    SpecError
        Naming the file, the bad key and what to write instead.
    """
    path = Path(path).resolve()
    data = _read(path)
    stem = path.stem
    layout = layout or Layout(Path.cwd())
    spec = Spec(
        path=path,
        title=str(data.get("title", stem)),
        description=str(data.get("description", "")).strip(),
        runtime=str(data.get("runtime", "inprocess")),
        runs_dir=(layout.root / str(data.get("runs", layout.runs.format(stem=stem)))).resolve(),
        report_path=layout.root / str(data.get("report", layout.report.format(stem=stem))),
        name=str(data.get("name", "")),
        settings=dict(data.get("settings", {})),
        axes=[],
        seeds=[],
        app_dir=layout.root,
    )
    if runs_dir is not None:
        spec.runs_dir = runs_dir.resolve()
    if spec.runtime not in RUNTIMES and not re.fullmatch(r"[\w.]+:\w+", spec.runtime):
        raise spec.fail(
            f"runtime = {spec.runtime!r}: choose one of {RUNTIMES}, or name a function "
            "'package.module:function' that runs one run (see server/sweep/run.py)"
        )
    grid = dict(data.get("grid", {}))
    seeds = grid.pop(SEED_AXIS, [spec.settings.pop("seed", 0)])
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds):
        raise spec.fail(f"grid seed = {seeds!r}: give a list of integers, e.g. seed = [0, 1, 2]")
    spec.seeds = seeds
    spec.axes = [_axis(spec, name, values) for name, values in grid.items()]
    methods = data.get("methods", {})
    if methods:
        values = [{"label": k, "strategy": k, **(v or {})} for k, v in methods.items()]
        spec.axes.append(_axis(spec, METHOD_AXIS, values))
    # Default run names: every axis label (the method's last), then the seed.
    spec.name = spec.name or "-".join([*(f"{{{a.name}}}" for a in spec.axes), "seed{seed}"])
    spec.baseline = {str(k): str(v) for k, v in data.get("baseline", {}).items()}
    for row, base in spec.baseline.items():
        strangers = [repr(label) for label in dict.fromkeys((row, base)) if label not in methods]
        if strangers:
            names = " and ".join(strangers)
            verb = "is not a [methods] label" if len(strangers) == 1 else "are not [methods] labels"
            raise spec.fail(
                f'[baseline] {row} = "{base}": {names} {verb} (the labels: '
                f"{', '.join(methods)}); {BASELINE_FORM}"
            )
    if "columns" in data:
        spec.columns = [_column(spec, entry) for entry in data["columns"]]
    axis_names = {a.name for a in spec.axes}
    for entry in data.get("paper", []):
        unknown = set(entry) - axis_names - {"value"}
        if "value" not in entry or unknown:
            raise spec.fail(
                f"paper entry {entry}: needs 'value' and axis names only ({sorted(axis_names)}); "
                f"unknown: {sorted(unknown)}"
            )
    spec.paper = list(data.get("paper", []))
    spec.plot = dict(data.get("plot", {}))
    for panel in spec.plot.get("panels", []):
        if panel not in axis_names:
            raise spec.fail(f"plot panels: '{panel}' is not a grid axis ({sorted(axis_names)})")
    return spec


def paper_value(spec: Spec, labels: Mapping[str, str]) -> Any:
    """The paper's number for a row, when an entry of ``paper`` matches all its given axes."""
    for entry in spec.paper:
        wanted = {k: v if isinstance(v, list) else [v] for k, v in entry.items() if k != "value"}
        if all(labels.get(k) in [label_of(x) for x in v] for k, v in wanted.items()):
            return entry["value"]
    return None
