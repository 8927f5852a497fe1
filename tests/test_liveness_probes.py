"""The rule by which a failed probe takes a peer's record out of a standby holder's view, and when it stops."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hivemind.p2p import P2P, PeerID

from swarm.net.transport import INFO_PROTOCOL
from swarm.net.wire import WireLimits, read_frames, write_frames
from swarm.peer.liveness_probes import LivenessProbes, probe_plan
from swarm.proto import PROTOCOL_VERSION, PeerInfo, PeerInfoRequest
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


def test_a_round_asks_the_last_peer_to_answer_per_held_stage_and_the_own_stage_peers_not_heard_from():
    records = {
        0: [record("me", 0, 99.0), record("mate", 0, 99.0), record("quiet", 0, 99.0)],
        1: [record("a", 1, 99.0), record("b", 1, 99.0), record("c", 1, 99.0, state=LEAVING)],
        2: [],
    }
    answered = {"b" * 4: 50.0, "a" * 4: 40.0}
    peers, backups = probe_plan(records, 0, [1, 2], "me" * 4, {"mate" * 4}, answered)
    assert peers == {"quiet" * 4, "b" * 4}, "the mate spoke this period, b answered last; a stage of none: nobody"
    assert backups == {"b" * 4: ["a" * 4]}, "a leaving peer is never asked"


@pytest.mark.timeout(60)
def test_a_failed_probe_asks_its_stages_other_peers_in_the_same_round():
    """Over real libp2p: a live peer answers the info protocol; two ids nobody holds fail within the timeout."""

    async def main():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in await server.get_visible_maddrs()]
        caller = await P2P.create(initial_peers=maddrs)
        try:

            async def answer(_info, reader, writer):
                await read_frames(reader, PeerInfoRequest, WireLimits())
                await write_frames(writer, [PeerInfo(protocol_version=PROTOCOL_VERSION)])
                writer.close()

            await server.add_binary_stream_handler(INFO_PROTOCOL, answer)
            live = server.peer_id.to_base58()
            gone, also_gone = (PeerID(bytes([0, 4, 9, 8, 7, n])).to_base58() for n in (1, 2))
            probes = LivenessProbes(record_ttl=TTL, timeout=1.0)
            await probes.probe(caller, [live], {live: [gone]})
            assert probes.answered.keys() == {live} and probes.probes == 1, "an answer: the rest are not asked"
            await probes.probe(caller, [also_gone], {also_gone: [live, gone]})
            assert probes.probes == 4 and set(probes.silent) == {gone, also_gone} and probes.failures == 2
            assert not probes.in_flight
        finally:
            await caller.shutdown()
            await server.shutdown()

    asyncio.run(main())
