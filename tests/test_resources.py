"""Per-process CPU and memory from /proc (server/deploy/resources.py): stat lines, the kind of each
Flower process, CPU per kind and per node (reaped children included), memory lines and peaks, the
Fleet API byte counter, and what ``ba-deploy local --resources`` reports for each node of a
deployment."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from beyond_averaging.server.deploy.local import (
    LocalDeployment,
    SuperNodeProcess,
    report_resources,
    watch_resources,
)
from beyond_averaging.server.deploy.resources import (
    FleetRelay,
    ProcessWatch,
    ProcStat,
    Tracked,
    cpu_seconds,
    cpu_seconds_by,
    kinds_of,
    parse_stat,
    peak_rss_sampler,
    reset_peak_rss,
    status_bytes,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="no /proc here")


def by_kind(
    table: Mapping[int, Tracked], root: int = 1
) -> tuple[dict[str, float], dict[str, float]]:
    return cpu_seconds_by(table, kinds_of(table, root), ticks_per_second=100.0)


# A stat line as proc(5) lays it out, with a comm that holds a space and a parenthesis.
# pid 4242, comm "flwr (x", state S, ppid 17, utime 250, stime 30, cutime 1200, cstime 45,
# starttime 98765, rss 3000 pages.
LINE = (
    "4242 (flwr (x) S 17 4242 4242 0 -1 4194560 1000 0 0 0 250 30 1200 45 20 0 3 0 98765 "
    "123456789 3000 18446744073709551615 1 1 0 0 0 0 0 16781312 16386 0 0 0 17 1 0 0 0 0 0"
)


def test_a_stat_line_is_read_from_the_last_parenthesis() -> None:
    assert parse_stat(LINE) == ProcStat(
        pid=4242,
        comm="flwr (x",
        state="S",
        ppid=17,
        cpu_ticks=280,
        children_ticks=1245,
        start_ticks=98765,
        rss_pages=3000,
    )


def test_this_process_s_own_stat_line_reads_back() -> None:
    path = Path("/proc/self/stat")
    if not path.is_file():
        pytest.skip("no /proc on this system")
    stat = parse_stat(path.read_text())
    assert stat.state in "RS"
    assert stat.rss_pages > 0


def test_a_process_s_cpu_seconds_grow_with_its_work_and_are_zero_once_it_is_gone() -> None:
    if not Path("/proc/self/stat").is_file():
        pytest.skip("no /proc on this system")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; t = time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\ninput()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while cpu_seconds(child.pid) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = cpu_seconds(child.pid)
        assert 0.45 <= used < 30, used  # its busy half second (and its start), in seconds
    finally:
        child.communicate(b"\n", timeout=30)
    assert cpu_seconds(child.pid) == 0.0  # reaped: nothing to read


def stat(pid: int, comm: str, ppid: int, cpu: int, children: int = 0, start: int = 0) -> ProcStat:
    return ProcStat(pid, comm, "S", ppid, cpu, children, start, 100)


def tracked(
    first: ProcStat, last: ProcStat | None = None, at_start: bool = False, ended: bool = False
) -> Tracked:
    return Tracked(first, last or first, at_start, first.rss_pages, ended)


def deployment_table() -> dict[int, Tracked]:
    """A benchmark (1) with a SuperLink (10) -> SuperExec (11) -> ServerApp (12) and a
    SuperNode (20) -> SuperExec (21) -> ClientApps 22 (reaped, read 30 ticks before its end),
    23 (reaped, read at its end) and 24 (a zombie, not reaped)."""
    return {
        1: tracked(stat(1, "python", 0, 100), stat(1, "python", 0, 130), at_start=True),
        10: tracked(stat(10, "flower-superlin", 1, 500), stat(10, "flower-superlin", 1, 900), True),
        11: tracked(stat(11, "flower-superexe", 10, 50), stat(11, "flower-superexe", 10, 60), True),
        12: tracked(stat(12, "flwr-serverapp", 11, 10), stat(12, "flwr-serverapp", 11, 700)),
        20: tracked(stat(20, "flower-supernod", 1, 80), stat(20, "flower-supernod", 1, 120), True),
        # The SuperExec reaped 22 (300 ticks in all) and 23 (250) in the window: 550 more.
        21: tracked(
            stat(21, "flower-superexe", 20, 40, children=5000),
            stat(21, "flower-superexe", 20, 55, children=5550),
            at_start=True,
        ),
        22: tracked(
            stat(22, "flwr-clientapp", 21, 5), stat(22, "flwr-clientapp", 21, 270), ended=True
        ),
        23: tracked(
            stat(23, "flwr-clientapp", 21, 3), stat(23, "flwr-clientapp", 21, 250), ended=True
        ),
        24: tracked(stat(24, "flwr-clientapp", 21, 9), stat(24, "flwr-clientapp", 21, 260)),
        30: tracked(stat(30, "flwr", 1, 70)),
    }


def test_each_process_has_its_kind_and_a_superexec_the_kind_of_whom_it_serves() -> None:
    kinds = kinds_of(deployment_table(), root=1)
    assert kinds == {
        1: "benchmark",
        10: "superlink",
        11: "superexec-server",
        12: "serverapp",
        20: "supernode",
        21: "superexec-node",
        22: "clientapp",
        23: "clientapp",
        24: "clientapp",
        30: "flwr-run",
    }


def warm_node_table() -> dict[int, Tracked]:
    """A benchmark (1) with ``ba-supernode`` (40) running a SuperNode (41) and the warm executor
    (42), which forked ClientApp 43 (still named as its parent when first read) and 44."""
    return {
        1: tracked(stat(1, "python", 0, 0)),
        40: tracked(stat(40, "ba-supernode", 1, 1)),
        41: tracked(stat(41, "flower-supernod", 40, 2)),
        42: tracked(stat(42, "ba-warm-exec", 40, 3)),
        43: tracked(stat(43, "ba-warm-exec", 42, 4), stat(43, "ba-clientapp", 42, 9)),
        44: tracked(stat(44, "ba-clientapp", 42, 5)),
    }


def test_a_warm_node_s_supervisor_executor_and_forked_clientapps_have_their_kinds() -> None:
    kinds = kinds_of(warm_node_table(), root=1)
    assert kinds == {
        1: "benchmark",
        40: "supervisor",
        41: "supernode",
        42: "warm-executor",
        43: "clientapp",
        44: "clientapp",
    }


def test_a_node_s_memory_sums_every_process_below_the_process_started_for_it() -> None:
    watch = ProcessWatch(1, {40: "node 0"})
    watch.processes = warm_node_table()
    watch.pss_read = float("inf")  # no PSS reading (the pids are made up)
    memory = watch.group_memory()
    # ba-supernode, the SuperNode, the warm executor and both ClientApps: 5 x 100 pages.
    assert memory == {"rss-node 0": 5 * 100 * watch.page}
    assert watch.group_of(44) == "node 0"
    assert watch.group_of(1) is None


def test_cpu_per_kind_counts_the_window_and_what_reaped_children_ran_after_their_last_reading() -> (
    None
):
    seconds, recovered = by_kind(deployment_table())
    # Alive at the start: last minus first; born in the window: all of it.
    assert seconds["benchmark"] == pytest.approx(0.30)
    assert seconds["superlink"] == pytest.approx(4.00)
    assert seconds["superexec-server"] == pytest.approx(0.10)
    assert seconds["serverapp"] == pytest.approx(7.00)
    assert seconds["supernode"] == pytest.approx(0.40)
    assert seconds["superexec-node"] == pytest.approx(0.15)
    assert seconds["flwr-run"] == pytest.approx(0.70)
    # ClientApps: 270 + 250 + 260 read, and 550 - (270 + 250) = 30 only the reaped times show.
    assert seconds["clientapp"] == pytest.approx(8.10)
    assert recovered["clientapp"] == pytest.approx(0.30)
    assert sum(recovered.values()) == pytest.approx(0.30)
    assert "unseen" not in seconds


def test_reaped_time_of_children_never_seen_is_counted_as_unseen() -> None:
    table = {
        1: tracked(stat(1, "python", 0, 0, children=100), stat(1, "python", 0, 0, children=340)),
    }
    table[1].at_start = True
    seconds, recovered = by_kind(table)
    assert seconds["unseen"] == pytest.approx(2.40)
    assert recovered["unseen"] == pytest.approx(2.40)


def test_a_node_s_children_never_seen_count_to_the_node_when_groups_are_subtrees() -> None:
    # A node's warm executor (42) reaped ClientApps that lived less than a sample: 300 ticks.
    table = warm_node_table()
    table[42] = tracked(stat(42, "ba-warm-exec", 40, 3, children=100), at_start=True)
    table[42].last = stat(42, "ba-warm-exec", 40, 3, children=400)
    groups = {pid: "node 0" if pid >= 40 else "other" for pid in table}
    seconds, recovered = cpu_seconds_by(table, groups, 100.0, subtrees=True)
    assert recovered == {"node 0": pytest.approx(3.00)}
    # Own ticks: 1 + 2 + 0 (read twice, at the start) + 9 + 5 of 40..44, and the 300 reaped.
    assert seconds["node 0"] == pytest.approx((1 + 2 + 9 + 5 + 300) / 100)
    assert by_kind(table)[1] == {"unseen": pytest.approx(3.00)}  # kinds: no child's kind known


def test_a_child_that_ends_between_two_samples_is_counted_from_its_parent() -> None:
    if not Path("/proc/self/stat").is_file():
        pytest.skip("no /proc on this system")
    watch = ProcessWatch(int(parse_stat(Path("/proc/self/stat").read_text()).pid))
    watch.open_window()
    burn = (
        "import time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\nprint(time.process_time())"
    )
    child = subprocess.run([sys.executable, "-c", burn], capture_output=True, text=True, check=True)
    watch.sample()  # the child was started and reaped between two samples
    seconds, recovered = by_kind(watch.processes, watch.root)
    own = float(child.stdout)  # what the child measured of itself, after its start-up
    assert own - 0.02 <= seconds["unseen"] <= own + 2.0
    assert recovered["unseen"] == seconds["unseen"]


#: A stand-in for a Flower process: waits for a line, then burns 0.4 s of CPU, touches
#: ``argv[1]`` MiB, says how much CPU the burn took, and sleeps until it is stopped.
WORKER = """
import sys, time
sys.stdin.readline()
start = time.process_time()
while time.process_time() < start + 0.4:
    pass
