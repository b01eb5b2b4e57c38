"""SuperNodes on other hosts, as docs/multi-host.md deploys them, on hosts made of Linux network
namespaces.

Four namespaces on one bridge stand for four machines on a network: the SuperLink's host
(10.77.0.1), two SuperNode hosts (10.77.0.11, .12) in the SuperNodes' network 10.77.0.0/24, and
an outsider (10.77.1.5) on the same wire but outside that network. Each process runs in its
host's namespace (``ip netns exec``), so everything a SuperNode and the SuperLink say crosses the
veth network, with TLS (the certificate names 10.77.0.1, ``docker/make-certs.sh --host``) and
SuperNode authentication (keys registered with ``make-certs.sh register``).

The SuperLink's host runs the docs' nftables ruleset (the block after ``<!-- multihost-test:
nftables -->`` in docs/multi-host.md, only its ``define`` values replaced): it admits the Fleet
port 9092 from the SuperNodes' network and drops the rest. The Control API (``flwr run``) stays
on that host's loopback, where this test runs ``flwr``, as an operator does through an SSH
tunnel. The installed Flower decides what 9092 is (server/deploy/flower_release.py): under flwr 1.39
the gRPC Fleet API itself; under the newest Flower, whose one HTTP port 9093 serves the Fleet,
Control and Runtime APIs alike, the docs' nginx proxy (the block after ``<!-- multihost-test:
nginx -->``), which passes on only the Fleet routes ``/v1/fleet/``.

Checked: one round of 2 SuperNodes completes with both replies; the Fleet port answers a SuperNode
host and not the outsider (the firewall's drop counter counts it); the Control API cannot be
reached from a SuperNode host (its port is dropped; under HTTP the proxy refuses the Control
routes, also dressed as Fleet paths); a SuperNode whose key was not registered is refused.

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip`` or ``nft``), and
under HTTP without nginx. Every namespace and process is removed afterwards (processes by PID).
About 4.5 minutes on the shared 2-core machine at a load average of 30-48, most of it the round
(docs/multi-host.md gives the measured times).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.runtime.processes import stop_process_tree
from tests.deploy_helpers import (
    REPO,
    Certificates,
    LocalDeployment,
    in_netns,
    lean_round,
    make_certificates,
    read_metrics,
)

# CI runs it on flwr 1.39 (gRPC) and, marked http_fleet, on the newest Flower (HTTP).
pytestmark = [pytest.mark.deployment, pytest.mark.http_fleet]

DOCS = REPO / "docs" / "multi-host.md"
TRANSPORT = FlowerRelease.installed().transport
NUM_SUPERNODES = 2
#: The docs' ports: SuperNodes dial 9092 (the gRPC Fleet API, or under HTTP the proxy of its
#: routes); 9093 is the SuperLink's HTTP port (Control and Runtime API; under HTTP also Fleet).
FLEET_PORT, CONTROL_PORT = 9092, 9093
SUPERLINK_ADDRESS = "10.77.0.1"
SUPERNODE_NETWORK = "10.77.0.0/24"
SUPERNODE_ADDRESSES = ("10.77.0.11", "10.77.0.12")
OUTSIDER_ADDRESS = "10.77.1.5"  # on the same wire, outside the SuperNodes' network
RUN_SETTINGS: dict[str, Any] = {**lean_round(NUM_SUPERNODES), "strategy": "fedavg"}


def namespaces_problem() -> str | None:
    """Why hosts cannot be simulated here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (ip netns add)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (Debian: apt-get install {package})"
    probe = f"ba-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if TRANSPORT == "http" and shutil.which("nginx") is None:
        return (
            "under the HTTP Fleet API the SuperLink's host publishes the Fleet routes through "
            "nginx (docs/multi-host.md), which is not installed (Debian: apt-get install "
            "nginx-light)"
        )
    return None


# ----------------------------------------------------------------------------- the docs' blocks
_BLOCK = re.compile(r"^<!-- multihost-test: ([\w-]+) -->\n```\w+\n(.*?)^```", re.M | re.S)


def docs_block(name: str) -> str:
    """The code block after ``<!-- multihost-test: NAME -->`` in docs/multi-host.md."""
    blocks: dict[str, str] = dict(_BLOCK.findall(DOCS.read_text(encoding="utf-8")))
    assert name in blocks, f"docs/multi-host.md has no block marked multihost-test: {name}"
    return blocks[name]


