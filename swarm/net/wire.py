"""Framing of stage calls on a stream, and tensors split into parts for streaming.

A message on the wire is a sequence of frames: 8 bytes of big-endian length, then one serialized
protobuf message. Tensors are encoded by their codec and cut into parts of at most CHUNK_BYTES;
frames are filled with parts in order, and every frame but the last says `more`. The reader
enforces its limits before it allocates anything, so an oversized or malformed message costs the
receiver nothing but a clear error.

A part's bytes stay outside protobuf (`Part`): the writer serializes a frame's own fields and each
part's small header with protobuf and writes the bytes after them as the `buffer` field; the reader
takes the `tensors` fields out of a frame by their protobuf encoding and keeps each `buffer` as a
view of the frame it came in. Frames are valid protobuf both ways; a tensor is copied once on its
way from the codec to the socket and once from the socket to the codec, instead of at every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
from google.protobuf.message import DecodeError, Message

from swarm.compression import PACKED_INTEGERS, Codec, CodecError, dtype_from_name, dtype_name, get_codec
from swarm.net.shared_memory import SHARED_MIN_BYTES, SharedMemoryError
from swarm.proto import ErrorCode, Tensor

CHUNK_BYTES = 512 * 1024
HEADER_BYTES = 8
MAX_TENSOR_DIMS = 8
MAX_PARTS_PER_FRAME = 512  # a frame of many small tensors stays far below the reader's field limit
MAX_FIELDS_PER_FRAME = 2**13
JOIN_BELOW_BYTES = 64 * 1024  # smaller pieces of a frame are joined into one write; larger ones written as they are

# protobuf's encoding, as far as frames need it (https://protobuf.dev/programming-guides/encoding/)
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
BUFFER_FIELD = Tensor.DESCRIPTOR.fields_by_name["buffer"].number
BUFFER_TAG = bytes([BUFFER_FIELD << 3 | LENGTH_DELIMITED])

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
    max_fields: int = 2**17  # protobuf fields in a message, tensor parts' own included
    max_parts: int = 2**14  # tensor parts in a message (a 256 MiB tensor is 512)
    frame_timeout: float = 60.0
    # where the byte limits come from and what to change, for a refusal (`swarm.net.request_limits`)
    source: str = ""

    def refusal(self, what: str) -> str:
        """The message of a TOO_LARGE refusal of `what`, saying where the limit comes from when known."""
        return f"{what}; {self.source}" if self.source else what


class Part(NamedTuple):
    """One part of a tensor on the wire: its header fields and its bytes, which protobuf never holds.

    `head` is a Tensor message with an empty buffer: shape, dtype, codec and number of parts on a
    tensor's first part, nothing on the others. `buffer` is a view of the codec's output when sent
    and of the received frame when read, so parts cost no copies of their own."""

    head: Tensor
    buffer: bytes | bytearray | memoryview


class Frame:
    """One frame to write: a message's own fields (the header on the first frame, `more` on all but
    the last), then its parts as that message's `tensors`, serialized without copying their bytes."""

    def __init__(self, message: Message, parts: Sequence[Part] = ()) -> None:
        self.message, self.parts = message, list(parts)

    def chunks(self) -> list[bytes | memoryview]:
        """The frame's serialization in pieces: small ones joined, each part's bytes as they are."""
        chunks, pending = [], [self.message.SerializeToString()]
        if self.parts:
            tag = _tag(_tensors_field(type(self.message)), LENGTH_DELIMITED)
        for part in self.parts:
            head, size = part.head.SerializeToString(), len(part.buffer)
            inner = len(head) + len(BUFFER_TAG) + _varint_size(size) + size
            pending += [tag, _varint(inner), head, BUFFER_TAG, _varint(size)]
            if size < JOIN_BELOW_BYTES:
                pending.append(part.buffer)
            else:
                chunks += [b"".join(pending), part.buffer]
                pending = []
        if pending:
            chunks.append(b"".join(pending))
        return chunks

    @property
    def nbytes(self) -> int:
        """The serialized frame's length (without the 8-byte length before it), counted without serializing."""
        total = self.message.ByteSize()
        if self.parts:
            tag_bytes = len(_tag(_tensors_field(type(self.message)), LENGTH_DELIMITED))
        for part in self.parts:
            size = len(part.buffer)
            inner = part.head.ByteSize() + len(BUFFER_TAG) + _varint_size(size) + size
            total += tag_bytes + _varint_size(inner) + inner
        return total

    def SerializeToString(self) -> bytes:  # noqa: N802 (as a protobuf message says it: tools frame either)
        return b"".join(self.chunks())


