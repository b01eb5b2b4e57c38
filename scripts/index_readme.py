"""Write README.index.md: README.md for a package index page, every relative link made absolute.

README.md links the manual by relative paths (``docs/install.md``), which work in a checkout and
on GitHub but lead nowhere on a package index page, where the package's long description is
shown. The package's ``readme`` (pyproject.toml) is therefore README.index.md: README.md with each
relative link turned into a link to the same file in the repository at the release's tag, so that
the index page of version X links the docs of version X::

    docs/install.md#extras  ->  <Source>/blob/v<version>/docs/install.md#extras   (a file)
    docs/results            ->  <Source>/tree/v<version>/docs/results             (a folder)
    ![plot](docs/a.png)     ->  <Source>/raw/v<version>/docs/a.png                (an image)
    #a-heading              ->  <Source>/blob/v<version>/README.md#a-heading

``<Source>`` is ``[project.urls] Source`` and ``<version>`` is ``[project] version``, both in
pyproject.toml; tags are ``v<version>`` (docs/install.md, "Releasing"). Links inside fenced code
are left alone. Edit README.md, never README.index.md, then::

    .venv/bin/python scripts/index_readme.py           # rewrite README.index.md
    .venv/bin/python scripts/index_readme.py --check   # exit 1 if it is out of date

tests/test_packaging.py runs the check and reads the built wheel's description.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "README.md"
TARGET = REPO / "README.index.md"
HEADER = (
    "<!-- Generated from README.md by scripts/index_readme.py (the package's long description, "
    "for a package index page): edit README.md, then run `.venv/bin/python "
    "scripts/index_readme.py`. -->\n"
)

#: ``[text](target)`` or ``![alt](target)``, with an optional "title" after the target.
_LINK = re.compile(
    r"(?P<image>!?)(?P<label>\[[^\]]*\])\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)"
)
_SCHEME = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)
_FENCE = re.compile(r"^\s*(```|~~~)")


def absolute_target(target: str, *, image: bool, source: str, version: str, root: Path) -> str:
    """The link ``target`` of README.md as an absolute URL under ``source`` at tag v``version``.

    Raises
    ------
    ValueError
        The target's path is not in the repository: the link would be dead everywhere.
    """
    if _SCHEME.match(target):
        return target
    path, hash_, anchor = target.partition("#")
    path = path.removeprefix("./") or SOURCE.name
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
        raise ValueError(f"README.md links {target!r}, which is not a path in the repository")
    kind = "raw" if image else "tree" if resolved.is_dir() else "blob"
    return f"{source.rstrip('/')}/{kind}/v{version}/{path}{hash_}{anchor}"


def index_readme(text: str, *, source: str, version: str, root: Path = REPO) -> str:
    """``text`` (README.md) with every relative link outside fenced code made absolute."""
    lines, in_code = [], False
    for line in text.splitlines(keepends=True):
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            line = _LINK.sub(
                lambda link: (
                    f"{link['image']}{link['label']}("
                    + absolute_target(
                        link["target"],
                        image=bool(link["image"]),
                        source=source,
                        version=version,
                        root=root,
                    )
                    + f"{link['title'] or ''})"
                ),
                line,
            )
        lines.append(line)
    return HEADER + "".join(lines)


def expected(root: Path = REPO) -> str:
    """README.index.md as README.md and pyproject.toml of ``root`` make it."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return index_readme(
        (root / SOURCE.name).read_text(encoding="utf-8"),
        source=project["urls"]["Source"],
        version=project["version"],
        root=root,
    )


def main(argv: list[str] | None = None) -> int:
    """Write README.index.md, or with ``--check`` say whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.index.md is stale")
    arguments = parser.parse_args(argv)
    text = expected()
    current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else None
    if arguments.check:
        if current != text:
            print(
                f"{TARGET.name} is not README.md with absolute links for this version: run "
                f".venv/bin/python scripts/{Path(__file__).name}",
                file=sys.stderr,
            )
            return 1
        return 0
    if current != text:
        TARGET.write_text(text, encoding="utf-8")
        print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
