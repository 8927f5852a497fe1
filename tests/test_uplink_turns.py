"""Replies to one destination in turn, the smallest first, on an emulated link their transfers share."""

from __future__ import annotations

import asyncio

import pytest

from swarm.net.link_shaper import SharedLink
from swarm.net.uplink_turns import MAX_OVERTAKEN, UplinkTurns

UNIT = 0.5  # seconds one transfer takes alone: the link is 8 Mbit/s, a transfer 500,000 bytes
SIZE = 500_000


async def completions(turns: UplinkTurns, sizes: list[int], destination=lambda i: "caller") -> list[float]:
    """Seconds from a common start until each transfer's write ran."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def send(index: int, nbytes: int) -> float:
        written = loop.create_future()

        async def write() -> None:
            written.set_result(loop.time() - start)

        await turns.send(destination(index), nbytes, write)
        return await written

    return list(await asyncio.gather(*[send(i, n) for i, n in enumerate(sizes)]))


def test_a_shared_link_ends_four_equal_transfers_together_and_turns_end_them_one_after_another():
    at_once = asyncio.run(completions(UplinkTurns(False, SharedLink(8.0)), [SIZE] * 4))
    in_turn = asyncio.run(completions(UplinkTurns(True, SharedLink(8.0)), [SIZE] * 4))
    assert all(4 * UNIT * 0.95 <= t <= 4 * UNIT * 1.5 for t in at_once), at_once
    assert sorted(in_turn) == pytest.approx([UNIT, 2 * UNIT, 3 * UNIT, 4 * UNIT], rel=0.3, abs=0.05)
    assert sum(in_turn) / sum(at_once) < 0.7


def test_the_smallest_waiting_reply_goes_next_and_other_destinations_do_not_wait():
    order: list[int] = []

    async def run() -> None:
        turns = UplinkTurns(True, SharedLink(8.0))
        loop = asyncio.get_running_loop()

        async def send(tag: int, nbytes: int, destination: str = "caller") -> None:
            async def write() -> None:
                order.append(tag)

            await turns.send(destination, nbytes, write)

        first = asyncio.create_task(send(0, SIZE))
        await asyncio.sleep(0)  # the first takes the turn; the others queue behind it
        tasks = [asyncio.create_task(send(tag, n)) for tag, n in ((1, 3 * SIZE), (2, SIZE // 10), (3, SIZE))]
        elsewhere = loop.time()
        await send(9, SIZE // 100, "another caller")
        assert loop.time() - elsewhere < UNIT / 2  # it shared the link, not the first caller's turn
        await asyncio.gather(first, *tasks)
        assert turns.waited == 3

    asyncio.run(run())
    assert order == [9, 0, 2, 3, 1]


def test_a_reply_passed_over_too_often_goes_next():
    turns = UplinkTurns(True)
    order: list[str] = []

    async def run() -> None:
        release = asyncio.Event()

        async def hold() -> None:
            await release.wait()

        holder = asyncio.create_task(turns.send("c", 1, hold))
        await asyncio.sleep(0)

        async def send(tag: str, nbytes: int) -> None:
            async def write() -> None:
                order.append(tag)

            await turns.send("c", nbytes, write)

        big = asyncio.create_task(send("big", 10**9))
        small = [asyncio.create_task(send(f"s{i}", 1)) for i in range(MAX_OVERTAKEN + 2)]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(holder, big, *small)

    asyncio.run(run())
    assert order.index("big") == MAX_OVERTAKEN


def test_a_waiting_reply_whose_caller_goes_away_leaves_the_turns_working():
    async def run() -> list[str]:
        turns, order = UplinkTurns(True), []
        release = asyncio.Event()

        async def write_after_release() -> None:
            await release.wait()
            order.append("first")

        async def write(tag: str):
            order.append(tag)

        first = asyncio.create_task(turns.send("c", 1, write_after_release))
        await asyncio.sleep(0)
        gone = asyncio.create_task(turns.send("c", 1, lambda: write("gone")))
        last = asyncio.create_task(turns.send("c", 2, lambda: write("last")))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        await asyncio.gather(first, last)
        return order

    assert asyncio.run(asyncio.wait_for(run(), 10)) == ["first", "last"]
