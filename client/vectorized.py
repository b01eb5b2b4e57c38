"""Vectorized cohort training: every sampled client of a round trains in one batched program.

The in-process runtime (``client-backend = "vectorized"``) hands all TRAIN messages of a round to
:func:`train_cohort` instead of calling the ClientApp once per node. The clients' parameters are
stacked along a leading client axis and one forward/backward pass per local step serves the whole
cohort (:func:`torch.func.vmap` over :func:`torch.func.functional_call`). The replies are the
ClientApp's, record for record, so every strategy runs unchanged.

What makes it the same arithmetic as the ClientApp's sequential loop
(:func:`tasks.training.train_local`):

- **Batches**: each client's steps come from :func:`tasks.batching.shuffled_batches` with the
  ClientApp's shuffle seed, so client ``i`` sees the same samples in the same order.
- **Unequal data sizes**: clients are ordered by their number of steps, longest first; at step
  ``s`` the clients that still have a batch are a prefix of that order, so the step runs on views
  ``parameters[:k]`` and the others are simply left alone (no wasted compute, no masks on the
  update). A partial last batch of an epoch is padded to the batch size; its loss is the mean over
  its real samples (padding weighs 0), as the sequential loop's ``CrossEntropyLoss`` takes it.
- **Optimiser**: ``torch.optim.SGD``'s update written out on the stacked tensors: weight decay
  added to the gradient, momentum buffer ``b <- m b + g`` (the first step's ``b = g`` is that with
  ``b = 0``), ``w <- w - lr b``; the round's learning rate is the ClientApp's
  (``ClientTask.round_learning_rate``). FedProx adds ``mu (w - w_received)`` to the gradient.
- **Records**: FedGMA's ``gradient`` is each client's gradient at its own last step (before that
  step's update, weight decay excluded, proximal term included, as ``train_local`` keeps it).
  Elastic's ``sensitivity`` is :mod:`client.sensitivity`'s math over the first epoch's batches on
  the received model, with the moving average kept in each node's ``Context.state``.

Memory (``benchmarks/systems.py --cohort-memory`` accounts for it): besides the cohort's data, a
pass holds its clients' stacked parameters, SGD's momentum buffer (when momentum is on) and one
step's gradients, each freed once its layer is updated, plus one step's batch and activations. The
replies are copied out layer by layer, each stacked layer freed once copied. The run option
``vectorized-clients-per-pass`` trains the cohort in passes of fewer clients, so only one pass's
training state is alive.

Refused (a :class:`ValueError` naming the model and the fix, before any training): models with
BatchNorm or other buffers (their running statistics would have to be tracked per client) and
models with dropout (per-client random streams cannot reproduce the sequential loop's draws).
Use ``client-backend = "clientapp"`` for those.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log
from torch import nn

from beyond_averaging.tasks.batching import shuffle_seed, shuffled_batches
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import resolve_device
from beyond_averaging.tasks.federation import DataSpec, load_client_partition
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CLIENT_RECORD,
    CONFIG_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SENSITIVITY_DECAY_KEY,
    SENSITIVITY_DTYPE_KEY,
    SENSITIVITY_RECORD,
    SERVER_ROUND_KEY,
    TRAIN_LOSS_KEY,
    ClientTask,
    requested_records,
)

from .app import SUPPORTED_RECORDS, node_partition
from .sensitivity import DEFAULT_DECAY, STATE_KEY, mismatch, to_upload

Stacked = dict[str, torch.Tensor]
"""Per-client tensors stacked on a leading client axis, keyed like ``named_parameters``."""

CLIENTS_PER_PASS_KEY = "vectorized-clients-per-pass"
"""Run option: clients trained at once (0: the whole cohort); see :func:`train_cohort`."""


# --------------------------------------------------------------------------------------------
# What the backend refuses
# --------------------------------------------------------------------------------------------


def refusal(model: nn.Module, name: str) -> str:
    """Why the vectorized backend cannot train ``model`` ("" when it can).

    Parameters
    ----------
    model : torch.nn.Module
        The model the clients would train.
    name : str
        Its name in the run configuration, quoted in the message.
    """
    fix = f"run model {name!r} with client-backend = 'clientapp', or pick a model without it"
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return (
                f"model {name!r} has {type(module).__name__} ({module_name!r}), whose running "
                f"statistics the vectorized backend does not track per client: {fix}"
            )
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return (
                f"model {name!r} has {type(module).__name__} ({module_name!r}); per-client "
                f"dropout draws cannot reproduce the ClientApp's random stream: {fix}"
            )
    buffers = [buffer_name for buffer_name, _ in model.named_buffers()]
    if buffers:
        return (
            f"model {name!r} has buffers {buffers[:3]}, which training may update per client: {fix}"
        )
    return ""


# --------------------------------------------------------------------------------------------
# The math: step plan, masked SGD on stacked parameters, sensitivity pass
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """Which samples every client uses at every local step.

    Clients are ordered by their number of steps, longest first, so the clients that still
    train at step ``s`` are the first ``active[s]``. Only their rows are stored (step after
    step), not a ``(steps, clients, batch)`` block: with unequal clients most of such a block
    would be padding for clients that have finished.

    Attributes
    ----------
    indices : torch.Tensor
        int32, ``(sum(active), batch_size)``: row indices into the cohort's data, the active
        clients of step 0, then of step 1, ...; ``-1`` pads a partial batch.
    active : tuple of int
        Number of clients (a prefix) with a batch at each step.
    """

    indices: torch.Tensor
    active: tuple[int, ...]

    @classmethod
    def from_batches(cls, batches: Sequence[Sequence[torch.Tensor]], batch_size: int) -> StepPlan:
        """Pad every client's list of batch index tensors into one plan.

        Parameters
        ----------
        batches : sequence of sequences of torch.Tensor
            ``batches[i][s]``: the data rows of client ``i``'s step ``s`` (at most
            ``batch_size``). Clients must come with non-increasing step counts.
        batch_size : int
            The padded width of a step.

        Raises
        ------
        ValueError
            Clients not ordered by step count, a batch wider than ``batch_size``, or a row
            index beyond int32.
        """
        counts = [len(steps) for steps in batches]
        if any(later > earlier for earlier, later in itertools.pairwise(counts)):
            raise ValueError(f"clients must be ordered by steps, longest first; got {counts}")
        num_steps = counts[0] if counts else 0
        active = tuple(sum(count > step for count in counts) for step in range(num_steps))
        indices = torch.full((sum(active), batch_size), -1, dtype=torch.int32)
        line = 0
        for step, clients in enumerate(active):
            for client in range(clients):
                rows = batches[client][step]
                if rows.numel() > batch_size:
                    raise ValueError(f"a batch of {rows.numel()} rows exceeds {batch_size}")
                if rows.numel() and int(rows.max()) > torch.iinfo(torch.int32).max:
                    raise ValueError(f"row {int(rows.max())} exceeds the int32 plan's range")
                indices[line, : rows.numel()] = rows
                line += 1
        return cls(indices, active)

    def steps(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Per step: the number of active clients ``k`` and their rows ``(k, batch_size)``."""
        start = 0
        for clients in self.active:
            yield clients, self.indices[start : start + clients]
            start += clients

    def to(self, device: torch.device) -> StepPlan:
        """The plan with its indices on ``device``."""
        return StepPlan(self.indices.to(device), self.active)


