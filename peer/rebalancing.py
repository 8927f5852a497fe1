"""Where a peer serves: the stage it picks with `--stage auto`, and its moves to the swarm's bottleneck.

Both follow the balance rule (`swarm.policy.balance`) on the swarm as the DHT shows it; when the
peer looks at the plan, and when it takes a move, is `swarm.policy.rebalance_timing`'s to say. Moves
read the swarm through `swarm.policy.held_records` (records that lapsed held for a grace period, and
each peer's measured spread), and never return to a stage within the cool-down of
`swarm.policy.rebalance_timing.ReturnCooldown`: the simulator drives the same pieces.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import torch

from swarm.models import ModelSpec, build_stage
from swarm.peer.checkpoint import checkpoint_path
from swarm.policy.balance import (
    MOVE_FIXED_SECONDS,
    Move,
    MoveCost,
    capacities,
    choose_stage,
    loads_from_records,
    plan_moves,
)
from swarm.policy.held_records import HeldRecords, hold_grace
from swarm.policy.rebalance_timing import LOOK, MOVE, RebalanceTiming, ReturnCooldown
from swarm.proto import PROTOCOL_VERSION
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord

if TYPE_CHECKING:
    from swarm.config import PeerConfig

logger = logging.getLogger(__name__)


FetchRecords = Callable[..., Awaitable[dict[int, list[StageRecord]]]]  # (only: int | Iterable[int] | None)
Announce = Callable[..., Awaitable[None]]  # (record: StageRecord | None): this peer's record, or the one given


class MovablePeer(Protocol):
    """What rebalancing reads of its peer (`swarm.peer.server.Peer`), and the state it sets while leaving."""

    config: PeerConfig
    spec: ModelSpec
    costs: list[float]  # each stage's relative cost per sample
    peer_id: str
    rng: random.Random
    stage: int
    state: str
    moving_to: int
    moves: int
    movable: bool


class Rebalancing:
    """A peer's choice of stage and its moves, reading the DHT with `fetch_records` and announcing with
    `announce` (the peer's own, so that its announcements stay in order with its renewals)."""

    def __init__(self, peer: MovablePeer, fetch_records: FetchRecords, announce: Announce) -> None:
        self.peer = peer
        self.fetch_records = fetch_records
        self.announce = announce
        self._state_mb: list[float] | None = None  # each stage's state, parameters and optimizer, in MiB
        config = peer.config
        # a move back within the horizon a move's gain is counted for would undo a move judged to pay
        grace = hold_grace(config.rebalance_period, config.announce_period, config.record_ttl)
        self.held = HeldRecords(grace, cooldown=config.rebalance_horizon)
        self.cooldown = ReturnCooldown(config.rebalance_horizon)  # its own moves, which it cannot miss

    async def choose_stage(self) -> int:
        """`--stage auto`: the stage of a checkpoint to resume, else the swarm's bottleneck."""
        peer, config = self.peer, self.peer.config
        if config.checkpoint_dir:
            for stage in range(config.num_stages):
                if checkpoint_path(config.checkpoint_dir, config.model, stage, config.num_stages).exists():
                    logger.info(f"Found a checkpoint of stage {stage}; hosting that stage")
                    return stage
        # peers started together would all see the same bottleneck: a random pause, then an
        # announcement right after choosing, lets the later ones see the earlier ones' choices
        await asyncio.sleep(peer.rng.uniform(0, config.announce_period))
        try:
            records = await self.fetch_records()
        except Exception as e:
            logger.warning(f"Could not read the swarm's stages ({e}); choosing among all of them at random")
            records = {}
        loads = loads_from_records(records, peer.costs)
        stage = choose_stage(loads, config.num_stages, peer.costs, peer.rng)
        logger.info(
            f"Chose stage {stage}: stage capacities {[round(c, 1) for c in capacities(loads, config.num_stages)]} "
            "samples/s"
        )
        # until this peer has measured itself, it counts as a typical peer of that stage
        peers_there = sorted(p.throughput for p in loads if p.stage == stage)
        typical = peers_there[len(peers_there) // 2] if peers_there else 0.0
        guess = config.simulated_speed / peer.costs[stage] if config.simulated_speed else typical
        placeholder = StageRecord(
            peer.peer_id, stage, config.model, config.num_stages, JOINING, 0, guess, 0,
            config.target_batch_size, 0, PROTOCOL_VERSION, movable=peer.movable, vocab_size=peer.spec.vocab_size,
        )  # fmt: skip
        try:
            await self.announce(placeholder)
        except Exception as e:
            logger.warning(f"Could not announce the choice of stage {stage} ({e})")
        return stage

    def move_cost(self) -> MoveCost:
        """What a move costs, from the model and flags every peer shares, so that all plan alike."""
        config = self.peer.config
        if self._state_mb is None:
            # the state a mover downloads: parameters and the two AdamW moments, counted on the meta device
            with torch.device("meta"):
                counts = [
                    sum(p.numel() for p in build_stage(self.peer.spec, s, config.num_stages, 0).parameters())
                    for s in range(config.num_stages)
                ]
            self._state_mb = [3 * 4 * n / 2**20 for n in counts]
        return MoveCost.of_state(
            max(self._state_mb), config.move_bandwidth_mbit, MOVE_FIXED_SECONDS, config.rebalance_horizon
        )

    async def planned_move(self) -> Move | None:
        """This peer's move in the balance rule's plan for the swarm as the DHT shows it now, if any."""
        peer, config = self.peer, self.peer.config
        try:
            records = await self.fetch_records()
        except Exception as e:
            logger.warning(f"Could not read the swarm's stages for rebalancing ({e})")
            return None
        view = self.held.update(records, time.monotonic())
        if not self.held.ready():
            return None  # one read shows neither lapses nor how noisy the speeds are
        loads = loads_from_records(view, peer.costs, self.held.spreads())
        now = time.monotonic()
        barred = {**self.held.barred(now), peer.peer_id: self.cooldown.barred(now)}
        plan = plan_moves(
            loads, config.num_stages, config.rebalance_margin, peer.costs, move_cost=self.move_cost(), barred=barred
        )
        mine = next((m for m in plan if m.peer_id == peer.peer_id), None)
        return mine if mine is not None and mine.source == peer.stage else None

    async def another_serves(self, stage: int) -> bool:
        """Whether the DHT shows a peer other than this one serving `stage` (read after announcing LEAVING)."""
        try:
            records = await self.fetch_records(only=stage)
        except Exception as e:
            logger.warning(f"Could not read stage {stage}'s records before leaving it ({e})")
            return False
        return any(r.state == SERVING and r.peer_id != self.peer.peer_id for r in records[stage])

    async def run(self, move_to: asyncio.Queue[int]) -> None:
        """Every randomised period, asks the balance rule whether this peer should move; tells `serve` where.

        Every peer computes the same whole plan, and each checks once a period, so the moves of a plan
        are taken within one period. A mover announces LEAVING naming its target at once: the others'
        plans count it there, so the rest of the plan stays the plan, and no second peer is sent for the
        gap it fills. It announces its target stage itself only once it has built it and serves there.
        """
        peer, config = self.peer, self.peer.config
        # a peer's first look comes within one period, so a swarm started skewed is balanced in one
        timing = RebalanceTiming(config.rebalance_period, config.announce_period, peer.rng, first_look=peer.moves == 0)
        wait = timing.start()
        while True:
            await asyncio.sleep(wait.seconds)
            if wait.action == LOOK:
                mine = await self.planned_move() if peer.state == SERVING else None
                wait = timing.looked(mine is not None, settled=self.held.ready() or peer.state != SERVING)
                continue
            # the second look: its target may differ, as where a plan sends each mover shifts with small
            # changes of speed; that it moves does not
            mine = await self.planned_move()
            wait = timing.confirmed(mine is not None)
            if wait.action != MOVE:
                continue
            if await self._leave_for(mine):
                self.cooldown.left(mine.source, time.monotonic())
                await move_to.put(mine.target)
                return
            wait = timing.stayed()

    async def _leave_for(self, move: Move) -> bool:
        """Announces LEAVING for the move's target; False, serving on, if then no other peer serves the stage.

        No stage is left without a serving peer in anyone's view, even where two peers read different
        views: once its LEAVING is out, the mover looks for another serving peer.
        """
        peer = self.peer
        peer.state, peer.moving_to = LEAVING, move.target
        try:
            await self.announce()
            await asyncio.sleep(peer.config.announce_period)
            if not await self.another_serves(peer.stage):
                logger.info(f"Staying on stage {peer.stage}: no other peer serves it in the DHT now")
                peer.state, peer.moving_to = SERVING, -1
                await self.announce()
                return False
        except BaseException:
            if peer.state == LEAVING and peer.moving_to == move.target:
                peer.state, peer.moving_to = SERVING, -1
            raise
        spread = self.held.pooled_spread() or 0.0
        logger.info(
            f"Moving from stage {move.source} to the bottleneck stage {move.target}: the lower of the two "
            f"goes from {move.low_before:.1f} to {move.low_after:.1f} samples/s (speeds measured within "
            f"{100 * spread:.0f}%)"
        )
        return True