def encode_tensor(tensor: torch.Tensor, codec: Codec) -> list[Part]:
    """The parts of one tensor on the wire. Integer and bool tensors skip lossy codecs: with one, wide
    integers (token ids) go packed into the narrowest type that holds them, and anything else as it is."""
    if not codec.applies_to(tensor.dtype):
        packs = codec.lossy and PACKED_INTEGERS.applies_to(tensor.dtype)
        codec = PACKED_INTEGERS if packs else get_codec("none")
    buffer = memoryview(codec.encode(tensor)).cast("B")
    num_parts = max(1, math.ceil(len(buffer) / CHUNK_BYTES))
    parts = [Part(Tensor(), buffer[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]) for i in range(num_parts)]
    head = parts[0].head
    head.shape.extend(tensor.shape)
    head.dtype = dtype_name(tensor.dtype)
    head.codec = codec.name
    head.num_parts = num_parts
    return parts


INLINE_CODING_BYTES = 8 * 2**20  # raw tensors up to this size are coded on the event loop (see `codes_inline`)


def codes_inline(codec_names: Sequence[str], nbytes: int) -> bool:
    """Whether tensors are cheap enough to encode or decode on the event loop rather than in a worker thread.

    Raw tensors (codec none) cost no copy to encode and at most one to decode, less than handing them to a
    worker thread and back: each hand-off waits for a thread to be scheduled, which on a busy machine takes
    longer than the copy. Lossy codecs compute over every value, and belong off the loop."""
    return nbytes <= INLINE_CODING_BYTES and all(name in ("", "none") for name in codec_names)


class Announced(NamedTuple):
    """A tensor as its parts announce it, before any byte of it is decoded: what decoding would make of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: str
    wire_bytes: int  # the bytes its parts carry, which the codec would decode


def _tensor_spans(parts: Sequence[Part]) -> Iterator[tuple[int, int, Announced]]:
    """Each tensor of `parts`: the span of its parts (start, end) and what its header announces; raises
    WireError on a malformed header."""
    index = count = 0
    while index < len(parts):
        head = parts[index].head
        num_parts = max(1, head.num_parts)
        if index + num_parts > len(parts):
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {count} is truncated: {num_parts} parts announced")
        shape = tuple(head.shape)
        if len(shape) > MAX_TENSOR_DIMS or any(size < 0 for size in shape):
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {count} has an invalid shape {list(shape)}")
        try:
            dtype = dtype_from_name(head.dtype)
        except CodecError as e:
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {count}: {e}") from None
        wire_bytes = sum(len(part.buffer) for part in parts[index : index + num_parts])
        yield index, index + num_parts, Announced(shape, dtype, head.codec or "none", wire_bytes)
        index, count = index + num_parts, count + 1


def announced_tensors(parts: Sequence[Part]) -> list[Announced]:
    """What the tensors in `parts` claim to be (shape, dtype, codec, bytes on the wire), read from their headers
    alone, so that a receiver can check them before decoding; raises WireError on a malformed header."""
    return [announced for _, _, announced in _tensor_spans(parts)]


def decode_tensors(parts: Sequence[Part], limits: WireLimits) -> list[torch.Tensor]:
    """Reassembles and decodes the tensors in `parts`; raises WireError on anything malformed."""
    tensors = []
    for start, end, (shape, dtype, codec_name, _) in _tensor_spans(parts):
        try:
            codec = get_codec(codec_name)
        except CodecError as e:
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)}: {e}") from None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > limits.max_tensor_bytes:
            raise WireError(
                ErrorCode.TOO_LARGE,
                limits.refusal(
                    f"tensor {len(tensors)} of shape {list(shape)} needs {nbytes / 2**20:.1f} MiB, "
                    f"over this peer's limit of {limits.max_tensor_bytes / 2**20:.1f} MiB"
                ),
            )
        continuation = parts[start + 1 : end]
        if any(p.head.shape or p.head.dtype or p.head.codec or p.head.num_parts for p in continuation):
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)} has a malformed continuation part")
        # a bytearray: the one copy of the payload, which the codec may then wrap without copying again (a
        # tensor read whole from shared memory is one already)
        own = parts[start].buffer
        if end - start == 1 and type(own) is bytearray:
            buffer = own
        else:
            buffer = bytearray().join(part.buffer for part in parts[start:end])
        try:
            tensors.append(codec.decode(buffer, shape, dtype))
        except CodecError as e:
            raise WireError(ErrorCode.BAD_REQUEST, f"tensor {len(tensors)}: {e}") from None
    return tensors


def pack_frames(header: Message, parts: Sequence[Part]) -> list[Frame]:
    """Spreads `parts` over frames of about CHUNK_BYTES; the first frame carries `header`."""
    frames = [Frame(header)]
    filled = 0
    for part in parts:
        if filled and filled + len(part.buffer) > CHUNK_BYTES or len(frames[-1].parts) == MAX_PARTS_PER_FRAME:
            frames.append(Frame(type(header)()))
            filled = 0
        frames[-1].parts.append(part)
        filled += len(part.buffer)
    for frame in frames[:-1]:
        frame.message.more = True
    return frames


async def write_frames(writer: asyncio.StreamWriter, frames: Sequence[Frame | Message]) -> None:
    """Writes frames (a plain message is a frame without parts), waiting for the transport to drain after each.

    On a connection that agreed on shared memory, large parts go through the sender's arena instead."""
    shared = getattr(writer, "shared", None)
    if shared is not None and shared.writes and all(isinstance(f, Frame) for f in frames) and _has_parts(frames):
        frames = _through_arena(frames, shared.own)
    for frame in frames:
        chunks = frame.chunks() if isinstance(frame, Frame) else [frame.SerializeToString()]
        size = sum(len(chunk) for chunk in chunks)
        if len(chunks[0]) < JOIN_BELOW_BYTES:  # the length goes out with the frame's start in one write
            chunks[0] = size.to_bytes(HEADER_BYTES, "big") + chunks[0]
        else:
            writer.write(size.to_bytes(HEADER_BYTES, "big"))
        for chunk in chunks:
            writer.write(chunk)
        await writer.drain()


