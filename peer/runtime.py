"""The runtime: one thread that runs a stage's forward and backward work on its device.

Requests wait in a queue; the worker takes the oldest and merges queued requests of the same
kind and shape into one batch, up to a sample limit, so a busy peer runs fewer, larger batches.
Only this thread touches the parameters, so accumulation and optimizer steps need no locks:
work that must see a consistent state (an averaging round and its step, a state snapshot for a
joining mate, loading a mate's state) runs on this thread too, as an exclusive task.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.models import GPTStage
from swarm.models.optimizer import apply_accumulated_step
from swarm.peer.faults import FaultPlan
from swarm.peer.stage_state import parameter_fingerprint

logger = logging.getLogger(__name__)


class CallAbandonedError(RuntimeError):
    """The caller's deadline passed before the runtime started the request: computing it would be wasted."""


class StaleGradientError(RuntimeError):
    """A backward whose forward ran against a model version older than the peer accepts."""


class QueueFullError(RuntimeError):
    """The peer already holds as many queued requests as it accepts: the caller should go elsewhere."""


SampleKey = tuple[str, int]  # a microbatch's global id: (trainer, microbatch id)


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

    def average(self, step: int, grad_sum: torch.Tensor | None, held: dict[SampleKey, int]) -> RoundResult | None:
        """Blocks the runtime thread for one averaging round; returns what the group agreed to step on.

        None means not now (the round came up short, or failed): the stage keeps what it has
        accumulated and steps when the coordinator asks again.
        """

    def held_elsewhere(self) -> frozenset[SampleKey]:
        """Called on the runtime thread: microbatches another replica holds or a recent round summed,
        whose backwards this peer answers without summing their gradients."""


@dataclass
class StageResult:
    """What one request gets back: output tensors (or input gradients), per-sample losses, the step."""

    tensors: list[torch.Tensor]
    losses: torch.Tensor | None
    step: int


@dataclass(eq=False)  # compared by identity: queue removals must not compare tensors
class _Task:
    backward: bool
    tensors: list[torch.Tensor]
    key: Hashable = None
    accumulate: bool = True
    version: int | None = None  # the step a backward's forward ran at
    exclusive: Callable[[], Any] | None = None  # runs alone on the runtime thread
    give_up_at: float | None = None  # time.monotonic() when the caller stops waiting for the reply
    future: Future = field(default_factory=Future)

    @property
    def num_samples(self) -> int:
        return self.tensors[0].shape[0] if self.tensors else 0

    def late(self, now: float) -> bool:
        return self.give_up_at is not None and self.give_up_at <= now

    def batches_with(self, other: _Task) -> bool:
        if self.exclusive is not None or other.exclusive is not None:
            return False
        return (self.backward, self.accumulate) == (other.backward, other.accumulate) and all(
            a.dtype == b.dtype and a.shape[1:] == b.shape[1:] for a, b in zip(self.tensors, other.tensors)
        )


