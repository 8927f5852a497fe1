"""Client side of stage calls: one libp2p stream per call, framed as in `swarm.net.wire`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from swarm.compression import Codec
from swarm.net.link_shaper import LinkShaper
from swarm.net.wire import (
    Part,
    WireError,
    WireLimits,
    codes_inline,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    write_frames,
)
from swarm.proto import PROTOCOL_VERSION, ErrorCode, PeerInfo, PeerInfoRequest, StageReply, StageRequest

STAGE_PROTOCOL = "/swarm/stage"
INFO_PROTOCOL = "/swarm/info"
# between stage-mates (see swarm.peer.mates)
PROGRESS_PROTOCOL = "/swarm/mates/progress"
GRAD_PROTOCOL = "/swarm/mates/grad"
STATE_PROTOCOL = "/swarm/mates/state"
COMMIT_PROTOCOL = "/swarm/mates/commit"
SLICE_PROTOCOL = "/swarm/mates/slice"
# a standby copy, from its holder to a peer that restores its stage (see swarm.peer.standby)
STANDBY_PROTOCOL = "/swarm/standby/state"

# Codes worth retrying on another peer of the same stage; the rest mean the request itself is wrong.
# WRONG_STAGE comes from a peer that has moved to another stage since the caller read its record.
RETRIABLE = {ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL, ErrorCode.WRONG_STAGE}

# A daemon that has just joined may not have its routing table filled yet; it says this, and a
# moment later the same lookup succeeds. Only this error is retried here: a dead peer fails fast.
ROUTING_WARMUP_ERROR = "failed to find any peer in table"
CONNECT_RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0)
REPLY_HEADER_BYTES = 64  # about what a reply carries besides tensor data
# A peer applies a backward only within this share of the caller's timeout, which leaves the rest for
# the reply to arrive: a gradient applied after its caller gave up (and retried elsewhere) would count twice.
COMMIT_SHARE = 0.75
# what the libp2p daemon says when nothing listens where a peer was (a dead peer's address, or its daemon's
# dial backoff after that): unlike a slow or broken answer, a sign that the peer is gone
DIAL_REFUSED = "failed to dial"


class StageCallError(Exception):
    """A stage call that failed: an error reply from the peer, a broken stream, or a timeout."""

    def __init__(self, code: int, message: str, peer_id: str = "", reply: StageReply | None = None) -> None:
        super().__init__(f"{ErrorCode.Name(code)} from {peer_id or 'peer'}: {message}")
        self.code, self.detail, self.peer_id, self.reply = code, message, peer_id, reply

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE


def dial_refused(error: BaseException) -> bool:
    """Whether a call failed because its peer's address refused the dial, not because an answer was slow or
    malformed: the daemon's own error, or a stage call's that carries it."""
    if isinstance(error, StageCallError):
        return error.code == ErrorCode.UNAVAILABLE and DIAL_REFUSED in error.detail
    return isinstance(error, ControlFailure) and DIAL_REFUSED in str(error)


def nothing_listens(p2p: object, peer_id: str, error: BaseException) -> bool:
    """Whether a call to `peer_id` through `p2p` failed because nothing listens where the peer was: its libp2p dial
    was refused (`dial_refused`), or its direct address, which answered before, refused a connection since (see
    `DirectPlane.refused_since_answered`; a just-killed peer's daemon can still take a libp2p stream and reset it)."""
    return dial_refused(error) or found_gone(p2p, peer_id)


def found_gone(p2p: object, peer_id: str) -> bool:
    """Whether `peer_id`'s direct address, which answered a call through `p2p` before, refused a connection since
    (`DirectPlane.refused_since_answered`; never through a plain P2P, which keeps no such record)."""
    refused_since = getattr(p2p, "refused_since_answered", None)
    return refused_since is not None and refused_since(peer_id)


async def exchange(p2p: P2P, peer_id: PeerID, protocol: str, frames: Sequence, reply_type: type, limits: WireLimits):
    """Opens a stream to `protocol` on a peer, sends `frames` and reads one framed reply."""
    reader, writer = await open_stream(p2p, peer_id, protocol)
    sending = asyncio.create_task(write_frames(writer, frames))
    try:
        # read while writing: a peer may refuse a request before it has all of it
        return await read_frames(reader, reply_type, limits)
    finally:
        if not sending.done():
            sending.cancel()
        with contextlib.suppress(BaseException):
            await sending
        writer.close()


async def exchange_and_hold(
    p2p: P2P, peer_id: PeerID, protocol: str, frames: Sequence, reply_type: type, limits: WireLimits
) -> float:
    """As `exchange`, then keeps the stream open until the callee ends it; returns the seconds it stayed open after
    the reply. A callee ends it `HANG_UP_TIMEOUT` seconds after its reply, or at once when its process dies (the
    kernel closes a dead process's connections): an end much sooner says the callee may be gone."""
    reader, writer = await open_stream(p2p, peer_id, protocol)
    try:
        await write_frames(writer, frames)
        await read_frames(reader, reply_type, limits)
        replied = time.monotonic()
        with contextlib.suppress(Exception):  # an end is an end: closed, reset or broken alike
            while await reader.read(2**16):
                pass
        return time.monotonic() - replied
    finally:
        writer.close()


async def open_stream(p2p: P2P, peer_id: PeerID, protocol: str):
    """Opens a binary stream to a peer, waiting out a routing table that is still empty."""
    for delay in CONNECT_RETRY_DELAYS:
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(peer_id, protocol)
            return reader, writer
        except Exception as e:
            if ROUTING_WARMUP_ERROR not in str(e):
                raise
        await asyncio.sleep(delay)
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, protocol)
    return reader, writer


