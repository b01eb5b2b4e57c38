"""The public surface equals the one recorded before the sub-package move.

``tests/public_surface.json`` was written by ``python -m tests.public_surface --write
tests/public_surface.json`` from the tree before the folders' modules moved into sub-packages: every
name of the public modules, its kind and signature, the methods and properties of the library's
classes, the Flower apps' types, the console scripts' names and the run options' defaults
(tests/public_surface.py says what is read and why only from location-independent entry points).
A change to the surface that is meant is recorded by writing the file again, in the same commit.
"""

from __future__ import annotations

import json

from tests.public_surface import SNAPSHOT, public_surface, surface_differences


def test_public_surface_is_unchanged_by_the_move() -> None:
    """Every public name, kind, signature, script name and run option is as recorded."""
    recorded = json.loads(SNAPSHOT.read_text("utf-8"))
    differences = surface_differences(recorded, public_surface())
    assert not differences, (
        f"the public surface differs from {SNAPSHOT.name} in {len(differences)} entries "
        "(rewrite it with `python -m tests.public_surface --write tests/public_surface.json` "
        "only if the change is meant):\n" + "\n".join(differences)
    )


def test_differences_name_each_entry() -> None:
    """An added, a removed and a changed entry are each reported with their path."""
    before = {"m": {"f": {"kind": "function", "signature": "(x)"}, "g": {"kind": "c"}}}
    after = {"m": {"f": {"kind": "function", "signature": "(x, y)"}, "h": {"kind": "c"}}}
    assert surface_differences(before, after) == [
        "changed: m > f > signature: '(x)' -> '(x, y)'",
        "removed: m > g > kind = 'c'",
        "added: m > h > kind = 'c'",
    ]
