"""The wire schema and framing: generated code in sync, messages and tensors round-trip, limits hold."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from google.protobuf import descriptor_pb2

from swarm.compression import get_codec
from swarm.net.wire import (
    CHUNK_BYTES,
    HEADER_BYTES,
    StreamEnded,
    WireError,
    WireLimits,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    write_frames,
)
from swarm.proto import (
    BACKWARD,
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    PeerInfo,
    PeerInfoRequest,
    StageReply,
    StageRequest,
    Tensor,
    swarm_pb2,
)

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"


def test_generated_code_matches_proto(tmp_path):
    out = tmp_path / "swarm.desc"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--descriptor_set_out={out}",
            "swarm.proto",
        ],
        check=True,
    )
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto.FromString(swarm_pb2.DESCRIPTOR.serialized_pb)
    # protoc adds derived json names that generated code omits, in nested types (map entries) too
    messages = list(compiled.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    assert compiled == committed, "proto/swarm_pb2.py is stale: run scripts/generate_proto.sh"


MESSAGES = [
    StageRequest(
        protocol_version=PROTOCOL_VERSION,
        kind=BACKWARD,
        model="gpt-tiny",
        stage=2,
        microbatch_id=2**40,
        step=-1,
        tensors=[Tensor(buffer=b"\x00\x01", shape=[1, 2], dtype="uint8", codec="none", num_parts=1)],
        more=True,
    ),
    StageReply(
        protocol_version=PROTOCOL_VERSION,
        error=Error(code=ErrorCode.TOO_LARGE, message="too big"),
        step=12,
        tensors=[Tensor(buffer=b"abc", num_parts=0)],
        loss=2.5,
        num_samples=8,
        more=False,
    ),
    PeerInfoRequest(protocol_version=PROTOCOL_VERSION),
    PeerInfo(
        protocol_version=PROTOCOL_VERSION,
        model="gpt-small",
        stage=1,
        num_stages=4,
        step=3,
        throughput=12.5,
        queue_length=2,
        state="serving",
        samples_accumulated=7,
        target_batch_size=64,
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trip(message):
    data = message.SerializeToString()
    again = type(message).FromString(data)
    assert again == message
    assert again.SerializeToString() == data


class BufferWriter:
    """Collects what write_frames writes; stands in for the stream writer of a libp2p stream."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=2**30)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def roundtrip(tensors: list[torch.Tensor], codec: str = "none", limits: WireLimits = WireLimits()):
    async def go():
        parts = [p for t in tensors for p in encode_tensor(t, get_codec(codec))]
        header = StageRequest(protocol_version=PROTOCOL_VERSION, model="m", stage=1)
        writer = BufferWriter()
        await write_frames(writer, pack_frames(header, parts))
        request, got_parts = await read_frames(reader_of(bytes(writer.data)), StageRequest, limits)
        return request, decode_tensors(got_parts, limits), len(writer.data)

    return asyncio.run(go())


TENSORS = {
    "float32": torch.randn(3, 4, 5),
    "float16": torch.randn(7).half(),
    "bfloat16": torch.randn(2, 3).bfloat16(),
    "float64": torch.randn(1, 1, 1, 2).double(),
    "int64": torch.randint(-(2**40), 2**40, (9, 2)),
    "int32": torch.randint(-100, 100, (4,), dtype=torch.int32),
    "uint8": torch.randint(0, 255, (3, 3), dtype=torch.uint8),
    "bool": torch.rand(5, 2) > 0.5,
    "scalar": torch.tensor(3.25),
    "empty": torch.empty(0, 4),
    "non_contiguous": torch.randn(6, 4).t(),
}


