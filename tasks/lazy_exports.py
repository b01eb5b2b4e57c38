"""Public names of a package imported on first use (PEP 562), for the packages' ``__init__``.

``beyond_averaging`` and ``beyond_averaging.tasks`` re-export names from modules that import
torch, scikit-learn or Flower Datasets; resolving them lazily keeps ``import
beyond_averaging.tasks.protocol`` (record names only) free of those seconds-long imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_exports(
    package: str, namespace: MutableMapping[str, Any], module_of_export: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a package with lazy exports.

    Parameters
    ----------
    package : str
        The package's ``__name__``; relative module names resolve against it.
    namespace : MutableMapping
        The package's ``globals()``: a resolved name is stored there, so later look-ups skip
        the hook.
    module_of_export : Mapping[str, str]
        Each public name and the (relative) module that defines it.

    Returns
    -------
    tuple
        ``(__getattr__, __dir__)`` to assign at the package's top level.
    """

    def __getattr__(name: str) -> object:  # noqa: N807 - PEP 562's name
        module_name = module_of_export.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - PEP 562's name
        return sorted({*namespace, *module_of_export})

    return __getattr__, __dir__
