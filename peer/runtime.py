"""The runtime: one thread that runs a stage's forward and backward work on its device.

Requests wait in a queue (`swarm.peer.request_queue`), merged into batches. Only this thread changes
the parameters, so accumulation and optimizer steps need no locks: work that must see a consistent
state (a round's start and its step, a state snapshot, loading a mate's state) runs here too, as an
exclusive task. An averaging round runs on the event loop meanwhile (`gradient_buffers`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.models import GPTStage
from swarm.models.precision import autocast
from swarm.peer.device_copies import DeviceCopies
from swarm.peer.faults import FaultPlan
from swarm.peer.gradient_buffers import Accumulated, flat_gradient, merged, put, set_gradients, take
from swarm.peer.request_queue import (
    CallAbandonedError,
    QueueFullError,
    RequestQueue,
    SampleKey,
    StageResult,
    Task,
    fail,
    settle,
)
from swarm.peer.stage_spilling import SpilledStage
from swarm.peer.stage_state import parameter_fingerprint
from swarm.peer.step_deltas import EMPTY, NONFINITE, STEPPED, DeltaRing, step_on_sum, step_outcome
from swarm.peer.step_fingerprints import StepFingerprints
from swarm.policy.throughput_average import ThroughputAverage

logger = logging.getLogger(__name__)


# what other modules import from here, beside the runtime itself
__all__ = [
    "CallAbandonedError",
    "QueueFullError",
    "RoundResult",
    "SampleKey",
    "StageResult",
    "StageRuntime",
    "StaleGradientError",
    "StepCoordinator",
]


class StaleGradientError(RuntimeError):
    """A backward whose forward ran against a model version older than the peer accepts."""


@dataclass
class RoundResult:
    """What an averaging round agreed on: the group's gradient sum and exactly which samples it holds."""

    grad_sum: torch.Tensor | None
    samples: int
    ids: list[tuple[str, int, int]] = field(default_factory=list)  # (trainer, microbatch, samples) summed
    lost: list[tuple[str, int, int]] = field(default_factory=list)  # given up: their holder died with them
    seconds: float = 0.0  # how long the round held up the runtime


class StepCoordinator(Protocol):
    """Decides when a stage steps and averages gradients with its stage-mates (see `peer/mates.py`)."""

    def local_progress(self, step: int, held: dict[SampleKey, int]) -> None:
        """Called on the runtime thread whenever the microbatches this peer holds toward `step` change."""

    def average(self, step: int, grad_sum: torch.Tensor | None, held: dict[SampleKey, int]) -> Future:
        """Starts one averaging round; the future resolves to what the group agreed to step on.

        The runtime thread does not wait for it: forwards, and backwards that add nothing to the
        gradients, keep running meanwhile. None means not now (the round came up short, or failed):
        the stage keeps what it has accumulated and steps when the coordinator asks again.
        """

    def held_elsewhere(self) -> frozenset[SampleKey]:
        """Called on the runtime thread: microbatches another replica holds or a recent round summed,
        whose backwards this peer answers without summing their gradients."""


