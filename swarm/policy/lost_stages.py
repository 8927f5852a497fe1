"""Which stages are lost, which copies of a stage the swarm holds, and which holder restores a lost one.

Standby holders (`swarm.peer.standby`) and newcomers compute these from the same signed records, so every
peer reaches the same answer where their views agree; nothing here touches the network.
"""

from __future__ import annotations

from swarm.records.stage_records import JOINING, SERVING, StageRecord

RESTORE_STEP_SLACK = 4  # copy steps apart that count as equally fresh when choosing a restorer


def standby_targets(stage: int, num_stages: int, count: int) -> list[int]:
    """The stages a peer of `stage` holds standby copies of: the next `count`, never its own."""
    following = ((stage + i) % num_stages for i in range(1, count + 1))
    return list(dict.fromkeys(s for s in following if s != stage))


def lost_stages(records: dict[int, list[StageRecord]], num_stages: int) -> set[int]:
    """Stages no record shows a peer serving or joining."""
    return {s for s in range(num_stages) if not any(r.state in (SERVING, JOINING) for r in records.get(s, []))}


def choose_restorer(stage: int, records: dict[int, list[StageRecord]]) -> tuple[str, int] | None:
    """(peer id, step) of the holder that restores `stage`, or None if none may.

    Every holder computes this from the records, so all must agree though their reads differ by a period:
    copies within `RESTORE_STEP_SLACK` steps of the freshest count as equally fresh (records a period old
    show copies that follow their stage a step or two apart, and three holders that each saw their own as
    the freshest once all left their stage at once). Among those: a movable peer before a pinned one, then
    the holder whose own stage keeps the most serving peers, then the peer id. The restorer takes a fresher
    copy after it serves, if a holder announces one. A stage's last serving peer never restores another:
    that would only move the loss.
    """
    candidates = []
    for own, group in records.items():
        serving = [r for r in group if r.state == SERVING]
        if own == stage or len(serving) < 2:
            continue
        for record in serving:
            copy = record.standby_of(stage)
            if copy is not None and copy[0] >= 0:
                candidates.append((copy[0], not record.movable, -len(serving), record.peer_id))
    if not candidates:
        return None
    freshest = max(c[0] for c in candidates)
    best = min((c for c in candidates if c[0] >= freshest - RESTORE_STEP_SLACK), key=lambda c: c[1:])
    return best[3], best[0]


def standby_copies(stage: int, records: dict[int, list[StageRecord]]) -> dict[str, tuple[int, str]]:
    """The copies of `stage` that serving peers of other stages announce: holder -> (step, fingerprint)."""
    return {
        r.peer_id: r.standby_of(stage)
        for own, group in records.items()
        if own != stage
        for r in group
        if r.state == SERVING and r.standby_of(stage) is not None
    }


def standby_holders(stage: int, records: dict[int, list[StageRecord]]) -> set[str]:
    """Peers whose serving records name them as holders of a standby copy of `stage`."""
    return set(standby_copies(stage, records))


def reached_step(stage: int, records: dict[int, list[StageRecord]], step: int) -> int:
    """The furthest step `stage`'s records (maybe the last words of its dead peers) show, and at least `step`."""
    return max([step, *(r.step for r in records.get(stage, []))])
