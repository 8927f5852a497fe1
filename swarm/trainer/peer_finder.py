"""The peers this trainer may call: read from the DHT into its router, and waited for when a stage has none.

A record is a claim, so none can stop this trainer: a peer whose record announces settings other than
those this trainer uses (`swarm.records.announced_settings.disagreements`: its own model, cut, vocabulary
and dtype; the target batch size most peers announce, then kept) is left out of the router and named
once, and a throughput claim out of its stage's bounds (`swarm.policy.claim_bounds`) is named once too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.config import TrainerConfig
from swarm.net.direct_plane import DirectPlane
from swarm.policy.claim_bounds import CLAIM_MULTIPLE, bounded_claims
from swarm.policy.router import Router
from swarm.records.accusations import accusation_book
from swarm.records.announced_settings import disagreements, used_settings
from swarm.records.stage_records import ANNOUNCED_DTYPES, SERVING, StageRecord, fetch_stage_records
from swarm.trainer.outcome import TrainingError

logger = logging.getLogger(__name__)

REFRESH_PERIOD = 2.0
# while a stage has no live peer, reads one at most this often, one read shared by every call that waits: a
# restored stage serves again a second or two after its last peer died, and each wait ended a poll late
WAIT_POLL = 0.2
MAX_NAMED = 1024  # disagreements and claims named in a warning; past this, at debug level only


class PeerFinder:
    """Keeps the router's view of every stage's peers fresh from the DHT, leaving out peers of another model."""

    def __init__(self, dht: DHT, config: TrainerConfig, vocab_size: int, router: Router) -> None:
        self.dht = dht
        self.config = config
        self.vocab_size = vocab_size  # the trainer's model's: a peer whose model has another cannot serve it
        self.router = router
        self.p2p: DirectPlane | None = None  # once the trainer's daemon is up: told where peers listen directly
        self._wrong_vocab: dict[str, tuple[int, int]] = {}  # peers whose model has another vocabulary: stage, size
        self.target_batch_size: int | None = None  # the swarm's, once `wait_for_swarm` found it: then this trainer's
        self.used: dict[str, tuple] = {}  # the settings this trainer uses and why, as the last read showed them
        self._named: set[tuple] = set()  # (peer, setting, value) already named in a warning
        # in a swarm with a trust root: the peers vouched trainers' spot checks accused, never called again
        self.accusations = accusation_book(config.trust_root, config.run_id, "Trainer")
        # told of every serving record that says its step is short of lost samples (stage, record), after each read
        self.on_short: Callable[[int, StageRecord], None] | None = None
        self._waiting_read: asyncio.Task | None = None  # the read the calls waiting for a stage share
        self._waiting_read_at = float("-inf")  # when it began (monotonic)

    def own_settings(self) -> dict[str, object]:
        """The announced settings this trainer has of its own: a record that differs from one is ignored."""
        config = self.config
        own: dict[str, object] = {"model": config.model, "num_stages": config.num_stages}
        own["vocab_size"] = self.vocab_size
        if config.dtype in ANNOUNCED_DTYPES:  # an explicit --dtype; auto takes the swarm's
            own["dtype"] = config.dtype
        if self.target_batch_size is not None:
            own["target_batch_size"] = self.target_batch_size
        if config.stage_blocks:  # an explicit cut; without one the trainer takes the swarm's (it holds no blocks)
            own["stage_blocks"] = tuple(config.stage_blocks)
        return own

    async def refresh(self) -> dict[int, list[StageRecord]]:
        """Reads the stages' records from the DHT into the router; returns this trainer's model's, per stage."""
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(
            None, fetch_stage_records, self.dht, self.config.run_id, self.config.num_stages
        )
        ignored = self._disagreeing([r for recs in records.values() for r in recs]) | await self._accused()
        mine = {stage: [r for r in recs if r.peer_id not in ignored] for stage, recs in records.items()}
        self.router.forget(ignored)  # also what an earlier read held of them
        self._name_claims(mine)
        self.router.update(mine, get_dht_time())
        if self.p2p is not None:
            self.p2p.learn(r for recs in mine.values() for r in recs)
        if self.on_short is not None:
            for stage, recs in mine.items():
                for record in recs:
                    if record.short and record.state == SERVING:
                        self.on_short(stage, record)
        return mine

    async def _accused(self) -> set[str]:
        """The peers accused so far (the run's accusations read again; a failed read keeps what was known)."""
        if self.accusations is None:
            return set()
        try:
            await self.accusations.read(self.dht)
        except Exception as e:
            logger.debug(f"Could not read the run's accusations: {e}")
        return set(self.accusations.accused)

    def _disagreeing(self, records: list[StageRecord]) -> set[str]:
        """The peers whose records announce settings other than this trainer's, each named once."""
        own = self.own_settings()
        found = disagreements(records, own)
        for d in found:
            if d.setting == "vocab_size":  # a peer whose model has another vocabulary cannot serve these token ids
                self._wrong_vocab.setdefault(d.peer_id, (d.stage, d.announced))
            self._name((d.peer_id, d.setting, d.announced), d.describe())
        self.used = used_settings(records, own)
        return {d.peer_id for d in found}

    def _name_claims(self, records: dict[int, list[StageRecord]]) -> None:
        """Names once each serving peer whose announced throughput is out of its stage's bounds."""
        for stage, recs in records.items():
            claims = {r.peer_id: r.throughput for r in recs if r.state == SERVING}
            counted, ignored = bounded_claims(claims, self.router.measured.get(stage, 0.0))
            for peer_id, claim in ignored.items():
                self._name(
                    (peer_id, "throughput", claim),
                    f"Not believing the throughput peer {peer_id} of stage {stage} announces ({claim:.4g} samples/s): "
                    f"more than {CLAIM_MULTIPLE:g} times its stage's; it counts as {counted[peer_id]:.4g} until timed",
                )

    def _name(self, key: tuple, warning: str) -> None:
        if key in self._named:
            return
        if len(self._named) < MAX_NAMED:
            self._named.add(key)
            logger.warning(warning)
        else:
            logger.debug(warning)

    async def refresh_forever(self) -> None:
        """Refreshes every REFRESH_PERIOD seconds until cancelled; a failed read is logged, not raised."""
        while True:
            await asyncio.sleep(REFRESH_PERIOD)
            await self._read_logged()

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
            if not await self._read_while_waiting():  # a stuck DHT node: the deadline above ends the wait, saying why
                await asyncio.sleep(REFRESH_PERIOD)
        if warned:
            logger.info(f"Stage {stage} has a live peer again; resuming")

    async def _read_while_waiting(self) -> bool:
        """Reads the records for the calls that wait for a stage: one read at a time, shared by all of them, begun
        at most every `WAIT_POLL` seconds; False if it failed (said once, by the call that began it)."""
        if self._waiting_read is None or self._waiting_read.done():
            await asyncio.sleep(max(0.0, self._waiting_read_at + WAIT_POLL - time.monotonic()))
        if self._waiting_read is None or self._waiting_read.done():
            self._waiting_read_at = time.monotonic()
            self._waiting_read = asyncio.ensure_future(self._read_logged())
        return await asyncio.shield(self._waiting_read)

    async def _read_logged(self) -> bool:
        """One `refresh`; a failed read is logged, not raised (False)."""
        try:
            await self.refresh()
        except Exception as e:
            logger.warning(f"Could not read peers from the DHT: {e}")
            return False
        return True

    async def wait_for_swarm(self) -> tuple[int, int]:
        """Waits for every stage to have a peer and for the swarm's target batch size (what more than half of the
        distinct peers announce, kept from then on); returns (target batch size, current step)."""
        await self.refresh()
        for stage in range(self.config.num_stages):
            await self.wait_for_stage(stage, before_first_step=True)
        self.target_batch_size = await self._settle_target()
        await self.refresh()  # peers of another target batch size are left out from now on
        for stage in range(self.config.num_stages):
            await self.wait_for_stage(stage, before_first_step=True)
        peers = [r for stage in range(self.config.num_stages) for r in self.router.live_peers(stage)]
        steps = {r.step for r in peers}
        if len(steps) > 1:
            logger.warning(f"Stages are at different steps {sorted(steps)}; continuing from the lowest")
        return self.target_batch_size, min(steps)

    async def _settle_target(self) -> int:
        """The target batch size more than half of the distinct peers announce; while they are split evenly, waits
        (no single identity decides); TrainingError after stage_wait_timeout."""
        deadline = time.monotonic() + self.config.stage_wait_timeout
        warned = False
        while "target_batch_size" not in self.used:
            peers = {r.peer_id: r.target_batch_size for recs in self.router.records.values() for r in recs.values()}
            split = sorted(set(peers.values()))
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"the peers are split evenly on --target-batch-size {split}: no value has more than half of them; "
                    "restart them alike"
                )
            if not warned:
                logger.warning(f"The peers are split evenly on --target-batch-size {split}; waiting for a majority")
                warned = True
            await asyncio.sleep(0.5)
            await self.refresh()
        return int(self.used["target_batch_size"][0])
