"""Standby copies of other stages' state, and the restore of a stage whose every peer died.

With `--standby-stages K`, a peer of stage s also holds a copy of the state (parameters, optimizer
state, step) of stages s+1 .. s+K (mod the number of stages), in host memory (or, past
`--standby-memory-mb`, in `--checkpoint-dir`), never on the accelerator. Its record lists each copy
as (stage, step, parameter fingerprint). Once a stage's peers announce a step `--standby-every`
steps past the copy (and a refresh has not taken more than `--standby-share` of the time since the
last), the holder downloads the stage's state again in the background, over the
stage-mates' state protocol: a stage's peers give their state to a peer whose signed record names
it as a standby holder of that stage, without taking it for a mate. As a joiner does, the holder
takes only a (step, fingerprint) that two of the stage's peers confirm, where two or more serve.

A stage is lost when no record shows a peer serving or joining it for `LOST_GRACE` announce periods.
If its last peers died (their records vanished, none saying it was leaving), every holder then
computes, from the same records, which of them restores it (`choose_restorer`: the freshest copy; a
holder whose own stage keeps another serving peer; a movable one first; ties by peer id). That peer
leaves its stage as on a move and builds the lost stage from its copy, at the copy's step, and says
how many steps of progress were lost. A stage whose last peers left on request (a stop, a preemption
notice) is not taken over: whoever stops a swarm one peer at a time does not want its stages
shuffled. Where no holder restores a lost stage within `FILL_PERIODS` more announce periods, a peer
of the stage with the most to spare moves there (`swarm.policy.empty_stages`). A peer that joins an
empty stage (a newcomer with `--stage auto` picks one first) takes the freshest copy from a holder
over `STANDBY_PROTOCOL`, which answers only a peer whose signed record is on that stage.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from hivemind.p2p import PeerID

from swarm.models import ModelSpec, build_stage
from swarm.net.transport import exchange
from swarm.net.wire import WireLimits, decode_tensors, pack_frames
from swarm.peer.mates import StageMates
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_state import StageStateError, check_state_tensors, load_state_tensors, parameter_fingerprint
from swarm.peer.state_file import StateFileError, read_tensor_list, write_tensor_list
from swarm.peer.state_transfer import (
    Version,
    confirmed_holders,
    confirmed_versions,
    encode_state,
    load_into_runtime,
    parameters_fingerprint,
    peer_versions,
    request_state,
    state_handler,
)
from swarm.peer.work_receipts import WorkReceipts, work_receipts
from swarm.policy.empty_stages import choose_filler, on_the_way
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, StateReply, StateRequest
from swarm.records.sample_ledger import SampleLedger, restore_record
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord

if TYPE_CHECKING:
    from swarm.config import PeerConfig

logger = logging.getLogger(__name__)

STANDBY_PROTOCOL = "/swarm/standby/state"
LOST_GRACE = 2  # announce periods a stage shows no serving or joining record before it counts as lost
FILL_PERIODS = 3  # announce periods after that in which a holder may restore it before another peer fills it
INFO_TIMEOUT = 5.0
STATE_TIMEOUT = 120.0
JOIN_RESTORE_TIMEOUT = 90.0  # how long a peer on an empty stage tries for a standby copy before a fresh start
JOIN_RETRY_S = 2.0
WHOLE_SWARM_EVERY = 5  # announce periods between a keeper's reads of every stage; in between, the ones it holds
SHORT_READ_RETRIES = 3  # reads a peer on an empty stage makes when the swarm has trained but shows no copy of it


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

    async def _fetch_records(self, only: int | None = None) -> dict[int, list[StageRecord]]:
        """The stages' records from the DHT (every stage's, or `only` that one's)."""


def standby_targets(stage: int, num_stages: int, count: int) -> list[int]:
    """The stages a peer of `stage` holds standby copies of: the next `count`, never its own."""
    following = ((stage + i) % num_stages for i in range(1, count + 1))
    return list(dict.fromkeys(s for s in following if s != stage))


