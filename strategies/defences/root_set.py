"""The server's root set: a few labelled samples it trains and judges on, and what needs it.

Root-set defences (docs/reliability.md, "Byzantine clients") all start from the same small,
class-balanced set held by the server (FedLAW's proxy set: ``proxy-per-class`` samples per
class): FLTrust scores each reply against the server's own update on it (:func:`root_update`,
:func:`trusted_replies`), ``proxy-weights`` learns the clients' weights on it
(:mod:`strategies.law_weights`), and trigger unlearning inverts and unlearns trigger patches on
it (:mod:`strategies.defences.trigger_unlearning`). :func:`root_set_use` is the one place that
says which options need it; the strategies and the run configuration ask it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from beyond_averaging.strategies.aggregate import NDArrayDict, as_numpy, is_floating
from beyond_averaging.strategies.replies.wire import ClientReply, received_norms
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.protocol import ClientTask
from beyond_averaging.tasks.training import train_local

from .proxy_data import ProxySetError, proxy_arrays
from .robust import median_length_scales

#: The robust aggregations that need a root set, and what each does on it.
ROOT_SET_METHODS = {
    "fltrust": "scores each reply against the server's own update",
    "proxy-weights": "learns the clients' weights",
}
#: ``proxy-weights``' schedule: FedLAW's defaults (its fedlaw-epochs and fedlaw-lr run options).
PROXY_WEIGHT_EPOCHS = 100
PROXY_WEIGHT_LR = 0.005


class RootSetUse(NamedTuple):
    """An option that needs the root set, and what it does on it."""

    #: The option, as a strategy's keyword argument.
    option: str
    does: str


def root_set_use(robust_aggregation: str, trigger_unlearning: bool) -> RootSetUse | None:
    """What the chosen defences do on the server's root set; None when none needs one.

    The one answer to "does this run need a root set":
    :class:`~strategies.defended.DefendedStrategy`
    refuses such options without one, FedLAW builds one from its proxy set, and the strategy
    factory gives one to the others (the run configuration, which imports no strategy, refuses
    the run options of the same defences without ``proxy-per-class`` samples).
    """
    if robust_aggregation in ROOT_SET_METHODS:
        return RootSetUse(
            f"robust_aggregation = {robust_aggregation!r}",
            ROOT_SET_METHODS[robust_aggregation],
        )
    if trigger_unlearning:
        return RootSetUse(
            "trigger_unlearning",
            "inverts and unlearns trigger patches",
        )
    return None


def root_update(
    model: nn.Module,
    global_arrays: NDArrayDict,
    features: torch.Tensor,
    labels: torch.Tensor,
    task: ClientTask,
    server_round: int,
) -> NDArrayDict:
    """g_0 = theta_0 - w: the server's own update on its root set, FLTrust's reference.

    The global model trained by SGD from w on ``features`` / ``labels`` (on the model's device)
    with the clients' local-training settings of the round (``task``: epochs, batch size,
    learning rate with its decay, momentum, weight decay), as FLTrust's server trains on its
    root data as the clients train on theirs, with the clients' own loop
    (:func:`tasks.training.train_local`); the batch plan is one ``torch.randperm`` of the root
    set per epoch from a generator seeded with ``task.seed x 100_003 + server_round``. Floating
    tensors only, in float64; ``model`` is not modified.
    """
    scratch = copy.deepcopy(model)
    scratch.load_state_dict(
        {key: torch.from_numpy(np.array(as_numpy(value))) for key, value in global_arrays.items()}
    )
    generator = torch.Generator().manual_seed(task.seed * 100_003 + server_round)
    plan = [
        batch
        for _ in range(task.local_epochs)
        for batch in torch.split(torch.randperm(len(labels), generator=generator), task.batch_size)
    ]
    train_local(
        scratch,
        DeviceData(features, labels, int(labels.max()) + 1),
        plan,
        learning_rate=task.round_learning_rate(server_round),
        momentum=task.momentum,
        weight_decay=task.weight_decay,
    )
    trained = scratch.state_dict()
    return {
        key: trained[key].detach().cpu().numpy().astype(np.float64) - as_numpy(value)
        for key, value in global_arrays.items()
        if is_floating(as_numpy(value))
    }


def trusted_replies(
    replies: Sequence[ClientReply],
    trust: npt.NDArray[np.float64],
    update_norms: npt.NDArray[np.float64],
    record_names: Sequence[str] = (),
    length: float | None = None,
) -> list[ClientReply]:
    """The replies of trust > 0, each weighted by its trust TS_k in place of its data size, its
    update rescaled to ``length`` (None: the trusted updates' median norm) as its
    ``update_scale``, in place of its clip scale, and each record in ``record_names`` to the
    trusted records' median norm (:func:`strategies.defences.robust.median_length_scales`). Reply
    order
    is kept."""
    trusted = trust > 0.0
    if length is None:
        scales = {"": median_length_scales(update_norms, trusted)}
    else:
        scales = {"": np.divide(length, update_norms, out=np.ones(trust.shape), where=trusted)}
    for name in record_names:
        scales[name] = median_length_scales(received_norms(name, replies), trusted)
    return [
        dataclasses.replace(
            reply,
            num_examples=float(trust[k]),
            update_scale=float(scales[""][k]),
            record_scales={name: float(scales[name][k]) for name in record_names},
        )
        for k, reply in enumerate(replies)
        if trusted[k]
    ]


@dataclasses.dataclass(frozen=True)
class RootSet:
    """The server's root data set on the device of the model that trains on it."""

    model: nn.Module
    features: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def from_data(
        cls,
        model: nn.Module,
        data: Any,
        *,
        seed: int,
        device: torch.device | None = None,
        argument: str = "proxy_set",
    ) -> RootSet:
        """The root set from any form :mod:`strategies.defences.proxy_data` reads, shuffled once by
        ``seed`` (as FedLAW's proxy batches are), with a copy of ``model`` on ``device``.

        Raises
        ------
        ProxySetError
            An empty set, or one holding NaN or Inf inputs.
        """
        features, labels = proxy_arrays(data, argument=argument)
        if len(labels) == 0:
            raise ProxySetError(
                f"{argument}= is empty: root-set trust (robust_aggregation = 'fltrust') trains "
                "the global model on it; pass a few labelled samples (run options: "
                "proxy-per-class >= 1, FLTrust's paper uses 100 samples in all)"
            )
        if not np.all(np.isfinite(features)):
            raise ProxySetError(f"{argument}= holds NaN or Inf inputs")
        target = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        order = np.random.default_rng(seed).permutation(len(labels))
        return cls(
            copy.deepcopy(model).to(target),
            torch.from_numpy(np.ascontiguousarray(features[order])).to(target),
            torch.from_numpy(np.ascontiguousarray(labels[order])).to(target),
        )

    def __len__(self) -> int:
        return len(self.labels)

    def update(
        self, global_arrays: NDArrayDict, task: ClientTask, server_round: int
    ) -> NDArrayDict:
        """:func:`root_update` of this root set."""
        return root_update(
            self.model, global_arrays, self.features, self.labels, task, server_round
        )
