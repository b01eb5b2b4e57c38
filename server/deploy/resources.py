"""What each part of a local deployment costs: CPU seconds and peak memory of every process,
sampled from ``/proc`` (Linux), grouped by node and by kind of process.

``ba-deploy local --resources`` samples the SuperLink, each SuperNode and everything they start
(SuperExecs, ServerApps, ClientApps, the warm executor), counts the bytes each SuperNode exchanges
with the Fleet API (:class:`FleetRelay`) and prints, when it stops, what each node cost
(:func:`resource_lines`); the deployment benchmarks read the same watch by kind of process.
docs/deployment.md ("What each node costs") says what is counted and what is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = float(1 << 20)
#: ``comm`` of each Flower process (Linux keeps the first 15 characters of the script's name).
COMM_KINDS = {
    "ba-supernode": "supervisor",
    "ba-warm-exec": "warm-executor",
    "ba-clientapp": "clientapp",
    "flower-superlin": "superlink",
    "flwr-serverapp": "serverapp",
    "flower-supernod": "supernode",
    "flower-superexe": "superexec",
    "flwr-clientapp": "clientapp",
    "flwr": "flwr-run",
}


def set_process_name(name: str) -> None:
    """Name this process in ``/proc/self/comm`` (Linux; elsewhere nothing happens), as
    :data:`COMM_KINDS` finds it."""
    try:
        with open("/proc/self/comm", "w", encoding="ascii") as comm:
            comm.write(name[:15])
    except OSError:  # not Linux, or /proc not mounted
        pass


#: Linux prctl(2): the signal a process gets when its parent ends.
PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's ``prctl`` (looked up here, not in a forked child: ``dlopen`` takes locks), or None
    where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def end_with_parent() -> bool:
    """Have the kernel send this process SIGTERM when the thread that started it ends, however
    it ends (Linux ``PR_SET_PDEATHSIG``). ``ba-deploy`` runs it in each child about to run a
    deployment's process, so that a ``ba-deploy`` killed with SIGKILL leaves no SuperLink or
    SuperNode holding its ports (``LocalDeployment.close`` stops them in order otherwise); the
    warm executor calls it at its start. Returns whether it was set (False: not Linux)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM) == 0


#: Every kind of process, with its name for a reader.
KINDS = {
    "superlink": "SuperLink",
    "superexec-server": "SuperExec (starts the ServerApp)",
    "serverapp": "ServerApp",
    "supernode": "SuperNode",
    "superexec-node": "SuperExec (starts ClientApps)",
    "supervisor": "`ba-supernode` (restarts the SuperNode and the warm executor)",
    "warm-executor": "warm executor (forks ClientApps)",
    "clientapp": "ClientApp",
    "flwr-run": "`flwr run` (the user's CLI)",
    "benchmark": "this benchmark (its sampling of /proc)",
    "other": "other processes below the benchmark",
    "unseen": "processes that ended between two samples",
}


@dataclass(frozen=True)
class ProcStat:
    """The fields of one ``/proc/<pid>/stat`` line that are read here.

    Times are in clock ticks (``SC_CLK_TCK``), ``rss_pages`` in pages.
    """

    pid: int
    comm: str
    state: str
    ppid: int
    cpu_ticks: int  # utime + stime: the process's own CPU, all its threads
    children_ticks: int  # cutime + cstime: of the children it has reaped (waited for)
    start_ticks: int  # starttime: since boot
    rss_pages: int


def parse_stat(line: str) -> ProcStat:
    """One ``/proc/<pid>/stat`` line (proc(5)). ``comm`` may hold spaces and parentheses, so the
    fields are counted from the last ``)``."""
    head, _, rest = line.rpartition(")")
    pid, _, comm = head.partition(" (")
    fields = rest.split()  # fields[0] is field 3 (state) of proc(5)
    return ProcStat(
        pid=int(pid),
        comm=comm,
        state=fields[0],
        ppid=int(fields[1]),
        cpu_ticks=int(fields[11]) + int(fields[12]),
        children_ticks=int(fields[13]) + int(fields[14]),
        start_ticks=int(fields[19]),
        rss_pages=int(fields[21]),
    )


