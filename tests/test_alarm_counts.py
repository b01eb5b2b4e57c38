"""The alarm count of the attack tables (benchmarks/alarms.py): a replay of the ServerApp's rule
over recorded rounds, and what counts as a false alarm or a miss."""

from __future__ import annotations

from benchmarks.alarms import Judged, replayed_alarms

CHANCE = 0.1


def rounds_of(accuracies: list[float]) -> list[dict[str, float]]:
    return [
        {"round": index, "test-accuracy": value, "test-loss": 2.0}
        for index, value in enumerate(accuracies)
    ]


def test_the_replay_judges_each_round_against_the_ones_before_and_the_last_as_the_last() -> None:
    # learned, then at chance from round 3 to the end (round 6): the collapse alarm from the
    # third round at chance (5), and at the last
    replayed = replayed_alarms(rounds_of([0.09, 0.5, 0.6, 0.1, 0.1, 0.1, 0.1]), CHANCE)
    assert replayed == {"accuracy-at-chance": [5, 6]}
    # never above chance + 0.05: only the last round says so
    replayed = replayed_alarms(rounds_of([0.09, 0.1, 0.12, 0.11]), CHANCE)
    assert replayed == {"never-above-chance": [3]}
    assert replayed_alarms(rounds_of([0.09, 0.5, 0.11, 0.6]), CHANCE) == {}


def test_a_miss_is_an_attacked_run_at_chance_below_its_twin_without_an_alarm() -> None:
    def judged(final: float, twin: float | None, alarms: dict[str, list[int]]) -> Judged:
        return Judged("run", False, final, twin, CHANCE, alarms)

    assert judged(0.12, 0.9, {}).missed
    assert judged(0.12, None, {}).missed  # no twin: it counts
    assert not judged(0.12, 0.9, {"accuracy-at-chance": [8]}).missed
    assert not judged(0.16, 0.9, {}).missed  # above chance + 0.05
    assert not judged(0.12, 0.11, {}).missed  # learned no less than its honest twin


def test_a_recorded_backdoor_alarm_counts_and_a_silent_backdoor_above_20_percent_is_missed() -> (
    None
):
    from benchmarks.alarms import BACKDOOR_MISS

    rounds = rounds_of([0.09, 0.5, 0.6, 0.7, 0.8, 0.8])
    rounds[1]["unlearning-dormant-update"] = 0.9
    rounds[2]["unlearning-dormant-update"] = 0.9  # flagged twice: no alarm yet
    assert replayed_alarms(rounds, CHANCE) == {}
    rounds[3]["unlearning-dormant-update"] = 0.1  # below the ratio: not flagged
    rounds[5]["unlearning-dormant-update"] = 0.3  # the third flagged round alarms
    assert replayed_alarms(rounds, CHANCE) == {"backdoor-suspected": [5]}
    silent = Judged("run", False, 0.9, 0.9, CHANCE, {}, backdoor=BACKDOOR_MISS)
    assert silent.missed_backdoor
    assert not silent.missed  # it learned: not an accuracy miss
    assert not Judged(
        "run", False, 0.9, 0.9, CHANCE, {"backdoor-suspected": [3]}, 0.9
    ).missed_backdoor
    assert not Judged("run", False, 0.9, 0.9, CHANCE, {}, backdoor=0.19).missed_backdoor
    assert not Judged("run", True, 0.9, None, CHANCE, {}, backdoor=0.9).missed_backdoor