def lost_stages(records: dict[int, list[StageRecord]], num_stages: int) -> set[int]:
    """Stages no record shows a peer serving or joining."""
    return {s for s in range(num_stages) if not any(r.state in (SERVING, JOINING) for r in records.get(s, []))}


def choose_restorer(stage: int, records: dict[int, list[StageRecord]]) -> tuple[str, int] | None:
    """(peer id, step) of the holder that restores `stage`, or None if none may.

    Every holder computes this from the records, so all agree where their views agree: the freshest
    copy first (the least progress lost), then a movable peer before a pinned one, then the holder
    whose own stage keeps the most serving peers, then the peer id. A stage's last serving peer never
    restores another: that would only move the loss.
    """
    candidates = []
    for own, group in records.items():
        serving = [r for r in group if r.state == SERVING]
        if own == stage or len(serving) < 2:
            continue
        for record in serving:
            copy = record.standby_of(stage)
            if copy is not None and copy[0] >= 0:
                candidates.append((-copy[0], not record.movable, -len(serving), record.peer_id))
    if not candidates:
        return None
    best = min(candidates)
    return best[3], -best[0]


def standby_copies(stage: int, records: dict[int, list[StageRecord]]) -> dict[str, tuple[int, str]]:
    """The copies of `stage` that serving peers of other stages announce: holder -> (step, fingerprint)."""
    return {
        r.peer_id: r.standby_of(stage)
        for own, group in records.items()
        if own != stage
        for r in group
        if r.state == SERVING and r.standby_of(stage) is not None
    }


def standby_holders(stage: int, records: dict[int, list[StageRecord]]) -> set[str]:
    """Peers whose serving records name them as holders of a standby copy of `stage`."""
    return set(standby_copies(stage, records))


def reached_step(stage: int, records: dict[int, list[StageRecord]], step: int) -> int:
    """The furthest step `stage`'s records (maybe the last words of its dead peers) show, and at least `step`."""
    return max([step, *(r.step for r in records.get(stage, []))])


