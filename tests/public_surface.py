"""The library's public surface as JSON: what a user may import, and how it is called.

The reference for ``tests/test_public_surface.py``, recorded before the folders' modules moved into
sub-packages (the launcher of ``server/`` into ``server/runtime/``, the robust rules of
``strategies/`` into ``strategies/defences/`` and the like): a move that keeps every public name and
signature keeps every user's code working. Only location-independent entry points are read, so the
same helper describes the tree before and after the move:

- the modules of :data:`MODULES`: each public name (the module's ``__all__``, else every name
  not starting with ``_`` whose object is defined in ``beyond_averaging`` or is a constant), its
  kind, ``str(inspect.signature(...))`` of a callable, the value of a constant; for a class, the
  signature of ``__init__`` and of its call, and the name, kind and signature of every public
  method, property or class attribute that a ``beyond_averaging`` class of its MRO defines (the
  defining module is not recorded: classes may move between modules);
- the ``app`` objects of :data:`APP_MODULES`, by their type's qualified name only;
- pyproject.toml's console scripts (names only: their targets move) and run options with their
  defaults (``[tool.flwr.app.config]``).

Signatures are written as ``inspect`` prints them; the library's modules use ``from __future__
import annotations``, so annotations are the source's strings. Defaults and constants are written
by :func:`stable_repr` (sets sorted, memory addresses blanked), so the record does not depend on
``PYTHONHASHSEED`` or on where objects live. Write or check the record::

    python -m tests.public_surface --write tests/public_surface.json
    python -m tests.public_surface --check tests/public_surface.json
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
import sys
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

#: The repository's root (its pyproject.toml names the console scripts and run options).
REPO = Path(__file__).resolve().parent.parent
#: Where the surface recorded before the sub-package move is kept. Not ``tests/data/``: the
#: repository's .gitignore ignores every folder named ``data/`` (datasets).
SNAPSHOT = Path(__file__).resolve().parent / "public_surface.json"
#: The modules whose public names are recorded (location-independent: they stay where they are).
MODULES = (
    "beyond_averaging",
    "beyond_averaging.strategies",
    "beyond_averaging.strategies.tracking",
    "beyond_averaging.tasks.protocol",
    "beyond_averaging.server.interactive",
    "beyond_averaging.server.pull",
    "beyond_averaging.server.packed_grid",
    "beyond_averaging.server.attacks",
    "beyond_averaging.tasks.packing",
)
#: The modules whose ``app`` object (the Flower component) is recorded, by its type only.
APP_MODULES = ("beyond_averaging.server.app", "beyond_averaging.client.app")
#: The package whose objects count as defined by the library.
PACKAGE = "beyond_averaging"
#: Values recorded as constants (with their value).
CONSTANT_TYPES = (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
#: Public names whose value changes with every release: recorded by kind only.
VALUE_FREE = frozenset({"__version__"})

_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+")


class _Shown:
    """A default value shown by a fixed text (a stable repr inside a signature)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


#: A numeric bound of a pydantic field written as a whole float (``Gt(gt=0.0)``).
_WHOLE_BOUND = re.compile(r"((?:Gt|Ge|Lt|Le)\((?:gt|ge|lt|le)=)(-?\d+)\.0\)")


def stable_repr(value: Any) -> str:
    """``repr`` that does not change between processes.

    Parameters
    ----------
    value
        Any object.

    Returns
    -------
    str
        Its ``repr``, with the items of sets and frozensets sorted (their order follows the
        string hash, which ``PYTHONHASHSEED`` changes per process), containers written item by
        item in the same way, and memory addresses (``at 0x7f...``) blanked.
    """
    if isinstance(value, set | frozenset):
        items = ", ".join(sorted(stable_repr(item) for item in value))
        name = type(value).__name__
        return f"{name}({{{items}}})" if items else f"{name}()"
    if isinstance(value, dict):
        items = ", ".join(f"{stable_repr(key)}: {stable_repr(item)}" for key, item in value.items())
        return "{" + items + "}"
    if isinstance(value, list):
        return "[" + ", ".join(stable_repr(item) for item in value) + "]"
    if isinstance(value, tuple) and type(value) is tuple:
        parts = [stable_repr(item) for item in value]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    return _ADDRESS.sub(" at 0x...", repr(value))


