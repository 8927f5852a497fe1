"""The wire side of step deltas (`swarm.peer.step_deltas`): a stage's peer gives them, a standby holder takes them.

A holder asks over the stage-mates' state protocol with a `StateRequest` marked `deltas`; the protocol's
gate admits it as it admits a holder taking a whole copy. The reply names the samples of each step from
`from_step` on (0: skipped) and carries the stepped ones' gradient sums as float32 tensors, each checked
against the stage's parameter count before it is used.
"""

from __future__ import annotations

import asyncio

import torch
from hivemind.p2p import P2P, PeerID

from swarm.net.transport import STATE_PROTOCOL, exchange
from swarm.net.wire import WireLimits, decode_tensors, pack_frames
from swarm.peer.stage_state import StageStateError
from swarm.peer.state_transfer import encode_state
from swarm.peer.step_deltas import DeltaRing, StepDelta, deltas_per_call
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, StateReply, StateRequest


class DeltasRefused(StageStateError):
    """A stage's peer answered a request for deltas with an error (its `code`)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{ErrorCode.Name(code)}: {message}")
        self.code = code


def takes_whole(error: StageStateError) -> bool:
    """Whether a catch-up that failed with `error` leaves the copy to be taken whole: the source keeps no deltas from
    the copy's step, or sent some that do not fit. Not where it refused this holder: a newcomer's record reaches the
    stage's peers a period apart, and one that has not read it yet turned every such catch-up into a whole copy."""
    return not (isinstance(error, DeltasRefused) and error.code == ErrorCode.FORBIDDEN)


async def answer_deltas(
    ring: DeltaRing | None, request: StateRequest, step: int, parameters: int, reply: StateReply
) -> list:
    """The frames answering a holder's request for the deltas since `request.from_step`, at stage step `step`, of a
    stage of `parameters` values."""
    deltas = ring.since(request.from_step, parameters) if ring is not None and request.from_step < step else None
    if deltas is None:
        kept = f"keeps the last {ring.keep}" if ring is not None else "keeps none"
        message = f"no deltas from step {request.from_step} here (at step {step}; {kept}): take the whole state"
        reply.error.CopyFrom(Error(code=ErrorCode.UNAVAILABLE, message=message))
        return [reply]
    parts = await encode_state([d.grad_sum for d in deltas if d.grad_sum is not None])
    given = StateReply(
        protocol_version=PROTOCOL_VERSION, step=request.from_step, delta_samples=[d.samples for d in deltas]
    )
    return pack_frames(given, parts)


def delta_limits(parameters: int) -> WireLimits:
    """The size limits of a reply with `deltas_per_call` float32 gradient sums of `parameters` values."""
    total = 4 * parameters * deltas_per_call(parameters) + 2**20
    return WireLimits(max_message_bytes=total, max_tensor_bytes=4 * parameters + 2**20)


async def request_deltas(
    p2p: P2P, peer_id: str, model: str, stage: int, from_step: int, parameters: int, timeout: float
) -> list[StepDelta]:
    """Asks a peer of `stage` for the deltas since `from_step`; StageStateError if it has none or sends bad ones."""
    request = StateRequest(
        protocol_version=PROTOCOL_VERSION, model=model, stage=stage, deltas=True, from_step=from_step
    )
    limits = delta_limits(parameters)
    reply, parts = await asyncio.wait_for(
        exchange(p2p, PeerID.from_base58(peer_id), STATE_PROTOCOL, [request], StateReply, limits), timeout
    )
    if reply.error.code != ErrorCode.OK:
        raise DeltasRefused(reply.error.code, reply.error.message)
    samples = list(reply.delta_samples)
    if reply.step != from_step or not 0 < len(samples) <= deltas_per_call(parameters):
        raise StageStateError(f"sent {len(samples)} deltas from step {reply.step}, asked from {from_step}")
    tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, limits)
    if len(tensors) != sum(1 for n in samples if n > 0):
        raise StageStateError(f"sent {len(tensors)} gradient sums for {len(samples)} steps")
    sums = iter(tensors)
    deltas = []
    for offset, count in enumerate(samples):
        grad_sum = next(sums) if count > 0 else None
        if grad_sum is not None and (grad_sum.dtype != torch.float32 or tuple(grad_sum.shape) != (parameters,)):
            raise StageStateError(f"a gradient sum is {grad_sum.dtype}{list(grad_sum.shape)}, expected [{parameters}]")
        deltas.append(StepDelta(from_step + offset, count, grad_sum))
    return deltas