@pytest.mark.parametrize("name", TENSORS)
def test_tensor_round_trip(name):
    tensor = TENSORS[name]
    request, (decoded,), _ = roundtrip([tensor])
    assert request.model == "m" and request.stage == 1
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_several_tensors_and_large_tensor_are_streamed_in_parts():
    big = torch.randn(5 * 2**20 // 4 + 3)  # a little over 5 MiB: over p2pd's 4 MiB unary limit
    small = torch.arange(10)
    _, decoded, wire_bytes = roundtrip([small, big, small])
    assert [t.shape for t in decoded] == [small.shape, big.shape, small.shape]
    assert torch.equal(decoded[1], big) and torch.equal(decoded[2], small)
    assert len(encode_tensor(big, get_codec("none"))) == -(-big.numel() * 4 // CHUNK_BYTES)
    assert wire_bytes < big.numel() * 4 * 1.01


def test_lossy_codec_leaves_integers_exact():
    tokens = torch.randint(0, 257, (4, 64))
    hidden = torch.randn(4, 64, 8)
    _, (tokens_out, hidden_out), _ = roundtrip([tokens, hidden], codec="fp16")
    assert torch.equal(tokens_out, tokens)
    assert hidden_out.dtype == torch.float32
    torch.testing.assert_close(hidden_out, hidden, rtol=1e-3, atol=1e-3)


def frame(message) -> bytes:
    data = message.SerializeToString()
    return len(data).to_bytes(HEADER_BYTES, "big") + data


def read_error(data: bytes, limits: WireLimits = WireLimits()) -> WireError:
    async def go():
        request, parts = await read_frames(reader_of(data), StageRequest, limits)
        decode_tensors(parts, limits)

    with pytest.raises(WireError) as info:
        asyncio.run(go())
    return info.value


def test_malformed_frame_is_refused():
    garbage = b"\xff\xff\xff\xff not a protobuf"
    error = read_error(len(garbage).to_bytes(HEADER_BYTES, "big") + garbage)
    assert error.code == ErrorCode.BAD_REQUEST and "malformed" in str(error)


def test_oversized_frame_is_refused_before_reading_it():
    error = read_error((2**40).to_bytes(HEADER_BYTES, "big"))
    assert error.code == ErrorCode.TOO_LARGE


def test_message_over_the_limit_is_refused():
    parts = encode_tensor(torch.zeros(2**20), get_codec("none"))  # 4 MiB in 8 parts
    data = b"".join(frame(f) for f in pack_frames(StageRequest(), parts))
    error = read_error(data, WireLimits(max_message_bytes=2**20))
    assert error.code == ErrorCode.TOO_LARGE


def test_declared_shape_over_the_limit_is_refused_before_allocating():
    huge = Tensor(buffer=b"\x00" * 16, shape=[2**20, 2**20], dtype="float32", codec="none", num_parts=1)
    error = read_error(frame(StageRequest(tensors=[huge])))
    assert error.code == ErrorCode.TOO_LARGE and "MiB" in str(error)


def test_truncated_stream_is_refused_as_one_that_ended():
    data = frame(StageRequest(more=True))
    for truncated in (data, data[:-1] if len(data) > HEADER_BYTES else data[:3]):
        error = read_error(truncated)
        assert isinstance(error, StreamEnded) and error.code == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "tensor",
    [
        Tensor(buffer=b"\x00" * 3, shape=[2], dtype="float32", num_parts=1),  # wrong length
        Tensor(buffer=b"\x00" * 4, shape=[1], dtype="complex64", num_parts=1),  # unknown dtype
        Tensor(buffer=b"\x00" * 4, shape=[1], dtype="float32", codec="zip", num_parts=1),  # unknown codec
        Tensor(buffer=b"\x00" * 4, shape=[-1], dtype="float32", num_parts=1),  # negative size
        Tensor(buffer=b"\x00" * 4, shape=[1], dtype="float32", num_parts=3),  # missing parts
    ],
)
def test_malformed_tensor_is_refused(tensor):
    error = read_error(frame(StageRequest(tensors=[tensor])))
    assert error.code == ErrorCode.BAD_REQUEST


def test_frames_are_protobuf_as_any_parser_reads_them():
    """What write_frames sends parses with protobuf's own parser into the same tensors, and frames serialized by
    protobuf (fields in any order) read back as the parts they hold: peers on either side interoperate."""
    tensors = [torch.randn(CHUNK_BYTES // 4 + 5), torch.arange(7), torch.tensor(1.5)]
    parts = [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
    header = StageRequest(protocol_version=PROTOCOL_VERSION, model="m", stage=3, microbatch_id=2**40)
    frames = pack_frames(header, parts)
    parsed = [StageRequest.FromString(frame.SerializeToString()) for frame in frames]
    assert parsed[0].model == "m" and parsed[0].microbatch_id == 2**40
    assert [f.more for f in parsed] == [True] * (len(parsed) - 1) + [False]
    as_protobuf = [t for f in parsed for t in f.tensors]
    assert [bytes(t.buffer) for t in as_protobuf] == [bytes(p.buffer) for p in parts]
    assert [t.num_parts for t in as_protobuf] == [p.head.num_parts for p in parts]
    # the other way: protobuf's serialization, tensors before the header fields, read by read_frames
    data = b""
    for message in parsed:
        reordered = b"".join(StageRequest(tensors=[t]).SerializeToString() for t in message.tensors)
        rest = StageRequest()
        rest.CopyFrom(message)
        rest.ClearField("tensors")
        body = reordered + rest.SerializeToString()
        data += len(body).to_bytes(HEADER_BYTES, "big") + body

    async def read():
        return await read_frames(reader_of(data), StageRequest, WireLimits())

    request, got = asyncio.run(read())
    assert request.model == "m" and not request.tensors
    decoded = decode_tensors(got, WireLimits())
    assert all(torch.equal(a, b) for a, b in zip(decoded, tensors))


def test_a_frame_counts_its_bytes_as_written():
    parts = encode_tensor(torch.randn(1000), get_codec("none"))
    (frame_,) = pack_frames(StageRequest(model="m"), parts)
    writer = BufferWriter()
    asyncio.run(write_frames(writer, [frame_]))
    assert len(writer.data) == HEADER_BYTES + frame_.nbytes == HEADER_BYTES + len(frame_.SerializeToString())


def test_many_small_tensors_spread_over_frames_a_reader_accepts():
    parts = [p for _ in range(2000) for p in encode_tensor(torch.tensor(1.0), get_codec("none"))]
    _, decoded, _ = roundtrip([torch.tensor(float(i)) for i in range(2000)])
    assert [float(t) for t in decoded] == [float(i) for i in range(2000)]
    assert len(pack_frames(StageRequest(), parts)) >= 2000 // 512


def raw_frame(body: bytes) -> bytes:
    return len(body).to_bytes(HEADER_BYTES, "big") + body


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"\x3a\x05\x0a\x09abc", ErrorCode.BAD_REQUEST),  # a part's buffer runs past the part
        (b"\x3a\x80", ErrorCode.BAD_REQUEST),  # a truncated length
        (b"\x3a" + b"\xff" * 11, ErrorCode.BAD_REQUEST),  # a varint longer than protobuf allows
        (b"\x03\x00", ErrorCode.BAD_REQUEST),  # field number 0
        (b"\x3b\x3c", ErrorCode.BAD_REQUEST),  # a group (wire type 3)
        (b"\x3a\x02\x0f\x00", ErrorCode.BAD_REQUEST),  # wire type 7 inside a part
        (b"\x3a\x00" * 9000, ErrorCode.TOO_LARGE),  # more fields than a frame may have
        (b"\xa0\x01\x00" * 9000, ErrorCode.TOO_LARGE),  # the same with unknown fields
    ],
)
def test_a_malformed_frame_is_refused_before_it_costs_much(body, code):
    error = read_error(raw_frame(body))
    assert error.code == code and "StageRequest" in str(error)


def test_a_message_of_too_many_parts_is_refused():
    body = b"\x3a\x00" * 8000 + b"\x40\x01"  # 8,000 empty parts, more to come
    error = read_error(raw_frame(body) * 3, WireLimits(max_parts=10_000))
    assert error.code == ErrorCode.TOO_LARGE and "parts" in str(error)
    error = read_error(raw_frame(body) * 20, WireLimits(max_fields=50_000, max_parts=10**6))
    assert error.code == ErrorCode.TOO_LARGE and "fields" in str(error)
