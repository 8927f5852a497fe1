"""The stage runtime on its own: batching, accumulation, steps, and repeated backward requests."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_progress import ProgressExchange
from swarm.peer.runtime import CallAbandonedError, QueueFullError, RoundResult, StageRuntime
from swarm.peer.state_handover import StateHandOver
from swarm.peer.step_machine import ACCUMULATING, StepMachine

SPEC = get_model_spec("gpt-tiny")


def make_runtime(stage: int = 1, target: int = 8) -> StageRuntime:
    module = build_stage(SPEC, stage, 3, seed=1)
    return StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=target)


def backward_inputs(batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, 16, SPEC.d_model, generator=g),
        torch.randn(batch, 16, SPEC.d_model, generator=g),
    ]


def test_merged_requests_give_the_same_results_as_separate_ones():
    separate, merged = make_runtime(), make_runtime()
    requests = [backward_inputs(2, seed) for seed in range(3)]
    separate.start()
    one_by_one = [separate.submit(True, r).result(30) for r in requests]
    # queue everything before the worker starts, so it merges the three into one batch
    futures = [merged.submit(True, r) for r in requests]
    merged.start()
    together = [f.result(30) for f in futures]
    for a, b in zip(one_by_one, together):
        torch.testing.assert_close(a.tensors[0], b.tensors[0], rtol=1e-5, atol=1e-6)
    for p, q in zip(separate.module.parameters(), merged.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    separate.shutdown()
    merged.shutdown()


def test_steps_when_the_target_batch_is_reached():
    runtime = make_runtime(target=6)
    runtime.start()
    before = [p.detach().clone() for p in runtime.module.parameters()]
    assert runtime.submit(True, backward_inputs(4, 0)).result(30).step == 0
    assert runtime.samples_accumulated == 4
    # the reply names the step the request was served at; the stage steps right after it
    assert runtime.submit(True, backward_inputs(2, 1)).result(30).step == 0
    assert runtime.samples_accumulated == 0 and runtime.step == 1
    assert all(p.grad is None for p in runtime.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, runtime.module.parameters()))
    runtime.shutdown()


def test_a_spot_check_backward_answers_the_same_input_gradients_and_holds_nothing():
    runtime = make_runtime(target=100)
    runtime.start()
    inputs = backward_inputs(3, 0)
    served = runtime.submit(True, inputs, key=("trainer", 7)).result(30)
    grads = [p.grad.clone() for p in runtime.module.parameters()]
    held = dict(runtime.held)
    # the same call asked again as a check, by another caller, with no key: nothing held, counted or summed
    checked = runtime.submit(True, inputs, accumulate=False).result(30)
    torch.testing.assert_close(served.tensors[0], checked.tensors[0], rtol=1e-5, atol=1e-7)
    assert checked.step == served.step and runtime.samples_accumulated == 3 and runtime.held == held
    assert runtime.duplicates == 0
    for p, g in zip(runtime.module.parameters(), grads):
        assert torch.equal(p.grad, g)
    # and it leaves the call's own key free: the real backward, sent first later, still counts once
    runtime.submit(True, backward_inputs(2, 1), accumulate=False).result(30)
    runtime.submit(True, backward_inputs(2, 1), key=("trainer", 8)).result(30)
    assert runtime.samples_accumulated == 5 and runtime.duplicates == 0
    runtime.shutdown()


def test_repeated_backward_is_not_accumulated_twice():
    runtime = make_runtime(target=100)
    runtime.start()
    inputs = backward_inputs(3, 0)
    first = runtime.submit(True, inputs, key=("trainer", 7)).result(30)
    grads = [p.grad.clone() for p in runtime.module.parameters()]
    again = runtime.submit(True, inputs, key=("trainer", 7)).result(30)
    torch.testing.assert_close(first.tensors[0], again.tensors[0])
    assert runtime.samples_accumulated == 3 and runtime.duplicates == 1
    for g, p in zip(grads, runtime.module.parameters()):
        assert torch.equal(g, p.grad)
    # another microbatch id is new work
    runtime.submit(True, inputs, key=("trainer", 8)).result(30)
    assert runtime.samples_accumulated == 6
    runtime.shutdown()


def test_last_stage_returns_losses_and_input_gradient():
    runtime = make_runtime(stage=2)
    runtime.start()
    hidden = torch.randn(2, 16, SPEC.d_model)
    targets = torch.randint(0, SPEC.vocab_size, (2, 16))
    result = runtime.submit(True, [hidden, targets]).result(30)
    assert result.losses.shape == (2,) and torch.isfinite(result.losses).all()
    assert result.tensors[0].shape == hidden.shape
    runtime.shutdown()


def test_failed_batch_reports_the_error_and_runtime_keeps_going():
    runtime = make_runtime()
    runtime.start()
    bad = [torch.randn(2, 16, SPEC.d_model), torch.randn(2, 16, 3)]  # grad of the wrong shape
    try:
        runtime.submit(True, bad, key=("t", 1)).result(30)
    except RuntimeError:
        pass
    else:
        raise AssertionError("a wrong gradient shape must fail")
    assert runtime.samples_accumulated == 0
    runtime.submit(True, backward_inputs(2, 0), key=("t", 1)).result(30)
    assert runtime.samples_accumulated == 2  # the retry of a failed request is accumulated
    runtime.shutdown()


def test_a_request_whose_caller_gave_up_is_dropped_unstarted_and_can_be_retried():
    """An overloaded peer must not spend its time on replies nobody waits for any more."""
    runtime = make_runtime(target=100)
    runtime.start()
    # the worker is busy for 0.3 s: the requests below wait in the queue meanwhile
    busy = runtime.run_exclusive(lambda: time.sleep(0.3))
    expired = runtime.submit(True, backward_inputs(4, 1), key=("trainer", 2), give_up_at=time.monotonic() + 0.05)
    patient = runtime.submit(True, backward_inputs(4, 2), key=("trainer", 3), give_up_at=time.monotonic() + 30)
    busy.result(30)
    assert patient.result(30).step == 0
    with pytest.raises(CallAbandonedError, match="deadline passed"):
        expired.result(30)
    assert runtime.abandoned == 1
    assert runtime.samples_accumulated == 4  # the dropped one was not applied
    # its retry is a first attempt, not a duplicate: it accumulates
    runtime.submit(True, backward_inputs(4, 1), key=("trainer", 2)).result(30)
    assert runtime.samples_accumulated == 8 and runtime.duplicates == 0
    runtime.shutdown()


def test_a_queued_retry_carries_the_gradient_when_its_original_expires_unstarted():
    """On an overloaded single-peer stage the trainer retries a backward on the same peer; the retry is
    queued as a duplicate (not to accumulate). When the original expires unstarted, the retry must
    accumulate it, or the sample is lost."""
    runtime = make_runtime(target=100)
    inputs = backward_inputs(2, seed=5)
    original = runtime.submit(True, inputs, key=("trainer", 7), give_up_at=time.monotonic() - 1)
    retry = runtime.submit(True, inputs, key=("trainer", 7))
    runtime.start()
    with pytest.raises(CallAbandonedError):
        original.result(30)
    retry.result(30)
    assert runtime.samples_accumulated == 2
    assert runtime.held == {("trainer", 7): 2}
    runtime.shutdown()


def test_a_backward_finished_after_its_caller_gave_up_leaves_the_gradients_as_they_were():
    runtime = make_runtime(target=100)
    runtime.faults = FaultPlan("before_commit@2=delay:0.5")  # the second backward computes past its deadline
    runtime.start()
    runtime.submit(True, backward_inputs(2, seed=1), key=("trainer", 1)).result(30)
    before = [p.grad.clone() for p in runtime.module.parameters()]
    late = runtime.submit(True, backward_inputs(2, seed=2), key=("trainer", 2), give_up_at=time.monotonic() + 0.25)
    with pytest.raises(CallAbandonedError):
        late.result(30)
    assert runtime.samples_accumulated == 2 and ("trainer", 2) not in runtime.held
    for p, grad in zip(runtime.module.parameters(), before):
        assert torch.equal(p.grad, grad)
    runtime.shutdown()


def test_a_full_queue_refuses_at_once_instead_of_growing():
    module = build_stage(SPEC, 1, 3, seed=1)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=64, max_queue=2)
    # not started: nothing leaves the queue
    runtime.submit(True, backward_inputs(2, 0))
    runtime.submit(False, backward_inputs(2, 1)[:1])
    with pytest.raises(QueueFullError):
        runtime.submit(True, backward_inputs(2, 2))
    assert runtime.queue_length == 2 and runtime.busy_refusals == 1
    runtime.start()
    runtime.shutdown()


def test_a_step_whose_summed_gradient_is_not_finite_is_skipped_and_the_parameters_stay_as_they_were():
    runtime = make_runtime(target=4)
    runtime.start()
    before = [p.detach().clone() for p in runtime.module.parameters()]
    hidden, grad = backward_inputs(4, 0)
    grad[0, 0, 0] = float("nan")  # what a broken contribution would bring (the handler refuses it at the door)
    assert runtime.submit(True, [hidden, grad]).result(30).step == 0
    assert runtime.step == 1 and runtime.nonfinite_steps == 1
    for a, b in zip(before, runtime.module.parameters()):
        assert torch.equal(a, b)
    # the next, sound batch steps as usual
    runtime.submit(True, backward_inputs(4, 1)).result(30)
    assert runtime.step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, runtime.module.parameters()))
    assert all(bool(torch.isfinite(p).all()) for p in runtime.module.parameters())
    runtime.shutdown()


def test_busy_time_counts_the_batches_run():
    runtime = make_runtime(target=64)
    assert runtime.busy_seconds == 0.0
    runtime.start()
    started = time.perf_counter()
    for seed in range(3):
        runtime.submit(True, backward_inputs(2, seed)).result(30)
    assert 0.0 < runtime.busy_seconds <= time.perf_counter() - started
    runtime.shutdown()


@pytest.mark.parametrize("max_batch_seconds, batches", [(0.5, [2, 2, 2]), (0.0, [6])])
def test_merging_stops_at_max_batch_seconds_of_work(max_batch_seconds, batches):
    module = build_stage(SPEC, 1, 3, seed=1)
    runtime = StageRuntime(
        module,
        build_optimizer(module, OptimizerSettings()),
        target_batch_size=1000,
        max_batch_seconds=max_batch_seconds,
        # 100 ms a sample of backward: 0.5 s holds two requests of 2 samples. Slow enough that the real compute,
        # which the measured speed also counts, stays below it on a loaded machine
        simulated_speed=10.0,
    )
    runtime.measure_throughput(backward_inputs(2, 0))
    settled: list[float] = []
    # queued before the worker starts: without the limit it merges all six into one batch
    futures = [runtime.submit(True, backward_inputs(2, seed)) for seed in range(6)]
    for future in futures:
        future.add_done_callback(lambda _: settled.append(time.perf_counter()))
    runtime.start()
    for future in futures:
        future.result(30)
    runtime.shutdown()
    # requests of one batch settle together; batches are at least 400 ms of simulated work apart
    sizes = [1]
    for before, after in zip(settled, settled[1:]):
        if after - before > 0.2:
            sizes.append(1)
        else:
            sizes[-1] += 1
    assert sizes == batches


class MatesHolding:
    """A step coordinator whose mates hold `keys` from its `from_call`-th look on (never stepping)."""

    def __init__(self, keys: set, from_call: int = 1) -> None:
        self.keys, self.from_call, self.calls = frozenset(keys), from_call, 0

    def local_progress(self, step, held) -> None:
        pass

    def average(self, step, grad_sum, held):
        return None

    def held_elsewhere(self) -> frozenset:
        self.calls += 1
        return self.keys if self.calls >= self.from_call else frozenset()


@pytest.mark.parametrize("from_call", [1, 2], ids=["queued", "while-computing"])
def test_a_backward_a_mate_holds_is_answered_without_accumulating(from_call):
    """A retried backward whose first attempt a mate applied (its reply lost): the same input gradient, no
    gradient summed. A mate's progress may also arrive while it computes: the batch then runs again."""
    plain, runtime = make_runtime(target=100), make_runtime(target=100)
    runtime.coordinator = MatesHolding({("trainer", 7)}, from_call)
    plain.start()
    runtime.start()
    inputs = backward_inputs(3, 0)
    expected = plain.submit(True, inputs, key=("trainer", 7)).result(30)
    answer = runtime.submit(True, inputs, key=("trainer", 7)).result(30)
    torch.testing.assert_close(answer.tensors[0], expected.tensors[0])
    assert runtime.samples_accumulated == 0 and not runtime.held and runtime.duplicates == 1
    assert all(p.grad is None for p in runtime.module.parameters())
    # other microbatches still accumulate, and the one the mate held does if it comes again (the mate died)
    runtime.coordinator = MatesHolding(set())
    runtime.submit(True, inputs, key=("trainer", 8)).result(30)
    runtime.submit(True, inputs, key=("trainer", 7)).result(30)
    assert runtime.held == {("trainer", 8): 3, ("trainer", 7): 3}
    plain.shutdown()
    runtime.shutdown()


