"""The rule by which a failed probe takes a peer's record out of a standby holder's view, and when it stops."""

from __future__ import annotations

import dataclasses

from swarm.peer.liveness_probes import LivenessProbes
from swarm.records.stage_records import LEAVING, SERVING, StageRecord

TTL = 6.0


def record(peer: str, stage: int, renewed_at: float, state: str = SERVING) -> StageRecord:
    base = StageRecord(peer * 4, stage, "gpt-tiny", 3, state, 5, 10.0, 0, 24, 0, 1)
    return dataclasses.replace(base, expiration=renewed_at + TTL)


def test_a_record_renewed_before_a_failed_probe_is_left_out_and_one_renewed_after_counts_again():
    probes = LivenessProbes(record_ttl=TTL, timeout=1.0)
    probes.silent = {"a" * 4: 100.0}  # a's last probe, sent at t=100, got no answer
    read = {0: [record("a", 0, renewed_at=99.0), record("b", 0, renewed_at=99.5)], 1: []}
    assert [r.peer_id for r in probes.live(read)[0]] == ["b" * 4]
    # the answer was late, not missing: a renewal after the probe says the peer lives
    renewed = {0: [record("a", 0, renewed_at=100.5)]}
    assert [r.peer_id for r in probes.live(renewed)[0]] == ["a" * 4]


def test_a_leaving_record_stays_in_view_after_its_peer_went_silent():
    """A peer that left on request and exited is silent too; its LEAVING record tells holders not to restore."""
    probes = LivenessProbes(record_ttl=TTL, timeout=1.0)
    probes.silent = {"a" * 4: 100.0}
    read = {0: [record("a", 0, renewed_at=99.0, state=LEAVING)]}
    assert probes.live(read) == read


def test_a_peer_with_a_shorter_record_ttl_counts_again_at_its_next_renewal():
    """The holder's --record-ttl (60 s) may exceed the silent peer's (6 s): its renewals then look older than the
    failed probe by the holder's reckoning, but a later expiration still shows one, within a period."""
    probes = LivenessProbes(record_ttl=60.0, timeout=1.0)
    probes.silent = {"a" * 4: 100.0}
    assert probes.live({0: [record("a", 0, renewed_at=99.0)]})[0] == []
    assert [r.peer_id for r in probes.live({0: [record("a", 0, renewed_at=101.0)]})[0]] == ["a" * 4]


def test_a_record_that_stops_renewing_is_stalled_after_a_period_and_one_that_renews_never_is():
    """In the calm a holder asks only the peers whose records stopped renewing: a live peer renews every period,
    whatever its TTL or clock (only a change of expiration counts, timed by the reader)."""
    probes = LivenessProbes(record_ttl=TTL, timeout=1.0)
    assert probes.stalled([record("a", 0, 100.0), record("b", 0, 500.0)], 1.0, now=10.0) == set()
    assert probes.stalled([record("a", 0, 101.0), record("b", 0, 500.0)], 1.0, now=10.6) == set()  # within a period
    assert probes.stalled([record("a", 0, 102.0), record("b", 0, 500.0)], 1.0, now=11.1) == {"b" * 4}
    assert probes.stalled([record("a", 0, 102.0), record("b", 0, 500.0)], 1.0, now=12.2) == {"a" * 4, "b" * 4}
    # b's renewal was only slow to spread: live again from the read that shows it
    assert probes.stalled([record("a", 0, 103.0), record("b", 0, 501.0)], 1.0, now=12.9) == set()