held = bytearray(int(sys.argv[1]) << 20)
for offset in range(0, len(held), 4096):
    held[offset] = 1
print(time.process_time() - start, flush=True)
time.sleep(60)
"""


def test_ba_deploy_resources_reports_each_node_s_cpu_seconds_and_peak_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def worker(mib: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-c", WORKER, str(mib)]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    deployment = LocalDeployment(None, tmp_path)  # nothing started: its processes are ours
    deployment.superlink = worker(10)
    node = SuperNodeProcess(3, worker(200), tmp_path / "node.log")
    deployment.supernodes = [node]
    processes = [deployment.superlink, node.process]
    try:
        resources = watch_resources(deployment)
        burnt = {}
        for label, process in zip(("SuperLink", "node 3"), processes, strict=True):
            assert process.stdin is not None
            assert process.stdout is not None
            process.stdin.write(b"go\n")
            process.stdin.flush()
            burnt[label] = float(process.stdout.readline())
        time.sleep(2.5)  # samples after the work, a PSS reading (once a second) among them
        report_resources(resources, tmp_path / "resources.json")
    finally:
        for process in processes:
            process.kill()
            process.wait()
    usage = json.loads((tmp_path / "resources.json").read_text(encoding="utf-8"))["groups"]
    assert list(usage) == ["SuperLink", "node 3"]
    for label, figures in usage.items():
        # Counted from the window's opening: the burn and the pages' first touch, no start-up.
        assert burnt[label] - 0.02 <= figures["cpu-seconds"] <= burnt[label] + 0.5
        assert figures["processes"] == 1
    assert 200 <= usage["node 3"]["peak-rss-mib"] <= 200 + 60  # the bytes, and the interpreter
    assert 10 <= usage["SuperLink"]["peak-rss-mib"] <= 10 + 60
    assert 200 <= usage["node 3"]["peak-pss-mib"] <= usage["node 3"]["peak-rss-mib"]
    out = capsys.readouterr().out
    assert out.startswith("ba-deploy: resources over ")
    node_line = next(line for line in out.splitlines() if line.startswith("  node 3"))
    assert f"CPU {usage['node 3']['cpu-seconds']:8.2f} s" in node_line
    assert f"RSS {usage['node 3']['peak-rss-mib']:7.1f}" in node_line


# ----------------------------------------------------------------------------- memory lines
def test_memory_of_a_process_that_ended_reads_zero_and_this_one_more() -> None:
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    ended = subprocess.run(command, check=True, capture_output=True, text=True)
    assert status_bytes("VmRSS", int(ended.stdout)) == 0
    assert status_bytes("VmHWM") >= status_bytes("VmRSS") > 0
    assert status_bytes("NoSuchLine") == 0
    assert status_bytes("MemTotal", path="/proc/meminfo") > status_bytes("VmRSS")


def test_the_peak_rss_sampler_follows_the_peak_of_processes_started_after_it() -> None:
    pids: list[int] = []
    with peak_rss_sampler(lambda: pids, interval=0.05) as sampler:
        assert sampler.peaks["rss"] == 0  # no process yet
        held = subprocess.Popen(
            [sys.executable, "-c", WORKER, "120"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            pids.append(held.pid)
            assert held.stdin is not None
            assert held.stdout is not None
            held.stdin.write(b"go\n")
            held.stdin.flush()
            held.stdout.readline()  # 120 MiB touched
            time.sleep(0.3)
        finally:
            held.kill()
            held.wait()
    assert 120 * 2**20 <= sampler.peaks["rss"] <= 180 * 2**20


def test_a_reset_peak_mark_drops_to_what_is_resident_now() -> None:
    held = bytearray(64 << 20)
    for offset in range(0, len(held), 4096):
        held[offset] = 1
    del held
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert status_bytes("VmHWM") < status_bytes("VmRSS") + (32 << 20)


# ----------------------------------------------------------------------------- Fleet bytes
def echo_twice_server() -> tuple[socket.socket, list[int]]:
    """A server that answers each connection with twice the bytes it read, until it closes."""
    server = socket.create_server(("127.0.0.1", 0))
    read: list[int] = []

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            while chunk := connection.recv(65536):
                read.append(len(chunk))
                connection.sendall(chunk * 2)

    threading.Thread(target=serve, daemon=True).start()
    return server, read


def test_the_fleet_relay_counts_each_way_and_passes_every_byte_on() -> None:
    server, read = echo_twice_server()
    relay = FleetRelay(server.getsockname())
    try:
        payload = bytes(range(256)) * 300  # 76,800 bytes
        answer = bytearray()
        with socket.create_connection(("127.0.0.1", relay.port)) as client:
            client.sendall(payload)
            while len(answer) < 2 * len(payload):
                answer += client.recv(65536)
        deadline = time.monotonic() + 5
        while relay.counts()[1] < 2 * len(payload) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.counts() == (76_800, 153_600)
        assert sum(read) == 76_800
        assert relay.address == f"127.0.0.1:{relay.port}"
    finally:
        relay.close()
        server.close()


def test_ba_deploy_resources_adds_the_fleet_bytes_of_a_relayed_node_from_the_window_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = echo_twice_server()
    deployment = LocalDeployment(None, tmp_path)
    deployment.superlink = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    relay = FleetRelay(server.getsockname())
    deployment.supernodes = [SuperNodeProcess(0, idle, tmp_path / "node.log", relay)]
    try:
        with socket.create_connection(("127.0.0.1", relay.port)) as client:
            client.sendall(b"x" * 1000)  # before the window: not counted
            answer = 0
            while answer < 2000:
                answer += len(client.recv(65536))
            resources = watch_resources(deployment)
            client.sendall(b"y" * 5000)
            answer = 0
            while answer < 10_000:
                answer += len(client.recv(65536))
            report_resources(resources, tmp_path / "resources.json")
    finally:
        for process in (deployment.superlink, idle):
            process.kill()
            process.wait()
        relay.close()
        server.close()
    usage = json.loads((tmp_path / "resources.json").read_text(encoding="utf-8"))["groups"]
    assert usage["node 0"]["fleet-sent-kb"] == 5.0
    assert usage["node 0"]["fleet-received-kb"] == 10.0
    assert "fleet-sent-kb" not in usage["SuperLink"]
    node_line = next(line for line in capsys.readouterr().out.splitlines() if "node 0" in line)
    assert node_line.endswith("Fleet API: sent 5 kB, received 10 kB")