async def read_frames(
    reader: asyncio.StreamReader,
    message_type: type[M],
    limits: WireLimits,
    reserve: Callable[[int], None] | None = None,
) -> tuple[M, list[Part]]:
    """Reads one message: its first frame (the header) and the tensor parts of all its frames.

    Raises WireError for a frame or message over the limits, a malformed frame, or a stream that
    ends mid-message; asyncio.TimeoutError if the sender stalls for longer than frame_timeout.
    `reserve(size)` is called with each frame's size before its bytes are read (it raises to refuse).
    """
    header: M | None = None
    parts: list[Part] = []
    total, fields_left = 0, limits.max_fields
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
                    limits.refusal(f"message exceeds this peer's limit of {limits.max_message_bytes / 2**20:.1f} MiB"),
                )
            if reserve is not None:
                reserve(size)
            data = await asyncio.wait_for(reader.readexactly(size), limits.frame_timeout)
        except asyncio.IncompleteReadError:
            raise StreamEnded() from None
        frame, frame_parts, fields = parse_frame(data, message_type, min(MAX_FIELDS_PER_FRAME, fields_left))
        if header is None:
            header = frame
        if not _streamed(message_type):
            return frame, []
        fields_left -= fields
        parts.extend(frame_parts)
        if len(parts) > limits.max_parts:
            refusal = limits.refusal(f"message of more than this peer's limit of {limits.max_parts} parts")
            raise WireError(ErrorCode.TOO_LARGE, refusal)
        if not frame.more:
            break
    if any(part.head.shared_length for part in parts):
        parts = _read_from_arena(parts, getattr(reader, "shared", None), limits, total)
    return header, parts


def _has_parts(frames: Sequence[Frame | Message]) -> bool:
    return any(isinstance(frame, Frame) and frame.parts for frame in frames)


def _through_arena(frames: Sequence[Frame], arena) -> list[Frame]:
    """The message of `frames` with each large tensor written whole to `arena` (`swarm.net.shared_memory.Arena`)
    and named by where it lies, as one part: the message then fits in a frame or two of small fields, and
    the reader takes each tensor in one read."""
    parts = [part for frame in frames for part in frame.parts]
    out, index = [], 0
    while index < len(parts):
        run = parts[index : index + max(1, parts[index].head.num_parts)]
        index += len(run)
        if sum(len(part.buffer) for part in run) < SHARED_MIN_BYTES:
            out += run
            continue
        head = Tensor()
        head.CopyFrom(run[0].head)
        head.num_parts = 1
        head.shared_offset, head.shared_length = arena.put([part.buffer for part in run])
        out.append(Part(head, b""))
    header = type(frames[0].message)()
    header.CopyFrom(frames[0].message)
    header.more = False
    return pack_frames(header, out)


