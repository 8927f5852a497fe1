"""Stage-mates: the peers that host one stage train as one data-parallel group.

Each peer accumulates the gradient sums of the microbatches it serves and tells its mates how many
samples it holds toward the current step (`MateProgress`). When the stage as a whole has seen the
target batch, every member sends its gradient sum to every other member (`GradContribution`) and
each adds up all contributions in the order of their peer ids, so every member ends the round
with the very same bits; then each divides by the group's sample count and steps its optimizer.
A member that served nothing contributes zero samples and still steps with the rest.

Membership is what a peer sees in the DHT (mates announced as serving), widened by every peer
that sent it progress or a contribution for the step and by the member lists those carry. A mate
that cannot be reached is dropped from the round at once; one that stays silent is dropped when
`averaging_timeout` runs out. A peer that finds itself behind its mates (a contribution or an
announcement from a later step, or a round that diverged) downloads their state and goes on.

This is our own protocol rather than hivemind's Optimizer, for reasons measured on these machines
(2 peers, a 1.2M-parameter model, target batch 32): its progress goes through the DHT and groups
form by matchmaking, so an epoch took 1.0 to 1.5 s against 0.15 to 0.3 s of compute, and shorter
matchmaking times failed to form groups; a failed round stepped on zeroed gradients; and replicas
never held bit-identical parameters, because each applies the all-reduce as a difference to its
own values. Here a round costs one exchange of gradients and replicas stay bit-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID
from swarm.compression import Codec, get_codec
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_state import (
    StageStateError,
    check_state_tensors,
    load_state_tensors,
    state_fingerprint,
    state_tensors,
)
from swarm.proto import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    GradContribution,
    MateProgress,
    MateReply,
    StateReply,
    StateRequest,
)

from swarm.stage_records import SERVING, StageRecord
from swarm.transport import GRAD_PROTOCOL, PROGRESS_PROTOCOL, STATE_PROTOCOL, exchange
from swarm.wire import (
    WireError,
    WireLimits,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    wait_for_hang_up,
    write_frames,
)

logger = logging.getLogger(__name__)

SEND_ATTEMPTS = 3
PROGRESS_TIMEOUT = 5.0


@dataclass
class Contribution:
    """One member's part of an averaging round."""

    samples: int
    grad_sum: torch.Tensor | None
    members: frozenset[str]


