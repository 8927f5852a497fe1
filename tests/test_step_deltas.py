"""Step deltas: a standby copy fed what each step applied matches the stage bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.peer.delta_transfer import DeltasRefused, takes_whole
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_state import StageStateError, parameter_fingerprint, state_tensors
from swarm.peer.standby_copy import Standby
from swarm.peer.step_deltas import MAX_DELTAS_PER_CALL, DeltaRing, StepDelta, apply_deltas, deltas_per_call
from swarm.proto import ErrorCode

SPEC = get_model_spec("gpt-tiny")
TARGET = 4
PARAMETERS = 1000  # a small stage: every kept delta fits in one reply


def backward_inputs(batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 16, SPEC.d_model, generator=g), torch.randn(batch, 16, SPEC.d_model, generator=g)]


def live_copy(module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Standby:
    tensors, has_optimizer_state = state_tensors(module, optimizer)
    copy = Standby(1, step, 0, has_optimizer_state, parameter_fingerprint(module), 0, tensors=tensors)
    with torch.device("meta"):
        template = build_stage(SPEC, 1, 3, seed=1)
    copy.make_live(template, OptimizerSettings())
    return copy


def test_a_copy_fed_the_step_deltas_of_a_stepping_stage_shows_its_fingerprint_at_every_step():
    module = build_stage(SPEC, 1, 3, seed=1)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=TARGET)
    runtime.deltas = DeltaRing(keep=3)
    copy = live_copy(runtime.module, runtime.optimizer, 0)  # before the first step: no optimizer state yet
    runtime.start()
    try:
        for step in range(5):
            runtime.submit(True, backward_inputs(TARGET, step), key=("trainer", step)).result(30)
            runtime.settle_fingerprint()
            assert runtime.step == step + 1
            deltas = runtime.deltas.since(copy.step, PARAMETERS)
            assert [d.step for d in deltas] == [step] and deltas[0].samples == TARGET
            assert copy.advance(deltas) == runtime.version
        assert copy.samples_stepped == 5 * TARGET and copy.has_optimizer_state
        # the copy gives what the stage would: its parameters and both moments, bit for bit
        given, _ = state_tensors(runtime.module, runtime.optimizer)
        assert all(torch.equal(a, b) for a, b in zip(copy.load(), given))
        # only the last `keep` steps are kept: an older copy is refreshed whole
        assert runtime.deltas.since(1, PARAMETERS) is None and [
            d.step for d in runtime.deltas.since(2, PARAMETERS)
        ] == [2, 3, 4]
    finally:
        runtime.shutdown()


def test_skipped_steps_travel_as_deltas_without_a_gradient_and_move_only_the_step():
    module = build_stage(SPEC, 1, 3, seed=1)
    optimizer = build_optimizer(module, OptimizerSettings())
    copy = live_copy(module, optimizer, 7)
    before = copy.fingerprint
    assert copy.advance([StepDelta(7, 0, None), StepDelta(8, 0, None)]) == (9, before)
    assert copy.samples_stepped == 0 and not copy.has_optimizer_state


def test_a_delta_whose_sum_is_not_finite_is_skipped_as_the_replicas_skip_such_a_step():
    """A holder checks a delta's flat sum once; the verdict is the replicas' per-parameter one."""
    module = build_stage(SPEC, 1, 3, seed=1)
    optimizer = build_optimizer(module, OptimizerSettings())
    count = sum(p.numel() for p in module.parameters())
    broken = torch.ones(count)
    broken[count // 2] = float("nan")
    before = parameter_fingerprint(module)
    assert apply_deltas(module, optimizer, [StepDelta(0, 8, broken)]) == 0
    assert parameter_fingerprint(module) == before and all(p.grad is None for p in module.parameters())
    assert apply_deltas(module, optimizer, [StepDelta(1, 8, torch.ones(count))]) == 8
    assert parameter_fingerprint(module) != before


def test_deltas_that_do_not_start_at_the_copy_step_are_refused_untouched():
    module = build_stage(SPEC, 1, 3, seed=1)
    copy = live_copy(module, build_optimizer(module, OptimizerSettings()), 3)
    count = sum(p.numel() for p in module.parameters())
    with pytest.raises(StageStateError, match="do not fit"):
        copy.advance([StepDelta(4, 8, torch.ones(count))])
    assert copy.step == 3 and copy.fingerprint == parameter_fingerprint(module)


def test_the_ring_forgets_when_a_state_is_loaded_between_steps_and_keeps_nothing_unwanted():
    module = build_stage(SPEC, 1, 3, seed=1)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    ring = DeltaRing(keep=4)
    ring.record(3, module, "stepped", 8)
    ring.record(4, module, "stepped", 8)
    ring.record(9, module, "empty", 0)  # a mate's state at step 9 was loaded: 3 and 4 lead elsewhere
    assert ring.since(3, PARAMETERS) is None and [
        (d.step, d.samples, d.grad_sum) for d in ring.since(9, PARAMETERS)
    ] == [(9, 0, None)]
    holders: list[str] = []
    unwanted = DeltaRing(keep=4, wanted=lambda: bool(holders))
    unwanted.record(0, module, "stepped", 8)
    assert unwanted.since(0, PARAMETERS) is None


def test_the_ring_keeps_deltas_from_its_start_and_while_holders_ask_or_take_the_whole_state():
    """Measured in bench_standby: a holder took the whole state from one peer and caught up from another, which
    kept no deltas since nobody had asked it yet; each copy was then taken whole twice."""
    module = build_stage(SPEC, 1, 3, seed=1)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    ring = DeltaRing(keep=4, interest=60.0)
    ring.record(0, module, "stepped", 8)  # never asked yet: kept, for whichever holder asks first
    ring.asked_at -= 61.0  # a minute with no holder asking: holders refresh whole, no gradient is copied
    ring.record(1, module, "stepped", 8)
    assert ring.since(0, PARAMETERS) is None and ring.since(1, PARAMETERS) is None
    ring.note_interest()  # a holder took the whole state: the next steps are kept for its catch-up
    ring.record(2, module, "stepped", 8)
    assert [d.step for d in ring.since(2, PARAMETERS)] == [2]


def test_a_reply_carries_every_kept_delta_of_a_small_stage_and_one_of_a_large_one():
    """Each call costs both sides a connection and a handshake: a small stage's copy catches up in one."""
    module = build_stage(SPEC, 1, 3, seed=1)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    ring = DeltaRing(keep=8)
    for step in range(8):
        ring.record(step, module, "stepped", 8)
    count = sum(p.numel() for p in module.parameters())
    assert [d.step for d in ring.since(0, count)] == list(range(8))
    assert deltas_per_call(count) == MAX_DELTAS_PER_CALL
    assert len(ring.since(0, 10**9)) == deltas_per_call(10**9) == 1  # 4 GB a sum: one per message


