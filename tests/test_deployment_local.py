"""A real round of each strategy over Flower's Fleet API, with local SuperLink/SuperNodes.

Where the simulation tests run the app in Flower's simulation runtime, these start
``flower-superlink`` and three ``flower-supernode`` processes on loopback and run the app with
``flwr run``: the model goes down to every node and each reply, its extra records (``sensitivity``,
``gradient``) included, comes back over the Fleet API of the installed Flower: gRPC under flwr 1.39,
HTTP under 1.40 and later (:mod:`server.deploy.flower_release`). A byte-counting relay
(:class:`tests.deploy_helpers.FleetTap`) between each SuperNode and the Fleet API proves it:

- insecure: the uploaded stream carries the extra record's name (Flower serializes record names
  in the clear) and at least the serialized bytes of every record of the reply;
- TLS with SuperNode authentication: the stream is a TLS session (no record name readable), still
  at least as long as the replies, and a SuperNode whose key was not registered is refused.

The bytes each client uploads per round are printed (run with ``-s``) and written to
``<tmp>/upload-bytes-<mode>.json``; docs/deployment.md reports them.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD
from tests.deploy_helpers import (
    REPO,
    Certificates,
    FleetTap,
    LocalDeployment,
    available_strategies,
    lean_round,
    make_certificates,
    read_metrics,
    reply_record_sizes,
)

# CI runs on the newest Flower's HTTP Fleet API (.ci/run) the tests marked http_fleet: every
# strategy's insecure round, FedAvg's TLS round and the refused node; the other strategies' TLS
# rounds are marked extended (TLS is the transport's, not a strategy's).
pytestmark = [pytest.mark.deployment]

NUM_SUPERNODES = 3
STRATEGIES = ("fedavg", "elastic", "fedlaw", "fedgma")
EXTRA_RECORDS = (SENSITIVITY_RECORD, GRADIENT_RECORD)
#: One lean round: digits, FedLAW's MLP, one local epoch, every node trains.
RUN_SETTINGS: dict[str, Any] = lean_round(NUM_SUPERNODES)
#: TLS record type "handshake" and major version 3: the first bytes of a TLS ClientHello.
TLS_HANDSHAKE_PREFIX = b"\x16\x03"
#: How a plain-text connection to the Fleet API opens: gRPC with the client connection preface
#: of HTTP/2 (RFC 9113); Flower's HTTP Fleet API client with an HTTP/1.1 request to its routes.
PLAIN_OPENING = {
    "grpc": re.compile(re.escape(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")),
    "http": re.compile(rb"(GET|POST) /v1/fleet/[\w/-]+ HTTP/1\.1\r\n"),
}
TRANSPORT = FlowerRelease.installed().transport

AVAILABLE = available_strategies(STRATEGIES, RUN_SETTINGS)


def strategy_params(
    http_fleet: tuple[str, ...] = STRATEGIES, extended: tuple[str, ...] = ()
) -> list[Any]:
    """Every strategy, those of ``http_fleet`` and ``extended`` marked so; one this build lacks
    is skipped with the reason, not dropped silently."""
    return [
        pytest.param(
            name,
            marks=[
                *(
                    [pytest.mark.skip(reason=f"strategy {name!r} not in this build: {why}")]
                    if why
                    else []
                ),
                *([pytest.mark.http_fleet] if name in http_fleet else []),
                *([pytest.mark.extended] if name in extended else []),
            ],
            id=name,
        )
        for name, why in AVAILABLE.items()
    ]


class TappedDeployment:
    """A deployment whose SuperNodes all reach the Fleet API through their own FleetTap."""

    def __init__(self, deployment: LocalDeployment, taps: list[FleetTap], report: Path) -> None:
        self.deployment, self.taps, self.report_path = deployment, taps, report
        self.report: dict[str, Any] = {}

    def run_strategy(self, strategy: str, mode: str) -> tuple[list[dict[str, Any]], list[bytes]]:
        """One round of ``strategy``; its metrics and what each SuperNode uploaded meanwhile."""
        for tap in self.taps:
            tap.take()  # forget the idle traffic before this run
        settings = {
            **RUN_SETTINGS,
            "strategy": strategy,
            "run-name": f"{strategy}-{mode}",
            "output-dir": str(self.deployment.workdir / "runs"),
        }
        started = time.monotonic()
        run_dir = self.deployment.run(settings, timeout=300.0)
        seconds = time.monotonic() - started
        uploads = [tap.take()[0] for tap in self.taps]
        sizes = reply_record_sizes(strategy, RUN_SETTINGS)
        rounds = RUN_SETTINGS["num-server-rounds"]
        self.report[strategy] = {
            "serialized-reply-bytes": sizes,
            "serialized-reply-total": sum(sizes.values()),
            "wire-upload-bytes-per-round": [len(upload) // rounds for upload in uploads],
            "run-seconds": round(seconds, 1),
        }
        self.report_path.write_text(json.dumps(self.report, indent=2), encoding="utf-8")
        print(f"\n[{mode}] {strategy}: {json.dumps(self.report[strategy])}")
        # An honest run at the app's defaults warns of nothing (the direction check's note on
        # label skew is INFO): the ServerApp's log, as flwr run streamed it, holds no WARNING.
        log = (run_dir / "log.txt").read_text(encoding="utf-8")
        assert "[ROUND 1]" in log or "round 1" in log, log[-2000:]
        assert [line for line in log.splitlines() if "WARNING" in line] == [], log[-3000:]
        return read_metrics(run_dir), uploads


def tapped_deployment(
    workdir: Path, certificates: Certificates | None, mode: str
) -> Iterator[TappedDeployment]:
    """Start a SuperLink and NUM_SUPERNODES tapped SuperNodes (with keys when certificates)."""
    deployment = LocalDeployment(
        REPO, workdir, certificates=certificates, supernode_auth=certificates is not None
    )
    taps: list[FleetTap] = []
    try:
        deployment.start()
        if certificates is not None:
            deployment.register_supernodes(NUM_SUPERNODES)
        for partition in range(NUM_SUPERNODES):
            taps.append(FleetTap(("127.0.0.1", deployment.fleet_port)))
            deployment.start_supernode(
                partition,
                NUM_SUPERNODES,
                superlink_address=taps[-1].address,
                auth_key=None if certificates is None else certificates.supernode_key(partition),
            )
        deployment.wait_for_nodes(NUM_SUPERNODES)
        yield TappedDeployment(deployment, taps, workdir / f"upload-bytes-{mode}.json")
    finally:
        deployment.close()
        for tap in taps:
            tap.close()


@pytest.fixture(scope="module")
def insecure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TappedDeployment]:
    yield from tapped_deployment(tmp_path_factory.mktemp("deploy-insecure"), None, "insecure")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    # One key more than there are SuperNodes: the last one is never registered.
    return make_certificates(tmp_path_factory.mktemp("certs"), NUM_SUPERNODES + 1)


@pytest.fixture(scope="module")
def tls(
    tmp_path_factory: pytest.TempPathFactory, certificates: Certificates
) -> Iterator[TappedDeployment]:
    yield from tapped_deployment(tmp_path_factory.mktemp("deploy-tls"), certificates, "tls")


def assert_round_aggregated_every_reply(metrics: list[dict[str, Any]]) -> None:
    """Round 1 aggregated all NUM_SUPERNODES replies: each carried every record the rule needs.

    The strategies drop a reply that lacks one of their required records (counted as
    ``dropped-missing-<record>``) and stop the run if none has it, so three valid replies mean
    the records arrived at the ServerApp intact.
    """
    last = metrics[-1]
    assert [entry["round"] for entry in metrics] == [0, 1]
    assert last["replies-received"] == NUM_SUPERNODES
    assert last["replies-valid"] == NUM_SUPERNODES
    assert last["replies-dropped"] == 0
    assert last["aggregated"] == 1
    assert 0.0 <= last["test-accuracy"] <= 1.0
    assert math.isfinite(last["test-loss"])


def assert_uploads_carry_replies(strategy: str, uploads: list[bytes]) -> None:
    """Each SuperNode uploaded at least the serialized bytes of its reply's records."""
    payload = sum(reply_record_sizes(strategy, RUN_SETTINGS).values())
    for node, upload in enumerate(uploads):
        assert len(upload) >= payload, (
            f"SuperNode {node} uploaded {len(upload)} B over the Fleet API, less than the "
            f"{payload} B of its serialized reply"
        )


