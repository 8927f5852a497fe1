"""The trainer's peer finder waiting for an empty stage: one read shared by every waiting call, paced."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from swarm.policy.router import Router
from swarm.records.stage_records import SERVING, StageRecord
from swarm.trainer.peer_finder import WAIT_POLL, PeerFinder


def record(peer: str, expiration: float) -> StageRecord:
    return StageRecord(peer, 0, "gpt-tiny", 3, SERVING, 0, 10.0, 0, 32, 0, 2, expiration)


def test_calls_waiting_for_an_empty_stage_share_one_read_at_a_time_and_resume_together():
    config = SimpleNamespace(trust_root=None, run_id="swarm", stage_wait_timeout=30.0)
    router = Router()
    finder = PeerFinder(None, config, 256, router)
    reads: list[float] = []

    async def read_records() -> None:  # stands in for the DHT read: the stage is served again on the third
        reads.append(time.monotonic())
        await asyncio.sleep(0.05)
        if len(reads) == 3:
            router.update({0: [record("restorer", time.time() + 60.0)]}, 0.0)

    finder.refresh = read_records

    async def waiting_calls() -> None:
        await asyncio.wait_for(asyncio.gather(*(finder.wait_for_stage(0, False) for _ in range(4))), 10.0)

    asyncio.run(waiting_calls())
    assert len(reads) == 3, "four calls waiting made one read at a time between them, not one each"
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    assert all(gap >= WAIT_POLL - 0.01 for gap in gaps), gaps
    assert all(gap < WAIT_POLL + 0.5 for gap in gaps), gaps  # and no slower than the pace (0.5 s each before)
