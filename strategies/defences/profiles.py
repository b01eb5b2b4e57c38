"""Defence profiles: one name for the combination of defences the tables measured for a kind of
federation, as keyword options of any rule (the run option ``defence-profile`` sets the same
run options; docs/reliability.md, "Defence profiles").

- ``"none"``: the defaults (the reply bounds only);
- ``"iid"``: root-set trust and trigger unlearning (``robust_aggregation = "fltrust"``,
  ``TriggerUnlearning()``), which held the backdoors of the IID table;
- ``"label-skew"``: trigger unlearning with 6 passes, the additive search, dormant inputs, a
  memory of the last round's triggers and 0.4 of each unlearning step's loss on the stamped
  inputs (``patched_share``), and the claim bound at one median
  (``max_claim_factor = 1``); for FedLAW (``fedlaw=True``) also ``learn = "clients"``: the
  shrink factor gamma stays 1 (learned, it was above 1 in every round of the tables and scaled
  up what the unlearning left of a backdoor); for Elastic (``elastic=True``) also ``tau = 0``:
  zeta at most 1 (up to 1 + tau it scaled up the weights the clients are least sensitive to,
  where a backdoor lives).

Every profile that unlearns needs ``model=`` and ``proxy_set=`` (the server's root set) beside
it::

    FedAvg(model=net, proxy_set=(x, y), **defence_profile("label-skew"))
    FedLAW(model=net, proxy_set=(x, y), **defence_profile("label-skew", fedlaw=True))
    ElasticAggregation(model=net, proxy_set=(x, y), **defence_profile("label-skew", elastic=True))
"""

from __future__ import annotations

import difflib
from typing import Literal, TypedDict

from .trigger_unlearning import TriggerUnlearning

ProfileName = Literal["none", "iid", "label-skew"]
PROFILE_NAMES: tuple[ProfileName, ...] = ("none", "iid", "label-skew")


class ProfileOptions(TypedDict, total=False):
    """The keyword options a profile sets: those of every rule, FedLAW's ``learn`` and
    Elastic's ``tau``."""

    robust_aggregation: str
    trigger_unlearning: TriggerUnlearning
    max_claim_factor: float
    learn: Literal["both", "shrink", "clients"]
    tau: float


def defence_profile(name: str, *, fedlaw: bool = False, elastic: bool = False) -> ProfileOptions:
    """The keyword options of profile ``name`` for any rule, with ``fedlaw`` FedLAW's own one
    too and with ``elastic`` Elastic's (module docstring).

    Raises
    ------
    ValueError
        An unknown name, naming the closest one.
    """
    if name == "none":
        return {}
    if name == "iid":
        return {"robust_aggregation": "fltrust", "trigger_unlearning": TriggerUnlearning()}
    if name == "label-skew":
        options: ProfileOptions = {
            "trigger_unlearning": TriggerUnlearning(
                epochs=6,
                additive_weight=1.0,
                dormant_inputs=True,
                memory_rounds=1,
                patched_share=0.4,
            ),
            "max_claim_factor": 1.0,
        }
        if fedlaw:
            options["learn"] = "clients"
        if elastic:
            options["tau"] = 0.0
        return options
    close = difflib.get_close_matches(str(name), PROFILE_NAMES, n=1, cutoff=0.0)
    raise ValueError(
        f"defence_profile({name!r}): use one of {', '.join(map(repr, PROFILE_NAMES))}; "
        f"the closest is {close[0]!r}"
    )
