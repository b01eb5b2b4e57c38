"""End-to-end deployment in containers: the image, compose.yaml and its TLS overlay, for real.

One image build (docker/Dockerfile, from the wheelhouse when present) serves every test, of the
Flower release this interpreter runs: flwr 1.39 builds ``FLEET=grpc``, 1.40 and later ``FLEET=http``
(server/deploy/flower_release.py), so the suite tests the transport of its environment. Then:

- the insecure stack of compose.yaml (SuperLink + 3 SuperNodes) runs 2 rounds of each strategy of
  this build through ``flwr run`` from the host; the compose health checks pass; the engine
  published the Fleet and Control APIs on 127.0.0.1 only;
- on the same stack one round of Elastic runs under secure aggregation (SecAgg+'s four stages
  through the containers' SuperLink and warm executors);
- on the same stack a SuperNode is stopped (``docker compose stop``) while a run is under way, and
  the run completes with the two others;
- the SuperLink is restarted: its state was in memory, so every SuperNode comes back under a new
  node id (their restart policy) and the next run trains on all three;
- the TLS + SuperNode-authentication overlay (compose.tls.yaml, certificates from
  docker/make-certs.sh, keys registered by its one-shot registrar) runs 2 rounds through
  compose's ``flwr`` service as docs/deployment.md does, and a SuperNode container with a key
  that was never registered is refused;
- docs/deployment.md's first section, "Start the federation and run", runs as written: its bash
  blocks in order, in a copy of the checkout (the wheelhouse, ``up --build`` on this module's
  image, whose layers are cached, the run through compose's ``flwr`` service, the copy-out,
  ``down``);
- a build with no wheelhouse and no network stops with a message naming
  docker/make-wheelhouse.sh (not pip's ``ResolutionImpossible``);
- the engine's own ``docker compose config`` gives the gRPC stack and the HTTP stack
  (``--env-file docker/http.env``) different project names and host ports.

Skipped, with the reason, where no container engine (``docker`` and ``docker compose``) works;
``.ci/engine.sh`` sets one up on the project machine. Run with ``-s`` to see the timings.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.overrides import LaunchError
from beyond_averaging.server.runs.folder import read_summary
from beyond_averaging.server.runtime.processes import flower_environment, free_port
from tests.deploy_helpers import (
    REPO,
    Certificates,
    ComposeStack,
    available_strategies,
    container_engine_problem,
    make_certificates,
    online_nodes_from_listing,
    read_metrics,
    run_app,
    run_config_argument,
    stage_app,
    write_connection,
)

ENGINE_PROBLEM = container_engine_problem()
pytestmark = [
    pytest.mark.deployment,
    pytest.mark.skipif(
        ENGINE_PROBLEM is not None,
        reason=f"no container engine, container deployment tests skipped: {ENGINE_PROBLEM}",
    ),
]

FLEET = FlowerRelease.installed().transport
IMAGE = f"beyond-averaging:test-{FLEET}"
#: The uid:gid the image runs as (docker/Dockerfile APP_UID/APP_GID).
CONTAINER_USER = (1000, 1000)
NUM_SUPERNODES = 3  # the supernode blocks of compose.yaml
STRATEGIES = ("fedavg", "elastic", "fedlaw", "fedgma")
RUN_SETTINGS: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": NUM_SUPERNODES,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "fraction-train": 1.0,
    "seed": 0,
    "output-dir": "/app/runs",  # inside the SuperLink container: the BA_RUNS mount
}
AVAILABLE = available_strategies(STRATEGIES, RUN_SETTINGS) if ENGINE_PROBLEM is None else {}
CONNECTION = "compose"


def strategy_params() -> list[Any]:
    """Every strategy; one this build lacks is skipped with the reason."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skip(reason=f"strategy {name!r} not in this build: {why}")
            if (why := AVAILABLE.get(name, ""))
            else (),
            id=name,
        )
        for name in STRATEGIES
    ]


def timed(label: str, started: float) -> None:
    print(f"\n[containers] {label}: {time.monotonic() - started:.0f} s")


#: A cold build takes under 2 minutes from the wheelhouse here (1 min 45 s, FLEET=http, no layer
#: cache). A build still running after this long is stuck, not slow: podman's RUN steps are known
#: to hang now and then (containers/podman#21504), and a CI job once ran past its limit inside the
#: first test of this module, where the build runs. It is stopped and tried once more.
BUILD_TIMEOUT_S = 900.0


