"""A standby copy given over real libp2p: the version the holder's record announces, even where the copy moved on.

A holder's copy follows its stage between two renewals of its record, so a newcomer that read the record a moment
ago asks for a version the holder no longer has (a p3 replay: two holders sent step 144 where their records said 140
and 142, and both copies were refused while the stage stood empty). The holder announces the version it gives before
giving it; the newcomer takes a later version only where the holder's signed record says so at a read after the
reply, and nothing its record never announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import P2P

from swarm.config import PeerConfig
from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.net.transport import STANDBY_PROTOCOL
from swarm.net.wire import WireLimits
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_state import StageStateError, parameter_fingerprint, state_tensors
from swarm.peer.standby_copy import Standby
from swarm.peer.standby_newcomer import NewcomerRestore, answer_standby
from swarm.peer.state_transfer import state_handler
from swarm.records.stage_records import JOINING, SERVING, StageRecord

SPEC = get_model_spec("gpt-tiny")
STAGES = 3
LIMITS = WireLimits(max_message_bytes=2**28, max_tensor_bytes=2**28)


def stage_record(peer_id: str, stage: int, state: str = SERVING, standbys=()) -> StageRecord:
    return StageRecord(peer_id, stage, "gpt-tiny", STAGES, state, 5, 10.0, 0, 24, 0, 1, standbys=tuple(standbys))


class Board:
    """The records both peers read, in place of a DHT read: what each peer last announced."""

    def __init__(self) -> None:
        self.records: dict[str, StageRecord] = {}

    async def read(self, only=None) -> dict[int, list[StageRecord]]:
        stages = range(STAGES) if only is None else [only]
        return {s: [r for r in self.records.values() if r.stage == s] for s in stages}


class Holder:
    """A peer of stage 0 holding a copy of stage 1; `honest`: its announcements list the copy as it is."""

    def __init__(self, board: Board, peer_id: str, copy: Standby, honest: bool = True) -> None:
        self.config = PeerConfig(model="gpt-tiny", num_stages=STAGES)
        self.board, self.peer_id, self.copy, self.honest = board, peer_id, copy, honest
        self.announced = 0

    def announce(self, version: tuple[int, str]) -> None:
        standbys = [(1, *version)]
        self.board.records[self.peer_id] = stage_record(self.peer_id, 0, standbys=standbys)

    async def _announce(self, record=None) -> None:
        self.announced += 1
        if self.honest:
            self.announce(self.copy.version)

    async def _fetch_records(self, only=None):
        return await self.board.read(only)


def a_copy_at(step: int) -> tuple[Standby, list[torch.Tensor]]:
    """A live copy of stage 1 at `step`, with its state's tensors, which differ from a fresh stage's."""
    module = build_stage(SPEC, 1, STAGES, seed=3)
    optimizer = build_optimizer(module, OptimizerSettings())
    tensors, has_optimizer_state = state_tensors(module, optimizer)
    copy = Standby(1, step, 96, has_optimizer_state, parameter_fingerprint(module), 0, tensors=tensors)
    with torch.device("meta"):
        template = build_stage(SPEC, 1, STAGES, seed=3)
    copy.make_live(template, OptimizerSettings())
    return copy, tensors


@contextlib.asynccontextmanager
async def holder_and_newcomer(board: Board, copy: Standby, honest: bool):
    """The holder's libp2p daemon answering `STANDBY_PROTOCOL`, and a newcomer on stage 1 (real runtime) dialling
    it; both on the board (the newcomer joining stage 1)."""
    holder_p2p = await P2P.create()
    newcomer_p2p = await P2P.create(initial_peers=[str(a) for a in await holder_p2p.get_visible_maddrs()])
    module = build_stage(SPEC, 1, STAGES, seed=9)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=4)
    runtime.start()
    try:
        holder = Holder(board, str(holder_p2p.peer_id), copy, honest)
        handler = state_handler(
            functools.partial(answer_standby, holder, {1: copy}), failure="Failed to give", caller="a standby request"
        )
        await holder_p2p.add_binary_stream_handler(STANDBY_PROTOCOL, handler)
        newcomer_id = str(newcomer_p2p.peer_id)
        board.records[newcomer_id] = stage_record(newcomer_id, 1, JOINING)
        mates = SimpleNamespace(p2p=newcomer_p2p, progress=SimpleNamespace(reached=lambda step: None))
        newcomer = SimpleNamespace(
            peer_id=newcomer_id, stage=1, config=holder.config, runtime=runtime, mates=mates, _fetch_records=board.read
        )
        yield holder, NewcomerRestore(newcomer, set, lambda stage: LIMITS), runtime
    finally:
        runtime.shutdown()
        await newcomer_p2p.shutdown()
        await holder_p2p.shutdown()


def run_download(copy: Standby, announced: tuple[int, str], honest: bool = True):
    """The newcomer asks for the version `announced` (the holder's record at its read); returns what came of it."""

    async def main():
        board = Board()
        async with holder_and_newcomer(board, copy, honest) as (holder, restore, runtime):
            holder.announce(announced)
            try:
                taken = await asyncio.wait_for(restore._download_from_holder(holder.peer_id, announced), 60)
            except StageStateError as e:
                taken = e
            loaded = [t.clone() for t in state_tensors(runtime.module, runtime.optimizer)[0]]
            return taken, holder.announced, runtime.step, loaded

    return asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_copy_that_moved_on_since_the_read_is_announced_before_it_is_given_and_taken():
    copy, tensors = a_copy_at(144)
    taken, announced, step, state = run_download(copy, announced=(140, "46d9ed9dd6e5ad70"))
    assert taken == (144, copy.fingerprint) and announced == 1 and step == 144
    parameters = len(list(build_stage(SPEC, 1, STAGES, seed=3).parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state[:parameters], tensors[:parameters])), "the copy's parameters"


@pytest.mark.timeout(120)
def test_a_version_the_holders_record_never_announces_is_refused_and_nothing_is_loaded():
    copy, _ = a_copy_at(144)
    # a holder whose record stays at 140 (a store that failed, or one that gives what it never announced)
    taken, _, step, _ = run_download(copy, announced=(140, "46d9ed9dd6e5ad70"), honest=False)
    assert isinstance(taken, StageStateError) and "its record says (140, '46d9ed9dd6e5ad70')" in str(taken)
    assert step == 0, "nothing loaded"
    # a copy older than the one announced is refused without a second read: a later record cannot vouch for it
    copy, _ = a_copy_at(139)
    taken, _, step, _ = run_download(copy, announced=(140, "46d9ed9dd6e5ad70"))
    assert isinstance(taken, StageStateError) and "sent step 139" in str(taken) and step == 0


def test_a_snapshot_gives_the_tensors_with_the_version_they_are_at():
    copy, tensors = a_copy_at(7)
    given, step, fingerprint, samples, has_optimizer_state = copy.snapshot()
    assert (step, fingerprint, samples, has_optimizer_state) == (7, copy.fingerprint, 96, copy.has_optimizer_state)
    assert all(torch.equal(a, b) for a, b in zip(given, tensors))
