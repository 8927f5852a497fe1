"""A stage short of samples lost with a dead mate waits for what can still come, and steps at once when what it
misses is held toward the next step, or belongs to trainers that finished (and said so in their signed records)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from swarm.compression import get_codec
from swarm.net.dht_node import TetheredDHT
from swarm.peer.averaging_round import AveragingRound
from swarm.peer.faults import FaultPlan
from swarm.peer.step_machine import SHORT, StepMachine
from swarm.peer.trainer_departures import MAX_REMEMBERED, TrainerDepartures, watch_departures
from swarm.records.trainer_records import FINISHED_TTL, TrainerProgress, TrainerRecord, fetch_trainer_records, publish

ME = "QmPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
DONE = "QmTrainerDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDD"
LIVE = "QmTrainerLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLL"
MATE = "QmPeerMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMM"


def record(trainer: str, finished: bool) -> TrainerRecord:
    return TrainerRecord(trainer, "gpt-tiny", 2, 4, 32, 4.0, 10.0, 0, (), (), finished=finished)


def short_machine(lost: dict) -> tuple[StepMachine, list[int]]:
    """A lone peer of stage 1 of 2 whose step 5 is short of `lost`, with 60 s of --short-wait left."""
    module = torch.nn.Linear(2, 2)
    module.stage, module.num_stages = 1, 2
    requested: list[int] = []
    runtime = SimpleNamespace(module=module, step=5, max_batch_samples=64, target_batch_size=16)
    runtime.request_step = requested.append
    machine = StepMachine(runtime, ME, "gpt-tiny", FaultPlan())
    machine.serving = True
    machine.start(p2p=None)
    state = machine.steps[5]
    state.phase, state.lost = SHORT, dict(lost)
    state.short_deadline = machine.loop.time() + 60.0
    return machine, requested


def test_a_short_step_steps_at_once_when_only_finished_trainers_are_missing():
    async def go() -> None:
        machine, requested = short_machine({(DONE, 1): 8, (LIVE, 2): 8})
        assert machine.waiting_on() == {DONE, LIVE}
        machine.advance(5)
        assert requested == [], "both trainers may still send theirs"
        machine.departures.note([record(DONE, True), record(LIVE, False)])
        machine.advance(5)
        assert requested == [], "the live trainer's microbatch may still come"
        machine.steps[5].progress[MATE] = {(LIVE, 2): 8}  # sent again
        assert machine.waiting_on() == {DONE}
        machine.advance(5)
        assert requested == [5], "nothing more will come: the step goes ahead"

    asyncio.run(go())


def test_a_short_step_does_not_wait_for_what_a_member_holds_toward_the_next_step():
    """A backward that came while the round ran is accumulated toward the next step: sent again, it is answered
    without accumulating, so the short step would wait out --short-wait for it (a wave run: 20 s, and a hundred
    resends of one microbatch). It is not asked for, and the step goes ahead without it."""

    async def go() -> None:
        machine, requested = short_machine({(LIVE, 1): 8, (LIVE, 2): 8})
        machine.steps[6].progress[MATE] = {(LIVE, 2): 8}
        assert machine.lost() == {(LIVE, 1): 8}, "a SHORT reply names only what may still come"
        machine.advance(5)
        assert requested == [], "microbatch 1 may still come"
        machine.steps[5].progress[MATE] = {(LIVE, 1): 8}
        assert machine.lost() == {}
        machine.advance(5)
        assert requested == [5]
        # its round sums microbatch 1, held at this step, and goes short no more for microbatch 2
        assert machine.waits_in_vain(5)
        machine.steps[6].progress.clear()
        assert not machine.waits_in_vain(5), "nobody holds microbatch 2: its trainer may still send it"

    asyncio.run(go())


def test_a_short_step_does_not_wait_for_what_a_recent_round_summed():
    """A dead member held a second copy of a microbatch that a round had summed already (sent again after a failed
    call): sent once more it would be answered as already summed, so the step does not wait for it."""

    async def go() -> None:
        machine, requested = short_machine({(LIVE, 1): 8})
        machine.advance(5)
        assert requested == [] and machine.lost() == {(LIVE, 1): 8}
        machine.summed_recently = frozenset({(LIVE, 1)})
        assert machine.lost() == {}
        machine.advance(5)
        assert requested == [5]

    asyncio.run(go())


def test_the_round_of_a_step_short_only_of_finished_trainers_gives_up_and_counts_them_lost():
    """The round itself steps without them, counted lost by id, instead of going short again for --short-wait."""

    async def go():
        machine, _ = short_machine({(DONE, 1): 8})
        machine.departures.note([record(DONE, True)])
        membership = SimpleNamespace(mates={}, state_source=None)
        averaging = AveragingRound(machine, membership, None, 30.0, short_wait=60.0, codec=get_codec("none"))
        started = time.monotonic()
        result = await asyncio.wait_for(averaging.round(5, torch.ones(6), {(LIVE, 2): 8}), 10)
        return result, averaging.samples_lost, time.monotonic() - started

    result, lost, seconds = asyncio.run(go())
    assert result is not None and result.samples == 8 and lost == 8 and seconds < 5, (result, lost, seconds)
    assert [tuple(item) for item in result.lost] == [(DONE, 1, 8)]


def test_departures_are_bounded_and_a_trainer_that_trains_again_is_waited_for():
    now = [0.0]
    departures = TrainerDepartures(clock=lambda: now[0])
    departures.note([record(DONE, True), record(LIVE, False)])
    assert departures.has_finished(DONE) and not departures.has_finished(LIVE)
    departures.note([record(DONE, False)])  # the same identity started again
    assert not departures.has_finished(DONE)
    flood = [record(f"Qm{'F' * 40}{i:04d}", True) for i in range(MAX_REMEMBERED + 50)]
    departures.note(flood)
    assert len(departures.finished) == MAX_REMEMBERED
    now[0] += 3600.0
    departures.note([])
    assert departures.finished == {}


def test_a_finished_record_says_so_and_outlives_a_training_one():
    progress = TrainerProgress(DONE, "gpt-tiny", 2)
    assert progress.record().to_value()["finished"] is False
    progress.finished = True
    value = progress.record().to_value()
    assert TrainerRecord.from_value(value, 99.0).finished
    older = {k: v for k, v in value.items() if k != "finished"}  # from a trainer of before the field
    assert TrainerRecord.from_value(older, 99.0).finished is False
    assert TrainerRecord.from_value({**value, "finished": "yes"}, 99.0) is None
    assert FINISHED_TTL >= 300.0  # a stage may go short of its samples minutes after it left


@pytest.mark.timeout(60)
def test_a_peer_reads_a_finished_trainers_signed_record_only_while_its_step_waits():
    """Over a real DHT: a trainer's finished record reaches the departures of a peer whose step waits on it; with
    nothing to wait for, the peer reads nothing."""
    trainer = TetheredDHT(start=True)
    peer = TetheredDHT(initial_peers=[str(m) for m in trainer.get_visible_maddrs()], start=True)
    finished_id = str(trainer.peer_id)
    try:
        assert publish(trainer, "run", record(finished_id, True), ttl=FINISHED_TTL)
        assert [r.finished for r in fetch_trainer_records(peer, "run")] == [True]

        async def go() -> tuple[bool, int, int]:
            departures = TrainerDepartures()
            waiting: set[str] = set()
            news: list[int] = []
            watch = asyncio.create_task(
                watch_departures(departures, lambda: waiting, lambda: news.append(1), peer, "run", period=0.1)
            )
            await asyncio.sleep(0.5)
            idle_reads = len(news)
            waiting.add(finished_id)
            deadline = time.monotonic() + 20
            while not departures.has_finished(finished_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            watch.cancel()
            return departures.has_finished(finished_id), idle_reads, len(news)

        seen, idle_reads, reads = asyncio.run(go())
        assert seen and idle_reads == 0 and reads >= 1
    finally:
        peer.shutdown()
        trainer.shutdown()
