"""Byzantine clients for testing a defence: the attack set of docs/reliability.md as a library.

Wrap a ServerApp's Grid in :class:`AttackGrid` to make some nodes attack: each round their train
replies are rewritten from the round's honest replies by an attack of :data:`ATTACKS` (the
omniscient attackers of the literature, and their best responses to this library's published
bounds). Backdoors train on :func:`poisoned` data stamped with a trigger of :data:`TRIGGERS`;
:func:`backdoor_test_set` and :func:`backdoor_success` measure what they planted.
docs/library.md ("Testing a defence against the attack set") shows one in a user's app.

- :mod:`~beyond_averaging.server.attacks.updates`: what an attacker sends (model attacks).
- :mod:`~beyond_averaging.server.attacks.triggers`: backdoor triggers, and the attacker that
  picks the one the server's trigger unlearning misses.
- :mod:`~beyond_averaging.server.attacks.grid`: the attack set and the Grid that plays it.
"""

from .grid import ATTACKS, Attack, AttackGrid, backdoor_success, backdoor_test_set, poisoned
from .triggers import (
    ADAPTIVE_CANDIDATES,
    BACKDOOR_TARGET,
    TRIGGERS,
    Trigger,
    TriggerChoice,
    choose_trigger,
)
from .updates import RoundView, alie_z, claim_bound, clip_bound, shejwalkar_gamma

__all__ = [
    "ADAPTIVE_CANDIDATES",
    "ATTACKS",
    "BACKDOOR_TARGET",
    "TRIGGERS",
    "Attack",
    "AttackGrid",
    "RoundView",
    "Trigger",
    "TriggerChoice",
    "alie_z",
    "backdoor_success",
    "backdoor_test_set",
    "choose_trigger",
    "claim_bound",
    "clip_bound",
    "poisoned",
    "shejwalkar_gamma",
]
