"""Fast checks of the deployment tooling: image requirements, certificates, the wire tap, staging.

The real deployments (processes and containers) are in test_deployment_local.py and
test_deployment_containers.py; these run in seconds and need no Flower processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from beyond_averaging.server.deploy.local import keep_stream
from tests.deploy_helpers import (
    REPO,
    FleetTap,
    LocalDeployment,
    make_certificates,
    online_nodes_from_listing,
    stage_app,
)


def _load_requirements_script() -> ModuleType:
    """docker/requirements.py, a script outside the packages, loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "docker_requirements", REPO / "docker" / "requirements.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


deployment_requirements = _load_requirements_script().deployment_requirements

needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None or shutil.which("ssh-keygen") is None,
    reason="make-certs.sh needs openssl and ssh-keygen",
)


def test_image_requirements_are_the_library_and_node_extra_without_simulation(
    tmp_path: Path,
) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[build-system]\nrequires = ["setuptools>=69"]\n'
        '[project]\nname = "x"\ndependencies = ["flwr>=1.39.0,<2", "torch>=2.4,<3"]\n'
        "[project.optional-dependencies]\n"
        'app = ["x[node]", "flwr[simulation]>=1.39.0,<2", "scikit-learn>=1.4"]\n'
        'node = ["pydantic>=2.7", "flwr[rest]>=1.40"]\n'
        'bench = ["matplotlib>=3.8"]\ndev = ["pytest>=8"]\n',
        encoding="utf-8",
    )
    assert deployment_requirements(pyproject, None, build=False) == [
        "flwr>=1.39.0,<2",
        "torch>=2.4,<3",
        "pydantic>=2.7",
        "flwr>=1.40",
    ]
    assert deployment_requirements(pyproject, "torch==2.13.0+cu128", build=True) == [
        "flwr>=1.39.0,<2",
        "torch==2.13.0+cu128",
        "pydantic>=2.7",
        "flwr>=1.40",
        "setuptools>=69",
    ]


def test_image_requirements_leave_out_simulation_sklearn_and_the_dev_tools() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]
    image = deployment_requirements(REPO / "pyproject.toml", None, build=False)
    wanted = [*declared["dependencies"], *declared["optional-dependencies"]["node"]]
    assert image == wanted
    heavy = ("ray", "scikit-learn", "datasets", "flwr-datasets", "pandas", "pyarrow", "scipy")
    assert not any("[simulation]" in requirement for requirement in image)
    assert not any(
        requirement.startswith((*heavy, "matplotlib", "pytest")) for requirement in image
    )


def test_constraints_pin_every_image_requirement_exactly() -> None:
    pinned = {
        line.split("==")[0].lower()
        for line in (REPO / "constraints.txt").read_text("utf-8").splitlines()
        if "==" in line and not line.startswith("#")
    }
    image = deployment_requirements(REPO / "pyproject.toml", None, build=False)
    unpinned = [
        r for r in image if re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() not in pinned
    ]
    assert unpinned == []


