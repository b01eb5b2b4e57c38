"""The reply bounds as one component: stage 3 of a reply's path (:mod:`strategies.replies`).

:class:`InfluenceBounds` takes the round's decoded replies and says which are dropped and how
much say each kept one has, judged by the round's other replies (:mod:`.influence` holds the
pure math). In this order:

1. drop replies whose records share no key with the rest, whose update or record norm is a
   ``norm-outlier`` (``update_norm_factor``), or whose update is a ``direction-outlier``
   (``direction_outlier_factor``);
2. a selection step, when one is plugged in (Krum / Multi-Krum / FLAME,
   :func:`strategies.defences.robust.selection_rule`; Flower's Bulyan takes its
   ``selection_rule`` the same way), drops the replies it leaves out;
3. bound each kept reply's weight (``max_claim_factor``) and scale its update and records down
   to ``update_clip_factor`` x the round's median norm, direction kept.

It returns a :class:`BoundedReplies`, which carries what the later stages read (the median
update norm the model guard and FLAME's noise scale by, the count of Byzantine suspects that
FedGMA's mask counts as abstentions, the round's figures); after the rule's aggregation,
:meth:`InfluenceBounds.model_rejection` guards the new model. Its state (the model guard's scale,
the direction check's decision and secret) is checkpointed under :data:`BOUNDS_STATE_KEY`.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from flwr.app import RecordDict
from flwr.common import log

from beyond_averaging.strategies.aggregate import NDArrayDict

from .influence import (
    RECORD_NORM_FACTOR_SCALE,
    bound_claims,
    cap_weights,
    clip_scales,
    direction_cosines,
    direction_outliers,
    max_over_median,
    norm_outliers,
    update_norms,
)
from .reporting import InfluenceView, node_label, partition_of
from .validation import ModelGuard, common_key_set
from .wire import ClientReply, ReplyRejected, received_norms

#: Default of ``update_norm_factor``: above every max/median ratio of honest replies measured on
#: digits, Dirichlet(0.1) and (0.5) (docs/reliability.md, ``benchmarks/reply_norms.py``).
DEFAULT_UPDATE_NORM_FACTOR = 10.0
#: Defaults of the Byzantine bounds, chosen by the attack table (docs/reliability.md, "Byzantine
#: clients"; ``benchmarks/specs/attacks.toml``): the smallest bounds that held the attacks of
#: the table where any defence held, without costing the honest evidence runs.
DEFAULT_UPDATE_CLIP_FACTOR = 2.0
DEFAULT_DIRECTION_OUTLIER_FACTOR = 2.0
DEFAULT_MAX_CLAIM_FACTOR = 10.0
#: Below this median direction cosine on the first checked round, the clients are too
#: heterogeneous for the direction check to single out a Byzantine reply: it is off for the run
#: (logged at INFO under the default label skew, docs/reliability.md).
HETEROGENEITY_COSINE = 0.3
#: Key of the reply bounds' part of a strategy's checkpoint state.
BOUNDS_STATE_KEY = "reply-bounds"
#: The reasons of the drops that mark a reply as a Byzantine suspect.
SUSPECT_REASONS = ("norm-outlier", "direction-outlier")

Pair = tuple[ClientReply, RecordDict]
Norms = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True)
class BoundsOptions:
    """How far one reply may move a round (the strategies' keyword arguments of the same names).

    Attributes
    ----------
    max_client_weight : float
        Largest weight share one reply may get, in (0, 1]; 1 is no cap.
    update_norm_factor : float
        Norm filter: a reply whose update norm exceeds this factor times the round's median is
        dropped (records: ``RECORD_NORM_FACTOR_SCALE`` times it); 0 turns it off.
    update_clip_factor : float
        Each update (and record) scaled down to at most this factor times the round's median
        norm; 0 turns clipping off.
    direction_outlier_factor : float
        Robust standard deviations below the round's median cosine at which an update pointing
        against the others' mean is dropped; 0 turns the check off.
    max_claim_factor : float
        No reply's weight counts for more than this factor times the round's median weight;
        0 turns the bound off.
    """

    max_client_weight: float = 1.0
    update_norm_factor: float = DEFAULT_UPDATE_NORM_FACTOR
    update_clip_factor: float = DEFAULT_UPDATE_CLIP_FACTOR
    direction_outlier_factor: float = DEFAULT_DIRECTION_OUTLIER_FACTOR
    max_claim_factor: float = DEFAULT_MAX_CLAIM_FACTOR

    def __post_init__(self) -> None:
        if not 0.0 < self.max_client_weight <= 1.0:
            raise ValueError(f"max_client_weight = {self.max_client_weight}: allowed is (0, 1]")
        if not self.update_norm_factor >= 0.0:
            raise ValueError(f"update_norm_factor = {self.update_norm_factor}: allowed is >= 0")
        for name in ("update_clip_factor", "direction_outlier_factor", "max_claim_factor"):
            factor = getattr(self, name)
            if not (math.isfinite(factor) and factor >= 0.0):
                raise ValueError(f"{name} = {factor}: allowed is a finite value >= 0 (0: off)")


class SelectionRule(Protocol):
    """A step that keeps some of the replies that passed the checks (Krum, Multi-Krum, FLAME)."""

    @property
    def reason(self) -> str:
        """The ``dropped-<reason>`` a reply it leaves out is counted under."""
        ...

    def choose(
        self, global_arrays: NDArrayDict, client_arrays: Sequence[Mapping[str, Any]]
    ) -> Sequence[int]:
        """Positions of the replies kept, in reply order."""
        ...

    def detail(self, kept: int, candidates: int) -> str:
        """The log line's reason for a reply left out."""
        ...


@dataclasses.dataclass(frozen=True)
class BoundedReplies:
    """What the reply bounds made of a round's replies: what the later stages read.

    Attributes
    ----------
    kept : list of (ClientReply, RecordDict)
        The kept replies, in reply order, their claims bounded and their update / record scales
        set (``ClientReply.update_scale``, ``record_scales``).
    rejected : dict of int to ReplyRejected
        The dropped replies, by their index in the replies given, with the reason.
    view : InfluenceView
        Every reply's update norm, drop and direction cosine, for the per-client records.
    median_update : float
        Median update norm of the kept replies: the model guard's and FLAME's scale.
    suspects : int
        Replies dropped as norm or direction outliers (Byzantine suspects).
    unselected : int
        Replies the selection step left out: Krum's quorum counts them as chosen from.
    figures : dict
        The round's figures: ``update-norm-ratio``, ``direction-cosine-*``, ``claims-bounded``,
        ``replies-clipped``.
    """

    kept: list[Pair]
    rejected: dict[int, ReplyRejected]
    view: InfluenceView
    median_update: float = 0.0
    suspects: int = 0
    unselected: int = 0
    figures: dict[str, float | int] = dataclasses.field(default_factory=dict)

    @classmethod
    def unbounded(cls, replies: Sequence[Pair] = ()) -> BoundedReplies:
        """``replies`` kept as they are, none dropped: where the bounds did not run (no global
        model to measure updates against, or no round yet)."""
        return cls(list(replies), {}, InfluenceView(np.zeros(0), {}, {}))


class InfluenceBounds:
    """The reply bounds of one run: options, the selection step, and the state across rounds.

    Parameters
    ----------
    options : BoundsOptions
        The bounds.
    required_records : sequence of str
        The extra ArrayRecords every reply carries (``sensitivity``, ``gradient``): their norms
        are filtered and clipped as the update's are.
    selection : SelectionRule, optional
        Krum / Multi-Krum / FLAME's selection, run after the drops (step 2).
    """

    def __init__(
        self,
        options: BoundsOptions,
        required_records: Sequence[str] = (),
        selection: SelectionRule | None = None,
    ) -> None:
        self.options = options
        self.required_records = tuple(required_records)
        self.selection = selection
        self.model_guard = ModelGuard()  # the run's honest scale (strategies.replies.validation)
        #: Whether the direction check runs in this run: decided on its first round (None before).
        self.direction_check: bool | None = None
        #: Draws the coordinates the direction check compares on a large model (with the
        #: round): secret, so that no client knows them; drawn on the check's first round and
        #: kept in the checkpoint, so that a resumed run compares the same ones.
        self.direction_secret: int | None = None

    # ------------------------------------------------------------------ the round's bounds
    def bound(
        self, server_round: int, global_arrays: NDArrayDict, accepted: Sequence[Pair]
    ) -> BoundedReplies:
        """Steps 1-3 of the module docstring over the round's decoded replies; each drop logged."""
        options = self.options
        rejected: dict[int, ReplyRejected] = {}
        for name in self.required_records:
            keep = common_key_set([frozenset(reply.records[name]) for reply, _ in accepted])
            for index, (reply, _) in enumerate(accepted):
                if keep is not None and frozenset(reply.records[name]) != keep:
                    rejected.setdefault(
                        index,
                        ReplyRejected(
                            f"bad-{name}",
                            f"record '{name}' shares no tensor with the round's other replies",
                        ),
                    )
        updates = update_norms(global_arrays, [r.arrays for r, _ in accepted])
        # What the filter compares, logged every round (filter on or off): how close honest
        # clients come to the factor is read from any run's metrics.jsonl.
        figures: dict[str, float | int] = {}
        ratio = max_over_median(updates)
        if ratio is not None:
            figures["update-norm-ratio"] = ratio
        needs_records = options.update_norm_factor > 0.0 or options.update_clip_factor > 0.0
        norms = {
            "update": updates,
            **{
                name: received_norms(name, [reply for reply, _ in accepted])
                for name in (self.required_records if needs_records else ())
            },
        }
        if options.update_norm_factor > 0.0 and accepted:
            self._drop_norm_outliers(norms, rejected)
        cosines = self._drop_direction_outliers(
            server_round, global_arrays, accepted, updates, rejected, figures
        )
        unselected = self._drop_unselected(global_arrays, accepted, rejected)
        for index, rejection in sorted(rejected.items()):
            reply, content = accepted[index]
            log(
                WARNING,
                "round %d: dropped reply from %s: %s",
                server_round,
                node_label(reply.node_id, partition_of(content)),
                rejection.detail,
            )
        kept = [index for index in range(len(accepted)) if index not in rejected]
        return BoundedReplies(
            kept=self._bounded(
                [accepted[i] for i in kept], {n: v[kept] for n, v in norms.items()}, figures
            ),
            rejected=rejected,
            view=InfluenceView(updates, rejected, cosines),
            # The model check bounds the new model by the median update that was aggregated.
            median_update=float(np.median(updates[kept])) if kept else 0.0,
            suspects=sum(
                rejection.reason.startswith(SUSPECT_REASONS) for rejection in rejected.values()
            ),
            unselected=unselected,
            figures=figures,
        )

    def capped(self, replies: list[ClientReply]) -> list[ClientReply]:
        """The replies with their weights capped at ``max_client_weight`` (shares summing to 1)."""
        if self.options.max_client_weight >= 1.0 or not replies:
            return replies
        shares = cap_weights(
            [reply.num_examples for reply in replies], self.options.max_client_weight
        )
        return [
            dataclasses.replace(reply, num_examples=float(share))
            for reply, share in zip(replies, shares, strict=True)
        ]

    def model_rejection(
        self, new_arrays: NDArrayDict, global_arrays: NDArrayDict, bounded: BoundedReplies
    ) -> str | None:
        """Why the rule's new model must not be committed (stage 5), or None."""
        return self.model_guard.rejection(new_arrays, global_arrays, bounded.median_update)

    def _drop_norm_outliers(
        self, norms: Mapping[str, Norms], rejected: dict[int, ReplyRejected]
    ) -> None:
        factor_of_update = self.options.update_norm_factor
        for name, values in norms.items():
            median = float(np.median(values))
            factor = factor_of_update * (1.0 if name == "update" else RECORD_NORM_FACTOR_SCALE)
            for flagged in np.flatnonzero(norm_outliers(values, factor)):
                index = int(flagged)
                rejected.setdefault(
                    index,
                    ReplyRejected(
                        "norm-outlier" if name == "update" else f"norm-outlier-{name}",
                        f"{name} norm {values[index]:.4g} exceeds {factor:g} x the round's "
                        f"median {median:.4g} (update-norm-factor = {factor_of_update:g})",
                    ),
                )

    def _drop_direction_outliers(
        self,
        server_round: int,
        global_arrays: NDArrayDict,
        accepted: Sequence[Pair],
        updates: Norms,
        rejected: dict[int, ReplyRejected],
        figures: dict[str, float | int],
    ) -> dict[int, float]:
        """Flag the replies whose update points against the others' (among those not flagged);
        return each compared reply's cosine with the others' mean, by its index."""
        factor = self.options.direction_outlier_factor
        candidates = [index for index in range(len(accepted)) if index not in rejected]
        if factor <= 0.0 or self.direction_check is False or len(candidates) < 3:
            return {}
        if self.direction_secret is None:
            self.direction_secret = secrets.randbits(63)
        cosines = direction_cosines(
            global_arrays,
            [accepted[i][0].arrays for i in candidates],
            updates[candidates],
            seed=(self.direction_secret, server_round),
        )
        median = float(np.median(cosines))
        figures["direction-cosine-min"] = float(cosines.min())
        figures["direction-cosine-median"] = median
        compared = {index: float(cosines[i]) for i, index in enumerate(candidates)}
        if not self._decide_direction_check(median):
            return compared
        flagged = np.flatnonzero(direction_outliers(cosines, factor))
        if flagged.size and median < HETEROGENEITY_COSINE:
            # The clients agreed on the check's first round, and no longer do (docs/reliability.md)
            log(
                WARNING,
                "round %d: the direction check drops %d replies in a round whose replies "
                "disagree among themselves (median cosine %.2f < %.2f), so honest clients with "
                "other data may be among them; if clients hold different label sets, set "
                "direction-outlier-factor = 0 (docs/reliability.md, 'Byzantine clients')",
                server_round,
                flagged.size,
                median,
                HETEROGENEITY_COSINE,
            )
        for position in flagged:
            rejected.setdefault(
                candidates[int(position)],
                ReplyRejected(
                    "direction-outlier",
                    f"its update points against the mean of the {len(candidates) - 1} others "
                    f"(cosine {cosines[position]:.3f} with it, the round's median {median:.3f}, "
                    f"direction-outlier-factor = {factor:g}); the check "
                    "sides with the majority: if most replies are Byzantine (Sybil clients), this "
                    "one may be honest (robust-aggregation = 'fltrust' tells them apart)",
                ),
            )
        return compared

    def _decide_direction_check(self, median_cosine: float) -> bool:
        """On the first round the direction check runs, whether it runs at all in this run: not
        where the clients disagree from the start (median cosine below HETEROGENEITY_COSINE, as
        under label skew); kept in the checkpoint (docs/reliability.md). Said at INFO with the
        default factor (the check is on by default and going off under skew is what the docs
        describe: a user who changed nothing sees no warning), at WARNING when the user chose a
        factor of their own, asking for a check that cannot work here."""
        if self.direction_check is None:
            self.direction_check = median_cosine >= HETEROGENEITY_COSINE
            if not self.direction_check:
                chosen = self.options.direction_outlier_factor != DEFAULT_DIRECTION_OUTLIER_FACTOR
                log(
                    WARNING if chosen else INFO,
                    "the clients' updates disagree from the first round (median cosine with the "
                    "others' mean %.2f < %.2f), as under strong label skew: the direction check "
                    "cannot tell a reply pointing against the rest from an honest one here and is "
                    "off for this run, and a minority of Byzantine clients can cost much "
                    "accuracy; clipping and the claim bound still limit each reply's say "
                    "(docs/reliability.md, 'Byzantine clients')",
                    median_cosine,
                    HETEROGENEITY_COSINE,
                )
        return self.direction_check

    def _drop_unselected(
        self,
        global_arrays: NDArrayDict,
        accepted: Sequence[Pair],
        rejected: dict[int, ReplyRejected],
    ) -> int:
        """The selection step: flag the replies it leaves out; return how many."""
        candidates = [index for index in range(len(accepted)) if index not in rejected]
        if self.selection is None or not candidates:
            return 0
        chosen = set(
            self.selection.choose(global_arrays, [accepted[i][0].arrays for i in candidates])
        )
        left_out = [index for position, index in enumerate(candidates) if position not in chosen]
        for index in left_out:
            rejected[index] = ReplyRejected(
                self.selection.reason, self.selection.detail(len(chosen), len(candidates))
            )
        return len(left_out)

    def _bounded(
        self, kept: list[Pair], norms: Mapping[str, Norms], figures: dict[str, float | int]
    ) -> list[Pair]:
        """The kept replies with their claims bounded and their update / record scales set."""
        if not kept:
            return kept
        claims = np.array([reply.num_examples for reply, _ in kept])
        bounded = bound_claims(claims, self.options.max_claim_factor)
        factor = self.options.update_clip_factor
        scales = {name: clip_scales(values, factor) for name, values in norms.items()}
        figures["claims-bounded"] = int(np.sum(bounded < claims))
        figures["replies-clipped"] = int(np.sum(scales["update"] < 1.0))
        return [
            (
                dataclasses.replace(
                    reply,
                    num_examples=float(bounded[i]),
                    update_scale=float(scales["update"][i]),
                    record_scales={n: float(scales[n][i]) for n in scales if n != "update"},
                ),
                content,
            )
            for i, (reply, content) in enumerate(kept)
        ]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The model guard's scale, the direction check's decision and secret, once they are
        made (nothing before): a strategy keeps it under :data:`BOUNDS_STATE_KEY`."""
        state = self.model_guard.state_dict()
        if self.direction_check is not None:
            state["direction-check"] = int(self.direction_check)
        if self.direction_secret is not None:
            state["direction-secret"] = self.direction_secret
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.model_guard.load_state_dict(state)
        check, secret = state.get("direction-check"), state.get("direction-secret")
        self.direction_check = None if check is None else bool(check)
        self.direction_secret = None if secret is None else int(secret)
