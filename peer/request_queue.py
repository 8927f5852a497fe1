"""The runtime's queue: the requests waiting for a stage's thread, and how they are merged into batches.

Requests wait in order of arrival. The worker takes the oldest and merges queued requests of the
same kind and shape into one batch, up to a sample limit, so a busy peer runs fewer, larger
batches. Background jobs (inference, `swarm.peer.inference_work`) wait apart, at a lower priority:
the worker runs one chunk of one of them only when no training request waits, so training waits for
at most one chunk, and the jobs take turns chunk by chunk. The queue remembers which backwards it
has applied, so that a retried backward (its reply lost on the way) is answered without
accumulating its gradient twice, and drops requests whose caller has given up before they were started.
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

logger = logging.getLogger(__name__)


class CallAbandonedError(RuntimeError):
    """The caller's deadline passed before the runtime started the request: computing it would be wasted."""


class QueueFullError(RuntimeError):
    """The peer already holds as many queued requests as it accepts: the caller should go elsewhere."""


SampleKey = tuple[str, int]  # a microbatch's global id: (trainer, microbatch id)


@dataclass
class StageResult:
    """What one request gets back: output tensors (or input gradients), per-sample losses, the step."""

    tensors: list[torch.Tensor]
    losses: torch.Tensor | None
    step: int
    # on a GPU the tensors may still be on the device, being computed: this CUDA event marks when they exist
    # (see `swarm.peer.device_copies`); None where they are ready
    ready: Any = None


@dataclass(eq=False)  # compared by identity: queue removals must not compare tensors
class Task:
    """One queued request: a forward or backward on some samples, or a function to run alone."""

    backward: bool
    tensors: list[torch.Tensor]
    key: Hashable = None
    accumulate: bool = True
    version: int | None = None  # the step a backward's forward ran at
    exclusive: Callable[[], Any] | None = None  # runs alone on the runtime thread
    give_up_at: float | None = None  # time.monotonic() when the caller stops waiting for the reply
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def num_samples(self) -> int:
        return self.tensors[0].shape[0] if self.tensors else 0

    def late(self, now: float) -> bool:
        return self.give_up_at is not None and self.give_up_at <= now

    def batches_with(self, other: Task) -> bool:
        if self.exclusive is not None or other.exclusive is not None:
            return False
        return (self.backward, self.accumulate) == (other.backward, other.accumulate) and all(
            a.dtype == b.dtype and a.shape[1:] == b.shape[1:] for a, b in zip(self.tensors, other.tensors)
        )


class BackgroundJob(Protocol):
    """Low-priority work run a chunk at a time between training batches."""

    future: Future

    def late(self, now: float) -> bool:
        """Whether its caller has given up on it."""

    def run_chunk(self) -> bool:
        """Runs the next chunk on the runtime thread; True once the job is done (its future settled)."""


def settle(future: Future, result: Any) -> None:
    """Resolves a request's future unless its caller cancelled it (it went away): never raises."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def fail(future: Future, error: BaseException) -> None:
    """Fails a request's future unless its caller cancelled it: never raises."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


