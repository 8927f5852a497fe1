"""Trial calls: how a peer this trainer never heard from earns its first real work.

A serving record is free to publish: an identity can announce itself on a stage and then answer
nothing, holding every call it gets open until the call times out. With the router on probation
(`swarm.policy.router`), such peers get no work of the training's own while the stage has a peer
that answered. Each forward answered elsewhere may instead be copied to one of them, off the
training's path: an answer, whatever it holds, ends the peer's probation (what it computes is the
spot checks' business); a failure bans it as any failed call does, for longer each time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from swarm.net.transport import CallStats, StageCallError
from swarm.policy.router import Router
from swarm.proto import StageReply
from swarm.records.stage_records import StageRecord

logger = logging.getLogger(__name__)

FIRST_CONTACT = 8  # peers of a stage tried at once before the first step


# one attempt of a stage call at one peer, no retry (`StageCaller.attempt`): (record, stage, backward, tensors,
# microbatch id, step, codec, stats) -> the reply and its tensors
Attempt = Callable[..., Awaitable[tuple[StageReply, list[torch.Tensor]]]]


class TrialCalls:
    """The trial forwards under way, at most `router.trial_candidate` allows."""

    def __init__(self, router: Router, attempt: Attempt, codec_for: Callable[[str], str]) -> None:
        self.router = router
        self.attempt = attempt
        self.codec_for = codec_for  # the codec calls to a peer use
        self.passed = 0
        self.failed = 0
        self._tasks: set[asyncio.Task] = set()

    def after_forward(self, stage: int, tensors: list[torch.Tensor], microbatch_id: int, step: int) -> None:
        """Called after each answered forward: copies it to a peer of `stage` on probation, if one is due."""
        record = self.router.trial_candidate(stage)
        if record is None:
            return
        self._spawn(self._try(record, stage, tensors, microbatch_id, step))

    async def first_contact(self, inputs: Callable[[int], list[torch.Tensor]], stages: int, step: int) -> None:
        """Before the first step: a trial forward of `inputs(stage)` to up to `FIRST_CONTACT` peers of each stage;
        returns once every stage has a peer that answered, or every trial has ended. The rest go on meanwhile."""
        for stage in range(stages):
            for record in self.router.first_trials(stage, FIRST_CONTACT):
                self._spawn(self._try(record, stage, inputs(stage), 0, step, timed=False))
        pending = set(self._tasks)
        while pending and not all(self.router.has_answered(stage) for stage in range(stages)):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        silent = self.failed + len(self._tasks)
        others = f"; the other {silent} get work once they answer one" if silent else ""
        logger.info(f"First contact: {self.passed} of {self.passed + silent} peers answered a trial forward{others}")

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _try(
        self, record: StageRecord, stage: int, tensors, microbatch_id: int, step: int, timed: bool = True
    ) -> None:
        """One trial forward; `timed`: its duration tells the router the speed of the peer (not so a one-token one)."""
        peer_id = record.peer_id
        started = time.perf_counter()
        try:
            await self.attempt(record, stage, False, tensors, microbatch_id, step, self.codec_for(peer_id), CallStats())
        except StageCallError as e:
            self.failed += 1
            ban = self.router.report_failure(peer_id, stage=stage)
            logger.warning(
                f"Stage {stage}: peer {peer_id} failed its trial forward ({e}); banned for {ban:.0f}s. "
                "It gets work once it answers one"
            )
            return
        except Exception as e:  # a trial that breaks is one trial lost, never the training's business
            logger.warning(f"Stage {stage}: the trial forward to {peer_id} broke: {type(e).__name__}: {e}")
            return
        finally:
            self.router.trial_done(peer_id)
        self.passed += 1
        seconds = time.perf_counter() - started
        self.router.report_success(peer_id, False, tensors[0].shape[0] if timed else 0, seconds)
        logger.info(f"Stage {stage}: peer {peer_id} answered its trial forward in {seconds:.2f}s; it takes work now")

    async def stop(self) -> None:
        """Cancels the trials under way."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