class StageMates:
    """A peer's view of its stage-mates and its side of their averaging rounds and state transfers."""

    def __init__(
        self,
        runtime: StageRuntime,
        peer_id: str,
        model: str,
        averaging_timeout: float = 30.0,
        codec: Codec | None = None,
    ) -> None:
        self.runtime = runtime
        self.peer_id = peer_id
        self.model = model
        self.stage = runtime.module.stage
        self.num_stages = runtime.module.num_stages
        self.averaging_timeout = averaging_timeout
        self.codec = codec or get_codec("none")
        self.num_parameters = sum(p.numel() for p in runtime.module.parameters())
        state_bytes = 16 * self.num_parameters + 2**20
        self.limits = WireLimits(max_message_bytes=state_bytes, max_tensor_bytes=state_bytes)
        self.mates: dict[str, StageRecord] = {}
        self.progress: dict[int, dict[str, int]] = defaultdict(dict)
        # contributions by (step, attempt): a round that came up short is tried again as the next attempt
        self.mailbox: dict[tuple[int, int], dict[str, Contribution | None]] = defaultdict(dict)
        self.attempts: dict[int, int] = defaultdict(int)
        self.short: dict[int, dict[str, int]] = {}  # per step: samples lost with each dead mate
        self.rounds = 0
        self.resyncs = 0
        self.dropped_members = 0
        self.serving = False  # set by the peer once it has the stage's state
        self.p2p: P2P | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._behind_checks = 0
        self._resyncing = False
        # peers that asked for this peer's state: they will not contribute to the round under way
        self._departed: set[str] = set()
        self._round_step: int | None = None
        self._handed_over: set[str] = set()  # mates that left after handing over their gradients
        self.on_short: Callable[[], None] | None = None  # wakes requests waiting for a step that is short
        self._progress_sends: dict[asyncio.Task, str] = {}  # progress on its way, and the mate it goes to
        self._silent: set[str] = set()  # mates the last progress did not reach: not waited for

    async def start(self, p2p: P2P) -> None:
        """Registers the mate protocols on the peer's P2P and hooks into the runtime."""
        self.p2p = p2p
        self.loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        await p2p.add_binary_stream_handler(PROGRESS_PROTOCOL, self._handle_progress)
        await p2p.add_binary_stream_handler(GRAD_PROTOCOL, self._handle_contribution)
        await p2p.add_binary_stream_handler(STATE_PROTOCOL, self._handle_state)
        self.runtime.coordinator = self

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.p2p is not None:
            for protocol in (PROGRESS_PROTOCOL, GRAD_PROTOCOL, STATE_PROTOCOL):
                with contextlib.suppress(Exception):
                    await self.p2p.remove_binary_stream_handler(protocol)

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the view of the group (event loop) --------------------------------------------------------

    def update_records(self, records: list[StageRecord]) -> None:
        """Takes in the stage's records from the DHT: who serves, and whether this peer fell behind."""
        mates = {
            r.peer_id: r
            for r in records
            if r.peer_id != self.peer_id
            and r.state == SERVING
            and r.model == self.model
            and r.num_stages == self.num_stages
        }
        new = set(mates) - set(self.mates)
        self.mates = mates
        if not self.serving:
            return
        step = self.runtime.step
        samples = self.progress[step].get(self.peer_id, 0)
        for peer_id in new:  # a mate that has just appeared has not heard this peer's progress
            self._spawn(self._send_progress(peer_id, step, samples))
        ahead = max((r.step for r in mates.values()), default=step) - step
        self._behind_checks = self._behind_checks + 1 if ahead >= 1 else 0
        # one step ahead for a moment is normal (a mate finishing a round first); longer is not
        if ahead >= 2 or self._behind_checks >= 2:
            self.schedule_resync(f"mates announce step {step + ahead}, this peer is at {step}")
        self._check_trigger(step)

    def start_serving(self) -> None:
        """Marks this peer as holding the stage's state; it may then start or join rounds."""
        self.serving = True
        self._check_trigger(self.runtime.step)

    def _check_trigger(self, step: int) -> None:
        if step != self.runtime.step or not self.serving:
            return
        total = sum(self.progress[step].values())
        box = self.mailbox.get((step, self.attempts[step]), {})
        started_by_mate = any(peer_id != self.peer_id and peer_id not in self._handed_over for peer_id in box)
        if total >= self.runtime.target_batch_size or started_by_mate:
            self.runtime.request_step(step)

    def on_step(self, step: int) -> None:
        """Called from the runtime thread after every step or state load."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._after_step, step)

    def _after_step(self, step: int) -> None:
        self._departed.clear()
        for old in [s for s in self.progress if s < step]:
            del self.progress[old]
        for old in [key for key in self.mailbox if key[0] < step]:
            del self.mailbox[old]
        for table in (self.attempts, self.short):
            for old in [s for s in table if s < step]:
                del table[old]
        self._check_trigger(step)

    # --- StepCoordinator: called on the runtime thread --------------------------------------------

    def local_progress(self, step: int, samples: int) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._on_local_progress, step, samples)

    def average(self, step: int, grad_sum: torch.Tensor | None, samples: int) -> tuple[torch.Tensor | None, int]:
        future = asyncio.run_coroutine_threadsafe(self._round(step, grad_sum, samples), self.loop)
        return future.result(self.averaging_timeout + 30)

    # --- progress -----------------------------------------------------------------------------------

    def _on_local_progress(self, step: int, samples: int) -> None:
        self.progress[step][self.peer_id] = samples
        for peer_id in self.mates:
            task = self._spawn(self._send_progress(peer_id, step, samples))
            self._progress_sends[task] = peer_id
            task.add_done_callback(lambda t: self._progress_sends.pop(t, None))
        self._check_trigger(step)

    async def progress_delivered(self) -> None:
        """Waits (at most `PROGRESS_TIMEOUT`) until the mates have heard of every sample accumulated so far.

        A backward is answered only after this: once a trainer holds the reply, the mates count its
        samples, so should this peer die before the round they know those samples are lost and ask for
        them again, instead of waiting for a batch that never fills. Mates the last progress did not
        reach are not waited for, so a dead mate does not slow every backward down.
        """
        pending = [task for task, mate in self._progress_sends.items() if mate not in self._silent]
        if pending:
            await asyncio.wait(pending, timeout=PROGRESS_TIMEOUT)

    async def _send_progress(self, peer_id: str, step: int, samples: int) -> None:
        message = MateProgress(
            protocol_version=PROTOCOL_VERSION, model=self.model, stage=self.stage, step=step, samples=samples
        )
        try:
            await asyncio.wait_for(
                exchange(self.p2p, PeerID.from_base58(peer_id), PROGRESS_PROTOCOL, [message], MateReply, WireLimits()),
                PROGRESS_TIMEOUT,
            )
            self._silent.discard(peer_id)
        except Exception as e:  # the round itself tolerates a silent mate
            self._silent.add(peer_id)
            logger.debug(f"Could not send progress to {peer_id}: {type(e).__name__}: {e}")

    async def _handle_progress(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        reply = MateReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step)
        try:
            message, _ = await read_frames(reader, MateProgress, WireLimits())
            if (error := self._check_header(message)) is not None:
                reply.error.CopyFrom(error)
            elif message.step >= self.runtime.step:  # older progress no longer matters
                self.progress[message.step][str(stream_info.peer_id)] = message.samples
                self._check_trigger(message.step)
        except WireError as e:
            reply.error.CopyFrom(Error(code=e.code, message=str(e)))
        await self._reply(reader, writer, [reply])

    def _check_header(self, message) -> Error | None:
        if message.protocol_version != PROTOCOL_VERSION:
            return Error(code=ErrorCode.VERSION_MISMATCH, message=f"this peer speaks protocol {PROTOCOL_VERSION}")
        if message.model != self.model or message.stage != self.stage:
            return Error(code=ErrorCode.WRONG_STAGE, message=f"this peer hosts stage {self.stage} of {self.model}")
        return None

    @staticmethod
    async def _reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: list) -> None:
        try:
            await write_frames(writer, frames)
            await wait_for_hang_up(reader)
        except Exception as e:
            logger.debug(f"Could not answer a stage-mate: {type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    # --- averaging rounds ------------------------------------------------------------------------------

    async def _round(self, step: int, grad_sum: torch.Tensor | None, samples: int) -> tuple[torch.Tensor | None, int]:
        """This peer's side of the averaging round at `step`; returns the group's gradient sum and samples."""
        attempt = self.attempts[step]
        box = self.mailbox[step, attempt]
        members = {self.peer_id, *self.mates, *self.progress.get(step, {})}
        members |= self._named_in(box)
        own = Contribution(samples, grad_sum, frozenset(members))
        box[self.peer_id] = own
        self._round_step = step
        try:
            summed, total = await self._gather(step, attempt, box, members, own)
        finally:
            self._round_step = None
        # a mate that announced samples but never sent them died holding them: those samples must be
        # sent again by the trainers, so the stage waits instead of stepping on a short batch
        lost = {
            peer_id: count
            for peer_id, count in self.progress.get(step, {}).items()
            if count > 0 and peer_id not in box and peer_id != self.peer_id
        }
        if lost:
            self.short.setdefault(step, {}).update(lost)
            for peer_id in lost:
                self.progress[step].pop(peer_id, None)
            self.attempts[step] = attempt + 1
            # what leaving mates handed over is still good: it goes into the next attempt as it is
            for peer_id in self._handed_over & set(box):
                self.mailbox[step, attempt + 1][peer_id] = box[peer_id]
            logger.warning(
                f"Stage {self.stage} step {step}: mate(s) {sorted(lost)} died holding {sum(lost.values())} samples; "
                "waiting for the trainers to send them again"
            )
            if self.on_short is not None:
                self.on_short()
            return None, -1
        return summed, total

    async def _gather(
        self, step: int, attempt: int, box: dict[str, Contribution | None], members: set[str], own: Contribution
    ) -> tuple[torch.Tensor | None, int]:
        loop = asyncio.get_running_loop()
        unreachable: set[str] = set()
        sent = {self.peer_id}
        sends = []
        deadline = loop.time() + self.averaging_timeout
        while True:
            for peer_id in members - sent:
                sent.add(peer_id)
                sends.append(
                    self._spawn(self._send_contribution(peer_id, step, own, members, unreachable, attempt=attempt))
                )
            self._changed.clear()
            members |= self._named_in(box)
            missing = members - set(box) - unreachable - self._departed
            if not missing and not (members - sent):
                break
            if missing and loop.time() >= deadline:
                self.dropped_members += len(missing)
                logger.warning(
                    f"Stage {self.stage} step {step}: no gradients from {len(missing)} mate(s) within "
                    f"{self.averaging_timeout:.0f}s; averaging without them"
                )
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.01, deadline - loop.time()))
        # every member adds the same contributions in the same order, so all get identical sums
        total, summed = 0, None
        for peer_id in sorted(box):
            contribution = box[peer_id]
            if contribution is None:
                continue
            total += contribution.samples
            if contribution.grad_sum is not None:
                summed = contribution.grad_sum.clone() if summed is None else summed.add_(contribution.grad_sum)
        self.rounds += 1
        if len(box) > 1:
            logger.debug(f"Stage {self.stage} step {step}: averaged {total} samples over {len(box)} peers")
        return summed, total

    @staticmethod
    def _named_in(box: dict[str, Contribution | None]) -> set[str]:
        named = set(box)
        for contribution in box.values():
            if contribution is not None:
                named |= contribution.members
        return named

    async def _send_contribution(
        self,
        peer_id: str,
        step: int,
        own: Contribution,
        members: set[str],
        unreachable: set[str],
        handover: bool = False,
        attempt: int = 0,
    ) -> None:
        header = GradContribution(
            protocol_version=PROTOCOL_VERSION,
            model=self.model,
            stage=self.stage,
            step=step,
            samples=own.samples,
            members=sorted(members),
            handover=handover,
            attempt=attempt,
        )
        loop = asyncio.get_running_loop()
        parts = []
        if own.grad_sum is not None:
            parts = await loop.run_in_executor(None, encode_tensor, own.grad_sum, self.codec)
        frames = pack_frames(header, parts)
        for attempt in range(SEND_ATTEMPTS):
            try:
                reply, _ = await asyncio.wait_for(
                    exchange(self.p2p, PeerID.from_base58(peer_id), GRAD_PROTOCOL, frames, MateReply, WireLimits()),
                    self.averaging_timeout,
                )
            except Exception as e:
                if attempt + 1 < SEND_ATTEMPTS:
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                logger.warning(f"Stage {self.stage} step {step}: mate {peer_id} is unreachable ({e}); dropping it")
                break
            if reply.error.code == ErrorCode.OK:
                return
            if reply.error.code == ErrorCode.OUT_OF_SYNC and reply.step > step:
                self.schedule_resync(f"mate {peer_id} is already at step {reply.step}")
            logger.warning(f"Stage {self.stage} step {step}: mate {peer_id} refused gradients: {reply.error.message}")
            break
        unreachable.add(peer_id)
        self._changed.set()

    async def _handle_contribution(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        sender = str(stream_info.peer_id)
        reply = MateReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step)
        try:
            header, parts = await read_frames(reader, GradContribution, self.limits)
            reply.error.CopyFrom(await self._accept_contribution(sender, header, parts))
        except WireError as e:
            reply.error.CopyFrom(Error(code=e.code, message=str(e)))
        except Exception as e:
            logger.exception(f"Failed to take gradients from {sender}")
            reply.error.CopyFrom(Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"))
        await self._reply(reader, writer, [reply])

    async def _accept_contribution(self, sender: str, header: GradContribution, parts: list) -> Error:
        if (error := self._check_header(header)) is not None:
            return error
        step = self.runtime.step
        # a peer that has just loaded a mate's state takes part in rounds before it serves
        if not step <= header.step <= step + 1:
            if self.serving and header.step > step:
                self.schedule_resync(f"mate {sender} averages step {header.step}, this peer is at {step}")
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {step}, not {header.step}")
        grad_sum = None
        if header.samples > 0:
            tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, self.limits)
            if len(tensors) != 1 or tensors[0].shape != (self.num_parameters,) or tensors[0].dtype != torch.float32:
                return Error(code=ErrorCode.BAD_REQUEST, message=f"expected one float32[{self.num_parameters}]")
            if not torch.isfinite(tensors[0]).all():
                return Error(code=ErrorCode.BAD_REQUEST, message="gradients hold NaN or infinity")
            grad_sum = tensors[0]
        if header.attempt < self.attempts[header.step]:
            return Error(code=ErrorCode.OK)  # from a round already found short here: superseded
        key = (header.step, header.attempt)
        self.mailbox[key][sender] = Contribution(header.samples, grad_sum, frozenset(header.members))
        self._changed.set()
        if header.handover:  # a leaving peer's gradients wait for the round the stage would hold anyway
            self._handed_over.add(sender)
        else:
            self._check_trigger(header.step)
        return Error(code=ErrorCode.OK)

    async def hand_over(self, timeout: float = 10.0) -> None:
        """Sends this peer's un-averaged gradients to its mates before it leaves, so its samples still count."""
        if not self.serving or not self.mates:
            return
        self.serving = False  # no new rounds and no resyncs from here on
        runtime = self.runtime
        step, grad_sum, samples = await asyncio.wrap_future(
            runtime.run_exclusive(lambda: (runtime.step, runtime.flat_gradient(), runtime.samples_accumulated))
        )
        if samples == 0:
            return
        members = {self.peer_id, *self.mates}
        own = Contribution(samples, grad_sum, frozenset(members))
        unreachable: set[str] = set()
        attempt = self.attempts[step]
        sends = [
            self._send_contribution(p, step, own, members, unreachable, handover=True, attempt=attempt)
            for p in self.mates
        ]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), timeout)
        taken = len(self.mates) - len(unreachable)
        logger.info(f"Handed {samples} samples of step {step} to {taken} of {len(self.mates)} stage-mate(s)")

    # --- state transfer --------------------------------------------------------------------------------

    async def _handle_state(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        frames: list = []
        try:
            request, _ = await read_frames(reader, StateRequest, WireLimits())
            if (error := self._check_header(request)) is not None:
                frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=error)]
            elif not self.serving:
                error = Error(code=ErrorCode.UNAVAILABLE, message="this peer is joining and has no state to give")
                frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=error)]
            else:
                runtime = self.runtime
                # a snapshot on the runtime thread sees the state between steps, never mid-step
                # it will not contribute to a round under way here: stop waiting for it
                requester = str(stream_info.peer_id)
                if self._round_step is not None:
                    self._departed.add(requester)
                    self._changed.set()
                snapshot = runtime.run_exclusive(
                    lambda: (runtime.step, runtime.samples_stepped, *state_tensors(runtime.module, runtime.optimizer))
                )
                step, samples_stepped, tensors, has_optimizer_state = await asyncio.wrap_future(snapshot)
                # the newcomer is a member from the step it takes: rounds from then on include it
                self.progress[step].setdefault(requester, 0)
                self._departed.discard(requester)
                logger.info(
                    f"Giving stage {self.stage} state of step {step} (fingerprint {state_fingerprint(tensors)}) "
                    f"to {requester}"
                )
                parts = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
                )
                reply = StateReply(
                    protocol_version=PROTOCOL_VERSION,
                    step=step,
                    has_optimizer_state=has_optimizer_state,
                    samples_stepped=samples_stepped,
                    progress={p: n for p, n in self.progress.get(step, {}).items() if p != requester and n > 0},
                )
                frames = pack_frames(reply, parts)
        except WireError as e:
            frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=Error(code=e.code, message=str(e)))]
        except Exception as e:
            logger.exception("Failed to send the stage's state")
            error = Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
            frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=error)]
        await self._reply(reader, writer, frames)

    async def download_state(self, peer_id: str, minimum_step: int = 0, timeout: float = 120.0) -> int:
        """Downloads a mate's state and loads it on the runtime thread; returns the step it is at.

        Raises StageStateError if the mate refuses, sends a state that does not fit, or is at a
        step before `minimum_step`.
        """
        step, tensors, has_optimizer_state, samples_stepped, progress = await request_state(
            self.p2p, peer_id, self.model, self.stage, self.limits, timeout
        )
        if step < minimum_step:
            raise StageStateError(f"the mate is at step {step}, not past {minimum_step}")
        runtime = self.runtime
        check_state_tensors(runtime.module, tensors, has_optimizer_state)

        def apply() -> None:
            load_state_tensors(runtime.module, runtime.optimizer, tensors, has_optimizer_state)

        await asyncio.wrap_future(
            runtime.run_exclusive(lambda: runtime.load_state(step, apply, samples_stepped), front=True)
        )
        logger.info(f"Loaded stage {self.stage} state of step {step} (fingerprint {state_fingerprint(tensors)})")
        # the giver's view of who holds samples toward the next step: should one of them die before the
        # round, this peer counts its samples as lost and asks for them again instead of waiting forever
        known = self.progress[step]
        for mate, samples in progress.items():
            if mate != self.peer_id:
                known[mate] = max(known.get(mate, 0), samples)
        return step

    async def sync_from_mates(self, minimum_step: int = 0) -> str | None:
        """Takes the state of the most advanced serving mate at `minimum_step` or later; its peer id, or None."""
        for record in sorted(self.mates.values(), key=lambda r: r.step, reverse=True):
            try:
                step = await self.download_state(record.peer_id, minimum_step)
            except Exception as e:
                logger.warning(f"Could not take stage {self.stage} state from {record.peer_id}: {e}")
                continue
            logger.info(f"Took stage {self.stage} state at step {step} from mate {record.peer_id}")
            return record.peer_id
        return None

    def schedule_resync(self, reason: str) -> None:
        """Downloads a mate's state in the background, once at a time."""
        if self._resyncing or not self.serving:
            return
        self._resyncing = True
        logger.warning(f"Stage {self.stage} is behind its mates ({reason}); downloading their state")

        async def resync() -> None:
            try:
                if await self.sync_from_mates(self.runtime.step + 1) is not None:
                    self.resyncs += 1
            finally:
                self._resyncing = False
                self._behind_checks = 0

        self._spawn(resync())


async def request_state(
    p2p: P2P, peer_id: str, model: str, stage: int, limits: WireLimits, timeout: float = 120.0
) -> tuple[int, list[torch.Tensor], bool, int, dict[str, int]]:
    """Asks a peer for its stage's state, or StageStateError.

    Returns (step, tensors, has_optimizer_state, samples_stepped, progress): progress is the samples
    each other member is known to hold toward the next step.
    """
    request = StateRequest(protocol_version=PROTOCOL_VERSION, model=model, stage=stage)
    reply, parts = await asyncio.wait_for(
        exchange(p2p, PeerID.from_base58(peer_id), STATE_PROTOCOL, [request], StateReply, limits), timeout
    )
    if reply.error.code != ErrorCode.OK:
        raise StageStateError(f"{ErrorCode.Name(reply.error.code)}: {reply.error.message}")
    tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, limits)
    return reply.step, tensors, reply.has_optimizer_state, reply.samples_stepped, dict(reply.progress)
