"""Packaging: one import name wherever the code runs, and a release that builds and checks.

The folders ``client/``, ``server/``, ``strategies/`` and ``tasks/`` at the repository's top are
the subpackages of ``beyond_averaging`` (docs/development.md, "Layout"). The same imports must
resolve, each to the files of the tree it runs from, in the four places the code runs:

1. a source checkout on ``sys.path``, nothing installed;
2. an editable install (``pip install -e``, what scripts/setup.sh makes);
3. the Flower App Bundle that ``flwr build`` makes and every node unpacks (the run executes the
   code it shipped, not a checkout that happens to be installed beside it);
4. the wheel, whose files all sit under ``site-packages/beyond_averaging/``.

Each case imports every module of the package in a fresh interpreter (``-I``: no ``PYTHONPATH``,
no user site, no current folder) whose site-packages hold the dependencies but not this package,
and reports where each module came from.

The release checks follow docs/install.md, "Releasing": ``python -m build`` makes an sdist and a
wheel, ``twine check --strict`` passes, the wheel built from the sdist equals the wheel built from
the checkout file for file, the sdist holds what a release ships, and the version is written once.

The builds run with ``--no-isolation`` (setuptools from constraints.txt, no registry); a release
build is isolated (docs/install.md), and the two differ only in where setuptools comes from.
"""

from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from beyond_averaging.server.runtime.processes import flower_environment

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
VERSION: str = PYPROJECT["project"]["version"]
#: The folders at the repository's top that are the package's subpackages (docs/development.md).
FOLDERS = ("client", "server", "strategies", "tasks")
#: What the package is built from (the rest of the repository is not part of any install).
PACKAGE_FILES = (
    "pyproject.toml",
    "README.md",
    "README.index.md",
    "LICENSE",
    "CHANGELOG.md",
    "MANIFEST.in",
)
#: The repository's address: every URL of the package's metadata is under it.
HOME = "https://github.com/beyond-averaging/beyond-averaging"
# A Markdown link's target: [text](target) or ![alt](target).
_LINK_TARGET = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)")
#: Pythons the package declares and the version legs test (docs/install.md, "Python versions").
PYTHONS = ("3.11", "3.12", "3.13")

# Run in the case's interpreter: put ROOT first on sys.path (Flower does the same with the folder
# it unpacked a FAB into), import every module of the four subpackages, print where each came from.
_PROBE = textwrap.dedent(
    """
    import importlib, importlib.util, json, pkgutil, sys
    root = sys.argv[1]
    if root:
        sys.path.insert(0, root)
    import beyond_averaging
    for folder in sys.argv[2].split(","):
        package = importlib.import_module(f"beyond_averaging.{folder}")
        for module in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            importlib.import_module(module.name)
    print(json.dumps({
        "files": {
            name: module.__file__
            for name, module in sys.modules.items()
            if name.split(".")[0] in ("beyond_averaging", *sys.argv[2].split(","))
        },
        "version": beyond_averaging.__version__,
        "public": [name for name in beyond_averaging.__all__ if hasattr(beyond_averaging, name)],
    }))
    """
)


@dataclass(frozen=True)
class Imported:
    """What one interpreter imported: module name -> file, the version, the public names found."""

    files: Mapping[str, str]
    version: str
    public: list[str]


def _run(command: list[str | Path], *, timeout: float = 300, **kwargs: object) -> str:
    completed = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )
    assert completed.returncode == 0, (
        f"{' '.join(map(str, command))} exited {completed.returncode}:\n"
        f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    )
    return str(completed.stdout)


def _tracked_files() -> list[str]:
    """The checkout's files as a clone would have them: tracked or new, never git-ignored."""
    listing = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO
    )
    return sorted({name for name in listing.split("\0") if name and (REPO / name).is_file()})


def _copy_checkout(destination: Path) -> Path:
    """A copy of the checkout's files: builds write into their source tree (build/, *.egg-info),
    which must not race with other work in the real checkout nor leak stale files into a wheel."""
    for name in _tracked_files():
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return destination