@dataclass
class CallStats:
    """What one stage call cost: bytes each way on the wire and time on the network."""

    bytes_sent: int = 0
    bytes_received: int = 0
    network_seconds: float = 0.0  # the exchange less the peer's own time (server_seconds)


async def call_stage(
    p2p: P2P,
    peer_id: PeerID,
    request: StageRequest,
    tensors: Sequence[torch.Tensor],
    codec: Codec,
    timeout: float,
    limits: WireLimits = WireLimits(),
    stats: CallStats | None = None,
    shaper: LinkShaper | None = None,
) -> tuple[StageReply, list[torch.Tensor]]:
    """Sends `request` with `tensors` to a peer; returns its reply and tensors or raises StageCallError.

    `stats`, if given, is filled in; `shaper`, if given, delays the call as an emulated slow link would.
    """
    request.protocol_version = PROTOCOL_VERSION
    request.deadline_s = timeout * COMMIT_SHARE
    loop = asyncio.get_running_loop()

    # encoding and decoding are CPU work: off the event loop, unless it costs less than getting there
    def encode() -> list[Part]:
        return [p for t in tensors for p in encode_tensor(t, codec)]

    raw_bytes = sum(t.numel() * t.element_size() for t in tensors)
    parts = encode() if codes_inline([codec.name], raw_bytes) else await loop.run_in_executor(None, encode)
    frames = pack_frames(request, parts)
    stats = stats if stats is not None else CallStats()
    stats.bytes_sent = sum(frame.nbytes for frame in frames)
    try:
        started = time.perf_counter()
        if shaper is not None:
            await shaper.send(str(peer_id), stats.bytes_sent)
        reply, reply_parts = await asyncio.wait_for(
            exchange(p2p, peer_id, STAGE_PROTOCOL, frames, StageReply, limits), timeout
        )
        stats.bytes_received = sum(len(part.buffer) for part in reply_parts) + REPLY_HEADER_BYTES
        if shaper is not None:
            await shaper.receive(str(peer_id), stats.bytes_received)
        stats.network_seconds = max(0.0, time.perf_counter() - started - reply.server_seconds)
        if reply.error.code != ErrorCode.OK:
            raise StageCallError(reply.error.code, reply.error.message, str(peer_id), reply)
        received = sum(len(part.buffer) for part in reply_parts)
        if codes_inline([part.head.codec for part in reply_parts], received):
            outputs = decode_tensors(reply_parts, limits)
        else:
            outputs = await loop.run_in_executor(None, decode_tensors, reply_parts, limits)
    except StageCallError:
        raise
    except WireError as e:
        raise StageCallError(ErrorCode.UNAVAILABLE, f"bad reply: {e}", str(peer_id)) from None
    except asyncio.TimeoutError:
        raise StageCallError(ErrorCode.UNAVAILABLE, f"no reply within {timeout:.1f}s", str(peer_id)) from None
    except Exception as e:  # the daemon could not reach the peer, or the stream broke
        raise StageCallError(ErrorCode.UNAVAILABLE, f"{type(e).__name__}: {e}", str(peer_id)) from None
    return reply, outputs


async def get_peer_info(p2p: P2P, peer_id: PeerID, timeout: float = 10.0) -> PeerInfo:
    """Asks a peer what it hosts and how it is doing."""
    request = PeerInfoRequest(protocol_version=PROTOCOL_VERSION)
    try:
        info, _ = await asyncio.wait_for(
            exchange(p2p, peer_id, INFO_PROTOCOL, [request], PeerInfo, WireLimits()), timeout
        )
    except asyncio.TimeoutError:
        raise StageCallError(ErrorCode.UNAVAILABLE, f"no reply within {timeout:.1f}s", str(peer_id)) from None
    except Exception as e:
        raise StageCallError(ErrorCode.UNAVAILABLE, f"{type(e).__name__}: {e}", str(peer_id)) from None
    if info.error.code != ErrorCode.OK:
        raise StageCallError(info.error.code, info.error.message, str(peer_id))
    return info