def build_once(command: list[str]) -> tuple[int | None, str]:
    """Run one ``docker build``; ``(None, output so far)`` when it outlived BUILD_TIMEOUT_S."""
    # Its own process group, so that a stuck build is stopped with every process it started.
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output
    return process.returncode, output


@pytest.fixture(scope="module")
def image() -> str:
    """Build the image once for every test of this module (a stuck build is tried again once)."""
    command = ["docker", "build", "-f", "docker/Dockerfile", "--build-arg", f"FLEET={FLEET}"]
    command += ["-t", IMAGE, "."]
    for attempt in (1, 2):
        started = time.monotonic()
        returncode, output = build_once(command)
        if returncode is not None:
            break
        timed(f"image build attempt {attempt} stopped after {BUILD_TIMEOUT_S:.0f} s", started)
        print(output[-2000:])
    else:
        stuck = f"docker build was stuck twice ({BUILD_TIMEOUT_S:.0f} s each)"
        pytest.fail(f"{stuck}:\n{output[-4000:]}")
    if returncode != 0:
        pytest.fail(f"docker build failed:\n{output[-4000:]}")
    source = "wheelhouse" if "from the wheelhouse" in output else "index"
    timed(f"image build ({source})", started)
    return IMAGE


@pytest.fixture(scope="module")
def staged_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stage_app(REPO, tmp_path_factory.mktemp("app"))


class Deployment:
    """A compose stack plus the host-side ``flwr`` connection to it."""

    def __init__(self, workdir: Path, files: list[str], certificates: Certificates | None) -> None:
        self.workdir = workdir
        self.runs = workdir / "runs"
        self.runs.mkdir()
        # The ServerApp writes here as the image's user.
        if os.geteuid() == 0:
            os.chown(self.runs, *CONTAINER_USER)
        else:
            self.runs.chmod(0o777)
        self.control_port = free_port()
        self.certificates = certificates
        env = dict(os.environ)
        env.update(
            {
                "BA_IMAGE": IMAGE,
                "BA_FLEET": FLEET,
                "BA_FLEET_PORT": str(free_port()),
                "BA_CONTROL_PORT": str(self.control_port),
                "BA_RUNS": str(self.runs),
                "BA_NUM_SUPERNODES": str(NUM_SUPERNODES),
            }
        )
        if certificates is not None:
            env["BA_CERTS"] = str(certificates.directory)
        self.stack = ComposeStack(
            f"batest{os.getpid()}{workdir.name[-6:].replace('-', '')}".lower(),
            [REPO / name for name in files],
            env,
        )
        self.flwr_env = flower_environment(workdir / "flwr-home")
        write_connection(
            workdir / "flwr-home",
            CONNECTION,
            f"127.0.0.1:{self.control_port}",
            None if certificates is None else certificates.ca_cert,
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait for the Control API, then for NUM_SUPERNODES SuperNodes online."""
        deadline = time.monotonic() + timeout
        scheme = "http" if self.certificates is None else "https"
        context = None
        if self.certificates is not None:
            context = ssl.create_default_context(cafile=str(self.certificates.ca_cert))
        while time.monotonic() < deadline:
            try:
                url = f"{scheme}://127.0.0.1:{self.control_port}/health"
                with urllib.request.urlopen(url, timeout=2.0, context=context):
                    break
            except OSError:
                time.sleep(2.0)
        while time.monotonic() < deadline:
            if len(self.online_node_ids()) >= NUM_SUPERNODES:
                return
            time.sleep(2.0)
        logs = "\n".join(
            f"--- {service}\n{self.stack.logs(service)[-1500:]}"
            for service in ["superlink", *(f"supernode-{i}" for i in range(NUM_SUPERNODES))]
        )
        raise LaunchError(f"the stack was not ready after {timeout} s\n{logs}")

    def online_node_ids(self) -> list[int]:
        completed = subprocess.run(
            ["flwr", "supernode", "list", CONNECTION, "--format", "json"],
            env=self.flwr_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return online_nodes_from_listing(completed.stdout)

    def run(self, app: Path, strategy: str, name: str, **overrides: Any) -> Path:
        settings = {**RUN_SETTINGS, "strategy": strategy, "run-name": name, **overrides}
        return run_app(app, self.flwr_env, CONNECTION, settings, self.runs, timeout=900.0)

    def healthy(self, service: str) -> bool:
        """Run the service's compose health check now (podman) or read its status (Docker)."""
        container = self.stack.container(service)
        probe = subprocess.run(
            ["docker", "healthcheck", "run", container],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if "unknown command" not in probe.stderr.lower() and "is not a docker command" not in (
            probe.stderr.lower()
        ):
            return probe.returncode == 0
        status = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.Health.Status}}", container],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout.strip()
        return status == "healthy"


