"""Shared memory on one host: callers and servers that agree in the handshake pass tensors through /dev/shm,
exactly and with the limits and checks of the socket path; a part that names shared memory nobody agreed on,
or an arena that is not what it claims, is refused with a clear error; nothing is left in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch
from hivemind.p2p import P2P, PeerID

from swarm.compression import get_codec
from swarm.net.direct_plane import DirectPlane, parse_direct_address
from swarm.net.identity import load_identity
from swarm.net.shared_memory import (
    SHM_DIR,
    TOKEN_BYTES,
    Arena,
    ArenaPool,
    ArenaReader,
    SharedMemoryError,
    remove_stale_arenas,
    shared_memory_available,
)
from swarm.net.transport import exchange
from swarm.net.wire import (
    WireError,
    WireLimits,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    wait_for_hang_up,
    write_frames,
)
from swarm.proto import ErrorCode, StageReply, StageRequest

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs a writable /dev/shm")

ECHO = "/swarm/test/tensor-echo"
LIMITS = WireLimits()


async def _echo(_info, reader, writer) -> None:
    """Answers with the tensors it was sent, decoded and encoded again (as a stage call's handler does)."""
    _, parts = await read_frames(reader, StageRequest, LIMITS)
    tensors = decode_tensors(parts, LIMITS)
    codec = get_codec("none")
    await write_frames(writer, pack_frames(StageReply(), [p for t in tensors for p in encode_tensor(t, codec)]))
    await wait_for_hang_up(reader)
    writer.close()


async def _planes(server_shared: bool, caller_shared: bool):
    server_identity, caller_identity = load_identity(None), load_identity(None)
    server_p2p = await P2P.create(identity_path=server_identity.path)
    server = DirectPlane(server_p2p, server_identity, shared_memory=server_shared)
    await server.add_binary_stream_handler(ECHO, _echo)
    address = await server.serve("127.0.0.1", 0, "127.0.0.1")
    caller_p2p = await P2P.create(identity_path=caller_identity.path)
    caller = DirectPlane(caller_p2p, caller_identity, shared_memory=caller_shared)
    caller.addresses[server_identity.peer_id] = parse_direct_address(address)
    return server, caller, PeerID.from_base58(server_identity.peer_id)


async def _round_trip(caller: DirectPlane, peer_id: PeerID, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    parts = [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
    _, reply_parts = await exchange(caller, peer_id, ECHO, pack_frames(StageRequest(), parts), StageReply, LIMITS)
    return decode_tensors(reply_parts, LIMITS)


def _own_arenas(*planes: DirectPlane) -> set[str]:
    return {arena.name for plane in planes if plane.arenas is not None for arena in plane.arenas._all}


@pytest.mark.timeout(60)
def test_tensors_pass_through_shared_memory_exactly_and_the_arenas_go_with_the_planes():
    tensors = [
        torch.randn(64, 64, 128),  # 2 MiB: four 512 KiB parts, read back as one
        torch.randn(8, 3000).to(torch.bfloat16),
        torch.randint(0, 257, (64, 64)),  # 32 KiB of int64: at the threshold
        torch.randn(5),  # small: stays in the frame
        torch.zeros(0, 7),
    ]

    async def main():
        server, caller, peer_id = await _planes(True, True)
        for _ in range(3):  # later calls reuse the arenas
            back = await _round_trip(caller, peer_id, tensors)
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, back))
        assert caller.calls["direct"] == 3 and caller.calls["shared_memory"] == 3
        assert server.server.shared_calls == 3
        names = _own_arenas(caller, server)
        assert names and all(os.path.exists(os.path.join(SHM_DIR, name)) for name in names)
        await caller.shutdown()
        await server.shutdown()
        assert not any(os.path.exists(os.path.join(SHM_DIR, name)) for name in names)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server_shared, caller_shared", [(True, False), (False, True)])
def test_either_side_may_decline_and_calls_go_over_the_socket(server_shared: bool, caller_shared: bool):
    tensors = [torch.randn(32, 64, 128)]

    async def main():
        server, caller, peer_id = await _planes(server_shared, caller_shared)
        back = await _round_trip(caller, peer_id, tensors)
        assert torch.equal(back[0], tensors[0])
        assert caller.calls["direct"] == 1 and caller.calls["shared_memory"] == 0
        assert server.server.shared_calls == 0
        await caller.shutdown()
        await server.shutdown()

    asyncio.run(main())


def _frames_bytes(parts) -> bytes:
    out = b""
    for frame in pack_frames(StageRequest(), parts):
        data = frame.SerializeToString()
        out += len(data).to_bytes(8, "big") + data
    return out


def _reader_with(data: bytes, shared=None) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    reader.shared = shared
    return reader


def test_a_part_in_shared_memory_nobody_agreed_on_or_out_of_bounds_is_refused():
    arena = Arena()
    try:
        tensor = torch.randn(1000)
        (part,) = encode_tensor(tensor, get_codec("none"))
        head = type(part.head)()
        head.CopyFrom(part.head)
        head.shared_offset, head.shared_length = arena.put([part.buffer])
        forged = [type(part)(head, b"")]

        async def read(shared) -> list:
            return (await read_frames(_reader_with(_frames_bytes(forged)), StageRequest, LIMITS))[1]

        with pytest.raises(WireError, match="did not agree") as refused:
            asyncio.run(read(None))
        assert refused.value.code == ErrorCode.BAD_REQUEST

        class Link:
            reader = ArenaReader(arena.name, arena.token)

        async def read_linked(parts) -> list:
            reader = _reader_with(_frames_bytes(parts), Link())
            return (await read_frames(reader, StageRequest, LIMITS))[1]

        assert torch.equal(decode_tensors(asyncio.run(read_linked(forged)), LIMITS)[0], tensor)
        head.shared_offset += 10**6  # past the end of the arena
        with pytest.raises(WireError, match="shared memory"):
            asyncio.run(read_linked(forged))
        head.shared_offset, head.shared_length = TOKEN_BYTES, 2**40  # over the message limit: refused unread
        with pytest.raises(WireError) as too_large:
            asyncio.run(read_linked(forged))
        assert too_large.value.code == ErrorCode.TOO_LARGE
        Link.reader.close()
    finally:
        arena.close()


def test_an_arena_is_opened_only_by_its_name_and_token_and_a_truncated_one_reads_short():
    arena = Arena()
    try:
        offset, length = arena.put([memoryview(b"x" * 100_000)])
        for name, token in (
            ("../etc/passwd", arena.token),
            ("swarm-shm-1-" + "0" * 32, arena.token),  # no such arena
            (arena.name, b"\0" * TOKEN_BYTES),  # not the token it holds
            (arena.name, arena.token[:4]),
        ):
            with pytest.raises(SharedMemoryError):
                ArenaReader(name, token)
        reader = ArenaReader(arena.name, arena.token)
        assert reader.read(offset, length) == b"x" * 100_000
        os.truncate(arena.path, offset + 10)  # the sender shrinks its file mid-call: an error, never a crash
        with pytest.raises(SharedMemoryError, match="ends before"):
            reader.read(offset, length)
        with pytest.raises(SharedMemoryError):
            reader.read(0, 4)  # the token is not data
        reader.close()
    finally:
        arena.close()


def test_arenas_of_processes_that_died_are_removed_and_a_pool_keeps_a_bounded_number():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(SHM_DIR, f"swarm-shm-{int(dead.stdout)}-{'ab' * 16}")
    with open(stale, "wb") as file:
        file.write(b"left behind")
    mine = Arena()
    try:
        assert remove_stale_arenas() >= 1
        assert not os.path.exists(stale) and os.path.exists(mine.path)
    finally:
        mine.close()
    pool = ArenaPool()
    taken = [pool.take() for _ in range(20)]
    for arena in taken:
        pool.give(arena)
    kept = [arena for arena in taken if os.path.exists(arena.path)]
    assert 0 < len(kept) < len(taken)
    pool.close()
    assert not any(os.path.exists(arena.path) for arena in taken)
