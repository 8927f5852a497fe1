"""A peer's record never lapses while it is alive, however long its event loop is kept busy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from swarm.net.dht_node import TetheredDHT
from swarm.peer.announcer import Announcer
from swarm.proto import PROTOCOL_VERSION
from swarm.records.stage_records import LEAVING, SERVING, StageRecord, announce, fetch_stage_records

RUN, TTL, PERIOD, BUSY = "announcer-test", 1.5, 0.3, 4.0


def watch(dht: TetheredDHT, peer_id: str, stop: threading.Event, seen: list[tuple[float, str | None]]) -> None:
    """Reads the stage's records from another thread, as any other peer would, noting this peer's state."""
    while not stop.is_set():
        records = fetch_stage_records(dht, RUN, 2, only=0)[0]
        seen.append((time.monotonic(), next((r.state for r in records if r.peer_id == peer_id), None)))
        time.sleep(0.1)


def longest_absence(seen: list[tuple[float, str | None]]) -> float:
    longest, since = 0.0, None
    for t, state in seen:
        if state is None:
            since = t if since is None else since
            longest = max(longest, t - since)
        else:
            since = None
    return longest


async def keep_loop_busy(seconds: float) -> None:
    """A handler that computes on the loop (or a read awaited in line) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.timeout(120)
def test_renewals_from_the_announcer_thread_survive_a_busy_loop_and_keep_states_in_order():
    dht = TetheredDHT(start=True)
    try:
        peer_id = str(dht.peer_id)
        state = {"value": SERVING}

        def record() -> StageRecord:
            return StageRecord(peer_id, 0, "gpt-tiny", 2, state["value"], 0, 5.0, 0, 32, 0, PROTOCOL_VERSION)

        def store(r: StageRecord) -> None:
            announce(dht, RUN, r, TTL)

        async def renew_on_the_loop(done: threading.Event) -> None:  # how renewals were scheduled before
            while not done.is_set():
                await asyncio.get_running_loop().run_in_executor(None, store, record())
                await asyncio.sleep(PERIOD)

        def run(renewing_on_loop: bool) -> float:
            stop, seen = threading.Event(), []
            announcer = Announcer(store, record, PERIOD)

            async def main() -> None:
                if renewing_on_loop:
                    task = asyncio.create_task(renew_on_the_loop(stop))
                else:
                    announcer.start()
                await asyncio.sleep(1.0)  # the record is out, and renewed
                await keep_loop_busy(BUSY)
                await asyncio.sleep(0.5)
                if renewing_on_loop:
                    stop.set()
                    await task  # its last store finishes before the loop closes

            watcher = threading.Thread(target=watch, args=(dht, peer_id, stop, seen), daemon=True)
            watcher.start()
            try:
                asyncio.run(main())
            finally:
                stop.set()
                watcher.join(10)
                announcer.stop()
            assert any(s == SERVING for _, s in seen)
            return longest_absence([(t, s) for t, s in seen if t > seen[0][0] + 1.0])

        # renewed from the loop, the record lapses while the loop is busy: the peer vanishes from view
        assert run(renewing_on_loop=True) > 1.0
        # renewed from the announcer's own thread, it never does
        assert run(renewing_on_loop=False) == 0.0

        # a change of state goes out in order with the renewals: the old state never comes back
        announcer = Announcer(store, record, 0.05)
        announcer.start()
        try:
            time.sleep(0.3)
            state["value"] = LEAVING
            announcer.announce_now().result(timeout=10)
            for _ in range(10):
                assert fetch_stage_records(dht, RUN, 2, only=0)[0][0].state == LEAVING
                time.sleep(0.05)
            assert announcer.renewals > 0 and announcer.failures == 0
        finally:
            announcer.stop()
    finally:
        dht.shutdown()