class HeldRound:
    """A coordinator whose rounds end only when the test says: a round under way, as long as it needs."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, torch.Tensor, dict, Future]] = []

    def local_progress(self, step, held) -> None:
        pass

    def held_elsewhere(self) -> frozenset:
        return frozenset()

    def average(self, step, grad_sum, held) -> Future:
        self.rounds.append((step, grad_sum, held, Future()))
        return self.rounds[-1][3]


def start_round(runtime: StageRuntime, coordinator: HeldRound, count: int) -> None:
    runtime.request_step(runtime.step)
    deadline = time.monotonic() + 30
    while len(coordinator.rounds) < count:
        assert time.monotonic() < deadline, "no round started"
        time.sleep(0.01)


def test_a_peer_serves_while_its_round_is_under_way_and_new_backwards_count_toward_the_next_step():
    runtime = make_runtime(target=4)
    coordinator = runtime.coordinator = HeldRound()
    runtime.start()
    runtime.submit(True, backward_inputs(4, 0), key=("t", 1)).result(30)
    start_round(runtime, coordinator, 1)
    step, grad_sum, held, rounding = coordinator.rounds[0]
    assert step == 0 and held == {("t", 1): 4}
    # the round is under way: a forward is served at once, at the step the round has not applied yet
    assert runtime.submit(False, [torch.randn(2, 16, SPEC.d_model)]).result(30).step == 0
    # a backward is applied at once too, into fresh buffers: toward the next step, not into the round's sum
    assert runtime.submit(True, backward_inputs(2, 1), key=("t", 2)).result(30).step == 0
    assert runtime.held == {("t", 2): 2} and runtime.step == 0
    rounding.set_result(RoundResult(grad_sum, 4, [("t", 1, 4)]))
    runtime.submit(False, [torch.randn(1, 16, SPEC.d_model)]).result(30)  # after the round's end
    assert runtime.step == 1 and runtime.held == {("t", 2): 2} and runtime.samples_accumulated == 2
    alone = make_runtime(target=4)  # what the next step holds is that backward's gradient alone
    alone.submit(True, backward_inputs(2, 1), key=("t", 2))
    alone.start()
    runtime.shutdown()
    alone.shutdown()
    assert torch.equal(runtime.flat_gradient(), alone.flat_gradient())


def test_a_round_that_fails_keeps_what_came_meanwhile_toward_its_step_for_the_retry():
    """A backward that arrives while an attempt runs (sent again after its call to a frozen mate timed out, say)
    is this step's: the attempt fails, and the retry sums it with the round's own, not the next step."""
    runtime = make_runtime(target=4)
    coordinator = runtime.coordinator = HeldRound()
    runtime.start()
    runtime.submit(True, backward_inputs(4, 0), key=("t", 1)).result(30)
    start_round(runtime, coordinator, 1)
    first = coordinator.rounds[0][1].clone()
    runtime.submit(True, backward_inputs(2, 1), key=("t", 2)).result(30)  # during the round
    coordinator.rounds[0][3].set_result(None)  # short: the stage waits for samples sent again
    runtime.submit(False, [torch.randn(1, 16, SPEC.d_model)]).result(30)  # after the round's end
    start_round(runtime, coordinator, 2)
    step, grad_sum, held, rounding = coordinator.rounds[1]
    assert step == 0 and held == {("t", 1): 4, ("t", 2): 2}
    assert not torch.equal(grad_sum, first) and grad_sum.shape == first.shape
    rounding.set_result(RoundResult(grad_sum, 6, [("t", 1, 4), ("t", 2, 2)]))
    runtime.submit(False, [torch.randn(1, 16, SPEC.d_model)]).result(30)
    assert runtime.step == 1 and runtime.held == {}
    runtime.shutdown()


def test_a_round_left_behind_by_a_state_load_leaves_the_next_steps_round_its_gradients():
    """A state loaded while a round was under way: the next step's round may start before the old one ends, and
    the old one's end must not take what the new one set aside (the peer would then never step on it)."""
    runtime = make_runtime(target=4)
    coordinator = runtime.coordinator = HeldRound()
    runtime.start()
    runtime.submit(True, backward_inputs(4, 0), key=("t", 1)).result(30)
    start_round(runtime, coordinator, 1)
    runtime.run_exclusive(lambda: runtime.load_state(3, lambda: None)).result(30)
    runtime.submit(True, backward_inputs(4, 1), key=("t", 2)).result(30)
    start_round(runtime, coordinator, 2)
    step, grad_sum, held, rounding = coordinator.rounds[1]
    assert step == 3 and held == {("t", 2): 4}
    coordinator.rounds[0][3].set_result(None)  # the old round ends (left behind) while the new one runs
    runtime.submit(False, [torch.randn(1, 16, SPEC.d_model)]).result(30)
    rounding.set_result(RoundResult(grad_sum, 4, [("t", 2, 4)]))
    runtime.submit(False, [torch.randn(1, 16, SPEC.d_model)]).result(30)
    assert runtime.step == 4 and runtime.samples_stepped == 4
    runtime.shutdown()


