"""Framing of stage calls on a libp2p stream, and tensors split into parts for streaming.

A message on the wire is a sequence of frames: 8 bytes of big-endian length, then one serialized
protobuf message. Tensors are encoded by their codec and cut into parts of at most CHUNK_BYTES;
frames are filled with parts in order, and every frame but the last says `more`. The reader
enforces its limits before it allocates anything, so an oversized or malformed message costs the
receiver nothing but a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError, Message

from swarm.compression import PACKED_INTEGERS, Codec, CodecError, dtype_from_name, dtype_name, get_codec
from swarm.proto import ErrorCode, Tensor

CHUNK_BYTES = 512 * 1024
HEADER_BYTES = 8
MAX_TENSOR_DIMS = 8

M = TypeVar("M", bound=Message)


class WireError(Exception):
    """A message that breaks the wire rules; `code` is the ErrorCode to answer it with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamEnded(WireError):
    """The sender hung up before its message was complete: most often a call its caller cancelled."""

    def __init__(self) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, "stream ended in the middle of a message")


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts. Frames are small by construction, so a huge one is refused at once."""

    max_frame_bytes: int = 4 * CHUNK_BYTES
    max_message_bytes: int = 256 * 1024 * 1024
    max_tensor_bytes: int = 256 * 1024 * 1024
    frame_timeout: float = 60.0


def encode_tensor(tensor: torch.Tensor, codec: Codec) -> list[Tensor]:
    """The parts of one tensor on the wire. Integer and bool tensors skip lossy codecs: with one, wide
    integers (token ids) go packed into the narrowest type that holds them, and anything else as it is."""
    if not codec.applies_to(tensor.dtype):
        packs = codec.lossy and PACKED_INTEGERS.applies_to(tensor.dtype)
        codec = PACKED_INTEGERS if packs else get_codec("none")
    buffer = codec.encode(tensor)
    num_parts = max(1, math.ceil(len(buffer) / CHUNK_BYTES))
    parts = [Tensor(buffer=buffer[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]) for i in range(num_parts)]
    head = parts[0]
    head.shape.extend(tensor.shape)
    head.dtype = dtype_name(tensor.dtype)
    head.codec = codec.name
    head.num_parts = num_parts
    return parts


def decode_tensors(parts: Sequence[Tensor], limits: WireLimits) -> list[torch.Tensor]:
    """Reassembles and decodes the tensors in `parts`; raises WireError on anything malformed."""
    tensors, index = [], 0
    while index < len(parts):
        head = parts[index]
        num_parts = max(1, head.num_parts)
        if index + num_parts > len(parts):
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)} is truncated: {num_parts} parts announced")
        shape = tuple(head.shape)
        if len(shape) > MAX_TENSOR_DIMS or any(size < 0 for size in shape):
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)} has an invalid shape {list(shape)}")
        try:
            dtype = dtype_from_name(head.dtype)
            codec = get_codec(head.codec or "none")
        except CodecError as e:
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)}: {e}") from None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > limits.max_tensor_bytes:
            raise WireError(
                ErrorCode.TOO_LARGE,
                f"tensor {len(tensors)} of shape {list(shape)} needs {nbytes / 2**20:.1f} MiB, "
                f"over this peer's limit of {limits.max_tensor_bytes / 2**20:.1f} MiB",
            )
        continuation = parts[index + 1 : index + num_parts]
        if any(part.shape or part.dtype or part.codec or part.num_parts for part in continuation):
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)} has a malformed continuation part")
        # a bytearray: the one copy of the payload, which the codec may then wrap without copying again
        buffer = bytearray().join(part.buffer for part in parts[index : index + num_parts])
        try:
            tensors.append(codec.decode(buffer, shape, dtype))
        except CodecError as e:
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)}: {e}") from None
        index += num_parts
    return tensors


def pack_frames(header: M, parts: Sequence[Tensor]) -> list[M]:
    """Spreads `parts` over frames of about CHUNK_BYTES; the first frame is `header` itself."""
    frames: list[M] = [header]
    filled = 0
    for part in parts:
        if filled and filled + len(part.buffer) > CHUNK_BYTES:
            frames.append(type(header)())
            filled = 0
        frames[-1].tensors.append(part)
        filled += len(part.buffer)
    for frame in frames[:-1]:
        frame.more = True
    return frames


async def write_frames(writer: asyncio.StreamWriter, frames: Sequence[Message]) -> None:
    """Writes frames, waiting for the transport to drain after each one."""
    for frame in frames:
        data = frame.SerializeToString()
        writer.write(len(data).to_bytes(HEADER_BYTES, "big"))
        writer.write(data)
        await writer.drain()


async def read_frames(
    reader: asyncio.StreamReader, message_type: type[M], limits: WireLimits
) -> tuple[M, list[Tensor]]:
    """Reads one message: its first frame (the header) and the tensor parts of all its frames.

    Raises WireError for a frame or message over the limits, a malformed frame, or a stream that
    ends mid-message; asyncio.TimeoutError if the sender stalls for longer than frame_timeout.
    """
    header: M | None = None
    parts: list[Tensor] = []
    total = 0
    while True:
        try:
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(HEADER_BYTES), limits.frame_timeout), "big")
            if size > limits.max_frame_bytes:
                raise WireError(
                    ErrorCode.TOO_LARGE,
                    f"frame of {size} bytes exceeds the limit of {limits.max_frame_bytes}; "
                    f"large tensors must be sent in parts of at most {CHUNK_BYTES} bytes",
                )
            total += HEADER_BYTES + size
            if total > limits.max_message_bytes:
                raise WireError(
                    ErrorCode.TOO_LARGE,
                    f"message exceeds this peer's limit of {limits.max_message_bytes / 2**20:.1f} MiB",
                )
            data = await asyncio.wait_for(reader.readexactly(size), limits.frame_timeout)
        except asyncio.IncompleteReadError:
            raise StreamEnded() from None
        try:
            frame = message_type.FromString(data)
        except DecodeError as e:
            raise WireError(ErrorCode.BAD_REQUEST, f"malformed {message_type.__name__} frame: {e}") from None
        if header is None:
            header = frame
        if not _streamed(frame):
            return frame, []
        parts.extend(frame.tensors)
        if not frame.more:
            break
    header.ClearField("tensors")
    return header, parts


def _streamed(message: Message) -> bool:
    """Whether a message type carries tensors across frames (small info messages do not)."""
    return "more" in message.DESCRIPTOR.fields_by_name


async def wait_for_hang_up(reader: asyncio.StreamReader, timeout: float = 10.0) -> None:
    """After replying, reads and drops anything more from the caller until it closes the stream.

    The caller closes once it has read the reply. Closing first loses the reply now and then:
    the daemon resets the stream and drops what it had not yet forwarded; and after a refusal
    mid-request the caller is still writing, which a closed stream would answer with a reset.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    with contextlib.suppress(Exception):
        while await asyncio.wait_for(reader.read(2**16), max(0.0, deadline - loop.time())):
            pass
