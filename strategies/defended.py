"""The defences that change what a rule aggregates: root-set trust (FLTrust) and FLAME's last steps.

Both are forms of ``robust_aggregation`` for every rule (docs/reliability.md, "Byzantine
clients"); their math is pure functions in :mod:`strategies.defences.robust`, and this module only
hands
each rule the replies and the model they give:

- ``"fltrust"`` (Cao et al., NDSS 2021): the server trains the global model on its own small
  root data set (FedLAW's proxy set: ``proxy-per-class`` samples per class, 100 by default) with
  the clients' local-training settings of the round, g_0 = theta_0 - w (:func:`root_update`).
  Each reply gets trust TS_k = ReLU(cos(u_k, g_0))
  (:func:`strategies.defences.robust.fltrust_scores`).
  Replies of trust 0 are left out (FedGMA's hard mask counts them as abstentions); the others
  enter the rule with TS_k in place of their data-size weight (a claim buys nothing) and s_k u_k
  in place of their clipped update (:func:`trusted_replies`), s_k bringing every trusted update
  to the trusted updates' median norm (FedLAW: to ||g_0||, FLTrust's own length), and their
  records to the trusted records' median norm; a weighted mean is then FLTrust's aggregate
  w + sum_k TS_k s_k u_k / sum_k TS_k. The direction check, which sides with the round's
  majority, is off: the root set judges direction. Each rule's page says what its own
  quantities become.
- ``"proxy-weights"``: each reply weighted by the client weights attentive LAW learns on the
  root set (FedLAW's, Li et al. ICML 2023, with its shrink factor fixed at 1) in place of its
  data size (:meth:`DefendedStrategy.proxy_weighted`): what a client's model adds to the mix on
  balanced data, which label skew does not make an honest client fail.
- ``"flame"`` (Nguyen et al., USENIX Security 2022): the majority cluster by cosine is kept by
  the base's selection step (:func:`strategies.defences.robust.flame_selection`), every kept update
  and
  record is clipped at the round's median norm (``FLAME_CLIP_FACTOR`` in place of
  ``update_clip_factor``), and Gaussian noise of standard deviation ``flame_noise_lambda``
  (default ``FLAME_NOISE_LAMBDA``, the paper's 0.001 for images) x the
  median update norm is added to the rule's new model (:meth:`DefendedStrategy.defended_model`).

- ``pre_aggregation`` (``"nnm"``, ``"bucketing"``, ``"centered-clipping"``): the replies the
  defences kept are mixed (:func:`strategies.defences.preaggregation.mix`) before the rule's own
  aggregation, so every rule's robust form runs on the mixtures.
- ``trigger_unlearning`` (a :class:`~strategies.defences.trigger_unlearning.TriggerUnlearning`):
after
  the rule's aggregation (and FLAME's noise) the server inverts a trigger patch for every class on
  the new model with its root set and unlearns the patches that work (Neural Cleanse,
  :func:`strategies.defences.trigger_unlearning.unlearn_triggers`), a backdoor defence that does not
  judge replies, so label skew does not make honest ones look guilty.

:class:`DefendedStrategy` sits between :class:`~strategies.base.ContractStrategy` (the
orchestrator) and the rules: it keeps the root set, reads the round's client task from the
train config, and records ``fltrust-trust``, ``fltrust-seconds`` and ``flame-noise-std``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar, Literal, Unpack, cast

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from torch import nn

from beyond_averaging.strategies.defences.preaggregation import (
    PreAggregation,
    check_pre_aggregation,
    mix,
)
from beyond_averaging.strategies.defences.robust import (
    FLAME_CLIP_FACTOR,
    FLAME_NOISE_LAMBDA,
    GENERIC_METHODS,
    flame_noise,
    fltrust_scores,
)
from beyond_averaging.strategies.defences.root_set import (
    PROXY_WEIGHT_EPOCHS,
    PROXY_WEIGHT_LR,
    RootSet,
    root_set_use,
    trusted_replies,
)
from beyond_averaging.strategies.defences.trigger_unlearning import (
    DORMANT_ALARM_RATIO,
    TriggerMemory,
    TriggerUnlearning,
    bound_rare_inputs,
    dormant_positions,
    dormant_update_ratio,
    first_layer_key,
    freeze_dormant_inputs,
    input_exercise,
    unlearn_triggers,
)
from beyond_averaging.strategies.replies.bounds import BoundsOptions
from beyond_averaging.strategies.replies.wire import ClientReply
from beyond_averaging.tasks.protocol import ClientTask

from .aggregate import NDArrayDict
from .arguments import ProjectOptions
from .base import ContractStrategy
from .law_weights import learn_aggregation_weights, weights_are_usable

#: Where :meth:`DefendedStrategy.state_dict` keeps the remembered triggers.
TRIGGER_MEMORY_STATE_KEY = "trigger-memory"


@dataclasses.dataclass(frozen=True)
class DefendedRound:
    """What the root-set defence made of the round being aggregated.

    Attributes
    ----------
    root_update : dict of np.ndarray, optional
        ``fltrust``: the server's update g_0 on its root set (FedGMA's mask lets it vote).
    distrusted : int
        ``fltrust``: replies of trust 0, Byzantine suspects as the bounds' outliers are.
    """

    root_update: NDArrayDict | None = None
    distrusted: int = 0


class DefenceOptions(ProjectOptions, total=False):
    """:class:`~strategies.arguments.ProjectOptions` and the pre-aggregation step in front of
    every rule (:mod:`strategies.defences.preaggregation`), keyword-only
    (:class:`DefendedStrategy`)."""

    pre_aggregation: PreAggregation
    bucket_size: int
    trigger_unlearning: TriggerUnlearning | None
    server_noise_std: float
    flame_noise_lambda: float


class RootSetOptions(DefenceOptions, total=False):
    """:class:`DefenceOptions` and the root set of ``fltrust``, keyword-only
    (:class:`DefendedStrategy`)."""

    model: nn.Module
    proxy_set: Any
    device: torch.device | None


class DefendedStrategy(ContractStrategy):
    """A rule with the robust forms that need more than the base's steps: ``fltrust`` and
    ``flame`` (module docstring). :meth:`aggregate` runs the rule's own aggregation
    (:meth:`aggregate_rule`, which each rule provides) between them.

    Parameters
    ----------
    *args, **options
        Those of :class:`~strategies.base.ContractStrategy`.
    model : nn.Module, optional
        The global model's architecture: with ``proxy_set``, the server trains a copy of it on
        the root set (``robust_aggregation = "fltrust"`` needs both).
    proxy_set : optional
        The root set, in any form :mod:`strategies.defences.proxy_data` reads.
    device : torch.device, optional
        Where the server update is trained; default CUDA when present, else CPU.
    """

    robust_methods: ClassVar[tuple[str, ...]] = (*GENERIC_METHODS, "fltrust", "proxy-weights")
    #: Whether the rule builds its root set itself (FedLAW, from its own proxy set).
    builds_root_set: ClassVar[bool] = False
    #: The length of the trusted updates: the trusted updates' median norm, or the server
    #: update's (``"root"``, FLTrust's own; FedLAW, which learns its weights on the root set).
    trusted_length: ClassVar[Literal["median", "root"]] = "median"

    def __init__(
        self,
        *args: Any,
        **options: Unpack[RootSetOptions],
    ) -> None:
        model = options.pop("model", None)
        proxy_set = options.pop("proxy_set", None)
        device = options.pop("device", None)
        pre_aggregation = options.pop("pre_aggregation", "none")
        bucket_size = options.pop("bucket_size", 2)
        check_pre_aggregation(pre_aggregation, bucket_size)
        trigger_unlearning = options.pop("trigger_unlearning", None)
        noise = {
            "server_noise_std": options.pop("server_noise_std", 0.0),
            "flame_noise_lambda": options.pop("flame_noise_lambda", FLAME_NOISE_LAMBDA),
        }
        for name, value in noise.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} = {value!r}: use a finite value >= 0 (0: no noise)")
        self.server_noise_std = float(noise["server_noise_std"])
        self.flame_noise_lambda = float(noise["flame_noise_lambda"])
        if trigger_unlearning is not None and not isinstance(trigger_unlearning, TriggerUnlearning):
            raise TypeError(
                f"trigger_unlearning = {trigger_unlearning!r}: pass a TriggerUnlearning(...) "
                "(strategies.defences.trigger_unlearning) or None"
            )
        project = cast(ProjectOptions, options)  # without the keys popped above
        super().__init__(*args, **project)
        self.pre_aggregation: PreAggregation = pre_aggregation
        self.bucket_size = bucket_size
        self.trigger_unlearning = trigger_unlearning
        #: The triggers of the last rounds, unlearned again (``TriggerUnlearning.memory_rounds``).
        self.trigger_memory = TriggerMemory(
            trigger_unlearning.memory_rounds if trigger_unlearning is not None else 0
        )
        self.root_set: RootSet | None = None
        self._dormant: tuple[str, npt.NDArray[np.bool_]] | None = None
        self._task: ClientTask | None = None  # fltrust: the clients' training of the round
        self._defence_metrics: dict[str, float | int | list[float]] = {}
        #: What the defences made of the round being aggregated (FedGMA's mask reads it).
        self.round_defence = DefendedRound()
        use = root_set_use(self.robust_aggregation, trigger_unlearning is not None)
        if model is not None and proxy_set is not None:
            self.root_set = RootSet.from_data(model, proxy_set, seed=self.seed, device=device)
        elif use is not None and not self.builds_root_set:
            raise ValueError(
                f"{use.option} in {type(self).__name__} {use.does} on the server's root data "
                "set: pass model= "
                "(the global model's architecture) and proxy_set= (a few labelled samples, e.g. "
                "10 per class; run options: proxy-per-class)"
            )

    def _effective_bounds(self, requested: BoundsOptions) -> BoundsOptions:
        """The reply bounds with the ones a defence replaces: under ``fltrust`` no direction
        check (the root set judges direction), under ``flame`` FLAME's clip at the median."""
        if self.robust_aggregation == "fltrust" and requested.direction_outlier_factor > 0.0:
            log(
                INFO,
                "robust-aggregation = 'fltrust': the root set judges each reply's direction, so "
                "the direction check, which sides with the round's majority, is off (a Byzantine "
                "majority would have it drop the honest replies)",
            )
            return dataclasses.replace(requested, direction_outlier_factor=0.0)
        if self.robust_aggregation == "flame":
            log(
                INFO,
                "robust-aggregation = 'flame': updates and records are clipped at the round's "
                "median norm (update-clip-factor %s is replaced by FLAME's %s)",
                requested.update_clip_factor,
                FLAME_CLIP_FACTOR,
            )
            return dataclasses.replace(requested, update_clip_factor=FLAME_CLIP_FACTOR)
        return requested

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """As the base; with ``fltrust``, the round's client task is kept for the server update."""
        if self.robust_aggregation == "fltrust":
            try:
                self._task = ClientTask.from_config(config)
            except (KeyError, ValueError, TypeError) as error:
                raise ValueError(
                    f"robust_aggregation = 'fltrust' needs the clients' local-training settings "
                    f"in the train config (this project's ClientTask keys): {error}"
                ) from None
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """The rule's aggregation (:meth:`aggregate_rule`) inside the defences: over
        :meth:`defended_replies` (the model stays as it is when ``fltrust`` trusts no reply),
        returning :meth:`defended_model` of its result."""
        kept = self.defended_replies(server_round, global_arrays, replies)
        if not kept:  # fltrust trusted no reply
            return {key: np.array(value) for key, value in global_arrays.items()}
        if self.pre_aggregation != "none":
            kept = self.pre_aggregated(server_round, global_arrays, kept)
        new_arrays = self.aggregate_rule(server_round, global_arrays, kept)
        return self.defended_model(server_round, new_arrays, global_arrays)

    @abstractmethod
    def aggregate_rule(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """The rule's own aggregation of the replies the defences kept."""

    def defended_replies(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> list[ClientReply]:
        """The replies the rule aggregates: under ``fltrust`` the trusted ones, weighted by their
        trust and rescaled to the trusted updates' median norm, or to the server update's under
        ``trusted_length = "root"`` (empty when none is trusted: the rule then keeps the model);
        otherwise ``replies`` as they are."""
        self._defence_metrics = {}
        self.round_defence = DefendedRound()
        if self.robust_aggregation == "proxy-weights":
            return self.proxy_weighted(global_arrays, replies)
        if self.robust_aggregation != "fltrust":
            return list(replies)
        if self._task is None or self.root_set is None:
            raise ValueError(
                "robust_aggregation = 'fltrust' trains the global model on the root set with the "
                "clients' local-training settings, read from the train config; this round's "
                "config had none (this project's ClientTask keys)"
            )
        started = time.perf_counter()
        g0 = self.root_set.update(global_arrays, self._task, server_round)
        trust, scales = fltrust_scores(global_arrays, [reply.arrays for reply in replies], g0)
        # ||u_k|| = ||g_0|| / s_k (a zero update has trust 0 and is left out anyway)
        reference = math.sqrt(sum(float(np.vdot(value, value)) for value in g0.values()))
        length = reference if self.trusted_length == "root" else None
        records = list(self.required_records)
        kept = trusted_replies(replies, trust, reference / scales, records, length)
        # Replies of trust 0 are Byzantine suspects: FedGMA's hard mask counts them as abstaining.
        self.round_defence = DefendedRound(root_update=g0, distrusted=len(replies) - len(kept))
        self._defence_metrics = {
            "fltrust-trust": [float(value) for value in trust],
            "fltrust-seconds": time.perf_counter() - started,
        }
        if not kept:
            log(
                WARNING,
                "round %d: FLTrust trusts no reply (every update points away from the server's "
                "root-set update): the global model stays as it is",
                server_round,
            )
        return kept

    def proxy_weighted(
        self, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> list[ClientReply]:
        """``replies`` weighted by the client weights lambda learned on the root set in place of
        their data sizes: attentive LAW, FedLAW's client weights without its shrink factor (Li
        et al., ICML 2023; :func:`strategies.fedlaw.learn_aggregation_weights` with ``learn =
        "clients"`` and FedLAW's default schedule), over the clipped client models, from their
        bounded data-size weights. The replies come back as they were when the learning fails."""
        if self.root_set is None:
            raise ValueError("robust_aggregation = 'proxy-weights' needs a root set")
        started = time.perf_counter()
        _, lambdas = learn_aggregation_weights(
            self.root_set.model,
            [reply.arrays for reply in replies],
            [reply.num_examples for reply in replies],
            [(self.root_set.features, self.root_set.labels)],
            epochs=PROXY_WEIGHT_EPOCHS,
            lr=PROXY_WEIGHT_LR,
            learn="clients",
            device=self.root_set.features.device,
            scales=[reply.update_scale for reply in replies],
            global_params=global_arrays,
        )
        if not weights_are_usable(1.0, lambdas):
            log(WARNING, "proxy weights: the root-set loss was not finite; data sizes kept")
            return list(replies)
        self._defence_metrics = {
            "proxy-weights": lambdas,
            "proxy-weights-seconds": time.perf_counter() - started,
        }
        return [
            dataclasses.replace(reply, num_examples=float(weight))
            for reply, weight in zip(replies, lambdas, strict=True)
        ]

    def pre_aggregated(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> list[ClientReply]:
        """The replies mixed by ``pre_aggregation``
        (:func:`strategies.defences.preaggregation.mix`), the rule's robust form then running on
        them; the mixing matrix's rows count as
        ``pre-aggregation-rows``."""
        mixed = mix(
            global_arrays,
            replies,
            self.pre_aggregation,
            trim_fraction=self.trim_fraction,
            bucket_size=self.bucket_size,
            seed=(self.seed, server_round),
        )
        self._defence_metrics["pre-aggregation-rows"] = len(mixed)
        return mixed

    def defended_model(
        self, server_round: int, arrays: NDArrayDict, previous: NDArrayDict | None = None
    ) -> NDArrayDict:
        """The rule's new model plus Gaussian noise, drawn from the run's seed and the round:
        under ``flame`` FLAME's, of standard deviation ``flame_noise_lambda`` x the median update
        norm; and ``server_noise_std`` on top (weak differential privacy, Sun et al. 2019, with
        ``update_clip_factor`` as the norm bound), independent noises adding in variance; then,
        with ``trigger_unlearning``, the patches that work on it unlearned on the root set, and
        with its ``dormant_inputs`` the first layer's weights of inputs blank in the whole root
        set kept at ``previous`` (the round's global model) values, and with its ``input_bound``
        each first-layer column's change from ``previous`` bounded by its input's exercise in
        the root set (:func:`~strategies.defences.trigger_unlearning.bound_rare_inputs`)."""
        std = self.server_noise_std
        if self.server_noise_std > 0.0:
            self._defence_metrics["server-noise-std"] = self.server_noise_std
        if self.robust_aggregation == "flame":
            flame_std = self.flame_noise_lambda * self.round_bounds.median_update
            self._defence_metrics["flame-noise-std"] = flame_std
            std = math.hypot(std, flame_std)
        if std > 0.0:
            arrays = flame_noise(arrays, std, (self.seed, server_round))
        if self.trigger_unlearning is None or self.root_set is None:
            return arrays
        started = time.perf_counter()
        aggregate = arrays
        arrays, figures = unlearn_triggers(
            self.root_set.model,
            arrays,
            self.root_set.features,
            self.root_set.labels,
            self.trigger_unlearning,
            self.trigger_memory if self.trigger_memory.rounds else None,
        )
        self._defence_metrics |= figures
        if self.trigger_unlearning.dormant_inputs and previous is not None:
            key, dormant = self._dormant_inputs()
            arrays = freeze_dormant_inputs(previous, arrays, key, dormant)
            ratio = dormant_update_ratio(previous, aggregate, key, dormant)
            self._defence_metrics["unlearning-dormant-inputs"] = int(dormant.sum())
            self._defence_metrics["unlearning-dormant-update"] = ratio
            flagged = ratio >= DORMANT_ALARM_RATIO
            self._defence_metrics["unlearning-dormant-flagged"] = int(flagged)
            if flagged:  # the run's alarm comes from server.app (backdoor_alarms), counting these
                log(
                    WARNING,
                    "round %d: the aggregate update on the weights of the %d inputs blank in the "
                    "whole root set is %.2f x its size elsewhere (flagged at %.2f): honest data "
                    "leave them alone, a trigger there does not; the update was not applied",
                    server_round,
                    int(dormant.sum()),
                    ratio,
                    DORMANT_ALARM_RATIO,
                )
        if self.trigger_unlearning.input_bound > 0 and previous is not None:
            key, _ = self._dormant_inputs()
            exercise = input_exercise(self.root_set.features).cpu().numpy()
            arrays, bounded = bound_rare_inputs(
                previous, arrays, key, exercise, self.trigger_unlearning.input_bound
            )
            self._defence_metrics["unlearning-inputs-bounded"] = bounded
        self._defence_metrics["unlearning-seconds"] = time.perf_counter() - started
        return arrays

    def _dormant_inputs(self) -> tuple[str, npt.NDArray[np.bool_]]:
        """The first layer's weight key and the root set's dormant inputs
        (:func:`~strategies.defences.trigger_unlearning.dormant_positions`), found once."""
        if self._dormant is None:
            assert self.root_set is not None
            features = self.root_set.features
            key = first_layer_key(self.root_set.model, int(features[0].numel()))
            if key is None:
                raise ValueError(
                    f"TriggerUnlearning(dormant_inputs=True or input_bound > 0) in "
                    f"{type(self).__name__}: the model's first layer with weights is not a "
                    f"Linear layer on the flattened input ({type(self.root_set.model).__name__}),"
                    " so no weight belongs to one input position; use dormant_inputs=False and "
                    "input_bound=0 (run options unlearning-dormant-inputs = false, "
                    "unlearning-input-bound = 0) or an mlp/logreg model"
                )
            self._dormant = (key, dormant_positions(features).cpu().numpy())
        return self._dormant

    def round_metrics(self) -> dict[str, float | int | list[float]]:
        """The defences' figures of the last aggregation (``fltrust-*``, ``flame-*``)."""
        return dict(self._defence_metrics)

    def _carried_state(self) -> dict[str, Any]:
        """The reply bounds' state and the triggers remembered for the next rounds (with
        ``TriggerUnlearning.memory_rounds``), so a resumed run unlearns what the interrupted one
        found."""
        state = super()._carried_state()
        if self.trigger_memory.rounds:
            state[TRIGGER_MEMORY_STATE_KEY] = self.trigger_memory.state_dict()
        return state

    def _load_carried_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Restore :meth:`_carried_state`; the rest of ``state``, for the rule."""
        rest = super()._load_carried_state(state)
        self.trigger_memory.load_state_dict(rest.pop(TRIGGER_MEMORY_STATE_KEY, []))
        return rest