@pytest.mark.parametrize("strategy", strategy_params())
def test_insecure_round_carries_each_strategys_records_over_the_fleet_api(
    insecure: TappedDeployment, strategy: str
) -> None:
    metrics, uploads = insecure.run_strategy(strategy, "insecure")
    assert_round_aggregated_every_reply(metrics)
    assert_uploads_carry_replies(strategy, uploads)
    wanted = set(reply_record_sizes(strategy, RUN_SETTINGS)) & set(EXTRA_RECORDS)
    for node, upload in enumerate(uploads):
        # Record names travel in the clear without TLS: each extra record this strategy
        # requested crossed the Fleet API, and no other one did.
        sent = {name for name in EXTRA_RECORDS if name.encode() in upload}
        assert sent == wanted, f"SuperNode {node} uploaded records {sent}, expected {wanted}"
    # Every connection a SuperNode opened to the Fleet API began as a plain-text connection of
    # this release's transport: gRPC's HTTP/2 preface, or an HTTP/1.1 request to a Fleet route.
    for tap in insecure.taps:
        assert tap.openings
        assert all(PLAIN_OPENING[TRANSPORT].match(opening) for opening in tap.openings), (
            TRANSPORT,
            tap.openings[:3],
        )


# TLS is the transport's: CI runs FedAvg's on HTTP; the other strategies' are marked extended
# (gRPC's TLS is in CI through the container stack's and `ba-deploy local`'s TLS tests).
@pytest.mark.parametrize(
    "strategy",
    strategy_params(http_fleet=("fedavg",), extended=("elastic", "fedlaw", "fedgma")),
)
def test_tls_round_of_each_strategy_is_encrypted_on_the_wire(
    tls: TappedDeployment, strategy: str
) -> None:
    metrics, uploads = tls.run_strategy(strategy, "tls")
    assert_round_aggregated_every_reply(metrics)
    assert_uploads_carry_replies(strategy, uploads)
    for node, upload in enumerate(uploads):
        readable = [
            name
            for name in (b"arrays", b"metrics", *map(str.encode, EXTRA_RECORDS))
            if name in upload
        ]
        assert not readable, f"SuperNode {node}'s upload shows {readable} in plain text"
    # Every connection a SuperNode opened to the Fleet API began with a TLS ClientHello.
    for tap in tls.taps:
        assert tap.openings
        assert all(opening.startswith(TLS_HANDSHAKE_PREFIX) for opening in tap.openings)


@pytest.mark.http_fleet
def test_unregistered_supernode_is_refused(
    tls: TappedDeployment, certificates: Certificates
) -> None:
    deployment = tls.deployment
    before = set(deployment.online_node_ids())
    intruder = deployment.start_supernode(
        0,
        NUM_SUPERNODES,
        auth_key=certificates.supernode_key(NUM_SUPERNODES),
        supervised=False,  # Flower's own exit, not ba-supernode's retries
    )
    exit_code = intruder.process.wait(timeout=120)
    # Flower logs its code 305 (connection error) and exits with status 1, as docs/deployment.md
    # says (it said "exits (code 305)" before).
    assert exit_code == 1
    assert "Failed to activate SuperNode" in intruder.log()
    assert "Exit Code: 305" in intruder.log()
    assert set(deployment.online_node_ids()) == before
