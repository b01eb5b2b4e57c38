"""The container path a newcomer follows from docs/deployment.md holds without a guess.

Checked on the files, with no container engine (tests/test_deployment_containers.py runs the
first section for real):

- every ``beyond-averaging:<tag>`` the docs and compose files name is a tag that a compose file
  or a documented ``docker build -t`` produces (the remote SuperNode's ``:cpu`` was none);
- every ``flwr run`` of the container walk-throughs passes a short ``num-server-rounds``;
- the gRPC and the HTTP stack (``--env-file docker/http.env``) differ in Compose project name
  (so in containers, network and volumes) and in every published host port;
- compose's ``flwr`` service reaches the SuperLink by the connections of docker/flwr-config.toml,
  whose CA path the TLS overlay mounts;
- docker/flwr_connections.py writes the host CLI's connections with the CA's absolute path,
  keeping the file's other connections;
- docker/check_index.py tells an unreachable index (and names docker/make-wheelhouse.sh) from a
  reachable one;
- compose.gpu.yaml's GPU reservation is the form podman-compose turns into the CDI device
  ``nvidia.com/gpu=all`` whose spec docs/deployment.md tells how to generate.
"""

from __future__ import annotations

import http.server
import re
import shutil
import socketserver
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_helpers import REPO, interpolate, merge_compose, published_ports

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMPOSE_FILES = ["compose.yaml", "compose.tls.yaml", "compose.gpu.yaml"]
NAMED = [*DOCS, *(REPO / name for name in COMPOSE_FILES), *sorted((REPO / "docker").glob("*"))]
HTTP_ENV = REPO / "docker" / "http.env"
#: Sections of docs/deployment.md whose commands run a container federation.
WALK_THROUGHS = ("Start the federation and run", "TLS and SuperNode authentication")
SHORT_RUN = 5  # rounds at most in a walk-through


