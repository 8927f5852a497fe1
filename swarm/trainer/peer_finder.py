"""The peers this trainer may call: read from the DHT into its router, and waited for when a stage has none."""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.config import TrainerConfig
from swarm.net.direct_plane import DirectPlane
from swarm.policy.router import Router
from swarm.records.stage_records import StageRecord, fetch_stage_records
from swarm.trainer.outcome import TrainingError

logger = logging.getLogger(__name__)

REFRESH_PERIOD = 2.0


class PeerFinder:
    """Keeps the router's view of every stage's peers fresh from the DHT, leaving out peers of another model."""

    def __init__(self, dht: DHT, config: TrainerConfig, vocab_size: int, router: Router) -> None:
        self.dht = dht
        self.config = config
        self.vocab_size = vocab_size  # the trainer's model's: a peer whose model has another cannot serve it
        self.router = router
        self.p2p: DirectPlane | None = None  # once the trainer's daemon is up: told where peers listen directly
        self._wrong_vocab: dict[str, tuple[int, int]] = {}  # peers whose model has another vocabulary: stage, size

    async def refresh(self) -> dict[int, list[StageRecord]]:
        """Reads the stages' records from the DHT into the router; returns this trainer's model's, per stage."""
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(
            None, fetch_stage_records, self.dht, self.config.run_id, self.config.num_stages
        )
        mine = {
            stage: [r for r in recs if r.model == self.config.model and r.num_stages == self.config.num_stages]
            for stage, recs in records.items()
        }
        for stage, recs in mine.items():
            # a peer whose embedding or head has another size cannot serve this trainer's token ids
            for r in recs:
                if r.vocab_size not in (0, self.vocab_size) and r.peer_id not in self._wrong_vocab:
                    self._wrong_vocab[r.peer_id] = (stage, r.vocab_size)
                    logger.warning(
                        f"Ignoring peer {r.peer_id} of stage {stage}: its model knows {r.vocab_size} token ids, "
                        f"this trainer's {self.vocab_size}; start it with --vocab-size {self.vocab_size}"
                    )
            mine[stage] = [r for r in recs if r.vocab_size in (0, self.vocab_size)]
        self.router.update(mine, get_dht_time())
        if self.p2p is not None:
            self.p2p.learn(r for recs in mine.values() for r in recs)
        return mine

    async def refresh_forever(self) -> None:
        """Refreshes every REFRESH_PERIOD seconds until cancelled; a failed read is logged, not raised."""
        while True:
            await asyncio.sleep(REFRESH_PERIOD)
            try:
                await self.refresh()
            except Exception as e:
                logger.warning(f"Could not read peers from the DHT: {e}")

    async def wait_for_stage(self, stage: int, before_first_step: bool) -> None:
        """Waits until `stage` has a live peer, saying so; TrainingError after stage_wait_timeout.

        Before the trainer's first step, a stage whose only peers have another vocabulary is an error at once.
        """
        deadline = time.monotonic() + self.config.stage_wait_timeout
        warned = False
        while not self.router.live_peers(stage):
            wrong = sorted({size for s, size in self._wrong_vocab.values() if s == stage})
            if wrong and before_first_step:
                raise TrainingError(
                    f"stage {stage} has only peers whose model knows {', '.join(map(str, wrong))} token ids, this "
                    f"trainer's {self.vocab_size}: start the peers and this trainer with the same --vocab-size"
                )
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"stage {stage} has had no live peer for {self.config.stage_wait_timeout:.0f}s; "
                    f"start one with `swarm peer --stage {stage} --initial-peers ...`"
                )
            if not warned:
                logger.warning(f"Stage {stage} has no live peer yet; waiting for one to join")
                warned = True
            await asyncio.sleep(0.5)
            await self.refresh()
        if warned:
            logger.info(f"Stage {stage} has a live peer again; resuming")

    async def wait_for_swarm(self) -> tuple[int, int]:
        """Waits for every stage to have a peer; returns (target batch size, current step)."""
        await self.refresh()
        for stage in range(self.config.num_stages):
            await self.wait_for_stage(stage, before_first_step=True)
        peers = [r for stage in range(self.config.num_stages) for r in self.router.live_peers(stage)]
        targets = {r.target_batch_size for r in peers}
        if len(targets) != 1:
            raise TrainingError(f"peers disagree on --target-batch-size: {sorted(targets)}; restart them alike")
        steps = {r.step for r in peers}
        if len(steps) > 1:
            logger.warning(f"Stages are at different steps {sorted(steps)}; continuing from the lowest")
        return targets.pop(), min(steps)
