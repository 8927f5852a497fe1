"""Replies to one destination leave one at a time, at the link's full rate, the smallest waiting first.

A peer's replies to one caller share the uplink between them. Sent all at once, four equal replies share
the link and all arrive after four replies' time; sent in turn, they arrive after one, two, three and four,
2.5 on average (temporal sharing, as ATLAS does for WAN training). A reply ready while another to the same
destination is being written waits its turn; the smallest waiting goes next, which lowers the mean further,
unless one has been passed over `MAX_OVERTAKEN` times, which then goes first (no reply starves). Replies to
other destinations do not wait for each other.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from swarm.net.link_shaper import SharedLink

MAX_OVERTAKEN = 8


@dataclass
class _Waiter:
    nbytes: int
    order: int
    ready: asyncio.Future
    overtaken: int = 0


@dataclass
class _Destination:
    busy: bool = False
    waiting: list[_Waiter] = field(default_factory=list)


def frames_bytes(frames: Sequence) -> int:
    """Bytes the frames take on the wire (frames with tensor parts, or plain messages)."""
    return sum(f.nbytes if hasattr(f, "nbytes") else f.ByteSize() for f in frames)


class UplinkTurns:
    """Writes replies to each destination one at a time (see the module's docstring); `enabled=False` writes them
    at once. `link`, for tests and benchmarks, emulates the uplink the replies cross (a `SharedLink`)."""

    def __init__(self, enabled: bool = True, link: SharedLink | None = None) -> None:
        self.enabled = enabled
        self.link = link
        self._destinations: dict[str, _Destination] = {}
        self._order = itertools.count()
        self.waited = 0  # replies that waited for another's turn

    async def send(self, destination: str, nbytes: int, write: Callable[[], Awaitable[None]]) -> None:
        """Runs `write` (which sends `nbytes` to `destination`) in that destination's turn."""
        if not self.enabled:
            await self._write(nbytes, write)
            return
        state = self._destinations.setdefault(destination, _Destination())
        if state.busy:
            waiter = _Waiter(nbytes, next(self._order), asyncio.get_running_loop().create_future())
            state.waiting.append(waiter)
            self.waited += 1
            try:
                await waiter.ready
            except BaseException:
                if waiter in state.waiting:
                    state.waiting.remove(waiter)
                elif waiter.ready.done() and not waiter.ready.cancelled():
                    self._pass_on(destination, state)  # it was handed the turn as it was cancelled
                raise
        state.busy = True
        try:
            await self._write(nbytes, write)
        finally:
            self._pass_on(destination, state)

    async def _write(self, nbytes: int, write: Callable[[], Awaitable[None]]) -> None:
        if self.link is not None:
            await self.link.transfer(nbytes)
        await write()

    def _pass_on(self, destination: str, state: _Destination) -> None:
        """The turn goes to the smallest waiting reply (or to one passed over too often), or ends."""
        if not state.waiting:
            state.busy = False
            self._destinations.pop(destination, None)
            return
        starved = [w for w in state.waiting if w.overtaken >= MAX_OVERTAKEN]
        chosen = (
            min(starved, key=lambda w: w.order) if starved else min(state.waiting, key=lambda w: (w.nbytes, w.order))
        )
        state.waiting.remove(chosen)
        for waiter in state.waiting:
            if waiter.order < chosen.order:
                waiter.overtaken += 1
        chosen.ready.set_result(None)
