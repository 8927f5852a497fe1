"""Where a chaos run's time went: each slow step's excess charged to the churn event that slowed it."""

from __future__ import annotations

from harness.chaos_report import time_lost_by_cause


def test_a_slow_step_is_charged_to_the_weightiest_event_near_it_and_a_fast_one_to_nothing():
    # one trainer: steps of 0.5 s (the no-churn median), one of 4.5 s after a stage loss, one of 1.5 s during a
    # kill and a start, one of 1.0 s with nothing within 3 s, then one after `until`
    ends = [[100.0, 100.5, 105.0, 105.5, 107.0, 107.5, 108.0, 108.5, 109.0, 109.5, 110.0, 111.0, 120.0]]
    events = [(100.4, "kill", 1), (100.6, "stage lost", 1), (106.0, "start", 2), (106.2, "kill", 0)]
    lost = time_lost_by_cause(ends, events, typical_step=0.5, until=115.0)
    assert lost == {"stage lost": 4.0, "kill": 1.0, "start": 0.0, "none": 0.5}
    # with two trainers the seconds are their mean: the churn window is one span of time, not one per trainer
    both = time_lost_by_cause([ends[0], [100.0, 100.5, 101.0]], events, typical_step=0.5, until=115.0)
    assert both == {cause: round(seconds / 2, 1) for cause, seconds in lost.items()}
