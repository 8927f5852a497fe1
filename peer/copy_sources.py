"""Where a standby holder takes a stage's copy from (`swarm.peer.standby`): versions, sources, shapes.

A holder takes only a version two of the stage's peers confirm: for a catch-up by step deltas, from what
their records announce (each lists its last steps); with a trust root, or for a whole refresh, from what
each answers when asked, since only an answer carries the receipts that say whose state counts. The
source is any peer at that version, so that the copies' cost is spread over the stage, but never one
whose deltas once led elsewhere.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch
from hivemind.utils import get_dht_time

from swarm.models import build_stage
from swarm.net.wire import WireLimits
from swarm.peer.state_transfer import (
    Version,
    announced_versions,
    confirmed_holders,
    newest_confirmed,
    peer_versions,
)
from swarm.peer.work_receipts import WorkReceipts, work_receipts
from swarm.proto import PeerInfo
from swarm.records.stage_records import StageRecord

if TYPE_CHECKING:
    from swarm.peer.liveness_probes import LivenessProbes
    from swarm.peer.standby_host import StandbyHost

INFO_TIMEOUT = 5.0


class CopySources:
    """A holder's view of the stages it copies: their shapes, their peers' versions, and whom to take from."""

    def __init__(self, peer: StandbyHost) -> None:
        self.peer = peer
        self.templates: dict[int, torch.nn.Module] = {}  # per stage: its shapes, on the meta device
        self.receipts: dict[int, WorkReceipts | None] = {}  # per stage, with a trust root: whose copies count
        self.delta_misses: dict[int, set[str]] = {}  # per stage: sources whose deltas led to no confirmed version
        self.rng = random.Random()

    def template(self, stage: int) -> torch.nn.Module:
        """The stage's module on the meta device: its shapes, to check a state against, at no memory cost."""
        if stage not in self.templates:
            config = self.peer.config
            with torch.device("meta"):
                self.templates[stage] = build_stage(self.peer.spec, stage, config.num_stages, config.seed)
        return self.templates[stage]

    def limits(self, stage: int) -> WireLimits:
        """The size limits of a whole state of `stage` (parameters and both optimizer moments) on the wire."""
        count = sum(p.numel() for p in self.template(stage).parameters())
        state_bytes = 16 * count + 2**20
        return WireLimits(max_message_bytes=state_bytes, max_tensor_bytes=state_bytes)

    def _receipts(self, stage: int) -> WorkReceipts | None:
        """With a trust root, the receipts that say whose copies of `stage` count; None without one."""
        if stage not in self.receipts:
            self.receipts[stage] = work_receipts(self.peer.config, self.peer.mates.machine.peer_id, stage)
        return self.receipts[stage]

    async def answered(
        self, stage: int, peers: list[str], known: dict[str, PeerInfo] | None = None
    ) -> dict[str, Version]:
        """Each of `peers`' (step, fingerprint) as it answers now, for `stage` (the silent ones left out; with a
        trust root, those that show no recent receipt naming them too); `known`: answers in hand, not asked again."""
        receipts = self._receipts(stage)
        sources = receipts.state_sources if receipts is not None else None
        p2p, model = self.peer.mates.p2p, self.peer.config.model
        return await peer_versions(p2p, peers, model, stage, INFO_TIMEOUT, sources, known)

    async def announced(
        self, stage: int, serving: list[StageRecord], fresh: bool = False, probes: LivenessProbes | None = None
    ) -> dict[str, Version]:
        """What `serving` peers' records announce, where no trust root asks for receipts (then each is asked):
        in the calm a catch-up costs the stage's peers one call, not one each. `fresh` (while peers die): each is
        asked as well, and the view with the newer confirmed version is taken. Records are announced and read
        once a period each, so the version they confirm trails the stage by up to two periods' steps, and a
        wave that takes the stage then rolls those steps back. The answers the holder's liveness `probes` got this
        period say the same: those peers are not asked twice."""
        peers, receipts = [r.peer_id for r in serving], self._receipts(stage) is not None
        recorded = announced_versions(serving)
        if not (fresh or receipts):
            return recorded
        since = get_dht_time() - self.peer.config.announce_period
        known = await probes.answers(peers, since) if probes is not None else None
        asked = await self.answered(stage, peers, known)
        if receipts:
            return asked
        return asked if newest_confirmed(asked) > newest_confirmed(recorded) else recorded

    def pick(self, stage: int, versions: dict[str, Version], minimum_step: int = 0) -> tuple[str, Version] | None:
        """A peer at the newest version two of `stage`'s peers confirm (from `minimum_step`), and that version;
        any of them, but none whose deltas led nowhere confirmed."""
        holders = confirmed_holders(versions, minimum_step)
        if not holders:
            return None
        top = versions[holders[0]]
        sources = [h for h in holders if versions[h] == top and h not in self.delta_misses.get(stage, ())]
        return (self.rng.choice(sources), top) if sources else None

    def note_miss(self, stage: int, source: str) -> int:
        """`source`'s deltas led `stage`'s copy to no confirmed version: never its source again. The stage's misses."""
        self.delta_misses.setdefault(stage, set()).add(source)
        return len(self.delta_misses[stage])

    def misses(self, stage: int) -> int:
        """How many sources' deltas led `stage`'s copy to no confirmed version."""
        return len(self.delta_misses.get(stage, ()))
