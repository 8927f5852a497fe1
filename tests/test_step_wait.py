"""A forward that asks for a step the stage has not taken waits for it; a peer that stops serving answers
such calls at once, since it will never take that step (its trainer goes to another peer at once)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from swarm.peer.handler import StageHandler
from swarm.records.stage_records import LEAVING, SERVING


class FullStep:
    """A stage whose current step has its batch: it steps once its round ends, which never happens here."""

    def is_full(self) -> bool:
        return True

    def lost(self) -> dict:
        return {}


def handler(state: list[str]) -> StageHandler:
    waiting = StageHandler.__new__(StageHandler)  # only the step wait is exercised: no stage module needed
    waiting.runtime = SimpleNamespace(step=3)
    waiting.mates = FullStep()
    waiting.state = lambda: state[0]
    waiting.step_wait = 30.0
    waiting._step_changed = asyncio.Event()
    return waiting


def test_a_call_waiting_for_the_next_step_is_answered_as_soon_as_its_peer_stops_serving():
    async def go() -> tuple[bool | None, float]:
        state = [SERVING]
        waiting = handler(state)
        started = time.monotonic()
        call = asyncio.create_task(waiting._wait_for_step(4))
        for _ in range(3):  # lets the call run up to its wait
            await asyncio.sleep(0)
        assert not call.done(), "a serving peer waits for its step"
        state[0] = LEAVING
        waiting.notify_step()
        return await asyncio.wait_for(call, 5), time.monotonic() - started

    reached, waited = asyncio.run(go())
    assert reached is False and waited < 2.0