@dataclass(frozen=True)
class CohortTrainResult:
    """What :func:`train_stacked` reports per client (row ``i`` = client ``i`` of the plan).

    Attributes
    ----------
    loss_sums : torch.Tensor
        float64 ``(clients,)``: sum over steps of the batch's mean loss times its sample count.
    last_gradient : Stacked or None
        Each client's training-objective gradient at its own last step; None unless asked.
    """

    loss_sums: torch.Tensor
    last_gradient: Stacked | None


def _gather(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]`` shaped ``(k, B, ...)``; padding (``-1``) reads row 0."""
    flat = rows.clamp(min=0).flatten()
    return values.index_select(0, flat).view(*rows.shape, *values.shape[1:])


def _batch_mean(per_sample: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's mean of ``per_sample`` ``(k, B)`` over its real samples, and their count.

    Padding is excluded with ``where`` rather than a product, so a non-finite value computed
    on a padding row cannot reach the result.
    """
    valid = rows >= 0
    counts = valid.sum(dim=1)
    return torch.where(valid, per_sample, 0.0).sum(dim=1) / counts, counts


def _live(parameters: Stacked, clients: int) -> Stacked:
    """Leaves that autograd differentiates: views of the first ``clients`` rows."""
    return {
        name: value[:clients].detach().requires_grad_(True) for name, value in parameters.items()
    }


