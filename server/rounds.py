"""The round loop of a run: Flower's ``Strategy.start``, able to start at any round.

Flower's loop always starts at round 1 and waits an hour for replies. A resumed run must start
after its checkpoint's round, and a run should not wait longer than ``round-timeout`` for a node
that hangs; this loop is Flower's (the same calls, in the same order) with

- ``first_round``: the round to start with (``checkpoint round + 1`` on a resume);
- ``timeout``: the bound of each ``send_and_receive``; replies that miss it are never read and
  are counted as ``dropped-timeout`` (the instructions sent minus the replies received);
- ``on_round_end``: called after every round with the global arrays and what the round did, where
  the ServerApp evaluates, records and checkpoints;
- a line every :data:`WAIT_NOTICE_SECONDS` while a round waits for replies, naming the nodes
  it still waits for and what may keep them (:func:`waiting_notice`): a round that waits on nodes
  that never answer (a simulation whose Ray never started) says so instead of waiting in silence.
  The nodes are those whose replies are still due where the Grid says so (a
  :class:`server.pull.PollingGrid`, the deployment's and the simulation's), else every node sent
  to; the line after the wait names the nodes whose replies missed the timeout.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from .pull import polling_grid


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did, for the ServerApp's bookkeeping."""

    server_round: int
    #: The new global model aggregated (False: the strategy kept the previous one).
    aggregated: bool
    train_sent: int
    train_received: int
    #: Federated evaluation metrics of the round (empty without federated evaluation).
    evaluate_metrics: dict[str, float] = field(default_factory=dict)
    #: Pulls of replies the round made (train and evaluate), where the Grid counts them (a
    #: :class:`server.pull.PollingGrid`); None where it does not.
    pulls: int | None = None

    @property
    def train_late(self) -> int:
        """Train instructions whose reply did not arrive within the round timeout."""
        return self.train_sent - self.train_received


RoundHook = Callable[[ArrayRecord, RoundOutcome], None]

#: Seconds a round waits for replies before it says what it waits for (and again every as many).
WAIT_NOTICE_SECONDS = 60.0
#: Node ids a waiting line names before it says how many more.
NODES_NAMED = 10


def nodes_text(nodes: Iterable[int]) -> str:
    """Node ids for a log line: the first :data:`NODES_NAMED`, then how many more."""
    ids = sorted(set(nodes))
    shown = ", ".join(map(str, ids[:NODES_NAMED]))
    return shown + (f" and {len(ids) - NODES_NAMED} more" if len(ids) > NODES_NAMED else "")


def awaited_nodes(grid: Grid, sent: Iterable[int]) -> Callable[[], list[int]]:
    """What tells, during a ``send_and_receive`` of ``grid``, the nodes whose replies are still
    due: the Grid itself where it keeps them, else every node of ``sent``."""
    sent = list(sent)
    polling = polling_grid(grid)
    if polling is not None:
        return lambda: sent if (due := polling.awaited()) is None else due
    return lambda: sent


def missing_nodes(sent: Iterable[int], replies: Iterable[Message]) -> list[int]:
    """The nodes of ``sent`` that no reply came from (each node once per reply it sent)."""
    answered = Counter(reply.metadata.src_node_id for reply in replies)
    missing = []
    for node in sent:
        if answered[node]:
            answered[node] -= 1
        else:
            missing.append(node)
    return missing


@contextmanager
def waiting_notice(
    server_round: int, kind: str, nodes: Callable[[], Iterable[int]], timeout: float
) -> Iterator[None]:
    """While inside (a ``send_and_receive``), log every :data:`WAIT_NOTICE_SECONDS` what the
    round waits for: the replies of which nodes (``nodes()``, asked at each line), for how long,
    and what keeps nodes silent; at INFO, at WARNING once half of ``timeout`` has passed."""
    done = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        while not done.wait(WAIT_NOTICE_SECONDS):
            due = list(nodes())
            waited = time.monotonic() - started
            # A long honest round is not a problem (INFO); one past half its timeout is about
            # to lose replies (WARNING).
            log(
                WARNING if waited >= timeout / 2 else INFO,
                "round %d: waiting %.0f s for the %s replies of %d node(s) (%s); replies "
                "that miss round-timeout = %g s are dropped. Nodes that never answer: in "
                "Flower's simulation their ClientApps run on Ray (a Ray that did not start, "
                "or a cluster that is gone); in a deployment, SuperNodes that are not "
                "connected (`flwr ls`) or still training",
                server_round,
                waited,
                kind,
                len(due),
                nodes_text(due),
                timeout,
            )

    watcher = threading.Thread(target=watch, name=f"round-{server_round}-wait", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def run_rounds(
    strategy: Strategy,
    grid: Grid,
    arrays: ArrayRecord,
    *,
    first_round: int,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_config: ConfigRecord,
    on_round_end: RoundHook,
) -> ArrayRecord:
    """Run rounds ``first_round..num_rounds``; return the last global arrays.

    Parameters
    ----------
    strategy : Strategy
        Any Flower message-API strategy.
    grid : Grid
        Where instructions go and replies come from.
    arrays : ArrayRecord
        The global model before ``first_round``.
    first_round, num_rounds : int
        The first and the last round to run (none when ``first_round > num_rounds``).
    timeout : float
        Seconds each ``send_and_receive`` waits for replies.
    train_config, evaluate_config : ConfigRecord
        Sent with every train / evaluate instruction (the strategy adds its own entries).
    on_round_end : RoundHook
        Called after each round with the global arrays and the round's :class:`RoundOutcome`.
    """
    polling = polling_grid(grid)
    for server_round in range(first_round, num_rounds + 1):
        pulls_before = None if polling is None else polling.pulls
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
        instructions = list(strategy.configure_train(server_round, arrays, train_config, grid))
        destinations = [m.metadata.dst_node_id for m in instructions]
        with waiting_notice(server_round, "train", awaited_nodes(grid, destinations), timeout):
            replies = list(grid.send_and_receive(instructions, timeout=timeout))
        received = len(replies)
        if received < len(instructions):
            log(
                INFO,
                "round %d: %d of %d train replies missed the %.0f s round timeout (dropped): "
                "node(s) %s",
                server_round,
                len(instructions) - received,
                len(instructions),
                timeout,
                nodes_text(missing_nodes(destinations, replies)) or "unknown",
            )
        new_arrays, _ = strategy.aggregate_train(server_round, replies)
        del replies  # the replies' buffers are not held through evaluation
        if new_arrays is not None:
            arrays = new_arrays
        evaluate_instructions = list(
            strategy.configure_evaluate(server_round, arrays, evaluate_config, grid)
        )
        evaluate_metrics: MetricRecord | None = None
        if evaluate_instructions:
            destinations = [m.metadata.dst_node_id for m in evaluate_instructions]
            awaited = awaited_nodes(grid, destinations)
            with waiting_notice(server_round, "evaluate", awaited, timeout):
                evaluate_replies = list(
                    grid.send_and_receive(evaluate_instructions, timeout=timeout)
                )
            evaluate_metrics = strategy.aggregate_evaluate(server_round, evaluate_replies)
        pulls = None
        if polling is not None and pulls_before is not None:
            pulls = polling.pulls - pulls_before
        on_round_end(
            arrays,
            RoundOutcome(
                server_round=server_round,
                aggregated=new_arrays is not None,
                train_sent=len(instructions),
                train_received=received,
                evaluate_metrics={
                    key: float(value)
                    for key, value in (evaluate_metrics or {}).items()
                    if isinstance(value, int | float)
                },
                pulls=pulls,
            ),
        )
    return arrays