def _package_modules() -> set[str]:
    """Every module the package holds, by import name, from the tracked sources."""
    names = {"beyond_averaging"}
    for path in _tracked_files():
        parts = Path(path).parts
        if len(parts) >= 2 and parts[0] in FOLDERS and parts[-1].endswith(".py"):
            dotted = [*parts[:-1], *([] if parts[-1] == "__init__.py" else [Path(parts[-1]).stem])]
            names.add(".".join(["beyond_averaging", *dotted]))
    return names


def _dependencies_only_venv(path: Path) -> Path:
    """A venv that sees this interpreter's installed packages but not its install of this project.

    The running environment's site-packages are named in a .pth file; Python does not run the .pth
    files of a folder named that way, so the editable install's import hook stays out.
    """
    _run([sys.executable, "-m", "venv", "--without-pip", path], timeout=120)
    python = path / "bin" / "python"
    purelib = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
    )
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n", "utf-8")
    return python


def _import_all(python: Path, root: Path | None, cwd: Path) -> Imported:
    output = _run([python, "-I", "-c", _PROBE, str(root or ""), ",".join(FOLDERS)], cwd=cwd)
    report = json.loads(output.strip().splitlines()[-1])
    return Imported(report["files"], report["version"], report["public"])


def _assert_resolves_into(
    imported: Imported, package_dir: Path, folder_of: dict[str, Path]
) -> None:
    """Every module came from `package_dir` (the package's own files) or a folder in `folder_of`,
    each under its full name only, and the package is whole."""
    assert set(imported.files) == _package_modules(), (
        "imported modules differ from the tracked sources: "
        f"{sorted(set(imported.files) ^ _package_modules())}"
    )
    for name, file in imported.files.items():
        parts = name.split(".")
        folder = folder_of[parts[1]] if len(parts) > 1 else package_dir
        expected = folder.joinpath(*parts[2:]) if len(parts) > 2 else folder
        assert Path(file) in (expected / "__init__.py", expected.with_suffix(".py")), (
            f"{name} imported from {file}, expected inside {folder}"
        )
    assert imported.version == VERSION
    assert "FedAvg" in imported.public
    assert "sensitivity_record" in imported.public


@pytest.fixture(scope="module")
def dependencies_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dependencies_only_venv(tmp_path_factory.mktemp("dependencies-venv"))


def test_no_symbolic_link_is_tracked() -> None:
    listing = _run(["git", "ls-files", "-s"], cwd=REPO)
    links = [line.split("\t")[1] for line in listing.splitlines() if line.startswith("120000 ")]
    assert links == [], f"tracked symbolic links (mode 120000): {links}"