def signature_text(target: Callable[..., Any]) -> str:
    """``str(inspect.signature(target))`` with defaults written by :func:`stable_repr`.

    Parameters
    ----------
    target
        A callable.

    Returns
    -------
    str
        Its signature, or ``"<no signature>"`` where ``inspect`` finds none (some built-ins).
    """
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return "<no signature>"
    parameters = [
        parameter
        if parameter.default is inspect.Parameter.empty
        else parameter.replace(default=_Shown(stable_repr(parameter.default)))
        for parameter in signature.parameters.values()
    ]
    # A pydantic bound given as 0 reads Gt(gt=0) in a fresh process and Gt(gt=0.0) once the
    # model's float fields have been validated elsewhere in the same process (the test suite):
    # one spelling for both.
    return _WHOLE_BOUND.sub(r"\1\2)", str(signature.replace(parameters=parameters)))


def _is_library(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and (module == PACKAGE or module.startswith(PACKAGE + "."))


def _is_constant(obj: Any) -> bool:
    return obj is None or isinstance(obj, CONSTANT_TYPES)


def _qualified_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _member(raw: Any, bound: Any) -> dict[str, str]:
    """A class member as found in its defining class's ``__dict__`` (``raw``) and on the class."""
    if isinstance(raw, staticmethod):
        return {"kind": "staticmethod", "signature": signature_text(raw.__func__)}
    if isinstance(raw, classmethod):
        return {"kind": "classmethod", "signature": signature_text(bound)}
    if isinstance(raw, property):
        getter = raw.fget
        signature = signature_text(getter) if getter is not None else "<no getter>"
        return {"kind": "property", "signature": signature, "settable": str(raw.fset is not None)}
    if isinstance(raw, cached_property):
        return {"kind": "cached_property", "signature": signature_text(raw.func)}
    if inspect.isfunction(raw):
        return {"kind": "method", "signature": signature_text(raw)}
    if isinstance(raw, type):
        return {"kind": "class", "signature": signature_text(raw)}
    if _is_constant(raw):
        return {"kind": "attribute", "value": stable_repr(raw)}
    return {"kind": "attribute", "type": _qualified_name(type(raw))}


def _annotation_text(annotation: Any) -> str:
    """A TypedDict key's annotation: the source's string (a ForwardRef's), else its repr."""
    if isinstance(annotation, typing.ForwardRef):
        return annotation.__forward_arg__
    return annotation if isinstance(annotation, str) else repr(annotation)


def describe_class(cls: type) -> dict[str, Any]:
    """A class's constructor and the public members the library defines for it.

    Parameters
    ----------
    cls
        A class.

    Returns
    -------
    dict
        For a TypedDict: ``kind`` ("TypedDict"), ``keys`` (each key's annotation) and
        ``required``. Otherwise ``kind`` ("class"), ``init`` (the signature of ``__init__``),
        ``call`` (the signature of a call of the class, what pydantic models and dataclasses
        spell out field by field) and ``members``: per public name (not starting with ``_``)
        whose defining class, the first of the MRO whose ``__dict__`` holds it, is a
        ``beyond_averaging`` class, its kind and signature (or value).
    """
    if typing.is_typeddict(cls):
        return {
            "kind": "TypedDict",
            "keys": {
                key: _annotation_text(annotation)
                for key, annotation in sorted(cls.__annotations__.items())
            },
            "required": sorted(getattr(cls, "__required_keys__", ())),
        }
    members: dict[str, dict[str, str]] = {}
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is None or not _is_library(owner):
            continue
        members[name] = _member(vars(owner)[name], getattr(cls, name, None))
    return {
        "kind": "class",
        "init": signature_text(cls.__init__),  # type: ignore[misc]  # the class's own, read only
        "call": signature_text(cls),
        "members": members,
    }


def describe(name: str, obj: Any) -> dict[str, Any]:
    """One public name of a module: its kind, and its signature, value or members.

    Parameters
    ----------
    name
        The name in its module.
    obj
        The object it names.

    Returns
    -------
    dict
        A JSON-able description (see the module's docstring).
    """
    if isinstance(obj, type):
        return describe_class(obj)
    if name in VALUE_FREE:
        return {"kind": "constant", "type": type(obj).__name__}
    if _is_constant(obj):
        return {"kind": "constant", "type": type(obj).__name__, "value": stable_repr(obj)}
    if isinstance(obj, typing.TypeVar):
        return {"kind": "TypeVar", "value": repr(obj)}
    if typing.get_origin(obj) is not None:
        return {"kind": "type-alias", "value": repr(obj)}
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return {"kind": "function", "signature": signature_text(obj)}
    if callable(obj):
        return {
            "kind": "callable",
            "type": _qualified_name(type(obj)),
            "signature": signature_text(obj),
        }
    return {"kind": "object", "type": _qualified_name(type(obj))}


def imported_from_elsewhere(module: Any) -> frozenset[str]:
    """The names a module imports from outside the library (``from logging import WARNING``).

    Parameters
    ----------
    module
        An imported module.

    Returns
    -------
    frozenset of str
        The names bound by its ``from X import name`` statements whose ``X`` is neither relative
        nor ``beyond_averaging``'s; empty where its source cannot be read.
    """
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return frozenset()
    return frozenset(
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module is not None
        and node.module.split(".")[0] != PACKAGE
        for alias in node.names
    )


def public_names(module: Any) -> list[str]:
    """A module's public names: its ``__all__``, else the library's objects and constants.

    Parameters
    ----------
    module
        An imported module.

    Returns
    -------
    list of str
        Sorted: ``__all__`` where the module has one; otherwise every name of the module not
        starting with ``_`` whose object is defined in ``beyond_averaging`` (its ``__module__``)
        or is a constant (:data:`CONSTANT_TYPES`, ``None``) not imported from outside the
        library (``TYPE_CHECKING``, ``logging.WARNING``: :func:`imported_from_elsewhere`);
        modules (imported sub-modules) are left out.
    """
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return sorted(exported)
    foreign = imported_from_elsewhere(module)
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if _is_library(obj) or (_is_constant(obj) and name not in foreign):
            names.append(name)
    return sorted(names)


def public_surface() -> dict[str, Any]:
    """The library's public surface as JSON-able data.

    Returns
    -------
    dict
        ``modules``: per module of :data:`MODULES`, per public name, its description
        (:func:`describe`); ``apps``: per module of :data:`APP_MODULES`, the qualified name of
        its ``app`` object's type; ``console-scripts``: the sorted names of pyproject.toml's
        ``[project.scripts]``; ``run-config``: ``[tool.flwr.app.config]``, keys and defaults.
    """
    modules: dict[str, dict[str, Any]] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        modules[module_name] = {
            name: describe(name, getattr(module, name)) for name in public_names(module)
        }
    apps = {
        module_name: _qualified_name(type(importlib.import_module(module_name).app))
        for module_name in APP_MODULES
    }
    project = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))
    surface = {
        "modules": modules,
        "apps": apps,
        "console-scripts": sorted(project["project"]["scripts"]),
        "run-config": dict(sorted(project["tool"]["flwr"]["app"]["config"].items())),
    }
    result: dict[str, Any] = json.loads(json.dumps(surface))  # JSON's own types, as read back
    return result


