"""Held-open calls to the peers a held stage hangs on: a death is seen when it happens, not a period later.

A standby holder learns that a held stage's last peer died from a probe (`swarm.peer.liveness_probes`) sent
once per announce period: half a period late on average, a whole one at worst, and the restore waits as long.
A process that dies has its connections closed by its kernel at once, crash and kill alike. So the holder
keeps one info call open to each serving peer of a held stage that has at most `WATCHED_PER_STAGE` of them:
the callee answers, then holds the stream until it hangs up `HANG_UP_TIMEOUT` seconds later, and the holder
calls again. A call that ends much sooner, or cannot be made, has the peer probed at once; a probe that fails
wakes the holder's read of every stage (`LivenessProbes.news`) as a periodic probe's does, and the restorer is
chosen then. Only the probe counts a peer silent: an early end proves nothing by itself (a gate turning a
stream away closes it too), and a peer whose call ended early but that answered the probe is left unwatched
for `QUIET_S` seconds, so that no callee, hostile or busy, makes the holder call it again and again. A held
call costs the callee one of the caller's open streams (`--max-streams-per-caller`) and one answer every
`HANG_UP_TIMEOUT` seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Coroutine, Iterable

from hivemind.p2p import P2P, PeerID

from swarm.net.transport import INFO_PROTOCOL, exchange_and_hold
from swarm.net.wire import HANG_UP_TIMEOUT, WireLimits
from swarm.peer.liveness_probes import LivenessProbes
from swarm.proto import PROTOCOL_VERSION, PeerInfo, PeerInfoRequest
from swarm.records.stage_records import SERVING, StageRecord

WATCHED_PER_STAGE = 2  # a stage with more serving peers outlives any one death: none of them is watched
EARLY_SHARE = 0.5  # a call held open for less than this share of the callee's hang-up timeout ended early
QUIET_S = 30.0  # seconds a peer that answered the probe after an early end is left unwatched


class DeathWatch:
    """The held calls of one standby holder (see the module docstring)."""

    def __init__(self, probes: LivenessProbes, spawn: Callable[[Coroutine], object]) -> None:
        self.probes = probes
        self.spawn = spawn  # runs a coroutine as a task its owner cancels when it stops
        self.wanted: set[str] = set()  # the peers to watch, as the last `follow` found them
        self.watching: set[str] = set()  # the peers a task watches now
        self.quiet_until: dict[str, float] = {}  # peer id -> when (time.monotonic) it may be watched again
        self.calls = 0  # calls made
        self.early_ends = 0  # calls that ended early or could not be made: each had its peer probed

    def follow(self, p2p: P2P, records: dict[int, list[StageRecord]], stages: Iterable[int], me: str) -> None:
        """Watches the serving peers (not `me`) of each of `stages` that has at most `WATCHED_PER_STAGE` of them in
        `records`; a peer watched before and not now is let go once its held call ends."""
        now = time.monotonic()
        wanted = set()
        for stage in stages:
            serving = {r.peer_id for r in records.get(stage, []) if r.state == SERVING}
            if len(serving) <= WATCHED_PER_STAGE:
                wanted |= serving
        self.wanted = {p for p in wanted - {me} if self.quiet_until.get(p, 0.0) <= now}
        self.quiet_until = {p: until for p, until in self.quiet_until.items() if until > now}
        for peer_id in self.wanted - self.watching:
            self.watching.add(peer_id)
            self.spawn(self._watch(p2p, peer_id))

    async def _watch(self, p2p: P2P, peer_id: str) -> None:
        """Holds calls to `peer_id` open, one after another while it is wanted, until one ends early; then probes
        the peer."""
        request, callee = PeerInfoRequest(protocol_version=PROTOCOL_VERSION), PeerID.from_base58(peer_id)
        try:
            held = HANG_UP_TIMEOUT
            while held >= EARLY_SHARE * HANG_UP_TIMEOUT:
                if peer_id not in self.wanted:
                    return
                held = 0.0
                self.calls += 1
                with contextlib.suppress(Exception):  # a call that cannot be made ends early, as one the callee cuts
                    held = await exchange_and_hold(p2p, callee, INFO_PROTOCOL, [request], PeerInfo, WireLimits())
            self.early_ends += 1
            while self.probes.in_flight:  # one round of probes at a time (see LivenessProbes.probe)
                await self.probes.round_ended.wait()
            await self.probes.probe(p2p, [peer_id])
            if peer_id not in self.probes.silent:
                self.quiet_until[peer_id] = time.monotonic() + QUIET_S
        finally:
            self.watching.discard(peer_id)
