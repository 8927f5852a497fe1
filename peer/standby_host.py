"""What standby copies read of the peer that holds them, and ask of it (`swarm.peer.server.Peer` provides it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from swarm.models import ModelSpec
from swarm.peer.mates import StageMates
from swarm.peer.runtime import StageRuntime
from swarm.records.sample_ledger import SampleLedger
from swarm.records.stage_records import StageRecord

if TYPE_CHECKING:
    from swarm.config import PeerConfig


class StandbyHost(Protocol):
    """What a standby keeper reads of its peer (`swarm.peer.server.Peer`), and asks of it."""

    config: PeerConfig
    spec: ModelSpec
    peer_id: str
    stage: int
    state: str
    mates: StageMates | None  # the stage-mates of the stage hosted now (None before the first is built)
    runtime: StageRuntime | None
    ledger: SampleLedger

    def request_move(self, stage: int) -> None:
        """Asks the peer to move to `stage` (here: to restore it) at its next chance."""

    async def _announce(self, record: StageRecord | None = None) -> None:
        """Stores this peer's record now (default: the current one, its copies as they are at the store)."""

    async def _fetch_records(self, only: int | None = None) -> dict[int, list[StageRecord]]:
        """The stages' records from the DHT (every stage's, or `only` that one's)."""