def _cohort_forward(model: nn.Module) -> Any:
    """``(stacked parameters, features (k, B, ...)) -> outputs (k, B, ...)``."""

    def one_client(parameters: Stacked, features: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = torch.func.functional_call(model, parameters, (features,))
        return output

    return torch.func.vmap(one_client)


def _step_gradients(
    forward: Any,
    parameters: Stacked,
    features: torch.Tensor,
    rows: torch.Tensor,
    per_sample_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One step's batch-mean losses ``(k,)``, real sample counts and parameter gradients.

    ``per_sample_loss(outputs (k, B, ...), rows (k, B)) -> (k, B)``. The leaves, the outputs and
    the graph die when this returns, so nothing of a step outlives its update but the gradients
    the caller consumes.
    """
    live = _live(parameters, rows.shape[0])
    with torch.enable_grad():
        outputs = forward(live, _gather(features, rows))
        losses, counts = _batch_mean(per_sample_loss(outputs, rows), rows)
        gradients = list(torch.autograd.grad(losses.sum(), list(live.values())))
    return losses.detach(), counts, gradients


def train_stacked(
    model: nn.Module,
    parameters: Stacked,
    features: torch.Tensor,
    labels: torch.Tensor,
    plan: StepPlan,
    *,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    proximal_mu: float = 0.0,
    anchor: Mapping[str, torch.Tensor] | None = None,
    keep_last_gradient: bool = False,
) -> CohortTrainResult:
    """Local SGD of every client of ``plan`` at once; updates ``parameters`` in place.

    Per client and step, the same arithmetic as :func:`tasks.training.train_local` with
    ``torch.optim.SGD(lr, momentum, weight_decay)`` and cross-entropy averaged over the batch's
    real samples.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture (its own parameters are not used); no buffers, no dropout.
    parameters : Stacked
        ``(clients, *shape)`` per parameter name, in the plan's client order; trained in place.
    features, labels : torch.Tensor
        The cohort's data; ``plan.indices`` index their rows.
    plan : StepPlan
        The steps, clients ordered longest first.
    learning_rate, momentum, weight_decay : float
        As ``torch.optim.SGD`` takes them (dampening 0, no Nesterov).
    proximal_mu : float
        FedProx's mu; the objective gains ``(mu / 2) ||w - anchor||^2``.
    anchor : Mapping[str, torch.Tensor], optional
        The received parameters, stacked ``(clients, ...)`` or one model's shape (shared by all);
        required when ``proximal_mu > 0``.
    keep_last_gradient : bool
        Keep each client's objective gradient at its last step.

    Returns
    -------
    CohortTrainResult
    """
    if proximal_mu > 0 and anchor is None:
        raise ValueError("proximal_mu > 0 needs the received parameters as anchor")
    clients = next(iter(parameters.values())).shape[0]
    forward = _cohort_forward(model)

    def cross_entropy(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        per_sample = nn.functional.cross_entropy(
            logits.flatten(0, 1), _gather(labels, rows).flatten(), reduction="none"
        )
        return per_sample.view(rows.shape)

    buffers = {name: torch.zeros_like(p) for name, p in parameters.items()} if momentum else {}
    last_gradient = (
        {name: torch.zeros_like(p) for name, p in parameters.items()}
        if keep_last_gradient
        else None
    )
    loss_sums = torch.zeros(clients, dtype=torch.float64, device=features.device)
    for k, rows in plan.steps():
        losses, counts, gradients = _step_gradients(
            forward, parameters, features, rows, cross_entropy
        )
        with torch.no_grad():
            loss_sums[:k] += losses.double() * counts
            # pop: each gradient is freed once its layer is updated, none outlives the step
            for name, value in parameters.items():
                gradient, weights = gradients.pop(0), value[:k]
                if proximal_mu > 0:
                    assert anchor is not None
                    reference = anchor[name]
                    reference = reference[:k] if reference.dim() == weights.dim() else reference
                    gradient.add_(weights - reference, alpha=proximal_mu)
                if last_gradient is not None:
                    last_gradient[name][:k] = gradient
                if weight_decay:  # in place: the gradient is ours, no second copy
                    gradient.add_(weights, alpha=weight_decay)
                if momentum:
                    gradient = buffers[name][:k].mul_(momentum).add_(gradient)
                weights.add_(gradient, alpha=-learning_rate)
                del gradient
    return CohortTrainResult(loss_sums, last_gradient)


def sensitivity_stacked(
    model: nn.Module,
    parameters: Stacked,
    features: torch.Tensor,
    plan: StepPlan,
    previous: Stacked,
    decay: float,
) -> Stacked:
    """Elastic's parameter sensitivity of every client at once (:mod:`client.sensitivity`).

    For each client and batch: loss = mean over the batch's real samples of ``||f(x)||^2``,
    then ``Omega <- decay * Omega + (1 - decay) * |d loss / d w|``.

    Parameters
    ----------
    parameters : Stacked
        The received models, ``(clients, ...)``; left unchanged.
    plan : StepPlan
        The batches of the pass (the first local epoch), clients ordered longest first.
    previous : Stacked
        float32 ``(clients, ...)`` moving averages to continue (zeros for a fresh start);
        updated in place and returned.
    decay : float
        Moving-average decay in [0, 1).
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"sensitivity decay = {decay}: allowed is [0, 1) (the paper uses 0.9)")
    forward = _cohort_forward(model)

    def squared_norm(outputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return outputs.pow(2).flatten(start_dim=2).sum(dim=2)

    for k, rows in plan.steps():
        _, _, gradients = _step_gradients(forward, parameters, features, rows, squared_norm)
        with torch.no_grad():
            for name in parameters:
                # abs_ in place: the gradient is ours, no second copy of it
                gradient = gradients.pop(0).abs_()
                previous[name][:k].mul_(decay).add_(gradient.float(), alpha=1.0 - decay)
                del gradient
    return previous


# --------------------------------------------------------------------------------------------
# Flower glue: messages in, the ClientApp's replies out
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _CohortData:
    """The cohort's partitions concatenated on the device, longest first.

    ``partitions[row]`` is the partition stored at ``row``; its samples are rows
    ``offsets[row] : offsets[row] + sizes[row]``.
    """

    key: tuple[Any, ...]
    features: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    partitions: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def message_order(self, partition_ids: Sequence[int]) -> tuple[int, ...]:
        """The position among the messages (whose partitions are ``partition_ids``) of each row."""
        positions: dict[int, list[int]] = {}
        for position, partition in enumerate(partition_ids):
            positions.setdefault(partition, []).append(position)
        return tuple(positions[partition].pop(0) for partition in self.partitions)


_last_cohort: list[_CohortData] = []  # one entry: the same cohort is sampled round after round


def _cohort_data(spec: DataSpec, partition_ids: Sequence[int], device: torch.device) -> _CohortData:
    """The cohort's data, reused while the same partitions train round after round.

    Keyed by the partitions as a set: a strategy samples the same cohort in another order each
    round, which must not rebuild (and copy) the whole cohort's data.
    """
    ids = tuple(sorted(partition_ids))
    key = (spec, ids, str(device))
    if _last_cohort and _last_cohort[0].key == key:
        return _last_cohort[0]
    _last_cohort.clear()  # free the previous cohort before building the next
    parts: list[LabeledData] = [load_client_partition(spec, pid) for pid in ids]
    empty = [pid for pid, part in zip(ids, parts, strict=True) if len(part.labels) == 0]
    if empty:
        raise ValueError(
            f"partitions {empty} hold no samples: a client cannot train on them; use fewer "
            "clients or another partition scheme"
        )
    # Longest first (stable): the clients still training at any step are then a prefix.
    order = tuple(sorted(range(len(parts)), key=lambda i: -len(parts[i].labels)))
    sizes = tuple(len(parts[i].labels) for i in order)
    offsets = tuple(sum(sizes[:row]) for row in range(len(sizes)))
    features = torch.cat([torch.from_numpy(parts[i].features) for i in order]).to(device)
    labels = torch.cat([torch.from_numpy(parts[i].labels) for i in order]).to(device)
    rows = tuple(ids[i] for i in order)
    data = _CohortData(key, features, labels, parts[0].num_classes, rows, offsets, sizes)
    _last_cohort.append(data)
    return data


def _config(message: Message) -> ConfigRecord:
    config: ConfigRecord = message.content[CONFIG_RECORD]  # type: ignore[assignment]
    return config


def _group_key(message: Message) -> str:
    """Messages with the same config train together (one round's cohort shares one)."""
    return repr(sorted(_config(message).items()))


def _stored_sensitivity(
    context: Context, parameters: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """The node's moving average from earlier rounds, or None (none, or another model's)."""
    record = context.state.array_records.get(STATE_KEY)
    if record is None:
        return None
    previous = {name: torch.from_numpy(array.numpy().copy()) for name, array in record.items()}
    reason = mismatch(previous, parameters)
    if reason:
        log(WARNING, "%s: starting a new sensitivity average", reason)
        return None
    return previous


def _stacked_received(
    messages: Sequence[Message], model: nn.Module, device: torch.device
) -> Stacked:
    """The received models' parameters, stacked ``(clients, ...)`` on ``device``.

    Each is loaded into ``model`` first, which checks its keys and shapes as the ClientApp's
    ``load_state_dict`` does; ``model`` is left on the meta device (no storage): its own weights
    are never used, :func:`torch.func.functional_call` swaps in the stacked ones.
    """
    model.to("meta")
    parameters = {
        name: torch.empty((len(messages), *p.shape), dtype=p.dtype, device=device)
        for name, p in model.named_parameters()
    }
    for row, message in enumerate(messages):  # one received model in memory at a time
        received: ArrayRecord = message.content[ARRAYS_RECORD]  # type: ignore[assignment]
        model.load_state_dict(received.to_torch_state_dict(), assign=True)
        for name, p in model.named_parameters():
            parameters[name][row] = p.detach()  # cast to the model's dtype, as load_state_dict
    model.to("meta")
    return parameters


def _anchor(parameters: Stacked) -> Stacked:
    """FedProx's anchor: one shared copy when every client received the same model."""
    shared = all(bool((value == value[:1]).all()) for value in parameters.values())
    return {
        name: (value[0] if shared else value).detach().clone() for name, value in parameters.items()
    }


def _sensitivity(
    model: nn.Module,
    parameters: Stacked,
    features: torch.Tensor,
    plan: StepPlan,
    config: ConfigRecord,
    contexts: Sequence[Context],
) -> list[ArrayRecord]:
    """Each client's ``sensitivity`` record; the new averages go to the nodes' Context.state."""
    decay = float(config.get(SENSITIVITY_DECAY_KEY, DEFAULT_DECAY))  # type: ignore[arg-type]
    dtype = str(config.get(SENSITIVITY_DTYPE_KEY, "float32"))
    template = {name: value[0] for name, value in parameters.items()}
    previous = {
        name: torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for name, value in parameters.items()
    }
    for row, context in enumerate(contexts):  # one node's stored average in memory at a time
        stored = _stored_sensitivity(context, template)
        for name, value in (stored or {}).items():
            previous[name][row] = value
    average = sensitivity_stacked(model, parameters, features, plan, previous, decay)
    records = []
    for row, context in enumerate(contexts):
        mine = {name: value[row] for name, value in average.items()}
        context.state[STATE_KEY] = to_upload(mine, "float32")
        records.append(to_upload(mine, dtype))
    return records


def train_cohort(messages: Sequence[Message], contexts: Sequence[Context]) -> list[Message]:
    """Train every client of ``messages`` together; one reply per message, in order.

    The in-process runtime calls this with a round's delivered TRAIN messages and each
    destination node's Context. Each reply is the ClientApp's (:func:`client.app.train`):
    ``arrays`` (trained model), ``metrics`` (``num-examples``, ``train-loss``) and the requested
    ``gradient`` / ``sensitivity`` records.

    The run option ``vectorized-clients-per-pass`` (in the nodes' ``run_config``; 0 or absent:
    the whole cohort) trains at most that many clients at once, longest first, one batched pass
    after another. Each client's arithmetic is the same either way; a pass holds the training
    state (parameters, momentum, gradients) of its own clients only, so narrower passes trade
    steps (each on fewer clients) for memory.

    Raises
    ------
    ValueError
        A requested record this backend cannot produce, a refused model (:func:`refusal`),
        an empty partition, or a negative ``vectorized-clients-per-pass``.
    """
    if len(messages) != len(contexts):
        raise ValueError(f"{len(messages)} messages but {len(contexts)} contexts")
    clients_per_pass = _clients_per_pass(contexts)
    groups: dict[str, list[int]] = {}
    for position, message in enumerate(messages):
        groups.setdefault(_group_key(message), []).append(position)
    replies: dict[int, Message] = {}
    for positions in groups.values():
        group_replies = _train_group(
            [messages[i] for i in positions], [contexts[i] for i in positions], clients_per_pass
        )
        replies.update(zip(positions, group_replies, strict=True))
    return [replies[position] for position in range(len(messages))]


def _clients_per_pass(contexts: Sequence[Context]) -> int:
    """The run's ``vectorized-clients-per-pass`` (0: the whole cohort in one pass)."""
    raw = contexts[0].run_config.get(CLIENTS_PER_PASS_KEY, 0) if contexts else 0
    try:
        width = int(raw)
    except (TypeError, ValueError):
        width = -1
    if width < 0:
        raise ValueError(
            f"{CLIENTS_PER_PASS_KEY} = {raw!r}: use 0 (the whole cohort in one pass) or a "
            "positive number of clients"
        )
    return width


@dataclass(frozen=True, eq=False)
class _Round:
    """What every pass of one config group shares."""

    config: ConfigRecord
    task: ClientTask
    requested: frozenset[str]
    server_round: int
    device: torch.device
    data: _CohortData
    partition_ids: tuple[int, ...]  # by data row (longest first)
    model: nn.Module


def _train_group(
    messages: Sequence[Message], contexts: Sequence[Context], clients_per_pass: int
) -> list[Message]:
    """Clients that received the same config: batched passes of ``clients_per_pass`` clients."""
    config = _config(messages[0])
    requested = requested_records(config)
    unsupported = sorted(requested - SUPPORTED_RECORDS)
    if unsupported:
        raise ValueError(
            f"the strategy requested records {unsupported} that the vectorized backend cannot "
            f"produce (it supports {sorted(SUPPORTED_RECORDS)})"
        )
    task = ClientTask.from_config(config)
    device = resolve_device(task.device)  # type: ignore[arg-type]
    partitions = [node_partition(context) for context in contexts]
    num_partitions = {count for _, count in partitions}
    if len(num_partitions) != 1:
        raise ValueError(f"nodes disagree on num-partitions: {sorted(num_partitions)}")
    spec = DataSpec.from_task(task, num_partitions.pop())
    data = _cohort_data(spec, [pid for pid, _ in partitions], device)
    order = data.message_order([pid for pid, _ in partitions])
    model = build_model(
        task.model,  # type: ignore[arg-type]
        tuple(int(size) for size in data.features.shape[1:]),
        data.num_classes,
    )
    reason = refusal(model, task.model)
    if reason:
        raise ValueError(reason)
    shared = _Round(
        config,
        task,
        requested,
        int(config.get(SERVER_ROUND_KEY, 1)),  # type: ignore[arg-type]
        device,
        data,
        data.partitions,
        model,
    )
    width = clients_per_pass or len(messages)
    replies: dict[int, Message] = {}
    for start in range(0, len(messages), width):
        rows = range(start, min(start + width, len(messages)))
        positions = [order[row] for row in rows]
        pass_replies = _train_pass(
            shared, rows, [messages[i] for i in positions], [contexts[i] for i in positions]
        )
        replies.update(zip(positions, pass_replies, strict=True))
    return [replies[position] for position in range(len(messages))]


def _train_pass(
    shared: _Round, rows: range, messages: Sequence[Message], contexts: Sequence[Context]
) -> list[Message]:
    """The clients at data rows ``rows`` (a run of the longest-first order) in one program."""
    task, data, model, device = shared.task, shared.data, shared.model, shared.device
    parameters = _stacked_received(messages, model, device)
    batches = [
        [
            indices + data.offsets[row]
            for indices in shuffled_batches(
                data.sizes[row],
                task.batch_size,
                task.local_epochs,
                shuffle_seed(task.seed, shared.server_round, shared.partition_ids[row]),
            )
        ]
        for row in rows
    ]
    plan = StepPlan.from_batches(batches, task.batch_size).to(device)
    epoch_steps = [math.ceil(data.sizes[row] / task.batch_size) for row in rows]
    first_epoch = StepPlan.from_batches(
        [steps[:count] for steps, count in zip(batches, epoch_steps, strict=True)],
        task.batch_size,
    )
    del batches  # the plans hold the same indices
    sensitivity: list[ArrayRecord] | None = None
    if SENSITIVITY_RECORD in shared.requested:  # on the received models, before training
        sensitivity = _sensitivity(
            model, parameters, data.features, first_epoch.to(device), shared.config, contexts
        )
    del first_epoch
    anchor = _anchor(parameters) if task.proximal_mu > 0 else None
    result = train_stacked(
        model,
        parameters,
        data.features,
        data.labels,
        plan,
        learning_rate=task.round_learning_rate(shared.server_round),
        momentum=task.momentum,
        weight_decay=task.weight_decay,
        proximal_mu=task.proximal_mu,
        anchor=anchor,
        keep_last_gradient=GRADIENT_RECORD in shared.requested,
    )
    del anchor, plan
    loss_sums = result.loss_sums.cpu().tolist()
    # Each stacked layer is copied out to the clients' records and freed before the next, so the
    # replies never sit beside a whole second stacked copy of the parameters.
    arrays = _per_client_arrays(parameters, list(model.state_dict()))
    gradients = (
        None
        if result.last_gradient is None
        else _per_client_arrays(result.last_gradient, list(result.last_gradient))
    )
    del result
    replies = []
    for index, (row, message) in enumerate(zip(rows, messages, strict=True)):
        size = data.sizes[row]
        content = RecordDict(
            {
                ARRAYS_RECORD: arrays[index],
                METRICS_RECORD: MetricRecord(
                    {
                        NUM_EXAMPLES_KEY: size,
                        TRAIN_LOSS_KEY: loss_sums[index] / (size * task.local_epochs),
                    }
                ),
                CLIENT_RECORD: ConfigRecord({PARTITION_ID_KEY: shared.partition_ids[row]}),
            }
        )
        if gradients is not None:
            content[GRADIENT_RECORD] = gradients[index]
        if sensitivity is not None:
            content[SENSITIVITY_RECORD] = sensitivity[index]
        replies.append(Message(content=content, reply_to=message))
    return replies


def _per_client_arrays(stacked: Stacked, names: Sequence[str]) -> list[ArrayRecord]:
    """One ArrayRecord per client row of ``stacked`` (keys in ``names`` order); empties it.

    Each layer is converted for every client, then removed from ``stacked``: what the caller
    holds no other reference to is freed layer by layer. The records are the ClientApp's
    (:func:`client.app.cpu_state`: CPU copies, the same Array bytes).
    """
    clients = next(iter(stacked.values())).shape[0] if stacked else 0
    layers: list[dict[str, Array]] = [{} for _ in range(clients)]
    for name in names:
        value = stacked.pop(name)
        for row in range(clients):
            layers[row][name] = Array(value[row].detach().cpu())
        del value
    return [ArrayRecord(layer) for layer in layers]