def assert_every_round_aggregated(metrics: list[dict[str, Any]], replies: int) -> None:
    assert [entry["round"] for entry in metrics] == [0, 1, 2]
    for entry in metrics[1:]:
        assert entry["replies-valid"] == replies, entry
        assert entry["replies-dropped"] == 0, entry
        assert entry["aggregated"] == 1, entry
        assert 0.0 <= entry["test-accuracy"] <= 1.0


@pytest.fixture(scope="module")
def insecure_stack(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("compose"), ["compose.yaml"], None)
    started = time.monotonic()
    with deployment.stack.up(timeout=900.0):
        deployment.wait_ready()
        timed("compose up, 3 SuperNodes online", started)
        yield deployment


def test_compose_health_checks_pass(insecure_stack: Deployment) -> None:
    for service in ["superlink", *(f"supernode-{i}" for i in range(NUM_SUPERNODES))]:
        assert insecure_stack.healthy(service), f"health check of {service} failed"


def test_the_insecure_stack_publishes_its_apis_on_loopback_only(insecure_stack: Deployment) -> None:
    # compose.yaml without BA_BIND_ADDRESS / BA_CONTROL_BIND_ADDRESS: what the engine bound.
    listing = subprocess.run(
        ["docker", "port", insecure_stack.stack.container("superlink")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    bindings = {
        line.split("->")[0].strip(): line.split("->")[1].strip()
        for line in listing.splitlines()
        if "->" in line
    }
    assert set(bindings) == {"9092/tcp", "9093/tcp"}, listing
    for container_port, host in bindings.items():
        assert host.startswith("127.0.0.1:"), f"{container_port} published on {host}"


@pytest.mark.parametrize(
    "strategy",
    [
        # FedAvg's compose run is the one CI repeats on the newest Flower (HTTP Fleet API).
        pytest.param(*param.values, marks=[*param.marks, pytest.mark.http_fleet], id=param.id)
        if param.id == "fedavg"
        else param
        for param in strategy_params()
    ],
)
def test_two_rounds_of_each_strategy_through_the_compose_stack(
    insecure_stack: Deployment, staged_app: Path, strategy: str
) -> None:
    started = time.monotonic()
    run_dir = insecure_stack.run(staged_app, strategy, f"{strategy}-compose")
    timed(f"{strategy}: 2 rounds", started)
    assert_every_round_aggregated(read_metrics(run_dir), NUM_SUPERNODES)


def test_a_secure_elastic_round_through_the_compose_stack(
    insecure_stack: Deployment, staged_app: Path
) -> None:
    # SecAgg+'s four stages (keys, shares, masked vectors, unmasking) between the SuperLink's
    # ServerApp and the warm executors of the three SuperNode containers.
    started = time.monotonic()
    run_dir = insecure_stack.run(
        staged_app,
        "elastic",
        "elastic-secure-compose",
        **{
            "secure-aggregation": "secaggplus",
            "min-train-replies": NUM_SUPERNODES,
            "num-server-rounds": 1,
        },
    )
    timed("elastic under secaggplus: 1 round", started)
    last = read_metrics(run_dir)[-1]
    assert last["round"] == 1
    assert last["aggregated"] == 1
    assert last["replies-valid"] == NUM_SUPERNODES
    assert last["secure-dropped-after-keys"] == 0
    assert last["elastic-scaled-tensors"] > 0  # zeta from the summed sensitivities


def documented_results_copy() -> tuple[list[str], list[str]]:
    """docs/deployment.md's command that copies the run folders out of the SuperLink container:
    its ``docker compose ...`` half (arguments after ``docker compose``) and the host's half."""
    page = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")
    (line,) = [
        line for line in page.splitlines() if line.startswith("docker compose exec -T superlink")
    ]
    compose, host = (part.split() for part in line.split("|"))
    return compose[2:], host


def test_the_documented_results_copy_brings_the_run_folders_home(
    insecure_stack: Deployment, staged_app: Path, tmp_path: Path
) -> None:
    insecure_stack.run(staged_app, "fedavg", "to-copy")
    compose, host = documented_results_copy()
    exported = subprocess.run(
        insecure_stack.stack.command(*compose),
        env=insecure_stack.stack.env,
        cwd=REPO,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert exported.returncode == 0, exported.stderr.decode(errors="replace")[-2000:]
    subprocess.run(host, input=exported.stdout, cwd=tmp_path, check=True, timeout=120)
    summary = read_summary(tmp_path / "runs" / "to-copy")
    assert summary["status"] == "completed", summary
    assert (tmp_path / "runs" / "to-copy" / "final_model.pt").is_file()


def test_run_completes_when_a_supernode_stops_mid_run(
    insecure_stack: Deployment, staged_app: Path
) -> None:
    name = "supernode-stopped"
    settings = {**RUN_SETTINGS, "strategy": "fedavg", "run-name": name, "min-train-replies": 2}
    started = time.monotonic()
    # `flwr run` in the background; supernode-2 is stopped once the run is under way.
    command = ["flwr", "run", str(staged_app), CONNECTION, "--stream", "--run-config"]
    command.append(run_config_argument(settings))
    process = subprocess.Popen(
        command,
        env=insecure_stack.flwr_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        metrics_path = insecure_stack.runs / name / "metrics.jsonl"
        deadline = time.monotonic() + 600
        # Round 0 (the initial model's evaluation) is written just before round 1 is sent out.
        while not (metrics_path.is_file() and metrics_path.read_text().strip()):
            assert process.poll() is None, "flwr run ended before round 1 started"
            assert time.monotonic() < deadline, "the run did not reach round 1 in 600 s"
            time.sleep(0.5)
        insecure_stack.stack("stop", "supernode-2", timeout=120.0)
        process.wait(timeout=900)
    finally:
        if process.poll() is None:
            process.kill()
        insecure_stack.stack("start", "supernode-2", timeout=120.0, check=False)
    timed("run with a SuperNode stopped in round 1", started)
    summary = read_summary(insecure_stack.runs / name)
    assert summary["status"] == "completed", summary.get("error")
    metrics = read_metrics(insecure_stack.runs / name)
    assert [entry["round"] for entry in metrics] == [0, 1, 2]
    for entry in metrics[1:]:
        assert entry["aggregated"] == 1, entry
        assert entry["replies-valid"] >= 2, entry
    # The stopped node's round-1 reply is missing or an error; round 2 samples the two left.
    assert metrics[1]["replies-valid"] == 2, metrics[1]
    assert metrics[2]["replies-received"] == 2, metrics[2]


def test_superlink_restart_forgets_its_nodes_which_register_again_and_train(
    insecure_stack: Deployment, staged_app: Path
) -> None:
    # compose.yaml keeps the SuperLink's state in memory (Flower's SQLite file lost replies under
    # load, docs/deployment.md "Load"): a restart forgets every node, each SuperNode exits on
    # "Invalid node ID" (gRPC) or "401 Unauthorized" (HTTP) and its restart policy (with
    # ba-supernode) brings it back with a new registration.
    insecure_stack.wait_ready()
    before = set(insecure_stack.online_node_ids())
    started = time.monotonic()
    insecure_stack.stack("restart", "superlink", timeout=180.0)
    insecure_stack.wait_ready(timeout=600.0)
    timed("SuperLink restarted, 3 SuperNodes online again", started)
    after = set(insecure_stack.online_node_ids())
    assert len(after) == NUM_SUPERNODES
    assert not after & before, "node ids survived the restart: the state was not in memory"
    run_dir = insecure_stack.run(staged_app, "fedavg", "after-superlink-restart")
    assert_every_round_aggregated(read_metrics(run_dir), NUM_SUPERNODES)


@pytest.fixture(scope="module")
def tls_certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    owner = f"{CONTAINER_USER[0]}:{CONTAINER_USER[1]}" if os.geteuid() == 0 else None
    # One key more than SuperNodes: the last one is never registered.
    return make_certificates(tmp_path_factory.mktemp("certs"), NUM_SUPERNODES + 1, owner=owner)


def test_tls_stack_with_authentication_runs_and_refuses_an_unregistered_node(
    image: str,
    tls_certificates: Certificates,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    deployment = Deployment(
        tmp_path_factory.mktemp("compose-tls"),
        ["compose.yaml", "compose.tls.yaml"],
        tls_certificates,
    )
    strategy = next(
        (name for name in ("elastic", "fedgma", "fedavg") if AVAILABLE.get(name) == ""),
        "fedavg",
    )
    started = time.monotonic()
    with deployment.stack.up(timeout=900.0):
        deployment.wait_ready()
        timed("TLS stack up, keys registered, 3 SuperNodes online", started)
        registrar = deployment.stack.logs("supernode-registrar")
        assert f"registered {NUM_SUPERNODES} SuperNode key(s)" in registrar, registrar

        # As docs/deployment.md runs it: compose's `flwr` service (the image's own CLI) with the
        # shipped connection local-deployment-tls, trusting the CA the overlay mounts.
        started = time.monotonic()
        name = f"{strategy}-tls"
        settings = {**RUN_SETTINGS, "strategy": strategy, "run-name": name}
        deployment.stack(
            *("--profile", "cli", "run", "--rm", "-T", "flwr"),
            *("run", ".", "local-deployment-tls", "--stream"),
            *("--run-config", run_config_argument(settings)),
            timeout=900.0,
        )
        timed(f"TLS {strategy}: 2 rounds through the flwr service", started)
        summary = read_summary(deployment.runs / name)
        assert summary["status"] == "completed", summary
        assert_every_round_aggregated(read_metrics(deployment.runs / name), NUM_SUPERNODES)

        # A SuperNode whose key was never registered, on the stack's network, is refused.
        network = subprocess.run(
            [
                "docker",
                "inspect",
                "--format",
                "{{range $name, $_ := .NetworkSettings.Networks}}{{$name}} {{end}}",
                deployment.stack.container("superlink"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()[0]
        key = tls_certificates.supernode_key(NUM_SUPERNODES)
        # The image's SuperNode runs under ba-supernode, which starts a refused SuperNode again
        # (as a restart policy would): the container does not end, so it is watched, then removed.
        intruder_name = f"{deployment.stack.project}-intruder"
        subprocess.run(
            [
                "docker",
                "run",
                "-d",
                "--name",
                intruder_name,
                "--network",
                network,
                "-e",
                "BA_TLS=1",
                "-e",
                "BA_PARTITION_ID=0",
                "-e",
                f"BA_NUM_PARTITIONS={NUM_SUPERNODES}",
                "-e",
                "BA_SUPERLINK_HOST=superlink",  # the Fleet API's port of the image's Flower
                "-v",
                f"{tls_certificates.ca_cert}:/app/certs/ca.crt:ro",
                "-v",
                f"{key}:/app/keys/supernode.key:ro",
                image,
                "supernode",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
        try:
            deadline = time.monotonic() + 180
            logs = ""
            while "flower-supernode (pid" not in logs:
                assert time.monotonic() < deadline, f"the intruder was not refused:\n{logs}"
                time.sleep(2.0)
                read = subprocess.run(
                    ["docker", "logs", intruder_name],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                logs = read.stdout + read.stderr
            assert "Failed to activate SuperNode" in logs
            # Flower logs its code 305 and the process exits with status 1 (docs/deployment.md).
            assert "Exit Code: 305" in logs
            assert "ended with status 1" in logs
            assert len(deployment.online_node_ids()) == NUM_SUPERNODES
        finally:
            subprocess.run(
                ["docker", "rm", "-f", intruder_name], capture_output=True, timeout=120, check=False
            )


# ------------------------------------------------------------------ the newcomer's path, as written
START_SECTION = "Start the federation and run"
#: What the copy of the checkout leaves out (.dockerignore's list, the environments, the results).
NOT_COPIED = (".git", ".venv", ".venvs", "wheelhouse", "runs", "build", "dist", ".flwr")
NOT_COPIED += ("docker/certs",)


def documented_start_commands() -> list[str]:
    """The bash blocks of docs/deployment.md's first section, up to its first subsection."""
    page = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")
    section = page.split(f"\n## {START_SECTION}\n", 1)[1]
    section = re.split(r"\n#{2,3} ", section, maxsplit=1)[0]
    return re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)


def copy_checkout(destination: Path) -> Path:
    """The repository's files in ``destination``: the sources copied, the wheelhouse hard-linked
    (307 MB), ``.venv`` a link to this one (docker/make-wheelhouse.sh's interpreter)."""

    def ignored(directory: str, names: list[str]) -> set[str]:
        relative = Path(directory).relative_to(REPO)
        return {
            name
            for name in names
            if str(relative / name).removeprefix("./") in NOT_COPIED
            or name in {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        }

    shutil.copytree(REPO, destination, ignore=ignored, symlinks=True)
    wheelhouse = REPO / "wheelhouse"
    if wheelhouse.is_dir():
        try:
            shutil.copytree(wheelhouse, destination / "wheelhouse", copy_function=os.link)
        except OSError:  # another file system
            shutil.rmtree(destination / "wheelhouse", ignore_errors=True)
            shutil.copytree(wheelhouse, destination / "wheelhouse")
    if (REPO / ".venv").exists():
        (destination / ".venv").symlink_to(REPO / ".venv")
    return destination


# Also on the newest Flower (its CLI in the `flwr` service, its HTTP Fleet API): 2 min here.
@pytest.mark.http_fleet
def test_the_start_section_of_the_docs_runs_as_written(image: str, tmp_path: Path) -> None:
    blocks = documented_start_commands()
    script = "\n".join(blocks)
    # The section still is the walk-through this test runs.
    for step in (
        "docker/make-wheelhouse.sh",
        "docker compose up -d --build",
        "run . local-deployment",
        "tar -xf -",
        "docker compose down",
    ):
        assert step in script, f"{START_SECTION!r} no longer has {step!r}:\n{script}"
    rounds = int(re.findall(r"num-server-rounds=(\d+)", script)[-1])
    checkout = copy_checkout(tmp_path / "checkout")
    # Only what must differ from a newcomer's machine: this module's image tag (its layers are
    # cached, so `up --build` builds nothing new), a project name and host ports of its own.
    env = dict(os.environ)
    env.update(
        {
            "BA_IMAGE": image,
            "BA_FLEET": FLEET,
            "COMPOSE_PROJECT_NAME": f"batestdocs{os.getpid()}",
            "BA_FLEET_PORT": str(free_port()),
            "BA_CONTROL_PORT": str(free_port()),
        }
    )
    started = time.monotonic()
    try:
        completed = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,  # 45 s here: the image's layers are cached
            check=False,
        )
    finally:
        subprocess.run(
            ["docker", "compose", "down", "-v", "-t", "5"],
            cwd=checkout,
            env=env,
            capture_output=True,
            timeout=300,
            check=False,
        )
    timed(f"docs' first section as written ({len(blocks)} blocks)", started)
    output = (completed.stdout + completed.stderr)[-5000:]
    assert completed.returncode == 0, output
    summaries = sorted((checkout / "runs").glob("*/summary.json"))
    assert len(summaries) == 1, (summaries, output)
    summary = read_summary(summaries[0].parent)
    assert summary["status"] == "completed", summary
    assert (summaries[0].parent / "final_model.pt").is_file()
    metrics = read_metrics(summaries[0].parent)
    assert [entry["round"] for entry in metrics] == list(range(rounds + 1))
    assert all(entry["aggregated"] == 1 for entry in metrics[1:]), metrics


def test_a_build_without_wheelhouse_or_index_says_so(tmp_path: Path) -> None:
    # No network, no wheels: before, pip retried and reported ResolutionImpossible.
    empty = f"wheelhouse/absent-{os.getpid()}"
    started = time.monotonic()
    build = ["docker", "build", "--network", "none", "-f", "docker/Dockerfile"]
    build += ["--build-arg", f"FLEET={FLEET}", "--build-arg", f"WHEELHOUSE={empty}"]
    completed = subprocess.run(
        [*build, "-t", f"beyond-averaging:test-no-wheelhouse-{os.getpid()}", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    timed("build refused without wheelhouse or index", started)
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0, output[-3000:]
    assert f"image build: {empty} holds no wheels" in output, output[-3000:]
    assert "docker/make-wheelhouse.sh" in output
    assert "ResolutionImpossible" not in output


def compose_config(*arguments: str) -> dict[str, Any]:
    """``docker compose [arguments] config``, as the engine's Compose resolves it."""
    completed = subprocess.run(
        ["docker", "compose", *arguments, "config"],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith(("BA_", "COMPOSE_"))},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    config: dict[str, Any] = yaml.safe_load(completed.stdout)
    return config


def host_ports(config: dict[str, Any]) -> set[str]:
    """The SuperLink's published host ports, in Compose's short or long port syntax."""
    ports = set()
    for entry in config["services"]["superlink"]["ports"]:
        ports.add(str(entry["published"]) if isinstance(entry, dict) else entry.split(":")[-2])
    return ports


def test_the_engine_gives_the_grpc_and_http_stacks_their_own_project_and_ports() -> None:
    grpc, http = compose_config(), compose_config("--env-file", "docker/http.env")
    assert grpc["name"] == "beyond-averaging-grpc"
    assert http["name"] == "beyond-averaging-http"
    assert host_ports(grpc) == {"9092", "9093"}
    assert host_ports(http) == {"9094", "9095"}
    assert http["services"]["superlink"]["image"] == "beyond-averaging:cpu-http"