@dataclass
class Standby:
    """One stage's state as a holder keeps it: in host memory (`tensors`) or on local disk (`path`)."""

    stage: int
    step: int
    samples_stepped: int
    has_optimizer_state: bool
    fingerprint: str  # of the parameters, as replicas announce it
    nbytes: int
    tensors: list[torch.Tensor] | None = None
    path: Path | None = None

    def load(self) -> list[torch.Tensor]:
        """The state's tensors, read back from disk if they were spilled there."""
        if self.tensors is not None:
            return self.tensors
        try:
            return read_tensor_list(self.path)
        except StateFileError as e:
            raise StageStateError(
                f"the standby copy of stage {self.stage} cannot be used ({e}); is the disk under --checkpoint-dir "
                "full or failing?"
            ) from None

    def apply(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copies the state into a freshly built stage and its optimizer."""
        load_state_tensors(module, optimizer, self.load(), self.has_optimizer_state)


class StandbyKeeper:
    """A peer's standby copies: refreshes them, watches for lost stages, restores one when it is chosen."""

    def __init__(self, peer: StandbyHost) -> None:
        self.peer = peer
        config = peer.config
        self.count = config.standby_stages
        self.every = config.standby_every
        self.share = config.standby_share
        self.next_refresh: dict[int, float] = {}  # per stage: no refresh before (time.monotonic), see --standby-share
        self.budget = int(config.standby_memory_mb * 2**20)
        self.spill_dir = Path(config.checkpoint_dir) / "standby" if config.checkpoint_dir else None
        self.standbys: dict[int, Standby] = {}
        self.fetching: set[int] = set()
        self.templates: dict[int, torch.nn.Module] = {}  # per stage: its shapes, on the meta device
        self.receipts: dict[int, WorkReceipts | None] = {}  # per stage, with a trust root: whose copies count
        self.empty_since: dict[int, float] = {}
        self.seen_serving: set[int] = set()  # stages a record showed served: only those can be lost
        self.left_on_request: set[int] = set()  # lost stages whose last peers left on request: not restored
        self.last_step: dict[int, int] = {}  # the highest step seen announced per stage
        self.reads = 0  # announce periods so far, each with a read (see stages_to_read)
        self.restore_pending: int | None = None
        self.restored: list[tuple[int, int, int]] = []  # (stage, step, steps lost) of each restore by this peer
        self.bytes_received = 0
        self.refreshes = 0
        self.rng = random.Random()
        self._tasks: set[asyncio.Task] = set()
        self._warned_budget: set[int] = set()
        # `STANDBY_PROTOCOL`: gives a held copy to a peer whose signed record is on that copy's stage
        self.handle_standby = state_handler(
            self._answer_standby, failure="Failed to give a standby copy", caller="a standby request"
        )

    # --- what the record says -----------------------------------------------------------------------

    def targets(self) -> list[int]:
        return standby_targets(self.peer.stage, self.peer.config.num_stages, self.count)

    def announced(self) -> tuple[tuple[int, int, str], ...]:
        """The record's `standbys`: each target stage with the copy held (step -1 before the first)."""
        entries = []
        for stage in self.targets():
            copy = self.standbys.get(stage)
            entries.append((stage, copy.step, copy.fingerprint) if copy else (stage, -1, ""))
        return tuple(entries)

    def held_bytes(self) -> int:
        return sum(copy.nbytes for copy in self.standbys.values() if copy.tensors is not None)

    # --- every announce period ----------------------------------------------------------------------

    def stages_to_read(self) -> list[int] | None:
        """The stages this period's read needs (the peer's own and those it holds copies of), or None for every
        stage: every `WHOLE_SWARM_EVERY` periods (which peers hold copies of this peer's stage) and while a
        stage looks lost (its restorer, or the peer that fills it, is chosen from every peer's record)."""
        self.reads += 1
        if self.reads % WHOLE_SWARM_EVERY == 1 or self.empty_since:
            return None
        return [self.peer.stage, *self.targets()]

    def observe(self, records: dict[int, list[StageRecord]], whole_swarm: bool = True) -> None:
        """Updates who may take this peer's stage's state, refreshes copies, and restores a lost stage.

        `records` holds the stages read this period; unless `whole_swarm`, some are left out, and nothing
        is concluded about those.
        """
        peer = self.peer
        if peer.mates is not None and whole_swarm:
            peer.mates.standby_holders = standby_holders(peer.stage, records)
        targets = self.targets()
        for stage in [s for s in self.standbys if s not in targets]:
            self._drop(stage)
        now = time.monotonic()
        lost = lost_stages(records, peer.config.num_stages) & set(records)
        for stage, group in records.items():
            if group:
                self.last_step[stage] = max([self.last_step.get(stage, 0), *(r.step for r in group)])
            if any(r.state == SERVING for r in group):
                self.seen_serving.add(stage)
            if stage in lost and stage not in self.empty_since:
                self.empty_since[stage] = now
                # its last peers said they were leaving on request (a stop, a preemption notice), not moving: not dead
                if any(r.state == LEAVING and r.moving_to < 0 for r in group):
                    self.left_on_request.add(stage)
            elif stage not in lost:
                self.empty_since.pop(stage, None)
                self.left_on_request.discard(stage)
        for stage in targets:
            serving = [r for r in records.get(stage, []) if r.state == SERVING and r.peer_id not in self.accused()]
            copy = self.standbys.get(stage)
            newest = max((r.step for r in serving), default=-1)
            # a copy at step 0 would be worth nothing: a stage restarted from scratch has the same parameters
            due = newest >= (copy.step if copy else 0) + self.every and now >= self.next_refresh.get(stage, 0.0)
            if serving and due and stage not in self.fetching and peer.state == SERVING:
                self._spawn(self.refresh(stage, [r.peer_id for r in serving]))
        if peer.state != SERVING or self.restore_pending is not None or not whole_swarm:
            return
        grace = LOST_GRACE * peer.config.announce_period
        for stage in sorted(self.standbys):
            since = self.empty_since.get(stage)
            if since is None or now - since < grace or stage in self.left_on_request:
                continue
            chosen = choose_restorer(stage, records)
            if chosen is not None and chosen[0] == peer.peer_id:
                copy = self.standbys[stage]
                logger.warning(
                    f"Stage {stage} has had no peer for {now - since:.0f}s; restoring it from this peer's standby "
                    f"copy of step {copy.step}"
                )
                self.restore_pending = stage
                peer.request_move(stage)
                return
        self._fill_empty(records, now)

    def _fill_empty(self, records: dict[int, list[StageRecord]], now: float) -> None:
        """Moves this peer to a stage left empty that no holder restores, if the records choose it."""
        peer = self.peer
        grace = (LOST_GRACE + FILL_PERIODS) * peer.config.announce_period
        for stage, since in sorted(self.empty_since.items()):
            # a stage never seen served is one whose peers are still starting, not one that lost them
            waiting = now - since < grace or stage in self.left_on_request or stage not in self.seen_serving
            if waiting or on_the_way(stage, records) or choose_filler(stage, records, self.accused()) != peer.peer_id:
                continue
            copy = self.standbys.get(stage)
            logger.warning(
                f"Stage {stage} has had no peer for {now - since:.0f}s and no holder of its copy is restoring it; "
                f"moving there from stage {peer.stage} (the stage with the most to spare) "
                + (f"with this peer's copy of step {copy.step}" if copy else "to take a copy, if one can still be had")
            )
            if copy is not None:
                self.restore_pending = stage
            peer.request_move(stage)
            return

    def accused(self) -> set[str]:
        """Peers a vouched trainer's spot check accused: never a source of a copy (`swarm.records.accusations`)."""
        mates = self.peer.mates
        return set(mates.membership.accused) if mates is not None else set()

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _drop(self, stage: int) -> None:
        copy = self.standbys.pop(stage, None)
        if copy is not None and copy.path is not None:
            copy.path.unlink(missing_ok=True)

    # --- refreshing a copy ----------------------------------------------------------------------------

    def template(self, stage: int) -> torch.nn.Module:
        """The stage's module on the meta device: its shapes, to check a state against, at no memory cost."""
        if stage not in self.templates:
            config = self.peer.config
            with torch.device("meta"):
                self.templates[stage] = build_stage(self.peer.spec, stage, config.num_stages, config.seed)
        return self.templates[stage]

    def limits(self, stage: int) -> WireLimits:
        count = sum(p.numel() for p in self.template(stage).parameters())
        state_bytes = 16 * count + 2**20
        return WireLimits(max_message_bytes=state_bytes, max_tensor_bytes=state_bytes)

    async def _versions(self, stage: int, peers: list[str]) -> dict[str, Version]:
        """Each of `peers`' (step, fingerprint) as it answers now, for `stage` (the silent ones left out; with a
        trust root, those that show no recent receipt naming them too)."""
        if stage not in self.receipts:
            self.receipts[stage] = work_receipts(self.peer.config, self.peer.mates.machine.peer_id, stage)
        receipts = self.receipts[stage]
        sources = receipts.state_sources if receipts is not None else None
        return await peer_versions(self.peer.mates.p2p, peers, self.peer.config.model, stage, INFO_TIMEOUT, sources)

    async def refresh(self, stage: int, serving: list[str]) -> None:
        """Downloads `stage`'s state from one of its serving peers, taking only a confirmed version."""
        self.fetching.add(stage)
        started = time.perf_counter()
        try:
            versions = await self._versions(stage, serving)
            holders = confirmed_holders(versions)
            if not holders:
                return
            top = versions[holders[0]]
            # any peer at the newest confirmed version: the copies' cost is spread over the stage
            source = self.rng.choice([h for h in holders if versions[h] == top])
            model = self.peer.config.model
            given = await request_state(self.peer.mates.p2p, source, model, stage, self.limits(stage), STATE_TIMEOUT)
            step, tensors, has_optimizer_state = given.step, given.tensors, given.has_optimizer_state
            samples_stepped = given.samples_stepped
            template = self.template(stage)
            check_state_tensors(template, tensors, has_optimizer_state)
            fingerprint = await parameters_fingerprint(template, tensors)
            if (step, fingerprint) not in confirmed_versions(versions):
                # the source stepped since its mates were asked: ask them again
                if (step, fingerprint) not in confirmed_versions(await self._versions(stage, serving)):
                    raise StageStateError(f"no other peer confirms step {step}, fingerprint {fingerprint}")
            if stage not in self.targets():
                return  # this peer moved meanwhile
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.bytes_received += nbytes
            self.refreshes += 1
            copy = Standby(stage, step, samples_stepped, has_optimizer_state, fingerprint, nbytes)
            old = self.standbys.get(stage)
            in_memory = self.held_bytes() - (old.nbytes if old and old.tensors is not None else 0)
            if in_memory + nbytes <= self.budget:
                copy.tensors = tensors
            elif self.spill_dir is not None:
                copy.path = (
                    self.spill_dir / f"standby-{model}-stage{stage}-of-{self.peer.config.num_stages}.safetensors"
                )
                await asyncio.get_running_loop().run_in_executor(None, self._spill, tensors, copy.path)
            else:
                if stage not in self._warned_budget:
                    self._warned_budget.add(stage)
                    logger.warning(
                        f"Not holding a standby copy of stage {stage}: {nbytes / 2**20:.1f} MiB would exceed "
                        "--standby-memory-mb, and there is no --checkpoint-dir to keep it on disk"
                    )
                return
            if old is not None and old.path is not None and old.path != copy.path:
                old.path.unlink(missing_ok=True)
            self.standbys[stage] = copy
            logger.info(
                f"Refreshed the standby copy of stage {stage} at step {step} (fingerprint {fingerprint}) "
                f"from {source}: {nbytes} bytes in {time.perf_counter() - started:.2f}s "
                f"({self.bytes_received} bytes over {self.refreshes} refreshes)"
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.info(f"Could not refresh the standby copy of stage {stage}: {type(e).__name__}: {e}")
        finally:
            self.fetching.discard(stage)
            # the copies' cost stays a bounded share of the time, whatever the step rate and state size
            self.next_refresh[stage] = time.monotonic() + (time.perf_counter() - started) / self.share

    @staticmethod
    def _spill(tensors: list[torch.Tensor], path: Path) -> None:
        write_tensor_list(path, tensors)  # a safetensors state file, written atomically

    # --- restoring a stage ----------------------------------------------------------------------------

    def claim(self, stage: int) -> Standby | None:
        """The copy this peer restores `stage` from, if it is moving there to restore it (then it is no standby)."""
        pending, self.restore_pending = self.restore_pending, None
        return self.standbys.pop(stage, None) if pending == stage else None

    def restore_into(self, copy: Standby, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Loads a claimed copy into the lost stage's fresh module, and says what was lost."""
        copy.apply(module, optimizer)
        lost = max(0, self.last_step.get(copy.stage, copy.step) - copy.step)
        self.restored.append((copy.stage, copy.step, lost))
        self.peer.ledger.write(restore_record(self.peer.peer_id, copy.stage, copy.step, copy.step + lost))
        logger.warning(
            f"Restored stage {copy.stage} from a standby at step {copy.step} (lost {lost} steps); "
            f"parameters {parameter_fingerprint(module)}"
        )
        if copy.path is not None:
            copy.path.unlink(missing_ok=True)

    def move_failed(self) -> None:
        """The move to restore a stage did not happen: the next look decides again."""
        self.restore_pending = None

    # --- a newcomer on an empty stage -------------------------------------------------------------------

    async def fetch_for_newcomer(self, timeout: float = JOIN_RESTORE_TIMEOUT) -> bool:
        """Brings this peer's stage back, which no live mate could give state for; True if it did.

        Tries the freshest standby copy first, then every other. While a copy is announced but cannot be had
        yet (its holder does not see this peer's record yet, or refreshed it meanwhile), or a holder is on
        its way to restore the stage, it tries again, up to `timeout`. If no copy is in sight but other
        stages have stepped past this peer, it reads a few times more (a DHT read may come back short).
        A peer that served the stage at a fresh start instead would throw away the stage's progress, and
        the holders would see no lost stage to restore. In a new swarm it returns at once.
        """
        peer = self.peer
        stage = peer.stage
        deadline = time.monotonic() + timeout
        reads = 0
        while True:
            records = await peer._fetch_records()
            peer.mates.update_records(records[stage])
            if any(r.step > peer.runtime.step for r in peer.mates.mates.values()):
                # a mate serves the stage again (a holder that restored it): its state, as any joiner takes it
                if await peer.mates.sync_from_mates(minimum_step=peer.runtime.step + 1) is not None:
                    return True
            copies = standby_copies(stage, records)
            copies = {p: c for p, c in copies.items() if c[0] > peer.runtime.step and p not in self.accused()}
            if await self._take_a_copy(copies, records):
                return True
            # stages step together: if any has stepped past this peer, so had this one; before concluding that
            # its copies died with it, read again a few times (a DHT read can come back short)
            trained = any(r.step > peer.runtime.step for group in records.values() for r in group)
            if not copies and not on_the_way(stage, records):
                if not trained:
                    return False
                if reads >= SHORT_READ_RETRIES:
                    logger.error(
                        f"Stage {stage}: other stages have trained, but no standby copy of this one is announced "
                        f"(its holders died with it?); serving it from step {peer.runtime.step}"
                    )
                    return self._start_over(records)
            reads += 1
            if time.monotonic() > deadline:
                logger.error(
                    f"Stage {stage}: no standby copy could be had in {timeout:.0f}s; serving it from step "
                    f"{peer.runtime.step}: its progress since is lost"
                )
                return self._start_over(records)
            await asyncio.sleep(JOIN_RETRY_S)

    def _start_over(self, records: dict[int, list[StageRecord]]) -> bool:
        """The stage goes on from this peer's own state, with no copy: the ledger says so, as for a restore,
        so that the progress thrown away is counted by id rather than as divergent replicas. Returns False."""
        peer = self.peer
        step = peer.runtime.step
        reached = reached_step(peer.stage, records, step)
        if reached <= step:  # the stage's own records are gone: the other stages say how far training went
            reached = max((r.step for group in records.values() for r in group), default=step)
        peer.ledger.write(restore_record(peer.peer_id, peer.stage, step, reached))
        return False

    async def _take_a_copy(self, copies: dict[str, tuple[int, str]], records: dict[int, list[StageRecord]]) -> bool:
        """Downloads the freshest of `copies` (holder -> (step, fingerprint)) that a holder gives; True if one."""
        stage = self.peer.stage
        counts = Counter(copies.values())
        # the freshest copy first (holders refresh at different moments, so copies rarely agree); at one
        # step, the version more holders announce. Each holder took its copy only once two of the stage's
        # peers confirmed it, and the state sent must match what the holder's signed record announces.
        for version in sorted(counts, key=lambda v: (v[0], counts[v]), reverse=True):
            for holder in sorted(p for p, c in copies.items() if c == version):
                try:
                    step, fingerprint = await self._download_from_holder(holder, version)
                except Exception as e:
                    logger.warning(f"Could not take stage {stage}'s standby copy from {holder}: {e}")
                    continue
                if await self._served_again(stage, step):
                    return True
                lost = reached_step(stage, records, step) - step
                self.peer.ledger.write(restore_record(self.peer.peer_id, stage, step, step + lost))
                logger.warning(
                    f"Restored stage {stage} from a standby at step {step} (lost {lost} steps); "
                    f"parameters {fingerprint}, taken from {holder}"
                )
                return True
        return False

    async def _served_again(self, stage: int, step: int) -> bool:
        """Whether a live peer serves `stage` again past `step` (a holder or a filler restored it while this peer
        took its copy): then this peer takes that peer's state and joins its history rather than starting one.
        A record alone says nothing here: the dead peers' records outlive them."""
        peer = self.peer
        records = await peer._fetch_records(only=stage)
        if not any(r.step > step and r.state in (SERVING, JOINING) for r in records[stage]):
            return False
        peer.mates.update_records(records[stage])
        source = await peer.mates.sync_from_mates(minimum_step=step + 1)
        if source is not None:
            logger.info(f"Stage {stage} is served again by {source}, past the copy of step {step}: took its state")
        return source is not None

    async def _download_from_holder(self, holder: str, version: tuple[int, str]) -> tuple[int, str]:
        peer = self.peer
        stage, runtime = peer.stage, peer.runtime
        limits = self.limits(stage)
        request = StateRequest(protocol_version=PROTOCOL_VERSION, model=peer.config.model, stage=stage)
        reply, parts = await asyncio.wait_for(
            exchange(peer.mates.p2p, PeerID.from_base58(holder), STANDBY_PROTOCOL, [request], StateReply, limits),
            STATE_TIMEOUT,
        )
        if reply.error.code != ErrorCode.OK:
            raise StageStateError(f"{ErrorCode.Name(reply.error.code)}: {reply.error.message}")
        tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, limits)
        check_state_tensors(runtime.module, tensors, reply.has_optimizer_state)
        fingerprint = await parameters_fingerprint(runtime.module, tensors)
        if (reply.step, fingerprint) != version:
            raise StageStateError(f"sent step {reply.step}, fingerprint {fingerprint}; its record says {version}")
        await load_into_runtime(runtime, reply.step, tensors, reply.has_optimizer_state, reply.samples_stepped)
        peer.mates.progress.reached(reply.step)
        return reply.step, fingerprint

    async def _answer_standby(self, requester: str, request: StateRequest, _parts, reply: StateReply) -> list:
        copy = self.standbys.get(request.stage)
        error = None
        if request.protocol_version != PROTOCOL_VERSION:
            error = Error(code=ErrorCode.VERSION_MISMATCH, message=f"this peer speaks protocol {PROTOCOL_VERSION}")
        elif request.model != self.peer.config.model or copy is None:
            error = Error(code=ErrorCode.WRONG_STAGE, message=f"no standby copy of stage {request.stage} here")
        else:
            records = await self.peer._fetch_records(only=copy.stage)
            on_stage = {r.peer_id for r in records[copy.stage] if r.state in (JOINING, SERVING)}
            if requester not in on_stage:
                error = Error(
                    code=ErrorCode.FORBIDDEN, message=f"no signed record puts {requester} on stage {copy.stage}"
                )
        if error is not None:
            reply.error.CopyFrom(error)
            return [reply]
        tensors = await asyncio.get_running_loop().run_in_executor(None, copy.load)
        parts = await encode_state(tensors)
        given = StateReply(
            protocol_version=PROTOCOL_VERSION,
            step=copy.step,
            has_optimizer_state=copy.has_optimizer_state,
            samples_stepped=copy.samples_stepped,
        )
        logger.info(f"Giving the standby copy of stage {copy.stage} (step {copy.step}) to {requester}")
        return pack_frames(given, parts)
