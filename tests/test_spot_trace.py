"""Spot traces: parsed strictly, replayed as a live-peer count scaled to the swarm's size."""

from __future__ import annotations

import pytest

from harness.spot_trace import live_peer_targets, mean_live_peers, read_trace


def test_live_count_is_scaled_so_the_peak_becomes_the_peer_count(tmp_path):
    trace = tmp_path / "trace.csv"
    # live nodes: 2 at t=0, 3 at 1 s, 2 at 2 s, 3 at 4 s (the last event sets the span)
    trace.write_text("0,add,a\n0,add,b\n1000,add,c\n2000,remove,a\n4000,add,d\n")
    targets = live_peer_targets(trace, minutes=1, max_peers=30)
    assert targets == [(0.0, 20), (15.0, 30), (30.0, 20), (60.0, 30)]


def test_the_count_never_falls_below_the_floor_and_simultaneous_events_count_once(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n500,remove,a\n500,remove,b\n500,remove,c\n1000,add,e\n")
    targets = live_peer_targets(trace, minutes=1, max_peers=8, min_peers=3)
    # at 500 ms the trace holds one node (2 peers), raised to the floor; no entry for the passing 6 and 4
    assert targets == [(0.0, 8), (30.0, 3), (60.0, 4)]


def test_the_mean_live_count_weighs_each_count_by_how_long_it_holds():
    targets = [(0.0, 20), (15.0, 30), (30.0, 20), (60.0, 30)]
    # 15 s at 20, 15 s at 30, 30 s at 20 over the first minute; the last target holds past the end
    assert mean_live_peers(targets, 60) == pytest.approx((15 * 20 + 15 * 30 + 30 * 20) / 60)
    assert mean_live_peers(targets, 90) == pytest.approx((15 * 20 + 15 * 30 + 30 * 20 + 30 * 30) / 90)
    with pytest.raises(ValueError):
        mean_live_peers([], 60)


@pytest.mark.parametrize(
    ("text", "error"),
    [("0,add,a\n5,launch,b\n", "trace.csv:2: event must be add or remove"), ("0,add,a\nsoon,add,b\n", "trace.csv:2")],
)
def test_malformed_lines_are_refused_with_their_number(tmp_path, text, error):
    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    with pytest.raises(ValueError, match=error):
        read_trace(trace)


def test_an_empty_trace_is_refused(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("\n")
    with pytest.raises(ValueError, match="no events"):
        read_trace(trace)
