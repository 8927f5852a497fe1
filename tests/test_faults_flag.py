"""The --faults language: entries parse to where, what, when and how long; a typo is named, not ignored."""

from __future__ import annotations

import pytest

from swarm.config.faults_flag import Fault, FaultError, parse_faults


def test_entries_parse_to_their_point_action_hit_and_seconds():
    faults = parse_faults("before_slices@1=delay:4, before_slices@1=freeze:100,after_step=perturb")
    assert faults == [
        Fault("before_slices", "delay", 1, 4.0),
        Fault("before_slices", "freeze", 1, 100.0),
        Fault("after_step", "perturb", None, 0.0),
    ]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("before_slice=die", "unknown point"),
        ("reply=explode", "unknown action"),
        ("reply@0=die", "hits count from 1"),
        ("reply=freeze:soon", "freeze's argument seconds"),
        ("reply=perturb", "applies at after_step only"),
        ("reply", "expected POINT[@N]=ACTION"),
    ],
)
def test_a_bad_entry_is_named(text, named):
    with pytest.raises(FaultError, match=named.replace("[", r"\[")):
        parse_faults(text)