@needs_openssl
def test_make_certs_writes_a_chain_with_the_compose_names_and_ec_node_keys(
    tmp_path: Path,
) -> None:
    certificates = make_certificates(tmp_path / "certs", nodes=2)
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(certificates.ca_cert), str(certificates.server_cert)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stderr
    san = subprocess.run(
        [
            "openssl",
            "x509",
            "-in",
            str(certificates.server_cert),
            "-noout",
            "-ext",
            "subjectAltName",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("DNS:superlink", "DNS:localhost", "IP Address:127.0.0.1"):
        assert name in san
    for index in range(2):
        public = certificates.supernode_public_key(index).read_text()
        assert public.startswith("ecdsa-sha2-nistp384 ")
        assert certificates.supernode_key(index).stat().st_mode & 0o077 == 0  # private: owner only
    assert not certificates.supernode_key(2).exists()


@needs_openssl
def test_make_certs_keeps_existing_keys_and_adds_missing_nodes(tmp_path: Path) -> None:
    first = make_certificates(tmp_path / "certs", nodes=1)
    key_before = first.supernode_public_key(0).read_text()
    server_before = first.server_cert.read_bytes()
    again = make_certificates(tmp_path / "certs", nodes=3)
    assert again.supernode_public_key(0).read_text() == key_before  # registered keys stay valid
    assert again.server_cert.read_bytes() == server_before
    assert again.supernode_public_key(2).is_file()


def test_make_certs_register_needs_a_connection(tmp_path: Path) -> None:
    completed = subprocess.run(
        ["bash", str(REPO / "docker" / "make-certs.sh"), "register", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 2
    assert "--connection" in completed.stderr


def test_fleet_tap_relays_both_ways_and_counts_the_upload() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def echo() -> None:
        connection, _ = server.accept()
        with connection:
            while len(received) < 100_000:
                chunk = connection.recv(65536)
                if not chunk:
                    break
                received.extend(chunk)
            connection.sendall(b"x" * 1234)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    tap = FleetTap(server.getsockname())
    try:
        payload = bytes(range(256)) * 400  # 102,400 bytes
        with socket.create_connection(("127.0.0.1", tap.port)) as client:
            client.sendall(payload)
            reply = bytearray()
            while len(reply) < 1234:
                chunk = client.recv(65536)
                if not chunk:
                    break
                reply.extend(chunk)
        thread.join(timeout=10)
        upload, download = tap.take()
    finally:
        tap.close()
        server.close()
    assert bytes(received[: len(payload)]) == payload[: len(received)]
    assert upload == payload[: len(upload)]
    assert len(upload) >= 100_000
    assert download == 1234
    assert bytes(reply) == b"x" * 1234
    assert tap.openings == [payload[:64]]
    assert tap.take() == (b"", 0)  # take() clears


def test_stage_app_copies_tracked_sources_and_skips_ignored_folders(tmp_path: Path) -> None:
    source = tmp_path / "app"
    for relative in (
        "pyproject.toml",
        "server/app.py",
        ".venv/lib/big.py",
        "runs/x/metrics.jsonl",
        "keep/data.json",
        ".git/config",
    ):
        path = source / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {relative}\n", encoding="utf-8")
    (source / ".gitignore").write_text(".venv/\nruns/\n", encoding="utf-8")
    staged = stage_app(source, tmp_path / "staged")
    copied = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert copied == [".gitignore", "keep/data.json", "pyproject.toml", "server/app.py"]


def test_stage_app_copies_only_what_fab_include_lists_besides_pyproject(tmp_path: Path) -> None:
    source = tmp_path / "app"
    for relative in ("server/app.py", "server/notes.md", "docs/x.md", "LICENSE", ".venv/a.py"):
        path = source / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(relative, encoding="utf-8")
    (source / "pyproject.toml").write_text(
        '[tool.flwr.app]\nfab-include = ["server/*.py", "LICENSE", ".venv/*.py"]\n',
        encoding="utf-8",
    )
    (source / ".gitignore").write_text(".venv/\n", encoding="utf-8")
    staged = stage_app(source, tmp_path / "staged")
    copied = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    # Git-ignored stays out even where fab-include names it, as in Flower's build.
    assert copied == ["LICENSE", "pyproject.toml", "server/app.py"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another account needs root")
def test_the_kept_stream_log_is_private_to_the_run_folder_s_owner(tmp_path: Path) -> None:
    # A container's ServerApp writes its run folder as the image's user (uid 1000 here, not
    # this root process): a log.txt left to root 0600 is the one file it cannot read, and the
    # docs' `docker compose exec -T superlink tar ... runs` copy then fails (exit 2).
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chown(run_dir, 1000, 1000)
    keep_stream(run_dir, "INFO : round 1\n")
    log = (run_dir / "log.txt").stat()
    assert (log.st_uid, log.st_gid) == (1000, 1000)
    assert log.st_mode & 0o777 == 0o600
    assert (run_dir / "log.txt").read_text() == "INFO : round 1\n"


def test_online_nodes_are_read_from_the_cli_listing() -> None:
    listing = "some banner\n" + json.dumps(
        {
            "success": True,
            "nodes": [
                {"node-id": "11", "status": "online"},
                {"node-id": "12", "status": "registered"},
                {"node-id": "13", "status": "offline"},
                {"node-id": "14", "status": "online"},
            ],
        }
    )
    assert online_nodes_from_listing(listing) == [11, 14]
    assert online_nodes_from_listing("Error: connection refused") == []


def test_closing_a_deployment_stops_what_it_started_even_when_re_parented(
    tmp_path: Path,
) -> None:
    # The SuperLink's stand-in starts a process in a session of its own and exits, as a
    # ServerApp whose parent died would be: only the deployment's marker can still find it.
    deployment = LocalDeployment(REPO, tmp_path)
    pid_file = tmp_path / "orphan.pid"
    starter = (
        "import subprocess, sys; "
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    deployment.superlink = subprocess.Popen([sys.executable, "-c", starter], env=deployment.env)
    deployment.superlink.wait(timeout=30)
    orphan = int(pid_file.read_text())
    os.kill(orphan, 0)  # running, outside the stand-in's (ended) tree
    deployment.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(orphan, 0)
        except ProcessLookupError:
            return
        # A killed child of no waiting parent is a zombie until init reaps it.
        with contextlib.suppress(FileNotFoundError):
            if Path(f"/proc/{orphan}/stat").read_text().split()[2] == "Z":
                return
        time.sleep(0.2)
    raise AssertionError(f"process {orphan} started by the deployment survived close()")
