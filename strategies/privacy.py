"""This project's strategies inside Flower's central differential-privacy wrappers.

Flower's ``DifferentialPrivacyServerSideFixedClipping`` and
``DifferentialPrivacyClientSideFixedClipping`` (and the two adaptive-clipping wrappers) hold a
strategy and call its ``configure_train`` / ``aggregate_train``. They clip each client's update
theta_k - w to L2 norm ``clipping_norm`` C (on the server; or on the client by Flower's
``fixedclipping_mod``) and add Gaussian noise of standard deviation
``noise_multiplier * C / num_sampled_clients`` to the model the strategy returns. What that means
for the rules here (docs/library.md, "Differential privacy"):

- A rule that needs an extra ArrayRecord in every reply (Elastic's ``sensitivity``, FedGMA's
  ``gradient``) cannot run inside them. The server-side wrappers clip *every* ArrayRecord of a
  reply as if it were the model, ``w + clip(record - w, C)``, pairing its tensors with the
  model's by position: a sensitivity or gradient would reach the rule mixed with the global model,
  or the wrapper fails when the record holds fewer tensors than the model. ``fixedclipping_mod``
  refuses a reply with more than one ArrayRecord, so every reply would come back as an error and
  the model would never train. :func:`check_privacy_composition` stops such a run before the
  initial evaluation and the first message, with :class:`PrivacyCompositionError` naming the
  fix.
- The noise is calibrated for an aggregate that one client's clipped update moves by at most
  C / num_sampled_clients: a mean with equal weights and a server step of at most 1 (FedAvg, as
  for Flower's own FedAvg). A rule that reweights, masks or rescales the mean with values computed
  from the replies, or steps with a server optimizer, runs inside the wrappers, but the noise does
  not give it the guarantee a privacy analysis of ``noise_multiplier`` assumes: the run logs a
  warning saying why (each rule's :meth:`~strategies.base.ContractStrategy.privacy_noise_gap`).

Flower's wrappers tell the wrapped strategy nothing about themselves: their constructors (flwr
1.39 to 1.42) only keep it as ``wrapper.strategy``, and the first call into it is ``summary()``,
which ``Strategy.start`` makes before the initial evaluation and before any message. So
:func:`calling_privacy_wrapper` finds the wrapper among the callers of the strategy's
``summary`` (where a run stops) and ``configure_train`` (for an app that drives the rounds
itself).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Collection, Mapping
from logging import WARNING
from typing import Protocol

from flwr.common import log
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import Strategy

from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD

#: Flower's central-DP wrappers: each clips every ArrayRecord of a reply on the server, or needs a
#: client mod that refuses more than one. Looked up by name: a Flower without one lacks that entry.
PRIVACY_WRAPPERS: tuple[type[Strategy], ...] = tuple(
    wrapper
    for name in (
        "DifferentialPrivacyServerSideFixedClipping",
        "DifferentialPrivacyClientSideFixedClipping",
        "DifferentialPrivacyServerSideAdaptiveClipping",
        "DifferentialPrivacyClientSideAdaptiveClipping",
    )
    if isinstance(wrapper := getattr(flower_strategies, name, None), type)
)
#: The client-side wrappers: clipping happens in a ClientApp mod, which allows one ArrayRecord.
CLIENT_SIDE_WRAPPERS = frozenset(
    {"DifferentialPrivacyClientSideFixedClipping", "DifferentialPrivacyClientSideAdaptiveClipping"}
)
#: How many callers up a wrapper is looked for: the wrapper calls the strategy's method directly
#: (``summary`` through a rule's own ``summary`` and the base's, a frame or two), a user's own
#: wrapper around Flower's adds a frame or two.
CALLER_DEPTH = 8

#: Per extra record: what a user who wants Flower's DP wrappers can do instead.
RECORD_FIXES = {
    GRADIENT_RECORD: (
        "use FedGMASoft, the same masked averaging with the mask taken from the clipped updates "
        "themselves (no extra record), or run FedGMA without Flower's DP wrappers"
    ),
    SENSITIVITY_RECORD: (
        "run ElasticAggregation without Flower's DP wrappers: its sensitivity has no form these "
        "wrappers clip correctly, and no rule here derives it from the clipped update alone"
    ),
}


class WrappableRule(Protocol):
    """What :func:`check_wrapper` reads of a strategy (a
    :class:`~strategies.base.ContractStrategy`)."""

    @property
    def required_records(self) -> Mapping[str, str]:
        """The extra ArrayRecords the rule needs in every reply."""
        ...

    def privacy_noise_gap(self) -> str | None:
        """Why the wrappers' noise does not cover the rule's aggregate; None when it does."""
        ...


#: The strategies whose noise-gap warning was logged: once per strategy.
_WARNED: weakref.WeakSet[WrappableRule] = weakref.WeakSet()


class PrivacyCompositionError(ValueError):
    """A strategy cannot run inside the Flower differential-privacy wrapper that holds it."""


def calling_privacy_wrapper(strategy: object) -> Strategy | None:
    """The Flower DP wrapper holding ``strategy`` that is calling into it, or None.

    Looks at the callers of this function, up to :data:`CALLER_DEPTH` frames: Flower's
    wrappers keep the wrapped strategy as ``wrapper.strategy`` and call its methods from their
    own.
    """
    frame = inspect.currentframe()
    for _ in range(CALLER_DEPTH):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, PRIVACY_WRAPPERS) and getattr(caller, "strategy", None) is strategy:
            return caller
    return None


def check_wrapper(strategy: WrappableRule) -> None:
    """Inside a Flower DP wrapper: stop a rule that cannot run there, warn once when the noise
    does not cover its aggregate.

    Called by the strategy's ``summary`` (``Strategy.start``'s first call into it, before any
    evaluation or message: where a run stops) and ``configure_train`` (for an app that drives
    the rounds itself); outside a wrapper it does nothing.

    Raises
    ------
    PrivacyCompositionError
        See :func:`check_privacy_composition`.
    """
    wrapper = calling_privacy_wrapper(strategy)
    if wrapper is not None:
        check_privacy_composition(
            type(strategy).__name__,
            list(strategy.required_records),
            strategy.privacy_noise_gap(),
            wrapper,
            warn=strategy not in _WARNED,
        )
        _WARNED.add(strategy)


def check_privacy_composition(
    rule: str,
    required_records: Collection[str],
    noise_gap: str | None,
    wrapper: Strategy,
    *,
    warn: bool,
) -> None:
    """Stop a rule that cannot run inside ``wrapper``; warn when the noise does not cover it.

    Parameters
    ----------
    rule : str
        The strategy's class name, for the messages.
    required_records : Collection[str]
        The extra ArrayRecords the rule needs in every reply.
    noise_gap : str or None
        Why one client's clipped update can move the rule's model by more than
        ``clipping_norm / num_sampled_clients``; None when it cannot.
    wrapper : Strategy
        The Flower DP wrapper holding the rule.
    warn : bool
        Whether to log the warning (once per run: the caller keeps track).

    Raises
    ------
    PrivacyCompositionError
        The rule needs an extra record, which the wrapper would clip as a model or refuse.
    """
    kind = type(wrapper).__name__
    for record in required_records:
        if kind in CLIENT_SIDE_WRAPPERS:
            why = (
                "the ClientApp mod this wrapper needs (Flower's fixedclipping_mod or "
                "adaptiveclipping_mod) refuses a reply with more than one ArrayRecord, so every "
                f"reply carrying '{record}' would come back as an error and the model would "
                "never train"
            )
        else:
            why = (
                "the wrapper clips every ArrayRecord of a reply as if it were the model, "
                f"w + clip(record - w, clipping_norm), so the '{record}' record would reach "
                f"{rule} mixed with the global model (or the wrapper fails on it when it holds "
                "fewer tensors than the model)"
            )
        fix = RECORD_FIXES.get(record, f"run {rule} without Flower's DP wrappers")
        raise PrivacyCompositionError(
            f"{rule} cannot run inside Flower's {kind}: it needs the ArrayRecord '{record}' in "
            f"every train reply, and {why}. Fix: {fix} (docs/library.md, 'Differential privacy')."
        )
    if noise_gap is not None and warn:
        log(
            WARNING,
            "%s inside Flower's %s: the wrapper's noise (noise_multiplier * clipping_norm / "
            "num_sampled_clients) is calibrated for a plain mean of the clipped updates, and %s. "
            "A privacy guarantee computed from noise_multiplier does not hold for this rule; "
            "FedAvg (server step <= 1, no robust aggregation) is the rule it holds for "
            "(docs/library.md, 'Differential privacy')",
            rule,
            kind,
            noise_gap,
        )