def test_a_copy_is_read_at_a_version_it_was_at_while_deltas_advance_it_on_another_thread():
    """A p3 replay: a holder's record paired step 170 with step 167's fingerprint (the renewal read the step after
    a catch-up set it, the fingerprint before), and a newcomer refused the copy as not what the record said."""
    module = build_stage(SPEC, 1, 3, seed=1)
    optimizer = build_optimizer(module, OptimizerSettings())
    copy = live_copy(module, optimizer, 0)
    count = sum(p.numel() for p in module.parameters())
    g = torch.Generator().manual_seed(0)
    deltas = [StepDelta(step, 8, torch.randn(count, generator=g)) for step in range(40)]
    versions = {copy.version}
    seen: set[tuple[int, str]] = set()
    read = threading.Event()

    def advance() -> None:
        for index, delta in enumerate(deltas):
            versions.add(copy.advance([delta]))
            if index % 10 == 0:  # a fast optimizer could run all 40 before the reader's first look: let it look
                read.wait(10)
                read.clear()

    stepping = threading.Thread(target=advance)
    stepping.start()
    while stepping.is_alive():
        seen.add(copy.version)
        read.set()
    stepping.join()
    assert len(seen) > 1 and seen <= versions, "every version read is one the copy was at"


def test_a_catch_up_refused_by_a_source_that_does_not_know_the_holder_yet_keeps_following_by_deltas():
    """Traced in a p3 replay: a newcomer's record reaches the stage's peers a period apart, and the one that had not
    read it yet refused its catch-up (FORBIDDEN), which marked the copy as having no deltas: taken whole again, five
    times the bytes. Only a source with no deltas from the copy's step, or deltas that do not fit, means that."""
    assert not takes_whole(DeltasRefused(ErrorCode.FORBIDDEN, "no signed record puts it on stage 1"))
    assert takes_whole(DeltasRefused(ErrorCode.UNAVAILABLE, "no deltas from step 3 here: take the whole state"))
    assert takes_whole(StageStateError("sent 3 deltas from step 7, asked from 5"))
