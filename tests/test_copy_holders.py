"""Which peers hold a stage's standby copies when each stage keeps at most a few (`swarm.policy.copy_holders`)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from swarm.config import PeerConfig
from swarm.peer.standby import StandbyKeeper
from swarm.peer.standby_copy import Standby
from swarm.policy.copy_holders import capped_targets, copy_holders
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord


def record(peer: str, stage: int, standbys=(), state: str = SERVING) -> StageRecord:
    return StageRecord(peer, stage, "gpt-tiny", 3, state, 5, 10.0, 0, 24, 0, 1, standbys=tuple(standbys))


def swarm(per_stage: int, stages: int = 3, holding: dict[str, list[int]] | None = None):
    holding = holding or {}
    return {
        s: [
            record(f"peer-{s}-{i}", s, [(t, 5, "f" * 16) for t in holding.get(f"peer-{s}-{i}", [])])
            for i in range(per_stage)
        ]
        for s in range(stages)
    }


def copies_per_stage(records, count: int, cap: int) -> Counter:
    held = Counter()
    for stage, group in records.items():
        for r in group:
            held.update(capped_targets(r.peer_id, stage, len(records), count, cap, records))
    return held


def test_a_large_swarm_keeps_at_most_the_cap_of_copies_of_each_stage_a_small_one_every_candidate():
    large = swarm(per_stage=10)
    assert copies_per_stage(large, count=2, cap=3) == {0: 3, 1: 3, 2: 3}
    assert copies_per_stage(large, count=2, cap=0) == {0: 20, 1: 20, 2: 20}  # no cap: every peer its two
    small = swarm(per_stage=1)
    assert copies_per_stage(small, count=2, cap=3) == {0: 2, 1: 2, 2: 2}


def test_the_copies_of_a_stage_sit_on_peers_of_the_stages_before_it_in_turn_nearest_first():
    records = swarm(per_stage=4)
    holders = copy_holders(2, 3, 2, 3, records)
    assert [h.split("-")[1] for h in holders] == ["1", "0", "1"]
    # in the calm (one next stage) only the stage before holds copies
    assert {h.split("-")[1] for h in copy_holders(2, 3, 1, 3, records)} == {"1"}


def test_claims_to_hold_copies_win_no_slot_and_a_newcomer_that_ranks_within_the_cap_takes_one():
    records = swarm(per_stage=4)
    first = copy_holders(2, 3, 2, 3, records)
    # peers that claim copies they may never have taken rank where their digests put them, not first
    claimants = [r.peer_id for g in records.values() for r in g if r.peer_id not in first and r.stage in (0, 1)]
    claimed = swarm(per_stage=4, holding={peer_id: [2] for peer_id in claimants})
    assert copy_holders(2, 3, 2, 3, claimed) == first
    for i in range(40):
        newcomer = record(f"newcomer-{i}", 1)
        records[1].append(newcomer)
        holders = copy_holders(2, 3, 2, 3, records)
        assert len(holders) == 3 and set(holders) <= set(first) | {newcomer.peer_id}
        records[1].remove(newcomer)


def test_when_a_holder_dies_the_next_candidate_of_its_stage_takes_its_place():
    records = swarm(per_stage=4)
    first = copy_holders(2, 3, 2, 3, records)
    dead = next(h for h in first if h.startswith("peer-1-"))
    records[1] = [r for r in records[1] if r.peer_id != dead]
    after = copy_holders(2, 3, 2, 3, records)
    assert set(first) - {dead} <= set(after) and len(after) == 3
    assert sorted(h.split("-")[1] for h in after) == ["0", "1", "1"]


def test_a_reader_whose_own_record_is_not_read_yet_is_still_a_candidate():
    records = swarm(per_stage=4)
    reader = copy_holders(2, 3, 2, 3, records)[0]
    stage = int(reader.split("-")[1])
    records[stage] = [r for r in records[stage] if r.peer_id != reader]
    assert 2 in capped_targets(reader, stage, 3, 2, 3, records)


def test_leaving_peers_are_no_candidates_joining_ones_are():
    records = {0: [record("a", 0, state=LEAVING), record("b", 0, state=JOINING)], 1: [], 2: []}
    assert copy_holders(1, 3, 1, 3, records) == ["b"]


def test_a_holder_passed_by_newcomers_keeps_its_copy_until_they_announce_theirs():
    """Two newcomers on a stage can pass every holder of the next stage's copy at once; if the holders dropped
    theirs then and the stage died before the newcomers took copies, it had none left (a spot trace's stage
    restarted from step 0 so, 140 steps lost)."""
    records = swarm(per_stage=2)
    before = copy_holders(2, 3, 2, 3, records)
    assert len(before) == 3
    newcomers = [record(f"newcomer-{i}", s) for i in range(30) for s in (0, 1)]
    passed = None
    for k in range(2, len(newcomers), 2):
        grown = {**records, 0: records[0] + newcomers[0:k:2], 1: records[1] + newcomers[1:k:2]}
        after = copy_holders(2, 3, 2, 3, grown)
        if not set(after) & set(before):
            passed = grown
            break
    assert passed is not None, "some newcomers pass every holder"
    for holder in before:
        stage = int(holder.split("-")[1])
        assert 2 not in capped_targets(holder, stage, 3, 2, 3, passed), "holding nothing, it takes no copy"
        assert 2 in capped_targets(holder, stage, 3, 2, 3, passed, held=[2]), "its copy stays while theirs are -1"
    holding = copy_holders(2, 3, 2, 3, passed)
    announced = {
        s: [record(r.peer_id, s, [(2, 7 if r.peer_id in holding else -1, "")]) for r in group]
        for s, group in passed.items()
    }
    for holder in before:
        stage = int(holder.split("-")[1])
        assert 2 not in capped_targets(holder, stage, 3, 2, 3, announced, held=[2]), "replaced: dropped"


def test_a_keeper_past_the_cap_drops_its_copy_and_one_within_it_keeps_its_own():
    """The wiring in `swarm.peer.standby`: the cap is taken from a read of every stage, and what it leaves
    out is dropped once the holders within it announce copies; a copy of a stage that looks lost is kept
    whatever the cap."""
    records = swarm(per_stage=5, holding={h: [1] for h in copy_holders(1, 3, 1, 3, swarm(per_stage=5))})
    holders = copy_holders(1, 3, 1, 3, records)
    outside = next(r.peer_id for r in records[0] if r.peer_id not in holders)
    for peer_id, keeps in ((holders[0], True), (outside, False)):
        config = PeerConfig(model="gpt-tiny", num_stages=3, announce_period=1.0)
        peer = SimpleNamespace(config=config, stage=0, state=SERVING, mates=None, peer_id=peer_id)
        keeper = StandbyKeeper(peer)
        keeper.standbys[1] = Standby(1, 4, 96, True, "0123456789abcdef", 0, tensors=[])
        keeper._spawn = lambda coroutine, fetching=None: coroutine.close()  # no event loop here: refreshes never run
        assert keeper.targets() == [1], "before its first read of every stage it keeps what it holds"
        keeper.observe(records)
        assert keeper.targets() == ([1] if keeps else [])
        assert (1 in keeper.standbys) == keeps
    lost = {**records, 1: []}
    keeper = StandbyKeeper(SimpleNamespace(config=config, stage=0, state=SERVING, mates=None, peer_id=outside))
    keeper.standbys[1] = Standby(1, 4, 96, True, "0123456789abcdef", 0, tensors=[])
    keeper._spawn = lambda coroutine, fetching=None: coroutine.close()
    keeper.empty_since[1] = 0.0
    keeper.observe(lost)
    assert 1 in keeper.standbys, "the copy of a stage that looks lost stays"