def test_the_build_maps_each_folder_into_the_package() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    expected = {"beyond_averaging": "beyond_averaging"} | {
        f"beyond_averaging.{folder}": folder for folder in FOLDERS
    }
    assert setuptools["package-dir"] == expected
    # Every package of the four folders is listed, sub-packages too: a folder left out of the
    # list would be left out of the wheel, with no error until someone imports it.
    subpackages = {
        "beyond_averaging." + ".".join(init.parent.relative_to(REPO).parts)
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted({*expected, *subpackages})


def test_a_checkout_on_sys_path_imports_its_own_folders(
    dependencies_python: Path, tmp_path: Path
) -> None:
    imported = _import_all(dependencies_python, REPO, cwd=tmp_path)
    _assert_resolves_into(
        imported, REPO / "beyond_averaging", {folder: REPO / folder for folder in FOLDERS}
    )


def test_an_editable_install_imports_the_folders_of_its_tree(
    dependencies_python: Path, tmp_path: Path
) -> None:
    tree = _copy_checkout(tmp_path / "tree")
    venv_python = _dependencies_only_venv(tmp_path / "venv")
    _run(
        [
            *(sys.executable, "-m", "pip", "--python", venv_python, "install", "--quiet"),
            *("--no-deps", "--no-build-isolation", "--no-index", "--editable", tree),
        ],
        cwd=tmp_path,
    )
    imported = _import_all(venv_python, None, cwd=tmp_path)
    _assert_resolves_into(
        imported, tree / "beyond_averaging", {folder: tree / folder for folder in FOLDERS}
    )


#: The largest FAB allowed (issue 27): every SuperNode downloads it, and every ClientApp process
#: unzips and hash-checks it per message. Flower stores a FAB's files uncompressed.
MAX_FAB_BYTES = 300_000


def test_the_fab_carries_the_manifest_and_license_and_runs_the_installed_library(
    tmp_path: Path,
) -> None:
    tree = _copy_checkout(tmp_path / "tree")
    built = tmp_path / "built"
    built.mkdir()
    env = flower_environment(tmp_path / "flwr-home")
    _run([Path(sys.executable).parent / "flwr", "build", "--app", tree], cwd=built, env=env)
    (fab,) = built.glob("*.fab")
    unpacked = tmp_path / "fab"
    with zipfile.ZipFile(fab) as archive:
        members = archive.namelist()
        archive.extractall(unpacked)
    # Flower's manifest of the FAB's files comes with every FAB; nothing of docs/, tests/,
    # benchmarks/, scripts/, docker/ or the code rides along.
    assert sorted(members) == [".info/CONTENT", "LICENSE", "pyproject.toml"]
    assert fab.stat().st_size <= MAX_FAB_BYTES, f"{fab.name}: {fab.stat().st_size} B"
    shipped = tomllib.loads((unpacked / "pyproject.toml").read_text(encoding="utf-8"))
    assert shipped["project"]["version"] == VERSION
    assert shipped["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "beyond_averaging.server.app:app",
        "clientapp": "beyond_averaging.client.app:app",
    }
    # The FAB's folder comes first on sys.path, as Flower puts it: the components still resolve
    # to the installed library (here the editable install of this checkout).
    imported = _import_all(Path(sys.executable), unpacked, cwd=tmp_path)
    _assert_resolves_into(
        imported, REPO / "beyond_averaging", {folder: REPO / folder for folder in FOLDERS}
    )


@dataclass(frozen=True)
class Release:
    """Artifacts of one release build of a copy of the checkout."""

    sdist: Path
    wheel_from_sdist: Path
    wheel_from_checkout: Path


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    tree = _copy_checkout(tmp_path_factory.mktemp("release-tree"))
    out = tmp_path_factory.mktemp("release-dist")
    build = [sys.executable, "-m", "build", "--no-isolation"]
    # Without --sdist/--wheel, build makes the sdist and then the wheel from the unpacked sdist.
    _run([*build, "--outdir", out / "from-sdist", tree], cwd=tree)
    _run([*build, "--wheel", "--outdir", out / "from-checkout", tree], cwd=tree)
    (sdist,) = (out / "from-sdist").glob("*.tar.gz")
    (wheel_from_sdist,) = (out / "from-sdist").glob("*.whl")
    (wheel_from_checkout,) = (out / "from-checkout").glob("*.whl")
    return Release(sdist, wheel_from_sdist, wheel_from_checkout)


def test_the_release_files_pass_twine_check(release: Release) -> None:
    output = _run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            release.sdist,
            release.wheel_from_sdist,
        ]
    )
    assert output.count("PASSED") == 2, output


def test_the_wheel_built_from_the_sdist_equals_the_wheel_built_from_the_checkout(
    release: Release,
) -> None:
    def contents(wheel: Path) -> dict[str, bytes]:
        with zipfile.ZipFile(wheel) as archive:
            return {name: archive.read(name) for name in archive.namelist()}

    from_sdist, from_checkout = (
        contents(release.wheel_from_sdist),
        contents(release.wheel_from_checkout),
    )
    assert release.wheel_from_sdist.name == release.wheel_from_checkout.name
    assert sorted(from_sdist) == sorted(from_checkout)
    differing = [name for name in from_sdist if from_sdist[name] != from_checkout[name]]
    assert differing == []


def test_the_wheel_holds_one_top_level_package_with_every_source_file(release: Release) -> None:
    dist_info = f"beyond_averaging-{VERSION}.dist-info"
    with zipfile.ZipFile(release.wheel_from_sdist) as archive:
        names = set(archive.namelist())
        top_level = archive.read(f"{dist_info}/top_level.txt").decode().split()
    assert {name.split("/")[0] for name in names} == {"beyond_averaging", dist_info}
    assert top_level == ["beyond_averaging"]
    sources = {
        f"beyond_averaging/{path}"
        for path in _tracked_files()
        if Path(path).parts[0] in FOLDERS and path.endswith(".py") and len(Path(path).parts) >= 2
    }
    assert sources <= names, f"missing from the wheel: {sorted(sources - names)}"
    assert {"beyond_averaging/__init__.py", "beyond_averaging/py.typed"} <= names
    assert f"{dist_info}/licenses/LICENSE" in names


