"""The Helm values of docker/helm/ fit Flower's charts and this project's image, checked offline.

Flower's SuperLink and SuperNode charts are a Flower Enterprise feature and not obtainable here, so
nothing renders these values (docs/multi-host.md, "Kubernetes"). What can be checked without them is
checked: every file parses; every parameter it sets is one of Flower's documented chart parameters
(the names this project relies on are kept below as data, with the Flower commit of the docs they
come from); and the values agree with this project's own settings: the image and its tag per Fleet
transport (compose.yaml), the ports per transport (server/deploy/flower_release.py and the ports
docker/entrypoint.sh gives it), the variables and files the entry point reads, the image's user
(docker/Dockerfile). The entry point's ``BA_ROLE``, which makes the image start under a chart's
arguments, is run with a stand-in for the Flower command.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML comes with flwr; no stubs installed

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from tests.deploy_helpers import interpolate

REPO = Path(__file__).resolve().parents[1]
HELM = REPO / "docker" / "helm"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"

#: Flower's Helm docs the names below come from: framework/docs/source/helm/how-to-deploy-
#: superlink-using-helm.md and how-to-deploy-supernode-using-helm.md (chart 1.26.1), "Parameters"
#: tables, at this commit of github.com/adap/flower.
FLOWER_DOCS_COMMIT = "fdef7afb1dca3030553be302366cfd285ed6632c"
#: Each documented parameter these values set, with its documented default. A parameter whose
#: default is ``{}`` or ``[]`` takes a free-form map or list (its keys are not chart parameters).
DOCUMENTED: dict[str, dict[str, str]] = {
    "superlink": {
        "global.license.enabled": "true",
        "global.license.existingSecret": '""',
        "global.securityContext.runAsUser": "49999",
        "global.securityContext.runAsGroup": "49999",
        "global.securityContext.fsGroup": "49999",
        "global.podSecurityContext.readOnlyRootFilesystem": "true",
        "tls.enabled": "true",
        "tls.issuer.enabled": "true",
        "tls.certificate.enabled": "true",
        "tls.existingSecret": '""',
        "superlink.image.registry": "registry.hub.docker.com",
        "superlink.image.repository": "flwr/superlink-ee",
        "superlink.image.tag": "1.26.1-ubuntu",
        "superlink.image.pullPolicy": "IfNotPresent",
        "superlink.isolationMode": "subprocess",
        "superlink.env": "[]",
        "superlink.volumes": "[]",
        "superlink.volumeMounts": "[]",
        "superlink.containerPorts.fleet": "9092",
        "superlink.containerPorts.control": "9093",
        "superlink.service.type": "ClusterIP",
        "superlink.service.servicePortFleet": "9092",
        "superlink.service.servicePortControl": "9093",
        "superlink.livenessProbe.enabled": "true",
        "superlink.readinessProbe.enabled": "true",
    },
    "supernode": {
        "global.securityContext.runAsUser": "49999",
        "global.securityContext.runAsGroup": "49999",
        "global.securityContext.fsGroup": "49999",
        "global.podSecurityContext.readOnlyRootFilesystem": "true",
        "global.env": "[]",
        "tls.enabled": "true",
        "supernode.replicas": "1",
        "supernode.image.registry": "registry.hub.docker.com",
        "supernode.image.repository": "flwr/supernode-ee",
        "supernode.image.tag": "1.26.1-ubuntu",
        "supernode.image.pullPolicy": "IfNotPresent",
        "supernode.isolationMode": "subprocess",
        "supernode.superlink.address": "my-superlink.example.com",
        "supernode.superlink.port": "9092",
        "supernode.superlink.certificate.existingSecret": '""',
        "supernode.node.config": "{}",
        "supernode.env": "[]",
        "supernode.volumes": "[]",
        "supernode.volumeMounts": "[]",
        "supernode.livenessProbe.enabled": "true",
        "supernode.readinessProbe.enabled": "true",
    },
}
#: The files of each chart: the values for flwr 1.39 (gRPC), and the overlay for the newest
#: Flower (HTTP) that goes after them.
FILES = {
    "superlink": ("superlink-values.yaml", "superlink-values-http.yaml"),
    "supernode": ("supernode-values.yaml", "supernode-values-http.yaml"),
}
RELEASES = {"grpc": FlowerRelease("1.39.0"), "http": FlowerRelease("1.42.0")}


def load(name: str) -> dict[str, Any]:
    values = yaml.safe_load((HELM / name).read_text(encoding="utf-8"))
    assert isinstance(values, dict), f"{name} is not a mapping"
    return values


def helm_merge(base: Any, overlay: Any) -> Any:
    """``helm -f base -f overlay``: maps merge key by key, lists and scalars are replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {**base, **{key: helm_merge(base.get(key), value) for key, value in overlay.items()}}
    return overlay


