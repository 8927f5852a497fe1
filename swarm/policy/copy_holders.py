"""Which peers hold a stage's standby copies: at most a few per stage, however large the swarm. Pure.

Each peer of stage s may hold copies of the next stages (`standby_targets`). Left at that, every
peer holds one: with p peers per stage and K copies each, a stage has p x K copies, each following
it step by step under churn (its step deltas fetched and applied every period), and the stage's
peers serve deltas to every one of them. Past the few copies that keep a stage through a wave, the
others cost CPU and links and save nothing.

So each stage keeps at most `cap` copies. Its candidate holders are the live peers of the stages
that would hold it; they are ranked, the same on every peer that reads the same records:

- one candidate per source stage in turn, the nearest stage first, so that the copies sit on peers of
  different stages and one wave that takes a stage and the stage before it leaves one;
- within a source stage, by a digest of (peer id, stage).

What a record claims to hold does not count: a claim proves nothing, and a few identities that
claimed copies they never took would otherwise push every real holder of a stage out of the cap. The
first `cap` hold it. When a holder dies, the next candidate starts a copy at its next read; a
newcomer whose digest ranks within the cap takes a copy, and the holder it passes drops its own once
every holder within the cap announces one (a newcomer fetched its copies whole before the cap as well).
Dropping at once left a stage with no live copy: in a spot trace, two newcomers passed both fresh
holders of a stage, whose last peer then died before the newcomers had taken theirs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from swarm.policy.lost_stages import standby_copies, standby_targets
from swarm.records.stage_records import JOINING, SERVING, StageRecord


def _digest(peer_id: str, stage: int) -> bytes:
    return hashlib.blake2b(f"{peer_id}/{stage}".encode(), digest_size=8).digest()


def copy_holders(
    target: int,
    num_stages: int,
    count: int,
    cap: int,
    records: dict[int, list[StageRecord]],
    me: tuple[str, int] | None = None,
) -> list[str]:
    """The peers that hold copies of stage `target`, at most `cap` (0: every candidate), in rank order.

    `records` are the live records read, per stage; `count` is how many next stages each peer copies. `me`
    is the reading peer as (id, stage): its own record is missing before its first announcement.
    """
    per_source: dict[int, list[tuple[bytes, str]]] = {}
    for source in range(num_stages):
        if target not in standby_targets(source, num_stages, count):
            continue
        ranked = {r.peer_id for r in records.get(source, []) if r.state in (SERVING, JOINING)}
        if me is not None and me[1] == source:
            ranked.add(me[0])
        per_source[source] = sorted((_digest(peer_id, target), peer_id) for peer_id in ranked)
    # round robin over the source stages, nearest first: each one's first candidate, then each one's second, ...
    ordered = sorted(
        ((rank, (target - source) % num_stages), peer_id)
        for source, ranked in per_source.items()
        for rank, (_, peer_id) in enumerate(ranked)
    )
    holders = [peer_id for _, peer_id in ordered]
    return holders if cap <= 0 else holders[:cap]


def replaced(target: int, holders: list[str], records: dict[int, list[StageRecord]]) -> bool:
    """Whether every one of `holders` announces a copy of stage `target` (at some step, not the -1 of one still to be
    taken): a copy held past the cap is kept until then."""
    copies = standby_copies(target, records)
    return all(holder in copies and copies[holder][0] >= 0 for holder in holders)


def capped_targets(
    peer_id: str,
    stage: int,
    num_stages: int,
    count: int,
    cap: int,
    records: dict[int, list[StageRecord]],
    held: Iterable[int] = (),
) -> list[int]:
    """The stages of `standby_targets(stage, num_stages, count)` this peer holds copies of when each stage keeps at
    most `cap` (see the module docstring). A copy it already holds (`held`) past the cap is kept until the holders
    within the cap announce theirs: newcomers that passed it in rank hold nothing yet, and a wave that took the
    stage then left it no copy."""
    kept = []
    for target in standby_targets(stage, num_stages, count):
        holders = copy_holders(target, num_stages, count, cap, records, (peer_id, stage))
        if peer_id in holders or (target in held and not replaced(target, holders, records)):
            kept.append(target)
    return kept
