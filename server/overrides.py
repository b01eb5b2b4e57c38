"""A run's settings before it starts: ``-c`` overrides, the app's defaults, and what a launch adds.

``ba-run``, ``ba-sweep`` and ``ba-deploy`` read a run's options here, before anything starts:

- :func:`app_defaults`: the app's ``[tool.flwr.app.config]`` (its pyproject.toml);
- :func:`parse_overrides`: ``-c`` values (``key=value`` pairs in Flower's ``--run-config``
  syntax, and TOML files), merged in order, the later winning;
- :func:`check_keys`: an unknown key refused, naming the closest known one;
- :func:`check_values`: every value checked by :class:`~beyond_averaging.server.config.RunConfig`
  (the ServerApp's own check, relations between keys included), so that a bad value is refused
  before any process starts, not by the ServerApp after the SuperLink and Ray;
- :func:`run_settings`: the fused settings of a launch, with the run name and absolute output
  folder it adds where the configuration gives none;
- :func:`run_config_argument`: settings written back as one ``--run-config`` value.

:class:`LaunchError` is what a launch raises when a run cannot be started (here: options that
cannot be read) or did not complete (:mod:`beyond_averaging.server.runtime.launch`);
:class:`OptionsError`, the kind of it for options that are not valid (``ba-run`` exits 2).
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .config import config_problems


class LaunchError(RuntimeError):
    """The run could not be started, or did not complete."""


class OptionsError(LaunchError):
    """The run's options are not valid (an unknown key, a value out of range): nothing started.

    ``ba-run`` exits with :data:`CONFIG_EXIT_CODE` for it, as a command line tool does for a bad
    argument.
    """


#: ``ba-run``'s exit code for options refused before anything starts (argparse's for bad usage).
CONFIG_EXIT_CODE = 2


def toml_value(value: Any) -> str:
    """A Python value in the TOML syntax of Flower's ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def run_config_argument(settings: Mapping[str, Any]) -> str:
    """One ``--run-config`` value holding every override of ``settings``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in settings.items())


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the app's pyproject.toml."""
    pyproject = app_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise LaunchError(f"no pyproject.toml in {app_dir}: pass --app <folder of the Flower app>")
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    try:
        return dict(data["tool"]["flwr"]["app"]["config"])
    except KeyError:
        raise LaunchError(f"{pyproject} has no [tool.flwr.app.config] table") from None


def is_toml_file(entry: str) -> bool:
    """A ``-c`` value that names a TOML file (as Flower tells one: it ends in ``.toml``)."""
    return entry.strip().endswith(".toml") and "=" not in entry


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``-c`` values as one dict, the later winning: Flower's ``--run-config`` syntax
    (``key=value`` pairs, TOML values) and TOML files (flattened as Flower flattens one), so a
    file with pairs after it is the file with those pairs changed.

    Raises
    ------
    LaunchError
        A file that cannot be read or is not TOML, or pairs Flower cannot parse.
    """
    from flwr.common.config import flatten_dict, parse_config_args

    merged: dict[str, Any] = {}
    for entry in overrides:
        if is_toml_file(entry):
            path = Path(entry.strip()).expanduser()
            try:
                merged.update(flatten_dict(tomllib.loads(path.read_text(encoding="utf-8"))))
            except OSError as error:
                raise LaunchError(f"-c {entry}: cannot read the file ({error})") from None
            except (tomllib.TOMLDecodeError, ValueError) as error:
                raise LaunchError(f"-c {entry}: not a TOML file of run options ({error})") from None
            continue
        try:
            merged.update(parse_config_args([entry]))
        except Exception as error:  # click.ClickException: Flower's message for bad syntax
            message = getattr(error, "message", None) or str(error)
            raise LaunchError(f"-c {entry!r}: {message}") from None
    return merged


def check_keys(overrides: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Refuse a key that is not a run option, naming the closest that is.

    Raises
    ------
    LaunchError
        One line per unknown key, with a suggestion where one is close (difflib).
    """
    problems = []
    for key in overrides:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f": did you mean '{close[0]}'?" if close else ""
        problems.append(f"unknown run-config key '{key}'{hint}")
    if problems:
        raise OptionsError(
            "; ".join(problems) + f" (the app's keys are those of {where}; docs/configuration.md)"
        )


def check_values(settings: Mapping[str, Any]) -> None:
    """Refuse settings that :class:`~beyond_averaging.server.config.RunConfig` refuses: the same
    check the ServerApp makes, made here before any process starts.

    Raises
    ------
    OptionsError
        One line: each bad key with its value, what is allowed and the closest allowed value
        (relations between keys in their own words), ``; ``-separated.
    """
    problems = config_problems(settings)
    if problems:
        raise OptionsError(
            "invalid run configuration: " + "; ".join(problems) + " (docs/configuration.md)"
        )


def run_settings(app_dir: Path, overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The fused settings of a launch and the overrides it adds: a run name and an absolute
    output folder when the configuration gives none, so the launcher knows where the summary
    will be.

    Raises
    ------
    OptionsError
        An unknown key (:func:`check_keys`) or a value :func:`check_values` refuses.
    LaunchError
        The app or a ``-c`` file cannot be read.
    """
    defaults = app_defaults(app_dir)
    given = parse_overrides(overrides)
    check_keys(given, list(defaults), f"[tool.flwr.app.config] in {app_dir / 'pyproject.toml'}")
    settings = defaults | given
    check_values(settings)
    extra: list[str] = []
    run_name = str(settings.get("run-name") or "")
    if not run_name:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        run_name = f"{settings.get('strategy', 'run')}-{settings.get('dataset', 'data')}-{stamp}"
        extra.append(f'run-name="{run_name}"')
    output_dir = Path(str(settings.get("output-dir") or "runs")).expanduser()
    if not output_dir.is_absolute():
        output_dir = app_dir / output_dir
        extra.append(f'output-dir="{output_dir}"')
    settings.update(parse_overrides(extra))
    return settings, extra