def dotenv(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of an env file, as Compose reads them (comments and blanks skipped)."""
    pairs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def merged(files: list[str], env: dict[str, str]) -> dict[str, Any]:
    model: Any = {}
    for name in files:
        model = merge_compose(model, yaml.safe_load((REPO / name).read_text(encoding="utf-8")))
    for _ in range(3):  # nested: ${BA_IMAGE:-beyond-averaging:cpu-${BA_FLEET:-grpc}}
        model = interpolate(model, env)
    result: dict[str, Any] = model
    return result


def built_tags() -> set[str]:
    """The image tags compose builds or runs, for both BA_FLEET values, and those a documented
    ``docker build ... -t TAG`` (or ``docker save``/``load`` of one) produces."""
    tags = set()
    for fleet in ("grpc", "http"):
        model = merged(["compose.yaml", "compose.gpu.yaml"], {"BA_FLEET": fleet})
        for service in model["services"].values():
            assert "${" not in service["image"], service["image"]
            tags.add(service["image"].split(":", 1)[1])
    for page in NAMED:
        if page.is_file():
            text = page.read_text(encoding="utf-8", errors="replace")
            tags.update(re.findall(r"-t beyond-averaging:([\w.-]+)", text))
    return tags


def test_every_image_tag_a_page_names_is_one_that_is_built() -> None:
    built = built_tags()
    assert {"cpu-grpc", "cpu-http", "cuda-grpc", "cuda-http"} <= built
    named = {
        (page.relative_to(REPO).as_posix(), tag.rstrip(".-:"))
        for page in NAMED
        if page.is_file()
        for tag in re.findall(
            r"beyond-averaging:([\w.${}<>:-]+)",
            page.read_text(encoding="utf-8", errors="replace"),
        )
        # A tag made of compose variables (``cpu-${BA_FLEET:-grpc}``) is checked as compose
        # interpolates it, in built_tags.
        if not set(tag) & set("${}<>")
    }
    unknown = sorted((page, tag) for page, tag in named if tag not in built)
    assert unknown == [], f"image tags no compose file or documented build produces: {unknown}"


def test_the_check_above_catches_the_tag_that_did_not_exist() -> None:
    assert "cpu" not in built_tags()


def section(page: str, heading: str) -> str:
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    body = text.split(f"\n## {heading}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def run_commands(text: str) -> list[str]:
    """The ``run . <connection>`` commands of a section's bash blocks, continuation lines joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    commands = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [command for command in commands if re.search(r"\brun \. local-deployment", command)]


@pytest.mark.parametrize("heading", WALK_THROUGHS)
def test_every_container_walk_through_runs_a_short_run(heading: str) -> None:
    commands = run_commands(section("deployment.md", heading))
    assert commands, f"no `run . local-deployment...` command in {heading!r}"
    for command in commands:
        rounds = re.findall(r"num-server-rounds=(\d+)", command)
        assert rounds, f"{heading!r} runs the default 15 rounds: {command}"
        assert int(rounds[0]) <= SHORT_RUN, command


def test_the_grpc_and_http_stacks_have_their_own_project_volumes_and_host_ports() -> None:
    http = dotenv(HTTP_ENV)
    assert http["BA_FLEET"] == "http"
    files = [REPO / "compose.yaml"]
    grpc_ports = {port for _, port, _ in published_ports(files, {}, "superlink")}
    http_ports = {port for _, port, _ in published_ports(files, http, "superlink")}
    assert grpc_ports == {"9092", "9093"}
    assert len(http_ports) == 2
    assert not grpc_ports & http_ports, (grpc_ports, http_ports)
    names = {merged(["compose.yaml"], env)["name"] for env in ({}, http)}
    assert names == {"beyond-averaging-grpc", "beyond-averaging-http"}
    # Compose scopes named volumes by project: every volume is a named one, none fixes its name.
    volumes = merged(["compose.yaml"], http)["volumes"]
    assert all(not (spec or {}).get("name") for spec in volumes.values()), volumes
    # The HTTP stack's Control API (where `flwr run` goes) is the port the env file names.
    assert http["BA_CONTROL_PORT"] in http_ports


def test_the_flwr_service_reaches_the_superlink_with_shipped_connections() -> None:
    config = tomllib.loads((REPO / "docker" / "flwr-config.toml").read_text(encoding="utf-8"))
    connections = config["superlink"]
    assert connections["local-deployment"] == {"address": "superlink:9093", "insecure": True}
    tls = connections["local-deployment-tls"]
    assert tls["address"] == "superlink:9093"
    plain = merged(["compose.yaml"], {})["services"]["flwr"]
    assert "./docker/flwr-config.toml:/app/.flwr/config.toml:ro" in plain["volumes"]
    assert plain["profiles"] == ["cli"], "`docker compose up` must not start the CLI"
    with_tls = merged(["compose.yaml", "compose.tls.yaml"], {})["services"]["flwr"]
    mounted = {volume.split(":")[1] for volume in with_tls["volumes"]}
    assert tls["root-certificates"] in mounted
    # What the FAB ships (pyproject.toml and fab-include) is what the service mounts.
    include = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["flwr"]
    shipped = {"pyproject.toml", *include["app"]["fab-include"]}
    assert {f"./{name}:/app/project/{name}:ro" for name in shipped} <= set(plain["volumes"])


def test_flwr_connections_names_the_ca_by_absolute_path_and_keeps_other_connections(
    tmp_path: Path,
) -> None:
    config = tmp_path / "flwr-home" / "config.toml"
    config.parent.mkdir()
    config.write_text(
        '[superlink]\ndefault = "mine"\n\n[superlink.mine]\naddress = "10.0.0.1:9093"\n'
        'insecure = true\n\n[superlink.local-deployment]\naddress = "stale:1"\ninsecure = true\n',
        encoding="utf-8",
    )
    certs = tmp_path / "certs"
    script = REPO / "docker" / "flwr_connections.py"
    command = [sys.executable, str(script), "--port", "9095", "--certs", "certs"]
    for _ in range(2):  # a second run replaces, never duplicates
        completed = subprocess.run(
            [*command, "--config", str(config)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
    assert "docker/make-certs.sh" in completed.stderr  # no CA yet: said, not guessed
    written = tomllib.loads(config.read_text(encoding="utf-8"))["superlink"]
    assert written["default"] == "mine"
    assert written["mine"]["address"] == "10.0.0.1:9093"
    assert written["local-deployment"] == {"address": "127.0.0.1:9095", "insecure": True}
    ca = Path(written["local-deployment-tls"]["root-certificates"])
    assert ca.is_absolute()
    assert ca == (certs / "ca.crt").resolve()


def test_flwr_connections_refuses_a_port_that_is_none() -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "docker" / "flwr_connections.py"), "--port", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 2
    assert "--port 0 is not a TCP port" in completed.stderr


class _Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def index_url(tmp_path: Path) -> Iterator[str]:
    """A PEP 503 index on loopback serving a page for pip."""
    (tmp_path / "simple" / "pip").mkdir(parents=True)
    (tmp_path / "simple" / "pip" / "index.html").write_text("<html></html>", encoding="utf-8")

    def handler(*args: Any) -> _Index:
        return _Index(*args, directory=str(tmp_path))

    with socketserver.TCPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/simple"
        finally:
            server.shutdown()


def test_check_index_names_the_wheelhouse_fix_when_an_index_does_not_answer(
    index_url: str,
) -> None:
    script = [sys.executable, str(REPO / "docker" / "check_index.py")]
    answered = subprocess.run(
        [*script, index_url], capture_output=True, text=True, check=False, timeout=60
    )
    assert answered.returncode == 0, answered.stderr
    with socketserver.TCPServer(("127.0.0.1", 0), _Index) as closed:
        dead = f"http://127.0.0.1:{closed.server_address[1]}/simple"
    refused = subprocess.run(
        [*script, "--wheelhouse", "wheelhouse/cpu", index_url, dead],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert refused.returncode == 1
    assert f"{dead}/pip/" in refused.stderr
    assert index_url not in refused.stderr  # only the index that failed is named
    assert "docker/make-wheelhouse.sh" in refused.stderr


def test_flowers_own_reader_takes_both_connection_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker/flwr-config.toml (the `flwr` service's) and what docker/flwr_connections.py writes
    (a host CLI's) are read by the installed Flower as the connections they mean."""
    flower_config = pytest.importorskip("flwr.cli.flower_config")
    container_home, host_home = tmp_path / "container", tmp_path / "host"
    container_home.mkdir()
    shutil.copy(REPO / "docker" / "flwr-config.toml", container_home / "config.toml")
    write = [sys.executable, str(REPO / "docker" / "flwr_connections.py"), "--port", "9093"]
    subprocess.run(
        [*write, "--config", str(host_home / "config.toml")],
        capture_output=True,
        check=True,
    )
    expected = {
        container_home: ("superlink:9093", "/app/certs/ca.crt"),
        host_home: ("127.0.0.1:9093", str(REPO / "docker" / "certs" / "ca.crt")),
    }
    for home, (address, ca) in expected.items():
        monkeypatch.setenv("FLWR_HOME", str(home))
        plain = flower_config.read_superlink_connection("local-deployment")
        assert (plain.address, plain.insecure) == (address, True)
        tls = flower_config.read_superlink_connection("local-deployment-tls")
        assert (tls.address, tls.root_certificates) == (address, ca)
        assert not tls.insecure


def test_the_gpu_overlay_is_what_podman_compose_maps_to_the_documented_cdi_device() -> None:
    # podman-compose 1.6 (container_to_gpu_res_args) passes `--device nvidia.com/gpu=all` for a
    # reservation with driver nvidia, capability gpu and count "all"; a numeric count arrives
    # from ${BA_GPUS_PER_NODE} as text, which it cannot use (the docs say so).
    for node in range(3):
        service = merged(["compose.yaml", "compose.gpu.yaml"], {})["services"][f"supernode-{node}"]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        assert device["count"] == "all"
    gpu = section("deployment.md", "GPU SuperNodes")
    for step in ("nvidia-ctk cdi generate", "--device nvidia.com/gpu=all", "nvidia-ctk runtime"):
        assert step in gpu, step