class RequestQueue:
    """The requests waiting for one stage's runtime thread, and the memory of the backwards it applied.

    `held_elsewhere` names the microbatches another replica holds or a recent round summed (their
    backwards are answered without accumulating); `merge_limit` says how many samples a batch led by
    a task may hold. `lock` guards the queue and the memory; the runtime guards its own small state
    with it too.
    """

    def __init__(
        self,
        stage: int,
        max_queue: int,
        held_elsewhere: Callable[[], frozenset[SampleKey]],
        merge_limit: Callable[[Task], int],
    ) -> None:
        self.stage = stage  # for the log
        self.max_queue = max_queue
        self.held_elsewhere = held_elsewhere
        self.merge_limit = merge_limit
        self.lock = threading.Condition()
        self.tasks: deque[Task] = deque()
        self.stopping = False
        # keys of recently applied backward requests: a retried backward whose first attempt was
        # applied (its reply lost on the way) gets its input gradient again but is not accumulated twice
        self.applied: OrderedDict[Hashable, None] = OrderedDict()
        self.max_remembered = 100_000
        self.busy_refusals = 0  # requests refused because the queue was full
        self.duplicates = 0
        self.abandoned = 0  # requests dropped because their caller had given up before they were applied
        self._anonymous = 0  # backwards that came without an id get a local one
        self.background: deque[BackgroundJob] = deque()  # run only while no task waits
        # seconds a training request that came during an inference chunk waited for that chunk, the latest ones
        self.inference_delays: deque[float] = deque(maxlen=4096)

    def __len__(self) -> int:
        return len(self.tasks)

    def put(
        self,
        backward: bool,
        tensors: list[torch.Tensor],
        key: Hashable = None,
        version: int | None = None,
        give_up_at: float | None = None,
        accumulate: bool = True,
    ) -> Future:
        """Queues a request (see `StageRuntime.submit`); QueueFullError if the queue is full."""
        with self.lock:
            if self.stopping:
                raise RuntimeError("the runtime is shutting down")
            if len(self.tasks) >= self.max_queue:
                self.busy_refusals += 1
                raise QueueFullError(f"this peer is busy: {len(self.tasks)} requests queued, its limit")
            if backward and key is None and accumulate:
                self._anonymous += 1
                key = ("", self._anonymous)
            task = Task(backward, tensors, key, accumulate=accumulate, version=version, give_up_at=give_up_at)
            if backward and accumulate:
                if key in self.applied:
                    task.accumulate = False
                    self.duplicates += 1
                    logger.info(f"Stage {self.stage}: backward {key} came again; not accumulating it twice")
                else:
                    self.applied[key] = None
                    if len(self.applied) > self.max_remembered:
                        self.applied.popitem(last=False)
            self.tasks.append(task)
            self.lock.notify()
        return task.future

    def put_exclusive(self, fn: Callable[[], Any], front: bool = False) -> Future:
        """Queues `fn` to run alone on the runtime thread (ahead of every queued request if `front`)."""
        task = Task(False, [], exclusive=fn)
        with self.lock:
            if self.stopping:
                raise RuntimeError("the runtime is shutting down")
            if front:
                self.tasks.appendleft(task)
            else:
                self.tasks.append(task)
            self.lock.notify()
        return task.future

    def put_background(self, job: BackgroundJob) -> None:
        """Queues a low-priority job; QueueFullError if as many jobs as the queue holds tasks already wait."""
        with self.lock:
            if self.stopping:
                raise RuntimeError("the runtime is shutting down")
            if len(self.background) >= self.max_queue:
                self.busy_refusals += 1
                raise QueueFullError(f"this peer is busy: {len(self.background)} inference requests queued, its limit")
            self.background.append(job)
            self.lock.notify()

    def stop(self) -> None:
        """Takes no more requests; the worker's `next_batch` returns None once the queue is empty."""
        with self.lock:
            self.stopping = True
            self.lock.notify()

    def fail_all(self, error: BaseException) -> None:
        """Fails every request still queued (once the worker has stopped)."""
        for task in self.tasks:
            fail(task.future, error)
        self.tasks.clear()
        for job in self.background:
            fail(job.future, error)
        self.background.clear()

    def next_batch(self) -> list[Task] | None:
        """Waits for the next batch: the oldest task and the queued ones that merge with it (None: stopped)."""
        while True:
            with self.lock:
                while not self.tasks and (self.stopping or not self.background):
                    if self.stopping:
                        return None
                    self.lock.wait()
                abandoned = self._take_abandoned()
                batch = self._take_batch() if self.tasks else self._take_chunk()
            for task in abandoned:
                fail(
                    task.future,
                    CallAbandonedError("the caller's deadline passed before this peer could start the request"),
                )
            if batch is not None:
                return batch

    def release(self, task: Task) -> None:
        """`task` will not be applied: a retry of it must accumulate. Called with the lock held.

        A duplicate of it already queued (the caller retried on this same peer, the only one of its
        stage) was queued not to accumulate: it now carries the gradient instead of losing it.
        """
        if not task.accumulate:
            return
        twin = next((t for t in self.tasks if t.key == task.key and t.backward and not t.accumulate), None)
        if twin is not None:
            twin.accumulate = True
        else:
            self.applied.pop(task.key, None)

    def put_back(self, batch: list[Task], now: float, elsewhere: frozenset[SampleKey]) -> list[Task]:
        """A batch whose gradients were dropped: those whose caller still waits go back to the front of the
        queue (those another replica holds, not to accumulate), the late ones are released and returned."""
        late = [task for task in batch if task.late(now)]
        with self.lock:
            for task in reversed([t for t in batch if not t.late(now)]):
                self.not_summed_twice(task, elsewhere)
                self.tasks.appendleft(task)
            for task in late:
                self.release(task)
            self.abandoned += len(late)
        return late

    def forget(self, keys: list[Hashable]) -> None:
        """Backwards dropped, not applied: sent again, they must accumulate."""
        with self.lock:
            for key in keys:
                self.applied.pop(key, None)

    def count_hung_up(self) -> None:
        """Counts a call whose caller hung up before its request was complete with the abandoned ones."""
        with self.lock:
            self.abandoned += 1

    def not_summed_twice(self, task: Task, elsewhere: frozenset[SampleKey]) -> None:
        """A backward another replica holds (or a recent round summed) runs without accumulating: its
        retry must only get its input gradient again. Called with the lock held."""
        if task.backward and task.accumulate and task.key in elsewhere:
            task.accumulate = False
            self.applied.pop(task.key, None)  # sent again after all (that replica died), it must accumulate
            self.duplicates += 1
            logger.info(
                f"Stage {self.stage}: backward {task.key} is held by a stage-mate or already summed; "
                "answering it without accumulating it twice"
            )

    def _take_abandoned(self) -> list[Task]:
        """Removes queued requests whose caller has given up; called with the lock held."""
        now = time.monotonic()
        abandoned = [t for t in self.tasks if t.late(now)]
        for task in abandoned:
            self.tasks.remove(task)
        for task in abandoned:
            self.release(task)
        if abandoned:
            self.abandoned += len(abandoned)
            logger.info(
                f"Stage {self.stage}: dropped {len(abandoned)} queued request(s) whose caller had given up "
                f"({self.abandoned} so far); this peer is overloaded"
            )
        return abandoned

    def _take_chunk(self) -> list[Task] | None:
        """One chunk of the oldest background job, as a task run alone; called with the lock held (no task waits).

        A job not done after its chunk goes to the back: jobs take turns, one chunk each."""
        now = time.monotonic()
        while self.background:
            job = self.background.popleft()
            if job.late(now):
                self.abandoned += 1
                late = CallAbandonedError("the caller's deadline passed before this peer finished the request")
                fail(job.future, late)
                continue

            def run(job: BackgroundJob = job) -> None:
                done = job.run_chunk()
                with self.lock:
                    if not done:
                        self.background.append(job)
                    # a chunk runs only while no task waits: every task queued now came during it
                    ended = time.monotonic()
                    self.inference_delays.extend(ended - t.queued_at for t in self.tasks if t.exclusive is None)

            return [Task(False, [], exclusive=run)]
        return None

    def _take_batch(self) -> list[Task]:
        """The next task and the queued ones that merge with it; called with the lock held."""
        elsewhere = self.held_elsewhere()
        batch = [self.tasks.popleft()]
        self.not_summed_twice(batch[0], elsewhere)
        total = batch[0].num_samples
        limit = self.merge_limit(batch[0])
        for task in list(self.tasks):
            if total + task.num_samples > limit:
                break
            self.not_summed_twice(task, elsewhere)
            if batch[0].batches_with(task):
                self.tasks.remove(task)
                batch.append(task)
                total += task.num_samples
        return batch