def read_stat(pid: int) -> ProcStat | None:
    """The stat of a process, or None once it has been reaped."""
    try:
        return parse_stat((Path("/proc") / str(pid) / "stat").read_text(encoding="utf-8"))
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """The CPU seconds process ``pid`` has used so far, all its threads (0 once it is reaped)."""
    stat = read_stat(pid)
    return stat.cpu_ticks / os.sysconf("SC_CLK_TCK") if stat is not None else 0.0


def status_bytes(field: str, pid: int | str = "self", path: str = "") -> int:
    """A memory line of ``/proc/<pid>/status`` (or ``path``, e.g. ``/proc/meminfo``) in bytes.

    Parameters
    ----------
    field : str
        The line's name: ``VmRSS`` (resident now), ``VmHWM`` (the peak), ``MemAvailable``.
    pid : int or str
        The process; ``"self"``: this one.
    path : str
        Another file of the same layout instead (``/proc/meminfo``).

    Returns
    -------
    int
        The value in bytes (the kernel writes kB); 0 once the process has ended or when the line
        is missing.
    """
    try:
        status = Path(path or f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith(f"{field}:")), "")
    return int(line.split()[1]) * 1024 if line else 0


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (``VmHWM``) to its current RSS (``ru_maxrss`` cannot
    be reset, and carries a parent's peak across fork and exec); False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def pss_bytes(pid: int) -> float:
    """A process's proportional set size (``/proc/<pid>/smaps_rollup``), 0 once it ended."""
    try:
        rollup = (Path("/proc") / str(pid) / "smaps_rollup").read_text(encoding="utf-8")
    except OSError:
        return 0.0
    for line in rollup.splitlines():
        if line.startswith("Pss:"):
            return float(line.split()[1]) * 1024
    return 0.0


@dataclass
class Tracked:
    """One process below the watch's root, as sampled.

    ``first`` is its reading when the window opened (``at_start``) or when it was first seen;
    ``last`` its latest (a zombie still reads: its final times); ``ended`` once it was reaped.
    """

    first: ProcStat
    last: ProcStat
    at_start: bool
    peak_rss_pages: int = 0
    ended: bool = False

    @property
    def own_ticks(self) -> int:
        """CPU ticks of the process itself within the window."""
        return self.last.cpu_ticks - (self.first.cpu_ticks if self.at_start else 0)

    @property
    def reaped_ticks(self) -> int:
        """CPU ticks of the children it reaped within the window (the kernel's exact sum)."""
        return self.last.children_ticks - (self.first.children_ticks if self.at_start else 0)


def kinds_of(processes: Mapping[int, Tracked], root: int | None = None) -> dict[int, str]:
    """The kind of every process: by its ``comm``, a SuperExec by whom it serves (its parent);
    ``root`` is the watching process (kind ``benchmark``)."""
    kinds: dict[int, str] = {root: "benchmark"} if root is not None and root in processes else {}

    def kind(pid: int) -> str:
        if pid not in kinds:
            found = COMM_KINDS.get(processes[pid].last.comm, "other")
            if found == "superexec":
                parent = processes[pid].last.ppid
                above = kind(parent) if parent in processes else "other"
                found = "superexec-server" if above == "superlink" else "superexec-node"
            kinds[pid] = found
        return kinds[pid]

    for pid in processes:
        kind(pid)
    return kinds


def cpu_seconds_by(
    processes: Mapping[int, Tracked],
    groups: Mapping[int, str],
    ticks_per_second: float,
    *,
    subtrees: bool = False,
) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds of each group of processes within the window, and the part of it that only
    the parents' reaped-children times show.

    Each process counts its own ticks at its last reading. A process reaped within the window
    may have run after its last reading (at most one interval); its parent's
    ``cutime + cstime`` holds its exact total, so the parent's reaped ticks minus the last
    readings of the children seen to end are added to those children's group. When no ended
    child of that parent was seen (every child lived less than an interval) they go to the
    parent's own group if the groups are ``subtrees`` (a child is in its parent's group, as a
    node's processes are), else to ``unseen``.
    """
    seconds: dict[str, float] = {}
    recovered: dict[str, float] = {}
    for pid, process in processes.items():
        seconds[groups[pid]] = seconds.get(groups[pid], 0.0) + process.own_ticks / ticks_per_second
    for pid, parent in processes.items():
        children = [c for c, p in processes.items() if p.last.ppid == pid and p.ended]
        seen = sum(processes[c].own_ticks + processes[c].reaped_ticks for c in children)
        missed = parent.reaped_ticks - seen
        if missed <= 0:
            continue  # a child's last reading came after its parent's: nothing was missed
        group = groups[pid] if subtrees else "unseen"
        group = Counter(groups[c] for c in children).most_common(1)[0][0] if children else group
        seconds[group] = seconds.get(group, 0.0) + missed / ticks_per_second
        recovered[group] = recovered.get(group, 0.0) + missed / ticks_per_second
    return seconds, recovered


class ProcessWatch:
    """A process (``root``) and every process below it, sampled from ``/proc``.

    :meth:`sample` reads the stat of each known process (parents before children: a child
    reaped during the sample is then in its parent's reaped times, or read by itself), finds new
    ones by their parent, and returns the memory now of each group in ``groups`` (a process the
    deployment started, e.g. a SuperNode, with its label), for :class:`PeakSampler`.
    """

    def __init__(
        self, root: int, groups: Mapping[int, str] | None = None, pss_every: float = 1.0
    ) -> None:
        self.root = root
        self.groups = dict(groups or {})
        #: Seconds between two readings of every process's PSS (``inf``: none, the cheaper).
        self.pss_every = pss_every
        self.processes: dict[int, Tracked] = {}
        self.foreign: set[int] = set()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.pss_read = 0.0
        self.samples = 0

    def open_window(self) -> None:
        """Count from now: the processes alive now count their times from this reading."""
        self.processes, self.foreign, self.samples = {}, set(), 0
        self.sample()
        for process in self.processes.values():
            process.at_start = True

    def _depth(self, pid: int) -> int:
        depth = 0
        while pid in self.processes and pid != self.root and depth < 64:
            pid, depth = self.processes[pid].last.ppid, depth + 1
        return depth

    def sample(self) -> dict[str, float]:
        """One reading of every process; each group's memory now (:meth:`group_memory`)."""
        self.samples += 1
        for pid in sorted(self.processes, key=self._depth):
            process = self.processes[pid]
            if process.ended:
                continue
            stat = read_stat(pid)
            if stat is None or stat.start_ticks != process.first.start_ticks:
                process.ended = True  # reaped (a new process under an old pid is another)
                continue
            if stat.comm != process.last.comm:  # it exec'd: its parent's pages are gone
                process.peak_rss_pages = 0
            process.last = stat
            process.peak_rss_pages = max(process.peak_rss_pages, stat.rss_pages)
        listed = {int(name) for name in os.listdir("/proc") if name.isdigit()}
        self.foreign &= listed  # a pid that went away may come back as one of ours
        fresh = sorted(listed - self.foreign - self.processes.keys())
        found = True
        while found:  # a child may be listed before its parent
            found = False
            for pid in fresh:
                if pid in self.processes:
                    continue
                stat = read_stat(pid)
                if stat is not None and (pid == self.root or stat.ppid in self.processes):
                    self.processes[pid] = Tracked(stat, stat, False, stat.rss_pages)
                    found = True
        # Not below the root: read once, not again while the pid stays taken. A process forked
        # by ours is ours from its birth (its parent is known before it is listed).
        self.foreign |= {pid for pid in fresh if pid not in self.processes}
        return self.group_memory()

    def group_of(self, pid: int) -> str | None:
        """The label of the group a process runs under (itself or an ancestor in ``groups``)."""
        while pid in self.processes and pid != self.root:
            if pid in self.groups:
                return self.groups[pid]
            pid = self.processes[pid].last.ppid
        return None

    def group_memory(self) -> dict[str, float]:
        """Memory now of each group with its live processes: resident bytes (``rss-<label>``)
        and, at most every ``pss_every`` seconds, proportional bytes (``pss-<label>``, Linux
        ``Pss``: a page shared by k processes counts 1/k to each). A forked ClientApp shares most
        of its pages with the warm parent, which RSS counts twice and PSS once."""
        memory: dict[str, float] = {}
        read_pss = time.monotonic() - self.pss_read >= self.pss_every
        for pid, process in self.processes.items():
            group = self.group_of(pid)
            if group is None or process.ended:
                continue
            rss = process.last.rss_pages * self.page
            memory[f"rss-{group}"] = memory.get(f"rss-{group}", 0.0) + rss
            if read_pss:
                memory[f"pss-{group}"] = memory.get(f"pss-{group}", 0.0) + pss_bytes(pid)
        if read_pss:
            self.pss_read = time.monotonic()
        return memory


class PeakSampler:
    """Samples ``measure()`` (named figures) on a thread every ``interval`` s; keeps each peak.

    ``peaks`` holds the largest value of each figure since the start; :meth:`mark` closes a
    phase and returns each figure's largest value since the previous mark. Use it as a context
    manager (sampling stops, with a last sample, when the block is left).
    """

    def __init__(self, measure: Callable[[], Mapping[str, float]], interval: float) -> None:
        self.measure, self.interval = measure, interval
        self.peaks: dict[str, float] = dict(measure())
        self._phase = dict(self.peaks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for name, value in self.measure().items():
            self.peaks[name] = max(self.peaks.get(name, value), value)
            self._phase[name] = max(self._phase.get(name, value), value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def mark(self) -> dict[str, float]:
        """The largest value of each figure since the previous mark (or the start)."""
        self._sample()
        phase, self._phase = self._phase, dict(self.measure())
        return phase

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def peak_rss_sampler(pids: Callable[[], list[int]], interval: float = 0.2) -> PeakSampler:
    """A :class:`PeakSampler` of ``rss``: the largest peak RSS (``VmHWM``) of the processes
    ``pids()`` returns, sampled every ``interval`` s (e.g. ``LocalDeployment.serverapp_pids``:
    the ServerApps of a deployment, which start and end with each run)."""
    return PeakSampler(
        lambda: {"rss": float(max((status_bytes("VmHWM", pid) for pid in pids()), default=0))},
        interval,
    )


class FleetRelay:
    """A TCP relay to ``target`` that counts the bytes each way: put between one SuperNode and
    the Fleet API (the SuperNode's ``--superlink`` is :attr:`address`), it measures what that
    node sends and receives, polling and TLS records included.

    Every connection made to :attr:`address` is relayed to ``target`` on two threads; a
    subclass may look at the bytes (:meth:`relayed`), as the deployment tests do.

    Parameters
    ----------
    target : tuple of (str, int)
        The Fleet API's host and port.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._sent = self._received = 0
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"fleet-relay-{self.port}", daemon=True).start()

    @property
    def address(self) -> str:
        """Where the SuperNode connects instead of the Fleet API."""
        return f"127.0.0.1:{self.port}"

    def counts(self) -> tuple[int, int]:
        """Bytes sent towards the Fleet API and received from it so far."""
        with self._lock:
            return self._sent, self._received

    def relayed(self, chunk: bytes, uploading: bool, first: bool) -> None:
        """Called (under the relay's lock) with each chunk: ``uploading`` towards the Fleet API,
        ``first`` the connection's first chunk that way. Here: nothing beyond the counts."""

    def close(self) -> None:
        """Stop relaying: close the listener and every relayed connection."""
        self._closed = True
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target, timeout=10.0)
            except OSError:
                if self._closed:
                    return
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, uploading: bool) -> None:
        first = True
        try:
            while chunk := source.recv(1 << 16):
                with self._lock:
                    if uploading:
                        self._sent += len(chunk)
                    else:
                        self._received += len(chunk)
                    self.relayed(chunk, uploading, first)
                sink.sendall(chunk)
                first = False
        except OSError:
            pass
        finally:  # one side closed: close the other, so that its peer sees the end too
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class ResourceWatch:
    """Every process below this one, grouped by ``groups`` (a started process: its label) and
    sampled every ``interval`` s on a thread from now until :meth:`stop`; with ``relays`` (a
    group's label: the :class:`FleetRelay` its SuperNode connects through), also the Fleet API
    bytes of those groups from now on."""

    def __init__(
        self,
        groups: Mapping[int, str],
        interval: float,
        relays: Mapping[str, FleetRelay] | None = None,
    ) -> None:
        self.watch = ProcessWatch(os.getpid(), groups)
        self.watch.open_window()
        self.relays = dict(relays or {})
        self.relayed_before = {label: relay.counts() for label, relay in self.relays.items()}
        self.started = time.monotonic()
        self.sampler = PeakSampler(self.watch.sample, interval).__enter__()

    def stop(self) -> dict[str, dict[str, float | int]]:
        """Stop sampling; each group's processes seen, CPU seconds, peak RSS and PSS (MiB) and,
        for a group with a relay, the kB its node sent to and received from the Fleet API."""
        self.sampler.__exit__(None, None, None)
        watch, peaks = self.watch, self.sampler.peaks
        groups = {pid: watch.group_of(pid) or "other" for pid in watch.processes}
        ticks = float(os.sysconf("SC_CLK_TCK"))
        seconds, _ = cpu_seconds_by(watch.processes, groups, ticks, subtrees=True)
        usage: dict[str, dict[str, float | int]] = {
            label: {
                "processes": sum(group == label for group in groups.values()),
                "cpu-seconds": round(seconds.get(label, 0.0), 2),
                "peak-rss-mib": round(peaks.get(f"rss-{label}", 0.0) / MIB, 1),
                "peak-pss-mib": round(peaks.get(f"pss-{label}", 0.0) / MIB, 1),
            }
            for label in dict.fromkeys(watch.groups.values())
        }
        for label, relay in self.relays.items():
            (sent, received), before = relay.counts(), self.relayed_before[label]
            usage[label]["fleet-sent-kb"] = round((sent - before[0]) / 1e3, 1)
            usage[label]["fleet-received-kb"] = round((received - before[1]) / 1e3, 1)
        return usage


def resource_lines(usage: Mapping[str, Mapping[str, float | int]], seconds: float) -> list[str]:
    """What ``ba-deploy local --resources`` prints when it stops: a line per group (a node's with
    its Fleet API kB sent and received, where they were counted)."""
    lines = [f"ba-deploy: resources over {seconds:.0f} s (CPU seconds; peak memory, MiB):"]
    width = max(len(label) for label in usage)
    for label, figures in usage.items():
        line = (
            f"  {label:<{width}}  CPU {figures['cpu-seconds']:8.2f} s  "
            f"RSS {figures['peak-rss-mib']:7.1f}  PSS {figures['peak-pss-mib']:7.1f}  "
            f"({figures['processes']} processes)"
        )
        if "fleet-sent-kb" in figures:
            line += (
                f"  Fleet API: sent {figures['fleet-sent-kb']:,.0f} kB, "
                f"received {figures['fleet-received-kb']:,.0f} kB"
            )
        lines.append(line)
    return lines