def values_for(chart: str, transport: str) -> dict[str, Any]:
    base, http = FILES[chart]
    values = load(base)
    return helm_merge(values, load(http)) if transport == "http" else values


def leaves(tree: Any, path: str = "") -> list[str]:
    """Dotted paths of every value that is not a map (lists are values)."""
    if isinstance(tree, dict) and tree:
        return [
            leaf for key, sub in tree.items() for leaf in leaves(sub, f"{path}.{key}".lstrip("."))
        ]
    return [path]


def env(values: dict[str, Any], chart: str) -> dict[str, str]:
    """The container's environment: ``global.env`` then the component's ``env`` (which the
    chart merges with it)."""
    entries = values.get("global", {}).get("env", []) + values[chart].get("env", [])
    return {entry["name"]: entry["value"] for entry in entries}


def mounted_files(values: dict[str, Any], chart: str) -> set[str]:
    """The files the values mount from Secrets: each mount's path (``subPath``) or the
    Secret's items below the mount path."""
    volumes = {volume["name"]: volume for volume in values[chart]["volumes"]}
    files: set[str] = set()
    for mount in values[chart]["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        if "subPath" in mount:
            files.add(mount["mountPath"])
        else:
            files |= {f"{mount['mountPath']}/{item['path']}" for item in secret["items"]}
    return files


def entrypoint_text() -> str:
    return ENTRYPOINT.read_text(encoding="utf-8")


def image_of_compose(transport: str) -> str:
    """The image compose.yaml runs for ``BA_FLEET=transport``."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text(encoding="utf-8"))
    image: str = compose["x-image"]["image"]
    for _ in range(3):  # nested: ${BA_IMAGE:-beyond-averaging:cpu-${BA_FLEET:-grpc}}
        image = interpolate(image, {"BA_FLEET": transport})
    assert "${" not in image, image
    return image


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("chart", sorted(FILES))
def test_every_value_set_is_a_parameter_of_flowers_documented_chart(chart: str) -> None:
    documented = DOCUMENTED[chart]
    for name in FILES[chart]:
        for leaf in leaves(load(name)):
            parts = leaf.split(".")
            prefixes = [".".join(parts[:end]) for end in range(len(parts), 0, -1)]
            known = next((prefix for prefix in prefixes if prefix in documented), None)
            assert known is not None, f"{name}: {leaf} is no documented {chart} chart parameter"
            if known != leaf:  # inside a parameter: only a free-form map takes any key
                assert documented[known] == "{}", f"{name}: {leaf} goes inside {known}"


@pytest.mark.parametrize("transport", sorted(RELEASES))
@pytest.mark.parametrize("chart", sorted(FILES))
def test_the_values_run_this_projects_image_of_each_transport(chart: str, transport: str) -> None:
    image = values_for(chart, transport)[chart]["image"]
    assert f"{image['repository']}:{image['tag']}" == image_of_compose(transport)
    assert image["registry"], "the image comes from a registry the cluster pulls from"
    assert env(values_for(chart, transport), chart)["BA_ROLE"] == chart


@pytest.mark.parametrize("transport", sorted(RELEASES))
def test_ports_per_transport_agree_with_the_flower_release_and_the_entrypoint(
    transport: str,
) -> None:
    release = RELEASES[transport]
    # The container ports the image's SuperLink listens on (docker/entrypoint.sh).
    ports = re.search(r"--fleet-port (\d+) --control-port (\d+)", entrypoint_text())
    assert ports is not None
    fleet, control = int(ports[1]), int(ports[2])
    superlink = values_for("superlink", transport)["superlink"]
    assert superlink["containerPorts"]["control"] == control
    # The Service's Fleet port leads to where this release serves the Fleet API.
    assert superlink["containerPorts"]["fleet"] == release.fleet_port(fleet, control)
    service = superlink["service"]
    targets = {
        service["servicePortFleet"]: superlink["containerPorts"]["fleet"],
        service["servicePortControl"]: superlink["containerPorts"]["control"],
    }
    # The SuperNodes dial the Service port this release's SuperNode dials, and it leads there.
    supernode_values = values_for("supernode", transport)
    supernode = supernode_values["supernode"]["superlink"]
    dialled = release.fleet_port(service["servicePortFleet"], service["servicePortControl"])
    assert supernode["port"] == dialled
    assert targets[dialled] == release.fleet_port(fleet, control)
    assert env(supernode_values, "supernode")["BA_SUPERLINK"] == (
        f"{supernode['address']}:{supernode['port']}"
    )


@pytest.mark.parametrize("transport", sorted(RELEASES))
def test_the_supernodes_node_config_and_the_entrypoints_partition_agree(transport: str) -> None:
    values = values_for("supernode", transport)
    config = values["supernode"]["node"]["config"]
    variables = env(values, "supernode")
    assert int(variables["BA_PARTITION_ID"]) == config["partition-id"]
    assert int(variables["BA_NUM_PARTITIONS"]) == config["num-partitions"]
    assert 0 <= config["partition-id"] < config["num-partitions"]
    assert values["supernode"]["replicas"] == 1  # a partition is one node's


@pytest.mark.parametrize("transport", sorted(RELEASES))
@pytest.mark.parametrize("chart", sorted(FILES))
def test_tls_and_node_authentication_are_on_with_the_files_the_entrypoint_reads(
    chart: str, transport: str
) -> None:
    values = values_for(chart, transport)
    variables = env(values, chart)
    assert values["tls"]["enabled"] is True
    assert variables["BA_TLS"] == "1"
    text = entrypoint_text()
    # Every variable set is one the entry point reads, so none is a silent typo.
    read = set(re.findall(r"\$\{?(BA_[A-Z_]+)", text))
    assert set(variables) <= read, set(variables) - read
    if chart == "superlink":
        assert variables["BA_SUPERNODE_AUTH"] == "1"
        needed = {"/app/certs/server.pem", "/app/certs/server.key", "/app/certs/ca.crt"}
    else:
        needed = {"/app/certs/ca.crt", "/app/keys/supernode.key"}
    assert all(path in text for path in needed)
    assert needed <= mounted_files(values, chart)


@pytest.mark.parametrize("chart", sorted(FILES))
def test_the_pods_run_as_the_images_user(chart: str) -> None:
    uid = re.search(r"^ARG APP_UID=(\d+)$", (REPO / "docker" / "Dockerfile").read_text(), re.M)
    assert uid is not None
    context = load(FILES[chart][0])["global"]["securityContext"]
    assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == int(uid[1])


def test_with_ba_role_the_entrypoint_drops_a_charts_arguments_and_makes_its_own(
    tmp_path: Path,
) -> None:
    # A stand-in for the Flower command the entry point execs: it prints its arguments.
    stub = tmp_path / "ba-supernode"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n', encoding="utf-8")
    stub.chmod(0o755)
    environment = {
        **os.environ,
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "BA_ROLE": "supernode",
        "BA_TLS": "1",
        "BA_SUPERLINK": "superlink.example.org:9092",
        "BA_PARTITION_ID": "1",
        "BA_NUM_PARTITIONS": "2",
    }
    chart_arguments = ["--insecure", "--superlink", "elsewhere:1", "--max-retries", "3"]
    completed = subprocess.run(
        ["sh", str(ENTRYPOINT), *chart_arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    arguments = completed.stdout.splitlines()
    assert "ignoring the arguments: --insecure --superlink elsewhere:1" in completed.stderr
    assert arguments[:2] == ["--root-certificates", "/app/certs/ca.crt"]
    assert "--insecure" not in arguments
    assert "--max-retries" not in arguments
    assert arguments[arguments.index("--superlink") + 1] == "superlink.example.org:9092"
    assert arguments[arguments.index("--node-config") + 1] == "partition-id=1 num-partitions=2"
