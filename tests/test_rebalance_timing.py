"""The timing of rebalancing and the measured speed, which the peer and the simulator share."""

from __future__ import annotations

import random

import pytest

from swarm.policy.rebalance_timing import CONFIRM, LOOK, MOVE, RebalanceTiming, ReturnCooldown, Wait
from swarm.policy.throughput_average import ThroughputAverage

PERIOD, ANNOUNCE = 60.0, 2.0


def timing(seed: int = 0, first_look: bool = True) -> RebalanceTiming:
    return RebalanceTiming(PERIOD, ANNOUNCE, random.Random(seed), first_look)


@pytest.mark.parametrize("seed", range(50))
def test_the_first_look_comes_within_one_period_and_later_ones_after_half_to_one_and_a_half(seed):
    machine = timing(seed)
    first = machine.start()
    assert first.action == LOOK and 0.0 <= first.seconds <= PERIOD
    later = machine.looked(moves=False)
    assert later.action == LOOK and 0.5 * PERIOD <= later.seconds <= 1.5 * PERIOD
    # a peer that has moved already starts on its new stage with a later look
    again = timing(seed, first_look=False).start()
    assert again.action == LOOK and 0.5 * PERIOD <= again.seconds <= 1.5 * PERIOD


@pytest.mark.parametrize("seed", range(50))
def test_a_planned_move_is_looked_at_again_one_to_two_announce_periods_later(seed):
    machine = timing(seed)
    machine.start()
    second = machine.looked(moves=True)
    assert second.action == CONFIRM and ANNOUNCE <= second.seconds <= 2 * ANNOUNCE
    assert machine.confirmed(moves=True) == Wait(MOVE, 0.0)


def test_a_move_the_second_look_does_not_confirm_waits_for_a_later_look():
    machine = timing()
    machine.start()
    machine.looked(moves=True)
    later = machine.confirmed(moves=False)
    assert later.action == LOOK and 0.5 * PERIOD <= later.seconds <= 1.5 * PERIOD


def test_a_move_called_off_at_the_last_moment_waits_for_a_later_look():
    machine = timing()
    machine.start()
    machine.looked(moves=True)
    machine.confirmed(moves=True)
    later = machine.stayed()
    assert later.action == LOOK and 0.5 * PERIOD <= later.seconds <= 1.5 * PERIOD


def test_waits_are_drawn_in_a_fixed_order_so_seeded_runs_repeat():
    """One draw per wait, in the order the waits are handed out: what the seeded simulator relies on."""
    machine, rng = timing(7), random.Random(7)
    waits = [
        machine.start(),
        machine.looked(False),
        machine.looked(True),
        machine.confirmed(False),
        machine.looked(True),
        machine.confirmed(True),
        machine.stayed(),
    ]
    expected = [
        PERIOD * rng.uniform(0, 1),
        PERIOD * rng.uniform(0.5, 1.5),
        rng.uniform(1, 2) * ANNOUNCE,
        PERIOD * rng.uniform(0.5, 1.5),
        rng.uniform(1, 2) * ANNOUNCE,
        0.0,
        PERIOD * rng.uniform(0.5, 1.5),
    ]
    assert [w.seconds for w in waits] == expected
    assert [w.action for w in waits] == [LOOK, LOOK, CONFIRM, LOOK, CONFIRM, MOVE, LOOK]


def test_calls_out_of_order_are_refused():
    machine = timing()
    with pytest.raises(RuntimeError):
        machine.looked(moves=False)  # nothing to look at before start
    machine.start()
    with pytest.raises(RuntimeError):
        machine.start()
    with pytest.raises(RuntimeError):
        machine.confirmed(moves=True)  # no second look was asked for
    with pytest.raises(RuntimeError):
        machine.stayed()
    machine.looked(moves=True)
    with pytest.raises(RuntimeError):
        machine.looked(moves=True)


def test_the_throughput_average_starts_from_one_timing_and_weighs_the_newest_a_tenth():
    average = ThroughputAverage()
    assert average.seconds_per_sample is None and average.samples_per_second == 0.0
    average.add(0.5)
    assert average.seconds_per_sample == 0.5 and average.samples_per_second == 2.0
    average.add(1.5)
    assert average.seconds_per_sample == pytest.approx(0.6)
    average.reset(0.25)  # a fresh timing on a new stage forgets the old stage's
    assert average.seconds_per_sample == 0.25 and average.samples_per_second == 4.0


def test_a_peer_may_not_return_to_a_stage_within_the_cool_down():
    cooldown = ReturnCooldown(600.0)
    assert cooldown.barred(0.0) == frozenset()
    cooldown.left(0, 100.0)
    cooldown.left(3, 250.0)
    assert cooldown.barred(300.0) == {0, 3}
    assert cooldown.barred(700.0) == {3}
    assert cooldown.barred(850.0) == frozenset()


def test_a_look_at_a_view_not_yet_settled_is_taken_again_within_two_announce_periods():
    machine, rng = timing(seed=4), random.Random(4)
    assert machine.start().seconds == PERIOD * rng.uniform(0, 1)
    again = machine.looked(moves=False, settled=False)
    assert again == Wait(LOOK, rng.uniform(1, 2) * ANNOUNCE)
    assert machine.looked(moves=True).action == CONFIRM