def _read_from_arena(parts: list[Part], shared, limits: WireLimits, total: int) -> list[Part]:
    """The parts with their bytes read from the sender's arena (`SharedMemoryLink.reader`), each into a buffer
    of its own that decoding then wraps without another copy (a sender writes each tensor whole, as one part).
    The bytes count against the message limit before any is read."""
    reader = shared.reader if shared is not None else None
    if reader is None:
        raise WireError(ErrorCode.BAD_REQUEST, "a part in shared memory on a connection that did not agree to it")
    total += sum(part.head.shared_length for part in parts)
    if total > limits.max_message_bytes:
        message = f"message exceeds this peer's limit of {limits.max_message_bytes / 2**20:.1f} MiB"
        raise WireError(ErrorCode.TOO_LARGE, limits.refusal(message))
    out = []
    for part in parts:
        if part.head.shared_length:
            if len(part.buffer):
                raise WireError(ErrorCode.BAD_REQUEST, "a part both in its frame and in shared memory")
            head = Tensor()
            head.CopyFrom(part.head)
            head.shared_offset, head.shared_length = 0, 0
            try:
                part = Part(head, reader.read(part.head.shared_offset, part.head.shared_length))
            except SharedMemoryError as e:
                raise WireError(ErrorCode.BAD_REQUEST, f"shared memory: {e}") from None
        out.append(part)
    return out


def parse_frame(data: bytes | bytearray, message_type: type[M], max_fields: int) -> tuple[M, list[Part], int]:
    """A frame's own fields, its tensor parts (their buffers views of `data`) and how many protobuf fields it
    had. WireError if malformed, or past `max_fields`: a frame of a million tiny fields is refused before it
    costs more time than a frame of large ones."""
    try:
        if not _streamed(message_type):
            return message_type.FromString(data), [], 0
        scan = _FieldScan(memoryview(data), max_fields)
        own, tensors = scan.split(0, len(data), _tensors_field(message_type))
        frame = message_type.FromString(b"".join(scan.data[start:end] for start, end in own))
        parts = []
        for start, end in tensors:
            fields, buffers = scan.split(start, end, BUFFER_FIELD)
            head = Tensor.FromString(b"".join(scan.data[s:e] for s, e in fields)) if fields else Tensor()
            last = buffers[-1] if buffers else (start, start)  # as protobuf does: the last occurrence wins
            parts.append(Part(head, scan.data[last[0] : last[1]]))
        return frame, parts, max_fields - scan.fields_left
    except DecodeError as e:
        raise WireError(ErrorCode.BAD_REQUEST, f"malformed {message_type.__name__} frame: {e}") from None
    except _Malformed as e:
        raise WireError(e.code, f"malformed {message_type.__name__} frame: {e}") from None


class _Malformed(Exception):
    def __init__(self, message: str, code: int = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class _FieldScan:
    """Walks the protobuf fields of one frame, counting them against a budget."""

    def __init__(self, data: memoryview, max_fields: int) -> None:
        self.data, self.fields_left, self.max_fields = data, max_fields, max_fields

    def split(self, start: int, end: int, number: int) -> tuple[list, list]:
        """The spans of the fields in data[start:end] other than `number` (adjacent ones merged), and the
        payload spans of every length-delimited field `number`."""
        data, others, found = self.data, [], []
        pos = start
        while pos < end:
            self.fields_left -= 1
            if self.fields_left < 0:
                raise _Malformed(f"more fields than the {self.max_fields} it may have", ErrorCode.TOO_LARGE)
            field_start = pos
            key, pos = _read_varint(data, pos, end)
            field, wire_type = key >> 3, key & 7
            if field == 0:
                raise _Malformed("field number 0")
            if wire_type == VARINT:
                _, pos = _read_varint(data, pos, end)
            elif wire_type == FIXED64:
                pos += 8
            elif wire_type == LENGTH_DELIMITED:
                length, pos = _read_varint(data, pos, end)
                if field == number and pos + length <= end:
                    found.append((pos, pos + length))
                    pos += length
                    continue
                pos += length
            elif wire_type == FIXED32:
                pos += 4
            else:
                raise _Malformed(f"wire type {wire_type} of field {field}")
            if pos > end:
                raise _Malformed(f"field {field} runs past the end of its message")
            if others and others[-1][1] == field_start:
                others[-1][1] = pos
            else:
                others.append([field_start, pos])
        return others, found


def _read_varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        if pos >= end:
            raise _Malformed("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise _Malformed("varint longer than 10 bytes")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


@functools.cache
def _tensors_field(message_type: type[Message]) -> int:
    return message_type.DESCRIPTOR.fields_by_name["tensors"].number


def _streamed(message_type: type[Message]) -> bool:
    """Whether a message type carries tensors across frames (small info messages do not)."""
    return "more" in message_type.DESCRIPTOR.fields_by_name


HANG_UP_TIMEOUT = 10.0  # seconds a callee waits for its caller to close after the reply, before it closes


async def wait_for_hang_up(reader: asyncio.StreamReader, timeout: float = HANG_UP_TIMEOUT) -> None:
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
