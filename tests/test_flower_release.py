"""What differs between the Flower releases the app deploys on is decided in one place,
server/deploy/flower_release.py: the Fleet transport, the SuperLink's address flags, the port a
SuperNode dials and what a forgotten SuperNode logs. The flags are those each release's own
``--help`` lists (flwr 1.39: ``--fleet-api-address``; 1.40 and later: the Fleet API on
``--host/--port``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from beyond_averaging.server.deploy.flower_release import FlowerRelease, installed_forgotten_markers

GRPC, HTTP = FlowerRelease("1.39.0"), FlowerRelease("1.42.0")


@pytest.mark.parametrize(
    ("version", "transport"),
    [
        ("1.21.0", "grpc"),
        ("1.39.0", "grpc"),
        ("1.39.2", "grpc"),
        ("1.40.0", "http"),
        ("1.42.0", "http"),
        ("1.100.1", "http"),
        ("2.0.0", "http"),
    ],
)
def test_the_fleet_api_is_grpc_until_1_39_and_http_from_1_40(version: str, transport: str) -> None:
    assert FlowerRelease(version).transport == transport


def test_a_version_that_is_no_release_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'main'"):
        _ = FlowerRelease("main").transport


def test_grpc_superlink_serves_the_fleet_api_on_its_own_port_and_nodes_dial_it() -> None:
    assert GRPC.superlink_ports("0.0.0.0", 9092, 9093) == [
        "--host",
        "0.0.0.0",
        "--port",
        "9093",
        "--fleet-api-address",
        "0.0.0.0:9092",
    ]
    assert GRPC.fleet_address("superlink", 9092, 9093) == "superlink:9092"


def test_http_superlink_serves_the_fleet_api_on_its_http_port_and_nodes_dial_that() -> None:
    # No --fleet-api-address: 1.40+ marks it deprecated and serves the Fleet API on --port.
    assert HTTP.superlink_ports("0.0.0.0", 9092, 9093) == ["--host", "0.0.0.0", "--port", "9093"]
    assert HTTP.fleet_address("superlink", 9092, 9093) == "superlink:9093"


def test_a_fleet_api_for_other_hosts_binds_a_public_address_beside_a_loopback_control_api() -> None:
    # docs/multi-host.md: SuperNodes on other hosts reach the Fleet API; `flwr run` stays local.
    assert GRPC.superlink_ports("127.0.0.1", 9092, 9093, fleet_host="192.0.2.10") == [
        "--host",
        "127.0.0.1",
        "--port",
        "9093",
        "--fleet-api-address",
        "192.0.2.10:9092",
    ]
    # Under HTTP one port serves every API: there is no separate Fleet address to bind.
    assert HTTP.superlink_ports("127.0.0.1", 9092, 9093, fleet_host="192.0.2.10") == [
        "--host",
        "127.0.0.1",
        "--port",
        "9093",
    ]


def test_an_ipv6_host_is_bracketed_in_addresses() -> None:
    assert GRPC.superlink_ports("::", 9092, 9093)[-1] == "[::]:9092"
    assert HTTP.fleet_address("::1", 9092, 9093) == "[::1]:9093"


def test_a_forgotten_node_is_recognised_by_each_releases_words() -> None:
    assert "Invalid node ID" in GRPC.forgotten_markers
    assert "401 Unauthorized" in HTTP.forgotten_markers
    assert installed_forgotten_markers() == FlowerRelease.installed().forgotten_markers


def test_the_command_line_prints_the_installed_releases_flags() -> None:
    def cli(*arguments: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "beyond_averaging.server.deploy.flower_release", *arguments],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()

    installed = FlowerRelease.installed()
    assert cli("transport") == installed.transport
    assert cli("fleet-address", "--host", "superlink") == installed.fleet_address(
        "superlink", 9092, 9093
    )
    assert cli("superlink-ports", "--flwr-version", "1.42.0", "--host", "0.0.0.0") == (
        "--host 0.0.0.0 --port 9093"
    )
