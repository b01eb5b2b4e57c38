"""The user-facing docs hold together: README.md is a short front page, every relative link in it
and in docs/*.md reaches a file (and heading) inside the repository, and CI runs the test command
the README gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRONT_PAGE_MAX_LINES = 100  # two screens

# [text](target) and ![alt](target); the target ends at whitespace or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (links inside code are not links)."""
    lines, in_code = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            in_code = not in_code
            continue
        if not in_code:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats -1, -2."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(page: Path) -> list[str]:
    links = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                links.append(target)
    return links


def _broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in _relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(root):
            broken.append(f"{target} (points outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(root)})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    assert _broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_no_page_names_a_path_outside_the_repository(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert re.findall(r"\.\./shared\S*", text) == []


def test_link_checker_catches_a_missing_file_an_outside_path_and_a_missing_heading(
    tmp_path: Path,
) -> None:
    root = tmp_path.resolve() / "repo"
    (root / "docs").mkdir(parents=True)
    page = root / "docs" / "probe.md"
    page.write_text(
        "# Probe\n\n[a](nope.md) [b](../../outside.md) [c](#absent) [d](#probe)\n"
        "```\n[not a link](ignored.md)\n```\n",
        encoding="utf-8",
    )
    assert _broken_links(page, root) == [
        "nope.md (no such file)",
        "../../outside.md (points outside the repository)",
        "#absent (no heading #absent in docs/probe.md)",
    ]


def test_readme_is_a_front_page_of_at_most_two_screens() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= FRONT_PAGE_MAX_LINES


def test_ci_runs_first_the_test_command_the_readme_gives() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [
        line
        for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert commands[0] == "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert f"```bash\n{commands[0]}\n```" in readme
    assert "```bash\nbash scripts/setup.sh && .venv/bin/ba-run\n```" in readme
