"""In-process runtime: the real ServerApp and ClientApp in one Python process, no Ray, no SuperLink.

:class:`InProcessGrid` is a Flower ``Grid`` that hands every instruction straight to the
ClientApp of its node, in this process, with one Flower ``Context`` per node (``node_config``
holds ``partition-id`` and ``num-partitions``, as a simulation or a SuperNode started with
``--node-config`` gives it; ``context.state`` persists across rounds as a SuperNode keeps it).
A node costs nothing until it is sent a message: its Context is made then, and kept after its
reply only when its ``state`` holds something (Elastic's sensitivity average), so a population of
1,000,000 nodes holds the Contexts of the nodes being served and of those with state, no more.
A ClientApp that raises is answered with an error reply, as Flower's simulation answers it, so
strategies see the same failures. :func:`run_inprocess` runs the app's real ServerApp
``main`` with that Grid: the app's components and run configuration are read from its
``pyproject.toml`` and loaded by their component strings, as ``flwr run`` does, so this module
never imports the ClientApp's package itself.

What is left out, and so what this runtime costs nothing for: Ray's start (tens of seconds on a
small machine), message serialisation, the SuperLink's state and polling. What it does not give:
clients in parallel processes (one message at a time, so one core's worth of client work unless
torch's own threads or a GPU are busy), a round timeout (a client cannot be abandoned half-way),
or isolation of a crashing ClientApp process.

With run-config ``client-backend = "vectorized"`` the Grid hands each round's train messages,
all at once, to the cohort trainer at :data:`VECTORIZED_COHORT` (all sampled clients trained as
one batched program); every other message still goes to the ClientApp.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import ERROR
from pathlib import Path
from typing import Any, cast

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.app.user_config import UserConfig
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.config import get_fused_config_from_dir, get_project_config
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.server_app import LoadServerAppError
from flwr.supercore import log
from flwr.supercore.object_ref import load_app
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.server.runs.checkpoint import record_dict_from_plain, record_dict_to_plain

#: Run-config key choosing who trains a round's cohort in this runtime.
CLIENT_BACKEND_KEY = "client-backend"
#: Backends: each message to the ClientApp, or a round's train messages to the cohort trainer.
CLIENT_BACKENDS = ("clientapp", "vectorized")
#: Component string of the vectorized cohort trainer (client/vectorized.py).
VECTORIZED_COHORT = "beyond_averaging.client.vectorized:train_cohort"
#: Node ids are this offset plus the partition id, so their sorted order is the partition order.
FIRST_NODE_ID = 1_000
#: Run id of in-process runs (there is one run per Grid).
RUN_ID = 1

#: ``train_cohort(messages, contexts) -> replies``, one reply per message, in order.
CohortTrainer = Callable[[Sequence[Message], Sequence[Context]], list[Message]]


def node_context(partition_id: int, num_partitions: int, run_config: UserConfig) -> Context:
    """The Context of the node that holds ``partition_id``, as Flower's simulation builds it."""
    return Context(
        run_id=RUN_ID,
        node_id=FIRST_NODE_ID + partition_id,
        node_config={"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config=dict(run_config),
    )


class InProcessGrid(Grid):
    """A Flower Grid whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Federation size; node ``FIRST_NODE_ID + i`` holds partition ``i`` of ``num_nodes``. No
        memory is spent per node until a node is sent a message (see :meth:`context`).
    run_config : UserConfig
        The run's configuration (every node's ``context.run_config``). Its ``client-backend``
        (default ``"clientapp"``) picks who trains a round's train messages.
    cohort_trainer : CohortTrainer, optional
        Used for train messages when ``client-backend`` is ``"vectorized"``; loaded from
        :data:`VECTORIZED_COHORT` when not given.

    Raises
    ------
    ValueError
        ``num_nodes < 1`` or an unknown ``client-backend``.
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: UserConfig,
        *,
        cohort_trainer: CohortTrainer | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes = {num_nodes}: a federation needs at least one node")
        backend = str(run_config.get(CLIENT_BACKEND_KEY, "clientapp"))
        if backend not in CLIENT_BACKENDS:
            raise ValueError(
                f"{CLIENT_BACKEND_KEY} = {backend!r} is not allowed: choose one of "
                f"{', '.join(CLIENT_BACKENDS)}"
            )
        if backend == "vectorized" and cohort_trainer is None:
            cohort_trainer = cast(CohortTrainer, load_app(VECTORIZED_COHORT, LoadClientAppError))
        self.client_app = client_app
        self.cohort_trainer = cohort_trainer if backend == "vectorized" else None
        self.num_nodes = num_nodes
        self.run_config = dict(run_config)
        #: The Contexts that exist: nodes being served, and nodes whose ``state`` holds something.
        self.contexts: dict[int, Context] = {}
        self._run = Run.create_empty(RUN_ID)
        self._replies: dict[str, Message] = {}

    # --- the Grid API ----------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        """Adopt ``run`` (its id goes into every instruction's metadata)."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this Grid serves."""
        return self._run

    # --- nodes and their client-side state ---------------------------------------------------
    def node_ids(self) -> range:
        """Every node of the federation, ascending (a ``range``: no list of a million ids)."""
        return range(FIRST_NODE_ID, FIRST_NODE_ID + self.num_nodes)

    def context(self, node: int) -> Context:
        """Node ``node``'s Context: the one it keeps, or a fresh one (then kept until the node's
        message is answered, and after that only if its ``state`` holds something).

        Raises
        ------
        ValueError
            ``node`` is not in this federation.
        """
        context = self.contexts.get(node)
        if context is None:
            if node not in self.node_ids():
                raise ValueError(
                    f"node {node}, which is not in this federation (nodes {FIRST_NODE_ID}.."
                    f"{FIRST_NODE_ID + self.num_nodes - 1})"
                )
            context = node_context(node - FIRST_NODE_ID, self.num_nodes, self.run_config)
            self.contexts[node] = context
        return context

    def _release(self, node: int) -> None:
        """Forget a node's Context once answered, unless its state holds something."""
        context = self.contexts.get(node)
        if context is not None and not context.state:
            del self.contexts[node]

    def node_states(self) -> dict[str, Any]:
        """Every node's non-empty ``context.state`` as plain data, keyed by node id (as text)."""
        return {
            str(node): record_dict_to_plain(context.state)
            for node, context in self.contexts.items()
            if context.state
        }

    def load_node_states(self, states: Mapping[str, Any]) -> None:
        """Give the nodes the ``context.state`` of :meth:`node_states` (a resumed run).

        Raises
        ------
        ValueError
            A node id that is not in this federation (the checkpoint is of another one).
        """
        for node, plain in states.items():
            try:
                context = self.context(int(node))
            except ValueError as error:
                raise ValueError(f"the checkpoint holds the state of {error}") from None
            context.state = record_dict_from_plain(plain)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """An instruction (Flower deprecates this method in favour of ``Message(...)``)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Every node of the federation (all are always connected), as :meth:`node_ids`."""
        return self.node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver every message now; the replies wait for :meth:`pull_messages`."""
        delivered = [self._deliver(message) for message in messages]
        for message, reply in zip(delivered, self._answer(delivered), strict=True):
            self._replies[message.metadata.message_id] = reply
        return [message.metadata.message_id for message in delivered]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that are waiting (each handed out once)."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Deliver ``messages`` and return their replies, in the order of ``messages``.

        ``timeout`` is accepted for the Grid API and has no effect: every client runs to its end
        in this process before the call returns.
        """
        return list(self.pull_messages(list(self.push_messages(messages))))

    # --- delivery --------------------------------------------------------------------------
    def _deliver(self, message: Message) -> Message:
        """Fill in what the SuperLink fills in: message id, run id, source, creation time."""
        node = message.metadata.dst_node_id
        if node not in self.node_ids():
            raise ValueError(
                f"message to node {node}, which is not in this federation (nodes "
                f"{FIRST_NODE_ID}..{FIRST_NODE_ID + self.num_nodes - 1})"
            )
        metadata = message.metadata
        metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as Flower's InMemoryGrid does
        metadata.__dict__["_run_id"] = self._run.run_id
        metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
        if not metadata.created_at:
            metadata.created_at = time.time()
        return message

    def _answer(self, messages: Sequence[Message]) -> list[Message]:
        """Replies in the order of ``messages``: train messages to the cohort trainer when one
        is set, everything else to the ClientApp one message at a time."""
        replies: list[Message | None] = [None] * len(messages)
        cohort = [
            i
            for i, message in enumerate(messages)
            if self.cohort_trainer is not None
            and message.metadata.message_type == MessageType.TRAIN
        ]
        if cohort and self.cohort_trainer is not None:
            cohort_messages = [messages[i] for i in cohort]
            contexts = [self.context(m.metadata.dst_node_id) for m in cohort_messages]
            answers = self.cohort_trainer(cohort_messages, contexts)
            for message in cohort_messages:
                self._release(message.metadata.dst_node_id)
            if len(answers) != len(cohort):
                raise RuntimeError(
                    f"the cohort trainer answered {len(answers)} of {len(cohort)} messages"
                )
            for i, answer in zip(cohort, answers, strict=True):
                replies[i] = self._stamped(answer)
        for i, message in enumerate(messages):
            if replies[i] is None:
                replies[i] = self._stamped(self._call_client(message))
        return [reply for reply in replies if reply is not None]

    def _call_client(self, message: Message) -> Message:
        context = self.context(message.metadata.dst_node_id)
        try:
            return self.client_app(message, context)
        except Exception as error:  # as Flower's simulation: an error reply, not a crash
            reason = f"{type(error)}:<'{error}'>"
            log(ERROR, "ClientApp of node %d raised %s", context.node_id, reason)
            return Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                reply_to=message,
            )
        finally:
            self._release(context.node_id)

    @staticmethod
    def _stamped(reply: Message) -> Message:
        if not reply.metadata.message_id:
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        return reply


# --- the run ------------------------------------------------------------------------------
def app_components(app_dir: Path) -> dict[str, str]:
    """``[tool.flwr.app.components]`` of the app at ``app_dir`` (serverapp, clientapp)."""
    try:
        components = get_project_config(app_dir)["tool"]["flwr"]["app"]["components"]
    except KeyError:
        raise ValueError(
            f"{app_dir / 'pyproject.toml'} has no [tool.flwr.app.components] table"
        ) from None
    return {str(key): str(value) for key, value in components.items()}


def run_inprocess(
    app_dir: Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    num_nodes: int | None = None,
    cohort_trainer: CohortTrainer | None = None,
) -> Context:
    """Run the Flower app at ``app_dir`` in this process: its ServerApp with an InProcessGrid.

    Parameters
    ----------
    app_dir : Path
        Folder of the app's ``pyproject.toml`` (this repository for ``ba-run``).
    overrides : Mapping, optional
        Run-config overrides, fused into ``[tool.flwr.app.config]`` as ``flwr run --run-config``
        fuses them (an unknown key is an error).
    num_nodes : int, optional
        Federation size; defaults to the run config's ``num-clients`` (what ``ba-run`` gives the
        simulation as ``num-supernodes``).
    cohort_trainer : CohortTrainer, optional
        Replaces the one loaded for ``client-backend = "vectorized"`` (tests).

    Returns
    -------
    Context
        The ServerApp's context after the run.

    Raises
    ------
    ValueError
        An unknown override key, a missing component table or a bad federation size; whatever
        the ServerApp raises propagates unchanged.
    """
    app_dir = Path(app_dir).resolve()
    components = app_components(app_dir)
    run_config = get_fused_config_from_dir(app_dir, dict(overrides or {}))
    server_app = cast(ServerApp, load_app(components["serverapp"], LoadServerAppError, app_dir))
    client_app = cast(ClientApp, load_app(components["clientapp"], LoadClientAppError, app_dir))
    if num_nodes is None:
        clients = run_config.get("num-clients")
        if not isinstance(clients, int):
            raise ValueError(f"num-clients = {clients!r}: pass num_nodes or an integer num-clients")
        num_nodes = clients
    grid = InProcessGrid(client_app, num_nodes, run_config, cohort_trainer=cohort_trainer)
    # What a ServerApp process learns from the SuperLink before `main` runs.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SUPERLINK_NODE_ID, 1
    context = Context(
        run_id=RUN_ID,
        node_id=SUPERLINK_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=run_config,
    )
    server_app(grid, context)
    return context
