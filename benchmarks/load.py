"""``python -m benchmarks.load``: how many SuperNodes one SuperLink holds on this machine, for the
default model: for each size N, a SuperLink and N SuperNodes
(:class:`server.deploy.local.LocalDeployment`) run a few rounds (docs/deployment.md, "Load:
SuperNodes per SuperLink").
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.deployment import page_facts, spread
from benchmarks.harness import save
from benchmarks.spec import REPO
from beyond_averaging.server.app import client_task
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.deploy.flower_release import CLIENTAPP_EXECUTORS, FlowerRelease
from beyond_averaging.server.deploy.local import LocalDeployment
from beyond_averaging.server.deploy.resources import (
    MIB,
    PeakSampler,
    ProcessWatch,
    cpu_seconds,
    kinds_of,
    peak_rss_sampler,
    status_bytes,
)
from beyond_averaging.server.overrides import LaunchError
from beyond_averaging.server.runs.folder import read_metrics
from beyond_averaging.server.sweep.report import markdown_table
from beyond_averaging.tasks.federation import DataSpec, load_client_partition
from beyond_averaging.tasks.partition_cache import CACHE_ENV

#: The parts of a node's memory in the load benchmark: the SuperNode process, the ClientApp
#: processes it starts (one per message) and the helpers between them (Flower's SuperExec).
NODE_PARTS = ("supernode", "clientapp", "superexec")


def node_parts(watch: ProcessWatch, load: list[float]) -> dict[str, float]:
    """The summed RSS of every node's processes (``watch.groups``: the SuperNodes), by part and
    in all, and the ClientApp processes running; appends the 1-minute load average to ``load``
    (the cores are shared with others)."""
    watch.sample()
    kinds = kinds_of(watch.processes)
    part = dict.fromkeys(NODE_PARTS, 0.0)
    clientapps = 0
    for pid, process in list(watch.processes.items()):
        if process.ended or watch.group_of(pid) is None:
            continue
        kind = kinds[pid] if kinds[pid] in ("supernode", "clientapp") else "superexec"
        part[kind] += process.last.rss_pages * watch.page
        clientapps += kind == "clientapp" and process.last.state != "Z"  # not yet reaped
    load.append(os.getloadavg()[0])
    return {**part, "total": sum(part.values()), "clientapps": clientapps}


def _mb(size: float) -> float:
    return round(size / MIB, 1)


def measure_load(
    size: int, args: argparse.Namespace, workdir: Path, file_state: bool
) -> dict[str, Any]:
    """One federation of ``size`` SuperNodes: start, run ``rounds`` rounds, stop."""
    row: dict[str, Any] = {"supernodes": size, "rounds": args.rounds}
    row["superlink-state"] = "file" if file_state else "memory"
    # In-memory SuperLink state by default: with its SQLite file, 7 of 10 replies failed here
    # with "database is locked" on a loaded machine; see docs/deployment.md (Load).
    deployment = LocalDeployment(REPO, workdir, file_state=file_state, executor=args.executor)
    load: list[float] = []
    started = time.monotonic()
    try:
        # subprocess: bare flower-supernode processes with Flower's isolation, as the first
        # pages measured; warm: under ba-supernode, as docs/deployment.md deploys them.
        supervised = args.executor == "warm"
        deployment.start().start_supernodes(size, supervised=supervised, timeout=max(120, 5 * size))
        row["seconds-to-online"] = round(time.monotonic() - started, 1)
        idle = sum(status_bytes("VmRSS", node.process.pid) for node in deployment.supernodes)
        row["supernode-idle-rss-mb"] = _mb(idle / size)
        settings = {"num-clients": size, "num-server-rounds": args.rounds}
        settings |= {"round-timeout": args.round_timeout, "run-name": f"load-{size}"}
        settings["output-dir"] = str(deployment.workdir / "runs")
        assert deployment.superlink is not None
        groups = {node.process.pid: "node" for node in deployment.supernodes}
        watch = ProcessWatch(os.getpid(), groups, pss_every=math.inf)
        sampler = PeakSampler(lambda: node_parts(watch, load), interval=1.0)
        with sampler as nodes, peak_rss_sampler(deployment.serverapp_pids) as server:
            run_started, link_cpu = time.monotonic(), cpu_seconds(deployment.superlink.pid)
            try:
                run_dir = deployment.run(settings, timeout=args.timeout)
            finally:
                row["run-seconds"] = round(time.monotonic() - run_started, 1)
                link_cpu = cpu_seconds(deployment.superlink.pid) - link_cpu
                row["superlink-cpu-s-per-round"] = round(link_cpu / args.rounds, 2)
                row["superlink-peak-rss-mb"] = _mb(status_bytes("VmHWM", deployment.superlink.pid))
        metrics = read_metrics(run_dir)
        row["round-seconds"] = [round(float(m["round-seconds"]), 1) for m in metrics[1:]]
        row["replies-valid"] = [m.get("replies-valid") for m in metrics[1:]]
        row["final-accuracy"] = round(float(metrics[-1]["test-accuracy"]), 4)
        row["serverapp-peak-rss-mb"] = _mb(server.peaks["rss"])
        row["node-peak-rss-mb-per-node"] = _mb(nodes.peaks["total"] / size)
        for part in NODE_PARTS:
            row[f"{part}-peak-rss-mb-per-node"] = _mb(nodes.peaks[part] / size)
        row["clientapp-processes-at-once"] = int(nodes.peaks["clientapps"])
        row["status"] = "completed"
    except (LaunchError, OSError, AssertionError) as error:
        row["status"] = "failed"
        row["error"] = f"{type(error).__name__}: {error}"[:2000]
    finally:
        if load:  # also for a failed run: how busy the cores were when it failed
            row["load-average"] = spread(load)
        deployment.close()
        if deployment.superlink_log.is_file():
            row.update(superlink_errors(deployment.superlink_log.read_text(errors="replace")))
    return row


def superlink_errors(log: str) -> dict[str, Any]:
    """How often the SuperLink logged "database is locked", and on which calls."""
    locked = [line for line in log.splitlines() if "database is locked" in line]
    calls = sorted(set(re.findall(r"\[(/[\w./-]+)\]\[UnexpectedError", "\n".join(locked))))
    return {"superlink-database-locked": len(locked), "superlink-locked-calls": calls}


def load_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The load benchmark's page."""
    cache = "empty at the start" if meta["cold-cache"] else "filled before the run"
    lines = [
        "# SuperNodes per SuperLink: load on this machine",
        "",
        f"Measured {meta['date']} with `{meta['command']}` on {meta['machine']}: "
        f"{meta['cpus']} CPU cores and {meta['memory-gib']} GiB shared with other jobs (the "
        "load average column says how busy the cores were; times are upper bounds). Default "
        f"configuration, flwr {meta['flwr']} ({meta['transport']} Fleet API), plain-text on "
        f"loopback, the SuperLink's state in {meta['superlink-state']}, ClientApps: "
        f"{meta.get('executor', 'Flower isolation')}, the partition cache {cache}; see "
        "[deployment](../deployment.md#load-supernodes-per-superlink).",
        "",
    ]
    cells = []
    for row in rows:
        locked = ""
        if row.get("superlink-database-locked"):
            locked = (
                f'; the SuperLink logged "database is locked" {row["superlink-database-locked"]}'
                f" times, on {', '.join(row['superlink-locked-calls']) or 'internal writes'}"
            )
        if row["status"] == "skipped":
            cells.append([row["supernodes"], *["-"] * 8, f"skipped: {row['why']}"])
        elif row["status"] == "failed":
            first_line = row["error"].splitlines()[0][:300].replace("|", "/")
            online = row.get("seconds-to-online", "-")
            load = " / ".join(map(str, row.get("load-average", ["-"])))
            failure = f"failed: {first_line}{locked}"
            cells.append([row["supernodes"], online, "-", load, *["-"] * 5, failure])
        else:
            parts = ("node", "supernode", "superexec", "clientapp")
            per_node = [row[f"{part}-peak-rss-mb-per-node"] for part in parts]
            cells.append(
                [
                    *(row["supernodes"], row["seconds-to-online"]),
                    ", ".join(map(str, row["round-seconds"])),
                    " / ".join(map(str, row["load-average"])),
                    *(row["serverapp-peak-rss-mb"], row["superlink-peak-rss-mb"]),
                    row.get("superlink-cpu-s-per-round", "-"),
                    "{} = {} + {} + {}".format(*per_node),
                    *(row["replies-valid"], f"completed{locked}"),
                ]
            )
    header = "SuperNodes | online after (s) | round seconds | load average min / mean / max"
    header += " | ServerApp peak RSS (MB) | SuperLink peak RSS (MB) | SuperLink CPU s per round"
    header += " | per node peak RSS (MB): all"
    header += " = SuperNode + SuperExec + ClientApp | valid replies | status"
    lines.append(markdown_table(header.split(" | "), cells))
    lines += [
        "Per node: the peak over the run of the summed RSS of every SuperNode with its "
        "processes, divided by the number of nodes; the parts are the peaks of each part's sum "
        "(they need not peak at the same moment, so they may add up to more than the whole).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """``python -m benchmarks.load``: measure each size in turn; print and save the rows."""
    parser = argparse.ArgumentParser(description="SuperNodes per SuperLink on this machine")
    parser.add_argument("--sizes", type=int, nargs="+", default=[5, 10, 20, 30, 50])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    # Long, to measure slow rounds rather than drop their replies; shorter where replies are
    # lost for good (the SQLite state's lock).
    parser.add_argument("--round-timeout", type=float, default=1800.0)
    parser.add_argument("--reserve-gib", type=float, default=4.0, help="memory left to others")
    parser.add_argument("--state", choices=("memory", "file"), default="memory")
    parser.add_argument("--cold-cache", action="store_true", help="empty partition cache at start")
    executor = "subprocess: bare flower-supernode; warm: under ba-supernode, its warm executor"
    parser.add_argument(
        "--executor", choices=CLIENTAPP_EXECUTORS, default="subprocess", help=executor
    )
    parser.add_argument("--publish", action="store_true")
    args = parser.parse_args()
    release = FlowerRelease.installed()
    name = "load" if args.state == "memory" and not args.cold_cache else f"load-{args.state}"
    name += "-cold" if args.cold_cache else ""
    name += "" if release.transport == "grpc" else f"-{release.transport}"
    name += "-warm" if args.executor == "warm" else ""
    rows: list[dict[str, Any]] = []
    per_node = 0.0  # memory per node of the largest size measured
    with tempfile.TemporaryDirectory(prefix="ba-load-") as scratch:
        # A cache of this benchmark's own, inherited by every process it starts.
        os.environ[CACHE_ENV] = str(Path(scratch) / "partitions")
        for size in sorted(args.sizes):
            spare = status_bytes("MemAvailable", path="/proc/meminfo") - args.reserve_gib * 2**30
            if per_node and size * per_node > spare:
                why = f"needs about {size * per_node / 2**30:.1f} GiB at {per_node / MIB:.0f} MB"
                why += f" per node, {max(spare, 0) / 2**30:.1f} GiB spare"
                rows.append({"supernodes": size, "status": "skipped", "why": why})
            else:
                if not args.cold_cache:  # the steady state: partitioned by an earlier message
                    task = client_task(parse_run_config({}))
                    load_client_partition(DataSpec.from_task(task, size), 0)
                file_state = args.state == "file"
                workdir = Path(scratch) / f"n{size}"
                rows.append(measure_load(size, args, workdir, file_state))
            print(rows[-1], flush=True)
            if rows[-1]["status"] == "completed":
                per_node = rows[-1]["node-peak-rss-mb-per-node"] * MIB
    meta = {
        **page_facts("load"),
        "memory-gib": round(status_bytes("MemTotal", path="/proc/meminfo") / 2**30, 1),
        "superlink-state": "an SQLite file" if args.state == "file" else "memory",
        "cold-cache": args.cold_cache,
        "executor": {"warm": "forked by the warm executor"}.get(args.executor, "Flower isolation"),
    }
    save("load", name, load_markdown(rows, meta), {"meta": meta, "rows": rows}, args.publish)


if __name__ == "__main__":
    main()