def test_the_wheel_declares_every_tested_python_without_an_upper_bound(release: Release) -> None:
    with zipfile.ZipFile(release.wheel_from_sdist) as archive:
        metadata = archive.read(f"beyond_averaging-{VERSION}.dist-info/METADATA").decode()
    fields = [
        line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line
    ]
    requires_python = SpecifierSet(dict(fields)["Requires-Python"])
    classifiers = {value for key, value in fields if key == "Classifier"}
    for python in PYTHONS:
        assert requires_python.contains(f"{python}.0")
        assert f"Programming Language :: Python :: {python}" in classifiers
    assert requires_python.contains("3.99.0"), f"{requires_python} caps the Python version"
    assert not requires_python.contains("3.10.99")
    assert dict(fields)["Version"] == VERSION
    assert dict(fields)["License-Expression"] == "Apache-2.0"


def _metadata(wheel: Path) -> tuple[list[tuple[str, str]], str]:
    """The wheel's METADATA: its header fields in order, and its description (the body)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"beyond_averaging-{VERSION}.dist-info/METADATA").decode()
    header, _, body = metadata.partition("\n\n")
    fields = [
        (key, value) for key, _, value in (line.partition(": ") for line in header.splitlines())
    ]
    return fields, body


def test_the_wheel_names_the_projects_home_docs_source_issues_and_changelog(
    release: Release,
) -> None:
    fields, _ = _metadata(release.wheel_from_sdist)
    urls = dict(value.split(", ", 1) for key, value in fields if key == "Project-URL")
    assert urls == {
        "Homepage": HOME,
        "Documentation": f"{HOME}/tree/main/docs",
        "Source": HOME,
        "Issues": f"{HOME}/issues",
        "Changelog": f"{HOME}/blob/main/CHANGELOG.md",
    }
    assert (REPO / "docs").is_dir()
    assert (REPO / "CHANGELOG.md").is_file()


def test_the_wheels_description_is_the_readme_with_links_to_this_versions_files(
    release: Release,
) -> None:
    # A package index page shows the description: a relative link there leads nowhere. Each of
    # README.md's relative links must be an absolute one to the same path at this version's tag.
    fields, description = _metadata(release.wheel_from_sdist)
    assert dict(fields)["Description-Content-Type"] == "text/markdown"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    relative = [t for t in _LINK_TARGET.findall(readme) if not re.match(r"^[a-z]+:", t)]
    assert len(relative) >= 20, "README.md should link the manual"
    targets = _LINK_TARGET.findall(description)
    assert [t for t in targets if not re.match(r"^https?://", t)] == []
    at_tag = re.compile(rf"^{re.escape(HOME)}/(blob|tree|raw)/v{re.escape(VERSION)}/([^#]+)(#.*)?$")
    ours = [t for t in targets if t.startswith(HOME)]
    assert len(ours) == len(relative)
    for target in ours:
        found = at_tag.match(target)
        assert found is not None, f"{target} is not a path at the tag v{VERSION}"
        kind, path = found.group(1), REPO / found.group(2)
        assert path.is_dir() if kind == "tree" else path.is_file(), target
    # Apart from the links (and a generated-file comment an index page does not show), it is
    # README.md word for word.
    back = re.sub(rf"{re.escape(HOME)}/(?:blob|tree|raw)/v{re.escape(VERSION)}/", "", description)
    back = re.sub(r"\]\(README\.md#", "](#", re.sub(r"\A<!--.*?-->\n", "", back, flags=re.S))
    assert back.strip() == readme.strip()


def test_the_committed_index_readme_is_up_to_date_with_readme_md() -> None:
    # README.index.md is generated from README.md and pyproject.toml (scripts/index_readme.py).
    _run([sys.executable, REPO / "scripts" / "index_readme.py", "--check"], cwd=REPO)


def test_the_installed_wheel_imports_from_site_packages_only(
    release: Release, dependencies_python: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site-packages"
    _run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--target", target, release.wheel_from_sdist),
        ]
    )
    entries = {path.name for path in target.iterdir()}
    assert entries == {"beyond_averaging", f"beyond_averaging-{VERSION}.dist-info", "bin"}, entries
    imported = _import_all(dependencies_python, target, cwd=tmp_path)
    package = target / "beyond_averaging"
    _assert_resolves_into(imported, package, {folder: package / folder for folder in FOLDERS})
    # No folder leaks as a top-level module next to the package.
    probe = "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); " + (
        "print([n for n in sys.argv[2].split(',') if importlib.util.find_spec(n)])"
    )
    leaked = _run([dependencies_python, "-I", "-c", probe, target, ",".join(FOLDERS)], cwd=tmp_path)
    assert leaked.strip() == "[]"


def test_every_console_script_of_the_installed_wheel_answers_help(
    release: Release, dependencies_python: Path, tmp_path: Path
) -> None:
    # Each [project.scripts] entry as the installed metadata names it, loaded and run with
    # --help from the wheel alone: a script whose module moved fails here, not in a user's shell.
    target = tmp_path / "site-packages"
    _run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--target", target, release.wheel_from_checkout),
        ]
    )
    run_script = (
        "import sys; from importlib.metadata import entry_points; name = sys.argv[1]; "
        "(script,) = entry_points(group='console_scripts', name=name); "
        "sys.argv = [name, '--help']; script.load()()"
    )
    for name in PYPROJECT["project"]["scripts"]:
        completed = subprocess.run(
            [dependencies_python, "-c", run_script, name],
            cwd=tmp_path,
            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, f"{name} --help: {completed.stderr[-2000:]}"
        assert "usage" in completed.stdout.lower(), f"{name} --help printed: {completed.stdout}"


def test_the_sdist_holds_the_package_and_the_release_files_only(release: Release) -> None:
    with tarfile.open(release.sdist) as archive:
        names = {
            Path(*Path(member.name).parts[1:]).as_posix()
            for member in archive.getmembers()
            if member.isfile()
        }
    top = {name.split("/")[0] for name in names}
    assert top == {
        "PKG-INFO",
        "setup.cfg",
        "beyond_averaging.egg-info",
        "beyond_averaging",
        *FOLDERS,
        *PACKAGE_FILES,
    }, f"unexpected in the sdist: {sorted(top)}"
    sources = {
        path
        for path in _tracked_files()
        if Path(path).parts[0] in (*FOLDERS, "beyond_averaging") and len(Path(path).parts) >= 2
    }
    assert sources <= names, f"missing from the sdist: {sorted(sources - names)}"


def test_the_version_is_written_once_in_code_and_the_changelog_names_it() -> None:
    written = re.compile(
        r"(?:beyond[-_.]averaging[-_.\s]+v?|__version__\s*[:=][^=\n]*[\"'])" + re.escape(VERSION)
    )
    elsewhere = [
        path
        for path in _tracked_files()
        if path not in ("pyproject.toml", "CHANGELOG.md")
        # Code and configuration; the docs may show a wheel's file name as an example
        # (docs/install.md, "Releasing", finds those at a release).
        and Path(path).suffix in (".py", ".toml", ".txt", ".sh", ".yaml", ".cfg", "")
        and written.search((REPO / path).read_text(encoding="utf-8", errors="replace"))
    ]
    assert elsewhere == [], f"the version {VERSION} is written outside pyproject.toml: {elsewhere}"

    headings = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2}|Unreleased)$",
        (REPO / "CHANGELOG.md").read_text(encoding="utf-8"),
        flags=re.MULTILINE,
    )
    assert headings, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' heading"
    assert headings[0][0] == VERSION, f"CHANGELOG.md's newest heading is {headings[0][0]}"
    versions = [tuple(int(part) for part in version.split(".")) for version, _ in headings]
    assert versions == sorted(set(versions), reverse=True), "versions must fall, each once"
    assert all(date != "Unreleased" for _, date in headings[1:]), "only the newest is unreleased"
