"""The rule by which a failed probe takes a peer's record out of a standby holder's view, and when it stops."""

from __future__ import annotations

import asyncio
import dataclasses

from hivemind.utils import get_dht_time

from swarm.peer.liveness_probes import LivenessProbes
from swarm.peer.state_transfer import peer_versions
from swarm.proto import PeerInfo
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


def test_a_refusal_another_call_found_counts_as_a_refused_probe_and_wakes_the_keeper_at_once():
    """A holder catching up its copy from a stage's last peer finds it gone the moment that peer dies: its keeper
    reads at once and the stage counts as lost without a grace, instead of a period later from a stalled record."""
    probes = LivenessProbes(record_ttl=TTL, timeout=1.0)
    last = record("a", 2, renewed_at=get_dht_time() - 0.5)
    assert probes.live({2: [last]}) == {2: [last]} and not probes.take_news()
    probes.note_refused(last.peer_id)
    assert probes.take_news() and probes.live({2: [last]}) == {2: []} and probes.all_refused([last])
    probes.note_refused(last.peer_id)  # told again by another call: no news
    assert not probes.take_news()
    # alive after all: a record renewed since counts again
    assert probes.live({2: [record("a", 2, renewed_at=get_dht_time() + 1.0)]})[2]


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


def test_a_probe_rounds_answers_stand_in_for_a_holders_version_asks_of_the_same_peers():
    """While copies follow their stages, a holder probes the held stages' peers and asks them their versions each
    period, both with one PeerInfo request: the probe's answer is taken for the ask (the one in flight waited
    for), and only a peer with no answer this period is asked again."""
    probes = LivenessProbes(record_ttl=TTL, timeout=1.0)
    answered = asyncio.Event()
    a, b, c = "a" * 4, "b" * 4, "c" * 4

    async def ask(p2p: object, peer_id: str) -> PeerInfo:
        await answered.wait()
        if peer_id == b:
            raise ConnectionError("silent")
        other_stage = 2 if peer_id == c else 1
        return PeerInfo(model="gpt-tiny", stage=other_stage, state=SERVING, step=7, fingerprint="f" * 16)

    probes._ask = ask

    async def main() -> None:
        since = get_dht_time()
        probing = asyncio.create_task(probes.probe(None, [a, b, c]))
        await asyncio.sleep(0)  # the round is in flight: its answers are waited for
        waiting = asyncio.create_task(probes.answers([a, b, c], since))
        await asyncio.sleep(0)
        assert not waiting.done()
        answered.set()
        await probing
        known = await waiting
        assert set(known) == {a, c}, "a silent peer has no answer"
        assert await probes.answers([a], get_dht_time() + 1.0) == {}, "an answer older than asked for is not taken"
        # every peer answered already: nobody is asked (no network at all), and only what fits counts
        assert await peer_versions(None, [a, c], "gpt-tiny", 1, 1.0, known=known) == {a: (7, "f" * 16)}

    asyncio.run(main())