def replace_exactly(text: str, replacements: dict[str, str]) -> str:
    """Each example value of the docs, replaced by this test's; each must be in the block."""
    for example, value in replacements.items():
        assert example in text, f"the docs' block no longer holds {example!r}"
        text = text.replace(example, value)
    return text


# ------------------------------------------------------------------------------------- hosts
@dataclass
class Hosts:
    """Network namespaces on one bridge, standing for machines on one network.

    ``<prefix>-lan`` holds the bridge (the switch); every other host has one veth ``eth0`` into
    it. Nothing is made in this process's own namespace, so deleting the namespaces removes
    every link too; :meth:`close` deletes each namespace it made.
    """

    prefix: str = field(default_factory=lambda: f"ba{uuid.uuid4().hex[:6]}")
    made: list[str] = field(default_factory=list)

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def ip(self, *arguments: str) -> None:
        done = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"`ip {' '.join(arguments)}` failed: {done.stderr.strip()}")

    def add(self, host: str) -> str:
        name = self.namespace(host)
        self.ip("netns", "add", name)
        self.made.append(name)
        self.ip("-n", name, "link", "set", "lo", "up")
        return name

    def build(self) -> Hosts:
        lan = self.add("lan")
        self.ip("-n", lan, "link", "add", "br0", "type", "bridge")
        self.ip("-n", lan, "link", "set", "br0", "up")
        for host, address in [
            ("superlink", f"{SUPERLINK_ADDRESS}/24"),
            ("node0", f"{SUPERNODE_ADDRESSES[0]}/24"),
            ("node1", f"{SUPERNODE_ADDRESSES[1]}/24"),
            ("outsider", f"{OUTSIDER_ADDRESS}/24"),
        ]:
            name = self.add(host)
            port = f"p-{host}"
            # Made inside the namespaces, never in this one: nothing outlives them.
            self.ip("-n", lan, "link", "add", port, "type", "veth", "peer", "eth0", "netns", name)
            self.ip("-n", lan, "link", "set", port, "master", "br0", "up")
            self.ip("-n", name, "addr", "add", address, "dev", "eth0")
            self.ip("-n", name, "link", "set", "eth0", "up")
        # The outsider's network is routed on the same wire (no router: one broadcast domain).
        outsider, superlink = self.namespace("outsider"), self.namespace("superlink")
        self.ip("-n", outsider, "route", "add", SUPERNODE_NETWORK, "dev", "eth0")
        self.ip("-n", superlink, "route", "add", f"{OUTSIDER_ADDRESS}/32", "dev", "eth0")
        return self

    def close(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()


#: Run inside a namespace: connect (and optionally speak HTTPS) to one address; print JSON.
_PROBE = r"""
import json, socket, ssl, sys, http.client
host, port, cafile, method, path = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
try:
    socket.create_connection((host, port), timeout=3).close()
except OSError as error:
    print(json.dumps({"connected": False, "error": type(error).__name__})); sys.exit()
status = None
if path:
    context = ssl.create_default_context(cafile=cafile)
    connection = http.client.HTTPSConnection(host, port, timeout=10, context=context)
    connection.request(method, path, body=b"", headers={"Content-Type": "application/protobuf"})
    status = connection.getresponse().status
print(json.dumps({"connected": True, "status": status}))
"""


def probe(
    netns: str, host: str, port: int, cafile: Path, path: str = "", method: str = "POST"
) -> dict[str, Any]:
    """From inside ``netns``: does ``host:port`` accept a connection, and what does an HTTPS
    request for ``path`` (sent as written, dot segments included) answer?"""
    command = [sys.executable, "-c", _PROBE, host, str(port), str(cafile), method, path]
    completed = subprocess.run(
        in_netns(netns, command), capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, Any] = json.loads(completed.stdout)
    return result


def dropped_packets(netns: str) -> int:
    """Packets the firewall's last rule counted: everything its policy then dropped."""
    listing = subprocess.run(
        in_netns(netns, ["nft", "-j", "list", "table", "inet", "beyond_averaging"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for item in json.loads(listing)["nftables"]:
        rule = item.get("rule")
        if rule and rule.get("comment", "").startswith("dropped"):
            for expression in rule["expr"]:
                if "counter" in expression:
                    return int(expression["counter"]["packets"])
    raise AssertionError(f"no 'dropped' counter in the firewall:\n{listing}")


# -------------------------------------------------------------------------------- federation
@dataclass
class Federation:
    hosts: Hosts
    deployment: LocalDeployment
    certificates: Certificates
    workdir: Path
    proxy: subprocess.Popen[bytes] | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def superlink_host(self) -> str:
        return self.hosts.namespace("superlink")

    def proxy_access_log(self) -> str:
        path = self.workdir / "nginx" / "access.log"
        return path.read_text(encoding="utf-8") if path.is_file() else ""


def start_firewall(hosts: Hosts, workdir: Path) -> None:
    """The docs' nftables ruleset, with this network's addresses, on the SuperLink's host."""
    ruleset = replace_exactly(
        docs_block("nftables"),
        {
            "define supernodes = 192.0.2.0/24": f"define supernodes = {SUPERNODE_NETWORK}",
            "define admins = 198.51.100.0/24": "define admins = 10.77.2.0/24",
            f"define fleet_port = {FLEET_PORT}": f"define fleet_port = {FLEET_PORT}",
        },
    )
    path = workdir / "superlink.nft"
    path.write_text(ruleset, encoding="utf-8")
    subprocess.run(
        in_netns(hosts.namespace("superlink"), ["nft", "-f", str(path)]),
        check=True,
        capture_output=True,
        timeout=30,
    )


def start_proxy(hosts: Hosts, workdir: Path, certificates: Certificates) -> subprocess.Popen[bytes]:
    """The docs' nginx server block (HTTP Fleet API only), in a config of its own."""
    directory = workdir / "nginx"
    directory.mkdir()
    server = replace_exactly(
        docs_block("nginx"),
        {
            "192.0.2.10": SUPERLINK_ADDRESS,
            "/etc/beyond-averaging/certs": str(certificates.directory),
        },
    )
    temp = " ".join(
        f"{kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (directory / "nginx.conf").write_text(
        f"user root;\nworker_processes 1;\npid {directory / 'nginx.pid'};\n"
        f"error_log {directory / 'error.log'};\nevents {{}}\n"
        f"http {{\naccess_log {directory / 'access.log'};\n{temp}\n{server}\n}}\n",
        encoding="utf-8",
    )
    log = (directory / "stdout.log").open("wb")
    process = subprocess.Popen(
        in_netns(
            hosts.namespace("superlink"),
            [
                "nginx",
                "-p",
                str(directory),
                "-c",
                str(directory / "nginx.conf"),
                "-g",
                "daemon off;",
            ],
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    return process


def wait_until_listening(
    netns: str, host: str, port: int, cafile: Path, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe(netns, host, port, cafile)["connected"]:
            return
        time.sleep(0.3)
    raise AssertionError(f"nothing listens on {host}:{port} in {netns} after {timeout} s")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    problem = namespaces_problem()
    if problem is not None:
        pytest.skip(problem)
    workdir = tmp_path_factory.mktemp("multihost")
    # One key more than there are SuperNodes: the last one is never registered.
    certificates = make_certificates(
        workdir / "certs", NUM_SUPERNODES + 1, hosts=[SUPERLINK_ADDRESS]
    )
    hosts = Hosts()
    deployment = LocalDeployment(
        REPO,
        workdir / "deploy",
        certificates=certificates,
        supernode_auth=True,
        netns=hosts.namespace("superlink"),
        fleet_host=SUPERLINK_ADDRESS,
    )
    # The docs' ports: the SuperLink's host is a namespace of its own, where they are free.
    deployment.control_port = CONTROL_PORT
    deployment.fleet_port = deployment.release.fleet_port(FLEET_PORT, CONTROL_PORT)
    proxy = None
    try:
        started = time.monotonic()
        hosts.build()
        start_firewall(hosts, workdir)
        deployment.start()
        deployment.register_supernodes(NUM_SUPERNODES)
        if TRANSPORT == "http":
            proxy = start_proxy(hosts, workdir, certificates)
        wait_until_listening(
            hosts.namespace("superlink"), SUPERLINK_ADDRESS, FLEET_PORT, certificates.ca_cert
        )
        for partition in range(NUM_SUPERNODES):
            deployment.start_supernode(
                partition,
                NUM_SUPERNODES,
                superlink_address=f"{SUPERLINK_ADDRESS}:{FLEET_PORT}",
                auth_key=certificates.supernode_key(partition),
                netns=hosts.namespace(f"node{partition}"),
            )
        deployment.wait_for_nodes(NUM_SUPERNODES)
        federation = Federation(hosts, deployment, certificates, workdir, proxy)
        federation.seconds["start"] = time.monotonic() - started
        yield federation
    finally:
        deployment.close()
        if proxy is not None:
            stop_process_tree(proxy)
        hosts.close()


# ------------------------------------------------------------------------------------- tests
def test_a_round_completes_with_supernodes_on_two_other_hosts(federation: Federation) -> None:
    settings = {
        **RUN_SETTINGS,
        "run-name": "multihost",
        "output-dir": str(federation.deployment.workdir / "runs"),
    }
    started = time.monotonic()
    run_dir = federation.deployment.run(settings, timeout=300.0)
    seconds = time.monotonic() - started
    metrics = read_metrics(run_dir)
    last = metrics[-1]
    assert [entry["round"] for entry in metrics] == [0, 1]
    assert last["replies-received"] == NUM_SUPERNODES
    assert last["replies-valid"] == NUM_SUPERNODES
    assert last["aggregated"] == 1
    # Each SuperNode's host reached the SuperLink only through the Fleet port: under HTTP the
    # proxy's log shows every request it passed on, all of them Fleet routes.
    if TRANSPORT == "http":
        requests = re.findall(r'"(?:GET|POST) (\S+) HTTP', federation.proxy_access_log())
        assert any(path.startswith("/v1/fleet/push-messages") for path in requests)
        sources = set(re.findall(r"^(\S+) ", federation.proxy_access_log(), re.M))
        assert sources == set(SUPERNODE_ADDRESSES)
    print(
        f"\n[multihost, {TRANSPORT}] start (namespaces, firewall, SuperLink, keys, "
        f"{NUM_SUPERNODES} SuperNodes online): {federation.seconds['start']:.1f} s; "
        f"flwr run of 1 round: {seconds:.1f} s; round-seconds {last['round-seconds']:.1f}; "
        f"load average {os.getloadavg()[0]:.0f}"
    )


def test_the_fleet_port_admits_the_supernodes_network_and_drops_the_outsider(
    federation: Federation,
) -> None:
    ca = federation.certificates.ca_cert
    node = federation.hosts.namespace("node0")
    assert probe(node, SUPERLINK_ADDRESS, FLEET_PORT, ca)["connected"]
    before = dropped_packets(federation.superlink_host)
    outsider = probe(federation.hosts.namespace("outsider"), SUPERLINK_ADDRESS, FLEET_PORT, ca)
    assert not outsider["connected"]
    assert outsider["error"] in ("TimeoutError", "socket.timeout")  # dropped, not refused
    assert dropped_packets(federation.superlink_host) > before


def test_the_control_api_cannot_be_reached_from_a_supernode_host(federation: Federation) -> None:
    ca = federation.certificates.ca_cert
    node = federation.hosts.namespace("node1")
    # On the SuperLink's own host the Control API answers (what `flwr run` uses there) ...
    local = probe(federation.superlink_host, "127.0.0.1", CONTROL_PORT, ca, "/v1/control/list-runs")
    assert local["connected"]
    assert local["status"] != 403
    # ... and from a SuperNode's host its port is dropped by the firewall.
    before = dropped_packets(federation.superlink_host)
    direct = probe(node, SUPERLINK_ADDRESS, CONTROL_PORT, ca)
    assert not direct["connected"]
    assert dropped_packets(federation.superlink_host) > before
    if TRANSPORT == "http":
        # Under HTTP the Fleet port is the proxy of one port that serves every API: it passes
        # on the Fleet routes only, whatever the path claims to be.
        for path in (
            "/v1/control/list-runs",
            "/v1/runtime/get-run",
            "/v1/fleet/../control/list-runs",
            "/v1/fleet/%2e%2e/control/list-runs",
        ):
            answer = probe(node, SUPERLINK_ADDRESS, FLEET_PORT, ca, path)
            assert answer == {"connected": True, "status": 403}, (path, answer)
        assert "/control/" not in "".join(
            line for line in federation.proxy_access_log().splitlines() if '" 200 ' in line
        )


def test_a_supernode_with_an_unregistered_key_is_refused_across_hosts(
    federation: Federation,
) -> None:
    deployment = federation.deployment
    before = set(deployment.online_node_ids())
    intruder = deployment.start_supernode(
        0,
        NUM_SUPERNODES,
        superlink_address=f"{SUPERLINK_ADDRESS}:{FLEET_PORT}",
        auth_key=federation.certificates.supernode_key(NUM_SUPERNODES),
        netns=federation.hosts.namespace("node1"),
        supervised=False,  # Flower's own exit, not ba-supernode's retries
    )
    exit_code = intruder.process.wait(timeout=120)
    assert exit_code == 1
    assert "Failed to activate SuperNode" in intruder.log()
    assert set(deployment.online_node_ids()) == before