class StageRuntime:
    """Runs one stage: queued forward and backward requests, gradient accumulation, optimizer steps."""

    def __init__(
        self,
        module: GPTStage,
        optimizer: torch.optim.Optimizer,
        target_batch_size: int,
        device: str = "cpu",
        max_batch_samples: int = 256,
        max_batch_seconds: float = 0.1,
        step: int = 0,
        on_step: Callable[[int, str], None] | None = None,
        max_staleness: int = 1,
        simulated_speed: float = 0.0,
        faults: FaultPlan | None = None,
        max_queue: int = 1024,
        dtype: torch.dtype = torch.float32,
        offload: bool = False,
        offload_group: int = 0,
    ) -> None:
        # offload: the blocks stay in host memory and visit the device a group at a time (peer/stage_spilling.py)
        self.spilling = SpilledStage(module, device, offload_group) if offload else None
        self.module = module if offload else module.to(device)
        self.copies = DeviceCopies(device)  # host <-> device off the critical path (inert on a CPU)
        # the compute dtype (`swarm.models.precision`): forwards run under its autocast and the boundary tensors
        # they return, and the input gradients, are in it; parameters, their gradients and the optimizer stay float32
        self.dtype = dtype
        self.optimizer = optimizer
        self.target_batch_size = target_batch_size
        self.device = torch.device(device)
        self.max_batch_samples = max_batch_samples
        # merged requests all wait for the whole batch: one that runs long sends the next stage a burst
        # after a pause, so merging stops at this much estimated work (0: at max_batch_samples only)
        self.max_batch_seconds = max_batch_seconds
        self.step = step
        self.samples_accumulated = 0
        self.held: dict[SampleKey, int] = {}  # the microbatches accumulated toward the current step
        # (step, fingerprint of the parameters at that step), replaced as one: readers on other threads
        # must never pair a new step with the previous step's fingerprint
        self.version: tuple[int, str] = (step, parameter_fingerprint(module))
        self.last_round: RoundResult | None = None  # what the latest step summed
        # after every step, from the thread that hashes the new parameters (`step_fingerprints`)
        self.on_step = on_step
        self.on_stepped: Callable[[int], None] | None = None  # at once after every step, on the runtime thread
        self.deltas: DeltaRing | None = None  # what each step applied, kept for standby holders (never when spilling)
        self.fingerprints = StepFingerprints(module)
        self.coordinator: StepCoordinator | None = None  # None: step alone at the target batch
        self.max_staleness = max_staleness
        self.stale_gradients = 0
        self.samples_stepped = 0  # over the stage's whole life; travels with its state
        self.speed = ThroughputAverage()  # what the peer announces; sizes its batches too
        # > 0: behave as a device of this many samples/s of backward work (compute padded with sleep)
        self.simulated_speed = simulated_speed
        self.faults = faults or FaultPlan()
        self.busy_seconds = 0.0  # spent running batches of requests: a pipeline's utilization is this over time
        self.nonfinite_steps = 0  # steps whose summed gradient was not finite: skipped by every replica alike
        self._step_requested: int | None = None  # guarded by the queue's lock
        self._in_round: Accumulated | None = None  # a running round's, set aside: backwards accumulate anew meanwhile
        self._overflow: Accumulated | None = None  # accumulated in a round of a step since left: the next step's
        self._loads = 0  # state loads so far: a round begun before one is not applied after it
        self.requests = RequestQueue(module.stage, max_queue, self._held_elsewhere, self._merge_limit)
        self._thread = threading.Thread(target=self._run, name="stage-runtime", daemon=True)

    # --- called from other threads ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        backward: bool,
        tensors: list[torch.Tensor],
        key: Hashable = None,
        version: int | None = None,
        give_up_at: float | None = None,
        accumulate: bool = True,
    ) -> Future:
        """Queues a request; the future resolves to a StageResult or to the exception it raised.

        `key` names a backward request uniquely (trainer and microbatch); a backward with a key already
        applied is answered without accumulating its gradients again. A backward's gradient is committed
        only while its caller still waits for the reply (before `give_up_at`): one that finishes later is
        dropped, so a retry on a stage-mate does not count it twice. `version` is the step a backward's
        forward ran at: up to `max_staleness` steps behind, its gradient is applied and counted as stale;
        further behind, it is refused with StaleGradientError. `give_up_at` (time.monotonic()) is when the
        caller stops waiting: a request not started by then is dropped with CallAbandonedError, so an
        overloaded peer does not spend its time on replies nobody reads while the callers' retries queue
        up. `accumulate=False` (a spot check's backward): input gradients only, nothing held or counted.
        """
        return self.requests.put(backward, tensors, key, version, give_up_at, accumulate)

    def run_exclusive(self, fn: Callable[[], Any], front: bool = False) -> Future:
        """Runs `fn` on the runtime thread between batches; the future resolves to its result."""
        return self.requests.put_exclusive(fn, front)

    def request_step(self, step: int) -> None:
        """Asks for an averaging round and optimizer step at `step`, ahead of queued requests.

        Thread-safe; a request for a step the runtime has passed, or one already queued, is ignored.
        """
        with self.requests.lock:
            if step != self.step or self._step_requested == step:
                return
            self._step_requested = step
        self.run_exclusive(lambda: self._average_and_step(step), front=True)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the parameters at the stage's current step."""
        return self.version[1]

    def fingerprint_at(self, step: int) -> str:
        """The parameters' fingerprint if the stage is at `step`, else the empty string."""
        at, fingerprint = self.version
        return fingerprint if at == step else ""

    @property
    def queue_length(self) -> int:
        return len(self.requests)

    @property
    def duplicates(self) -> int:
        """Backwards answered without accumulating: retries of applied ones, or held by a stage-mate."""
        return self.requests.duplicates

    @property
    def abandoned(self) -> int:
        """Requests dropped because their caller had given up before they were applied."""
        return self.requests.abandoned

    @property
    def busy_refusals(self) -> int:
        """Requests refused because the queue was full."""
        return self.requests.busy_refusals

    def count_hung_up(self) -> None:
        """Counts a call whose caller hung up before its request was complete with the abandoned ones."""
        self.requests.count_hung_up()

    @property
    def seconds_per_sample(self) -> float | None:
        """Seconds per sample of backward work, averaged over batches (None until measured)."""
        return self.speed.seconds_per_sample

    @property
    def throughput(self) -> float:
        """Samples per second of backward work (which includes the recomputed forward)."""
        return self.speed.samples_per_second

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finishes queued work (up to `timeout` seconds), then stops the worker."""
        self.requests.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.fingerprints.settle()  # the last step's fingerprint is known once the runtime stops
        self.fingerprints.shutdown()
        self.requests.fail_all(RuntimeError("the peer shut down before running this request"))

    def measure_throughput(self, sample: list[torch.Tensor]) -> float:
        """Times one backward on a sample batch to seed the throughput estimate; leaves no gradients."""
        sample = [t.to(self.dtype) if t.is_floating_point() else t for t in sample]  # as a request carries them
        # untimed first: a process's first backward also initializes torch's kernels (0.3 s against 0.02 s for
        # gpt-tiny here), and a first record 15 times too slow misleads the balance plans of every peer
        self._backward(sample)
        self.module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        self._backward(sample)
        self._pad_to_simulated_speed(start, sample[0].shape[0], backward=True)
        self.speed.reset((time.perf_counter() - start) / sample[0].shape[0])
        self.module.zero_grad(set_to_none=True)
        return self.throughput

    # --- the worker thread -----------------------------------------------------------------------

    def _held_elsewhere(self) -> frozenset[SampleKey]:
        return self.coordinator.held_elsewhere() if self.coordinator is not None else frozenset()

    def _merge_limit(self, head: Task) -> int:
        """Samples a batch led by `head` may hold: max_batch_samples, and max_batch_seconds of work once
        the stage's speed is known (a forward costs about a third of a backward)."""
        if self.max_batch_seconds <= 0 or not self.seconds_per_sample:
            return self.max_batch_samples
        per_sample = self.seconds_per_sample * (1.0 if head.backward else 1 / 3)
        return min(self.max_batch_samples, int(self.max_batch_seconds / per_sample))

    def _run(self) -> None:
        while (batch := self.requests.next_batch()) is not None:
            if batch[0].exclusive is not None:
                try:
                    settle(batch[0].future, batch[0].exclusive())
                except Exception as e:
                    logger.exception(f"Stage {self.module.stage}: an exclusive task failed")
                    fail(batch[0].future, e)
                continue
            if batch[0].backward:
                batch = self._drop_too_stale(batch)
                if not batch:
                    continue
            started = time.perf_counter()
            try:
                results = self._run_batch(batch)
            except Exception as e:
                logger.exception(f"Stage {self.module.stage} failed to run a batch of {len(batch)} requests")
                with self.requests.lock:  # nothing was applied: a retry must accumulate
                    for task in batch:
                        self.requests.release(task)
                for task in batch:
                    fail(task.future, e)
                continue
            finally:
                self.busy_seconds += time.perf_counter() - started
            for task, result in zip(batch, results):
                if isinstance(result, Exception):
                    fail(task.future, result)
                elif result is not None:  # None: put back in the queue to run again
                    settle(task.future, result)

    def _drop_too_stale(self, batch: list[Task]) -> list[Task]:
        """Refuses backwards too far behind; counts the stale ones that will be applied."""
        kept = []
        for task in batch:
            behind = self.step - task.version if task.version is not None else 0
            if behind > self.max_staleness:
                with self.requests.lock:
                    self.requests.release(task)
                fail(
                    task.future,
                    StaleGradientError(
                        f"the forward ran at step {task.version}, this peer is at step {self.step}; "
                        f"at most {self.max_staleness} step(s) behind are accepted: run the microbatch again"
                    ),
                )
                continue
            if behind > 0 and task.accumulate:
                self.stale_gradients += 1
            kept.append(task)
        return kept

    def _run_batch(self, batch: list[Task]) -> list[StageResult | Exception | None]:
        step = self.step
        sizes = [task.num_samples for task in batch]
        merged = [torch.cat(column) if len(batch) > 1 else column[0] for column in zip(*(t.tensors for t in batch))]
        merged = self.copies.to_device(merged)
        start = time.perf_counter()
        if not batch[0].backward:
            with torch.inference_mode():
                outputs = self._stage_forward(merged)
            self._pad_to_simulated_speed(start, sum(sizes), backward=False)
            # left on the device: the handler's worker copies them to the host while this thread runs the next batch
            ready = self.copies.ready_event()
            return [StageResult([out], None, step, ready) for out in outputs.split(sizes)]

        if not batch[0].accumulate:
            input_grad, losses = self._backward(merged, accumulate=False)
            self._pad_to_simulated_speed(start, sum(sizes), backward=True)
        else:
            params = list(self.module.parameters())
            # the batch's gradients go into fresh buffers, added to the step's sums only if committed
            previous = [p.grad for p in params]
            for param in params:
                param.grad = None
            try:
                input_grad, losses = self._backward(merged)
            except Exception:
                for param, grad in zip(params, previous):
                    param.grad = grad
                raise
            self._pad_to_simulated_speed(start, sum(sizes), backward=True)
            self.faults.hit_sync("before_commit")
            now = time.monotonic()
            elsewhere = self._held_elsewhere()
            if any(task.late(now) or task.key in elsewhere for task in batch):
                for param, grad in zip(params, previous):
                    param.grad = grad
                return self._requeue_uncommitted(batch, now, elsewhere)
            for param, grad in zip(params, previous):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
            elapsed = (time.perf_counter() - start) / sum(sizes)
            self.speed.add(elapsed)
            self.samples_accumulated += sum(sizes)
            for task, size in zip(batch, sizes):
                self.held[task.key] = self.held.get(task.key, 0) + size
            if self.coordinator is not None:  # during a round, toward the step after it
                self.coordinator.local_progress(self.step + (self._in_round is not None), dict(self.held))
            elif self.samples_accumulated >= self.target_batch_size:
                self._average_and_step(self.step)
        grads = input_grad.split(sizes) if input_grad is not None else [None] * len(batch)
        loss_parts = losses.split(sizes) if losses is not None else [None] * len(batch)
        ready = self.copies.ready_event()
        return [StageResult([] if grad is None else [grad], loss, step, ready) for grad, loss in zip(grads, loss_parts)]

    def _requeue_uncommitted(
        self, batch: list[Task], now: float, elsewhere: frozenset[SampleKey]
    ) -> list[Exception | None]:
        """A batch finished after some caller gave up, or holding a microbatch a mate summed meanwhile: its
        gradients are dropped; the late requests are answered as abandoned, the others go back to the front
        of the queue to run again, those the mate holds without accumulating."""
        late = self.requests.put_back(batch, now, elsewhere)
        if late:
            logger.info(
                f"Stage {self.module.stage}: {len(late)} backward(s) finished after their caller gave up; "
                "not applied (the caller sends them elsewhere)"
            )
        return [
            CallAbandonedError("the caller's deadline passed before this peer could apply the request")
            if task.late(now)
            else None
            for task in batch
        ]

    def _pad_to_simulated_speed(self, start: float, samples: int, backward: bool) -> None:
        """With a simulated speed, sleeps until the work has taken as long as that device would take."""
        if self.simulated_speed <= 0:
            return
        seconds = samples / self.simulated_speed * (1.0 if backward else 1 / 3)
        remaining = start + seconds - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def _stage_forward(self, inputs: list[torch.Tensor], targets: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's module on a call's inputs: its input, then the token ids where it takes them.

        It runs under autocast in the compute dtype. A hidden input is taken up to float32 (the stream a
        one-process model carries between its layers) and the output cast to the compute dtype, as it goes
        on the wire; losses stay float32. In float32 every cast is the tensor itself: nothing changes.
        """
        hidden = inputs[0].float() if inputs[0].is_floating_point() else inputs[0]
        with autocast(self.device, self.dtype):
            output = (self.spilling or self.module)(
                hidden, targets, tokens=inputs[1] if self.module.takes_tokens else None
            )
        return output.float() if targets is not None else output.to(self.dtype)

    def _backward(
        self, tensors: list[torch.Tensor], accumulate: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Recomputes the forward from the inputs and backpropagates; returns (input grad, losses).

        With accumulate=False only the input gradient is computed; parameter gradients stay as they are.
        """
        split = self.module.num_inputs
        stage_inputs, extra = list(tensors[:split]), tensors[split]
        inputs = stage_inputs[0]
        if inputs.is_floating_point():
            inputs = stage_inputs[0] = inputs.detach().requires_grad_(True)
        elif not accumulate and not self.module.is_last:
            return None, None  # token inputs have no gradient, and nothing is to be accumulated
        with torch.enable_grad():
            losses = self._stage_forward(stage_inputs, extra) if self.module.is_last else None
            output, grad_output = (
                (losses.sum(), None) if losses is not None else (self._stage_forward(stage_inputs), extra)
            )
            if accumulate:
                output.backward(grad_output)
                input_grad = inputs.grad if inputs.requires_grad else None
            else:
                input_grad = torch.autograd.grad(output, inputs, grad_output)[0] if inputs.requires_grad else None
        return input_grad, (None if losses is None else losses.detach())

    # --- steps and state ----------------------------------------------------------------------------

    def flat_gradient(self) -> torch.Tensor | None:
        """The accumulated gradient sums of all parameters as one float32 vector (None if nothing accumulated)."""
        return flat_gradient(self.module) if self.samples_accumulated else None

    def _average_and_step(self, step: int) -> None:
        """One step at `step`: averages with the stage-mates (if any), then applies the optimizer."""
        if step != self.step:
            return  # a request that crossed a state download or an earlier step
        if self.coordinator is None:
            ids = [(trainer, mb, n) for (trainer, mb), n in self.held.items()]
            self._apply_step(step, RoundResult(None, self.samples_accumulated, ids))
            return
        loads = self._loads
        try:
            rounding = self.coordinator.average(step, self.flat_gradient(), dict(self.held))
        except Exception as e:
            logger.error(f"Stage {self.module.stage}: could not start averaging at step {step} ({e!r}); will retry")
            with self.requests.lock:
                self._step_requested = None
            return
        # backwards from here on accumulate toward the next step, beside what the round sums
        self._in_round = take(self.module, self.held, self.samples_accumulated)
        self.held, self.samples_accumulated = {}, 0
        self._restore(self._overflow)
        self._overflow = None

        def finish(done: Future) -> None:
            with contextlib.suppress(RuntimeError):  # the runtime is shutting down
                self.run_exclusive(lambda: self._round_done(step, loads, done), front=True)

        rounding.add_done_callback(finish)

    def _round_done(self, step: int, loads: int, rounding: Future) -> None:
        """The round of `step` ended (on the runtime thread): step on its result, what came in meanwhile going to
        the next step; or, failed, keep all of it toward this step, for the retry to sum."""
        result = None
        try:
            result = rounding.result()
        except Exception as e:
            # keep the gradients; the coordinator asks for this step again on its next check
            logger.error(f"Stage {self.module.stage}: averaging at step {step} failed ({e!r}); will retry")
        if loads != self._loads or self._in_round is None:
            return  # a state was loaded meanwhile: it dropped every gradient (what is set aside now is a later round's)
        in_round, self._in_round = self._in_round, None
        overflow = take(self.module, self.held, self.samples_accumulated)
        if result is None or step != self.step:
            if step == self.step:  # not stepped: what came in meanwhile is this step's still, for its retry to sum
                self._restore(merged(in_round, overflow))
            else:
                self._restore(in_round)
                self._overflow = overflow if overflow.samples else None
            with self.requests.lock:
                self._step_requested = None
            if step == self.step and overflow.held and self.coordinator is not None:
                self.coordinator.local_progress(step + 1, {})
                self.coordinator.local_progress(step, dict(self.held))
            return
        if result.samples > 0 and result.grad_sum is not None:
            set_gradients(self.module, result.grad_sum)
        self._apply_step(step, result)
        self.module.zero_grad(set_to_none=True)
        self._restore(overflow)
        if overflow.samples and self.coordinator is not None:
            self.coordinator.local_progress(self.step, dict(self.held))

    def _restore(self, accumulated: Accumulated | None) -> None:
        """Makes gradients set aside the ones backwards accumulate into (the module's must be empty)."""
        if accumulated is not None:
            put(self.module, accumulated)
            self.held, self.samples_accumulated = dict(accumulated.held), accumulated.samples

    def _apply_step(self, step: int, result: RoundResult) -> None:
        """Applies the optimizer on what the round summed (or the stage alone accumulated) and moves to step + 1."""
        self.settle_fingerprint()
        with self.requests.lock:
            self._step_requested = None
        total = result.samples
        self.held = {}
        self.samples_accumulated = 0
        outcome = step_outcome(self.module, total)
        if self.deltas is not None:
            self.deltas.record(step, self.module, outcome, total)
        if outcome == EMPTY:
            # the group steps together even on nothing, so that its replicas stay at one step
            logger.warning(f"Stage {self.module.stage}: the group had no samples at step {step}; skipping it")
        elif outcome == NONFINITE:
            # every replica sums the same agreed contributions, so every replica skips alike
            self.nonfinite_steps += 1
            logger.error(
                f"Stage {self.module.stage}: the summed gradient of step {step} is not finite; skipping its "
                f"update ({self.nonfinite_steps} so far): a contribution was broken"
            )
        elif total != self.target_batch_size:
            logger.info(
                f"Stage {self.module.stage} steps on {total} samples, target is {self.target_batch_size}: "
                "microbatches crossed the step boundary"
            )
        if self.spilling is not None and outcome == STEPPED:
            self.spilling.step(self.optimizer, total)
        else:
            step_on_sum(self.module, self.optimizer, total, outcome)
        if outcome == STEPPED:
            self.samples_stepped += total
        self.step += 1
        self.last_round = result
        self.version = (self.step, "")  # its fingerprint follows
        if self.on_stepped is not None:
            self.on_stepped(self.step)
        self.fingerprints.hash(self.step, self._stepped)

    def _stepped(self, step: int, fingerprint: str) -> None:
        self.version = (step, fingerprint)
        if self.on_step is not None:
            self.on_step(step, fingerprint)

    def settle_fingerprint(self) -> None:
        """Waits for the fingerprint of the current step (call before changing the parameters)."""
        self.fingerprints.settle()

    def load_state(self, step: int, apply: Callable[[], None], samples_stepped: int = 0) -> dict[SampleKey, int]:
        """Replaces the stage's state (on the runtime thread): `apply` loads it. Returns the microbatches whose
        accumulated gradients it dropped: their trainers must send them again."""
        self.settle_fingerprint()
        self.module.zero_grad(set_to_none=True)
        self.samples_accumulated = 0
        self._loads += 1
        set_aside = [a for a in (self._in_round, self._overflow) if a is not None]
        dropped = {**self.held, **{key: n for a in set_aside for key, n in a.held.items()}}
        self.requests.forget(list(dropped))  # dropped, not applied: sent again, they must accumulate
        self._in_round = self._overflow = None
        self.held = {}
        if self.deltas is not None:
            self.deltas.forget()
        apply()
        with self.requests.lock:
            self._step_requested = None
        self.step = step
        self.samples_stepped = samples_stepped
        fingerprint = parameter_fingerprint(self.module)
        self.version = (step, fingerprint)
        self.last_round = None
        if self.on_step is not None:
            self.on_step(self.step, fingerprint)
        return dropped
