"""Who fills a stage that lost every peer when no standby holder restores it.

A stage with no peer stops every trainer. Its copy holders restore it first (`swarm.peer.standby`); where
none does within a few announce periods (its copies died with it, or the only holder is the last peer of
its own stage), a peer of the stage with the most to spare moves there, whatever the rebalancing period:
it takes a copy if one can still be had, or serves the stage from its initial state, said loudly. Every
peer computes the same choice from the same records, so one peer moves, not all.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.records.stage_records import LEAVING, SERVING, StageRecord


def coming(stage: int, records: dict[int, list[StageRecord]]) -> list[StageRecord]:
    """The leaving records that name `stage` as their peer's target (a restorer or a mover on its way there)."""
    return [r for group in records.values() for r in group if r.state == LEAVING and r.moving_to == stage]


def on_the_way(stage: int, records: dict[int, list[StageRecord]]) -> bool:
    """Whether a peer is leaving its stage for `stage` (a restorer or a mover announces its target)."""
    return bool(coming(stage, records))


def coming_copy(stage: int, records: dict[int, list[StageRecord]]) -> int | None:
    """The step of the freshest copy of `stage` that a holder on its way to restore it brings (its leaving record
    names the stage and still lists the copy), or None."""
    steps = [copy[0] for r in coming(stage, records) if (copy := r.standby_of(stage)) is not None]
    return max(steps, default=None)


def choose_filler(stage: int, records: dict[int, list[StageRecord]], barred: Iterable[str] = ()) -> str | None:
    """The peer id of the serving peer that moves to the empty `stage`, or None if no stage can spare one.

    A donor stage keeps a serving peer after the move (it has two or more). The mover is the one that
    leaves the pipeline's slower side fastest: of each candidate, the lower of its own speed (the empty
    stage's after the move) and what its stage keeps, the highest; then a movable peer before a pinned
    one, the donor with more peers, and the peer id. `barred` (peers accused by a vouched trainer) never
    move there.
    """
    shut_out = set(barred)
    candidates = []
    for own, group in records.items():
        serving = [r for r in group if r.state == SERVING and r.peer_id not in shut_out]
        if own == stage or len(serving) < 2:
            continue
        capacity = sum(r.throughput for r in serving)
        for record in serving:
            keeps = min(record.throughput, capacity - record.throughput)
            candidates.append((-keeps, not record.movable, -len(serving), record.peer_id))
    return min(candidates)[3] if candidates else None