def test_microbatches_a_state_load_dropped_are_expected_by_the_next_round_unless_summed_or_held():
    """A replica behind its mates accumulated microbatches toward a step they had passed, then took their state:
    its trainers had their replies and the mates never heard of them, so the round at the new step must expect
    them (and find them lost, asking their trainers again). Those the state sums, or a member holds, are not."""
    runtime = make_runtime(target=64)
    coordinator = runtime.coordinator = HeldRound()
    runtime.start()
    runtime.submit(True, backward_inputs(8, 0), key=("t", 1)).result(30)
    start_round(runtime, coordinator, 1)  # ("t", 1) is now set aside for the round
    runtime.submit(True, backward_inputs(8, 1), key=("t", 2)).result(30)
    runtime.submit(True, backward_inputs(8, 2), key=("t", 3)).result(30)
    dropped = runtime.run_exclusive(lambda: runtime.load_state(8, lambda: None)).result(30)
    runtime.shutdown()
    assert dropped == {("t", 1): 8, ("t", 2): 8, ("t", 3): 8}
    machine = StepMachine(runtime, "QmPeerA", "gpt-tiny", FaultPlan())
    handover = StateHandOver.__new__(StateHandOver)  # only the bookkeeping after a load is exercised
    handover.machine, handover.progress = machine, ProgressExchange(machine, SimpleNamespace())
    handover.progress.summed_union = frozenset({("t", 2)})  # a recent round summed it
    machine.steps[8].progress["QmPeerB"] = {("t", 3): 8}  # a mate holds it toward the new step
    handover._ask_again(8, dropped)
    assert machine.steps[8].lost == {("t", 1): 8}
    assert machine.steps[8].phase == ACCUMULATING and not machine.lost(), "no call is refused before the round"