def _leaves(value: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf by its path; a list of names is a set of leaves (each name's path)."""
    if isinstance(value, Mapping):
        leaves: dict[tuple[str, ...], Any] = {}
        for key, item in value.items():
            leaves.update(_leaves(item, (*path, str(key))))
        return leaves
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return {(*path, item): "present" for item in value}
    return {path: value}


def _entry(path: tuple[str, ...]) -> str:
    """``modules > beyond_averaging.strategies > FedAvg > members > start > signature``."""
    return " > ".join(path)


def surface_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Each entry added, removed or changed between two surfaces, one line each.

    Parameters
    ----------
    recorded
        The surface recorded before (:data:`SNAPSHOT`).
    current
        The surface now (:func:`public_surface`).

    Returns
    -------
    list of str
        ``removed: <path> = <value>``, ``added: <path> = <value>`` and ``changed: <path>:
        <before> -> <now>``, sorted by path; empty when the two are equal.
    """
    before, now = _leaves(recorded), _leaves(current)
    lines = []
    for path in sorted(set(before) | set(now)):
        if path not in now:
            lines.append(f"removed: {_entry(path)} = {before[path]!r}")
        elif path not in before:
            lines.append(f"added: {_entry(path)} = {now[path]!r}")
        elif before[path] != now[path]:
            lines.append(f"changed: {_entry(path)}: {before[path]!r} -> {now[path]!r}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Write the surface to a file, or check the tree's surface against one.

    Parameters
    ----------
    argv
        Command-line arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0, or 1 when ``--check`` found differences (each printed on a line of its own).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, metavar="PATH", help="record the surface here")
    action.add_argument("--check", type=Path, metavar="PATH", help="compare with this record")
    args = parser.parse_args(argv)
    surface = public_surface()
    print(f"the surface of {Path(importlib.import_module(PACKAGE).__file__ or '?').parent}")
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(surface, indent=2, sort_keys=True) + "\n", "utf-8")
        print(f"wrote {args.write}")
        return 0
    differences = surface_differences(json.loads(args.check.read_text("utf-8")), surface)
    for line in differences:
        print(line)
    print(f"{len(differences)} difference(s) from {args.check}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