def _settle(future: Future, result: Any) -> None:
    """Resolves a request's future unless its caller cancelled it (it went away): never raises."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def _fail(future: Future, error: BaseException) -> None:
    """Fails a request's future unless its caller cancelled it: never raises."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


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
    ) -> None:
        self.module = module.to(device)
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
        self._anonymous = 0  # backwards that came without an id get a local one
        # (step, fingerprint of the parameters at that step), replaced as one: readers on other threads
        # must never pair a new step with the previous step's fingerprint
        self.version: tuple[int, str] = (step, parameter_fingerprint(module))
        self.last_round: RoundResult | None = None  # what the latest step summed
        self.on_step = on_step
        self.coordinator: StepCoordinator | None = None  # None: step alone at the target batch
        self.max_staleness = max_staleness
        self.stale_gradients = 0
        self.samples_stepped = 0  # over the stage's whole life; travels with its state
        self.seconds_per_sample: float | None = None
        # > 0: behave as a device of this many samples/s of backward work (compute padded with sleep)
        self.simulated_speed = simulated_speed
        self.faults = faults or FaultPlan()
        self.max_queue = max_queue
        self.busy_refusals = 0  # requests refused because the queue was full
        self.busy_seconds = 0.0  # spent running batches of requests: a pipeline's utilization is this over time
        self.nonfinite_steps = 0  # steps whose summed gradient was not finite: skipped by every replica alike
        self._step_requested: int | None = None
        # keys of recently applied backward requests: a retried backward whose first attempt was
        # applied (its reply lost on the way) gets its input gradient again but is not accumulated twice
        self._applied: OrderedDict[Hashable, None] = OrderedDict()
        self.max_remembered = 100_000
        self.duplicates = 0
        self.abandoned = 0  # requests dropped because their caller had given up before they were applied
        self._queue: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._stopping = False
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
    ) -> Future:
        """Queues a request; the future resolves to a StageResult or to the exception it raised.

        `key` names a backward request uniquely (trainer and microbatch); a backward with a key
        already applied is answered without accumulating its gradients again. A backward's gradient is
        committed only while its caller still waits for the reply (before `give_up_at`): one that
        finishes later is dropped, so a retry on a stage-mate does not count it twice. `version` is the
        step a backward's forward ran at: up to `max_staleness` steps behind, its gradient is
        applied and counted as stale; further behind, it is refused with StaleGradientError.
        `give_up_at` (time.monotonic()) is when the caller stops waiting: a request not started by
        then is dropped with CallAbandonedError, so an overloaded peer does not spend its time on
        replies nobody reads while the callers' retries queue up behind them.
        """
        with self._cond:
            if self._stopping:
                raise RuntimeError("the runtime is shutting down")
            if len(self._queue) >= self.max_queue:
                self.busy_refusals += 1
                raise QueueFullError(f"this peer is busy: {len(self._queue)} requests queued, its limit")
            if backward and key is None:
                self._anonymous += 1
                key = ("", self._anonymous)
            task = _Task(backward, tensors, key, version=version, give_up_at=give_up_at)
            if backward:
                if key in self._applied:
                    task.accumulate = False
                    self.duplicates += 1
                    logger.info(f"Stage {self.module.stage}: backward {key} came again; not accumulating it twice")
                else:
                    self._applied[key] = None
                    if len(self._applied) > self.max_remembered:
                        self._applied.popitem(last=False)
            self._queue.append(task)
            self._cond.notify()
        return task.future

    def run_exclusive(self, fn: Callable[[], Any], front: bool = False) -> Future:
        """Runs `fn` on the runtime thread between batches; the future resolves to its result."""
        task = _Task(False, [], exclusive=fn)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the runtime is shutting down")
            if front:
                self._queue.appendleft(task)
            else:
                self._queue.append(task)
            self._cond.notify()
        return task.future

    def request_step(self, step: int) -> None:
        """Asks for an averaging round and optimizer step at `step`, ahead of queued requests.

        Thread-safe; a request for a step the runtime has passed, or one already queued, is ignored.
        """
        with self._cond:
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
        return len(self._queue)

    @property
    def throughput(self) -> float:
        """Samples per second of backward work (which includes the recomputed forward)."""
        return 1.0 / self.seconds_per_sample if self.seconds_per_sample else 0.0

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finishes queued work (up to `timeout` seconds), then stops the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for task in self._queue:
            _fail(task.future, RuntimeError("the peer shut down before running this request"))
        self._queue.clear()

    def measure_throughput(self, sample: list[torch.Tensor]) -> float:
        """Times one backward on a sample batch to seed the throughput estimate; leaves no gradients."""
        # untimed first: a process's first backward also initializes torch's kernels (0.3 s against 0.02 s for
        # gpt-tiny here), and a first record 15 times too slow misleads the balance plans of every peer
        self._backward(sample)
        self.module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        self._backward(sample)
        self._pad_to_simulated_speed(start, sample[0].shape[0], backward=True)
        self.seconds_per_sample = (time.perf_counter() - start) / sample[0].shape[0]
        self.module.zero_grad(set_to_none=True)
        return self.throughput

    # --- the worker thread -----------------------------------------------------------------------

    def _next_batch(self) -> list[_Task] | None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._stopping:
                        return None
                    self._cond.wait()
                abandoned = self._take_abandoned()
                batch = self._take_batch() if self._queue else None
            for task in abandoned:
                _fail(
                    task.future,
                    CallAbandonedError("the caller's deadline passed before this peer could start the request"),
                )
            if batch is not None:
                return batch

    def _release(self, task: _Task) -> None:
        """`task` will not be applied: a retry of it must accumulate. Called with the lock held.

        A duplicate of it already queued (the caller retried on this same peer, the only one of its
        stage) was queued not to accumulate: it now carries the gradient instead of losing it.
        """
        if not task.accumulate:
            return
        twin = next((t for t in self._queue if t.key == task.key and t.backward and not t.accumulate), None)
        if twin is not None:
            twin.accumulate = True
        else:
            self._applied.pop(task.key, None)

    def count_hung_up(self) -> None:
        """Counts a call whose caller hung up before its request was complete with the abandoned ones."""
        with self._cond:
            self.abandoned += 1

    def _take_abandoned(self) -> list[_Task]:
        """Removes queued requests whose caller has given up; called with the lock held."""
        now = time.monotonic()
        abandoned = [t for t in self._queue if t.late(now)]
        for task in abandoned:
            self._queue.remove(task)
        for task in abandoned:
            self._release(task)
        if abandoned:
            self.abandoned += len(abandoned)
            logger.info(
                f"Stage {self.module.stage}: dropped {len(abandoned)} queued request(s) whose caller had given up "
                f"({self.abandoned} so far); this peer is overloaded"
            )
        return abandoned

    def _held_elsewhere(self) -> frozenset[SampleKey]:
        return self.coordinator.held_elsewhere() if self.coordinator is not None else frozenset()

    def _not_summed_twice(self, task: _Task, elsewhere: frozenset[SampleKey]) -> None:
        """A backward another replica holds (or a recent round summed) runs without accumulating: its
        retry must only get its input gradient again. Called with the lock held."""
        if task.backward and task.accumulate and task.key in elsewhere:
            task.accumulate = False
            self._applied.pop(task.key, None)  # sent again after all (that replica died), it must accumulate
            self.duplicates += 1
            logger.info(
                f"Stage {self.module.stage}: backward {task.key} is held by a stage-mate or already summed; "
                "answering it without accumulating it twice"
            )

    def _take_batch(self) -> list[_Task]:
        """The next task and the queued ones that merge with it; called with the lock held."""
        elsewhere = self._held_elsewhere()
        batch = [self._queue.popleft()]
        self._not_summed_twice(batch[0], elsewhere)
        total = batch[0].num_samples
        limit = self._merge_limit(batch[0])
        for task in list(self._queue):
            if total + task.num_samples > limit:
                break
            self._not_summed_twice(task, elsewhere)
            if batch[0].batches_with(task):
                self._queue.remove(task)
                batch.append(task)
                total += task.num_samples
        return batch

    def _merge_limit(self, head: _Task) -> int:
        """Samples a batch led by `head` may hold: max_batch_samples, and max_batch_seconds of work once
        the stage's speed is known (a forward costs about a third of a backward)."""
        if self.max_batch_seconds <= 0 or not self.seconds_per_sample:
            return self.max_batch_samples
        per_sample = self.seconds_per_sample * (1.0 if head.backward else 1 / 3)
        return min(self.max_batch_samples, int(self.max_batch_seconds / per_sample))

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if batch[0].exclusive is not None:
                try:
                    _settle(batch[0].future, batch[0].exclusive())
                except Exception as e:
                    logger.exception(f"Stage {self.module.stage}: an exclusive task failed")
                    _fail(batch[0].future, e)
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
                with self._cond:  # nothing was applied: a retry must accumulate
                    for task in batch:
                        self._release(task)
                for task in batch:
                    _fail(task.future, e)
                continue
            finally:
                self.busy_seconds += time.perf_counter() - started
            for task, result in zip(batch, results):
                if isinstance(result, Exception):
                    _fail(task.future, result)
                elif result is not None:  # None: put back in the queue to run again
                    _settle(task.future, result)

    def _drop_too_stale(self, batch: list[_Task]) -> list[_Task]:
        """Refuses backwards too far behind; counts the stale ones that will be applied."""
        kept = []
        for task in batch:
            behind = self.step - task.version if task.version is not None else 0
            if behind > self.max_staleness:
                with self._cond:
                    self._release(task)
                _fail(
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

    def _run_batch(self, batch: list[_Task]) -> list[StageResult | Exception | None]:
        step = self.step
        sizes = [task.num_samples for task in batch]
        merged = [torch.cat(column) if len(batch) > 1 else column[0] for column in zip(*(t.tensors for t in batch))]
        merged = [tensor.to(self.device, non_blocking=True) for tensor in merged]
        start = time.perf_counter()
        if not batch[0].backward:
            with torch.inference_mode():
                outputs = self._stage_forward(merged)
            self._pad_to_simulated_speed(start, sum(sizes), backward=False)
            return [StageResult([out.cpu()], None, step) for out in outputs.split(sizes)]

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
            self.seconds_per_sample = (
                elapsed if self.seconds_per_sample is None else (0.9 * self.seconds_per_sample + 0.1 * elapsed)
            )
            self.samples_accumulated += sum(sizes)
            for task, size in zip(batch, sizes):
                self.held[task.key] = self.held.get(task.key, 0) + size
            if self.coordinator is not None:
                self.coordinator.local_progress(self.step, dict(self.held))
            elif self.samples_accumulated >= self.target_batch_size:
                self._average_and_step(self.step)
        grads = input_grad.cpu().split(sizes) if input_grad is not None else [None] * len(batch)
        loss_parts = losses.cpu().split(sizes) if losses is not None else [None] * len(batch)
        return [StageResult([] if grad is None else [grad], loss, step) for grad, loss in zip(grads, loss_parts)]

    def _requeue_uncommitted(
        self, batch: list[_Task], now: float, elsewhere: frozenset[SampleKey]
    ) -> list[Exception | None]:
        """A batch finished after some caller gave up, or holding a microbatch a mate summed meanwhile: its
        gradients are dropped; the late requests are answered as abandoned, the others go back to the front
        of the queue to run again, those the mate holds without accumulating."""
        late = [task for task in batch if task.late(now)]
        with self._cond:
            for task in reversed([t for t in batch if not t.late(now)]):
                self._not_summed_twice(task, elsewhere)
                self._queue.appendleft(task)
            for task in late:
                self._release(task)
            self.abandoned += len(late)
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
        """The stage's module on a call's inputs: its input, then the token ids where it takes them."""
        return self.module(inputs[0], targets, tokens=inputs[1] if self.module.takes_tokens else None)

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
        if self.samples_accumulated == 0:
            return None
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                for p in self.module.parameters()
            ]
        )

    def _average_and_step(self, step: int) -> None:
        """One step at `step`: averages with the stage-mates (if any), then applies the optimizer."""
        if step != self.step:
            return  # a request that crossed a state download or an earlier step
        if self.coordinator is None:
            ids = [(trainer, mb, n) for (trainer, mb), n in self.held.items()]
            result = RoundResult(None, self.samples_accumulated, ids)
        else:
            try:
                result = self.coordinator.average(step, self.flat_gradient(), dict(self.held))
            except Exception as e:
                # keep the gradients; the coordinator asks for this step again on its next check
                logger.error(f"Stage {self.module.stage}: averaging at step {step} failed ({e!r}); will retry")
                result = None
            if result is None:
                with self._cond:
                    self._step_requested = None
                return
            if result.samples > 0 and result.grad_sum is not None:
                offset = 0
                for param in self.module.parameters():
                    numel = param.numel()
                    param.grad = result.grad_sum[offset : offset + numel].view_as(param).to(param.device, param.dtype)
                    offset += numel
        with self._cond:
            self._step_requested = None
        total = result.samples
        self.held = {}
        self.samples_accumulated = 0
        if total <= 0:
            # the group steps together even on nothing, so that its replicas stay at one step
            logger.warning(f"Stage {self.module.stage}: the group had no samples at step {step}; skipping it")
            self.module.zero_grad(set_to_none=True)
        elif not self._gradients_finite():
            # every replica sums the same agreed contributions, so every replica skips alike
            self.nonfinite_steps += 1
            logger.error(
                f"Stage {self.module.stage}: the summed gradient of step {step} is not finite; skipping its "
                f"update ({self.nonfinite_steps} so far): a contribution was broken"
            )
            self.module.zero_grad(set_to_none=True)
        else:
            if total != self.target_batch_size:
                logger.info(
                    f"Stage {self.module.stage} steps on {total} samples, target is {self.target_batch_size}: "
                    "microbatches crossed the step boundary"
                )
            apply_accumulated_step(self.module, self.optimizer, total)
            self.samples_stepped += total
        fingerprint = parameter_fingerprint(self.module)
        self.step += 1
        self.version = (self.step, fingerprint)
        self.last_round = result
        if self.on_step is not None:
            self.on_step(self.step, fingerprint)

    def _gradients_finite(self) -> bool:
        return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in self.module.parameters())

    def load_state(self, step: int, apply: Callable[[], None], samples_stepped: int = 0) -> None:
        """Replaces the stage's state (on the runtime thread): `apply` loads it; accumulated gradients are dropped."""
        if self.samples_accumulated:
            logger.warning(
                f"Stage {self.module.stage}: dropping {self.samples_accumulated} accumulated samples of step "
                f"{self.step} to take a mate's state at step {step}"
            )
        self.module.zero_grad(set_to_none=True)
        self.samples_accumulated = 0
        with self._cond:  # dropped, not applied: sent again, they must accumulate
            for key in self.held:
                self._applied.pop(key, None)
        self.held = {}
        apply()
        with self._cond:
            self._step_requested = None
        self.step = step
        self.samples_stepped = samples_stepped
        fingerprint = parameter_fingerprint(self.module)
        self.version = (step, fingerprint)
        self.last_round = None
        if self.on_step is not None:
            self.on_step(self.step, fingerprint)