class ForwardedProgress(HeldRound):
    """A held round whose coordinator tells the step machine what the runtime holds, as the peer's does."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[tuple[int, dict]] = []

    def local_progress(self, step, held) -> None:
        self.said.append((step, held))


def test_a_microbatch_taken_during_a_round_and_dropped_by_a_load_is_asked_for_again():
    """A backward taken while the peer's round runs holds toward the next step, and the peer says so. A state
    load at that step drops it: the peer's own word must not count as a member holding it, or the round at the
    new step expects it from nobody and it is lost silently (8 samples in a trust-root chaos run)."""
    runtime = make_runtime(target=64)
    coordinator = runtime.coordinator = ForwardedProgress()
    runtime.start()
    runtime.submit(True, backward_inputs(8, 0), key=("t", 1)).result(30)
    start_round(runtime, coordinator, 1)  # its round at step 0 runs: what comes now holds toward step 1
    runtime.submit(True, backward_inputs(8, 1), key=("t", 2)).result(30)
    dropped = runtime.run_exclusive(lambda: runtime.load_state(1, lambda: None)).result(30)
    runtime.shutdown()
    assert dropped == {("t", 1): 8, ("t", 2): 8}
    machine = StepMachine(runtime, "QmPeerA", "gpt-tiny", FaultPlan())
    assert coordinator.said[-1] == (1, {("t", 2): 8}), "the peer said it holds it toward the next step"
    for step, held in coordinator.said:
        machine.steps[step].progress["QmPeerA"] = held
    handover = StateHandOver.__new__(StateHandOver)
    handover.machine, handover.progress = machine, ProgressExchange(machine, SimpleNamespace())
    handover._ask_again(1, dropped)
    assert machine.steps[1].lost == dropped and machine.steps[1].dropped["QmPeerA"] == dropped
    assert machine.own(1) == {}, "what went with the load is no longer said to be held"
