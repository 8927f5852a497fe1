"""The direct plane sealed: past the handshake, nothing on the socket shows a tensor's bytes (beside shared
memory too), and a frame that a man in the middle alters, replays or carries over from another connection
ends that call with a clear error, never reaches a handler, and leaves the server serving."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.compression import get_codec
from swarm.net.direct_plane import DirectPlane, DirectServer
from swarm.net.frame_cipher import LENGTH_BYTES, FrameTampered
from swarm.net.identity import load_identity
from swarm.net.shared_memory import ArenaPool, shared_memory_available
from swarm.net.transport import exchange
from swarm.net.wire import (
    HEADER_BYTES,
    WireError,
    WireLimits,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    wait_for_hang_up,
    write_frames,
)
from swarm.proto import DirectChallenge, StageReply, StageRequest

ECHO = "/swarm/test/sealed-echo"
LIMITS = WireLimits(frame_timeout=20)
MARKER = b"PLAINTEXT-MARKER"  # 16 bytes a tensor repeats: found on the wire, the wire showed the tensor


def _marked(nbytes: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(MARKER * (nbytes // len(MARKER))), dtype=torch.uint8)


class NoLibp2p:
    """Stands in for the process's P2P: these tests call directly or not at all."""

    async def call_binary_stream_handler(self, *_):
        raise ConnectionError("libp2p is not part of this test")


class EchoServer:
    """A direct server whose one protocol answers with the tensors it was sent; counts the requests it read."""

    def __init__(self, cipher: str | None = None, arenas: ArenaPool | None = None) -> None:
        self.identity = load_identity(None)
        options = {} if cipher is None else {"cipher": cipher}
        self.server = DirectServer(self.identity, arenas=arenas, **options)
        self.server.handlers[ECHO] = self._echo
        self.served = 0

    async def _echo(self, _info, reader, writer) -> None:
        _, parts = await read_frames(reader, StageRequest, LIMITS)
        self.served += 1
        tensors = decode_tensors(parts, LIMITS)
        codec = get_codec("none")
        await write_frames(writer, pack_frames(StageReply(), [p for t in tensors for p in encode_tensor(t, codec)]))
        await wait_for_hang_up(reader)
        writer.close()

    async def start(self) -> tuple[str, int]:
        return "127.0.0.1", await self.server.start("127.0.0.1", 0)


class Wiretap:
    """A man in the middle: forwards a caller's connections to a server, records what crosses each way, and past
    the handshake may flip one byte, send the first sealed frame twice, or send what an earlier connection's
    caller sent instead of what this one's sends."""

    def __init__(self, server: tuple[str, int]) -> None:
        self.server = server
        self.to_server, self.to_caller = bytearray(), bytearray()
        self.sealed_to_server: list[bytearray] = []  # per connection, what its caller sent past the handshake
        self.flip: tuple[str, int] | None = None  # (direction, offset past the handshake)
        self.replay_first_frame = False
        self.replace_with: bytes | None = None

    async def start(self) -> tuple[str, int]:
        self._listener = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return "127.0.0.1", self._listener.sockets[0].getsockname()[1]

    async def _connection(self, caller_reader, caller_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.server)
        await asyncio.gather(
            self._pump("to_server", caller_reader, server_writer), self._pump("to_caller", server_reader, caller_writer)
        )

    async def _pump(self, direction: str, reader, writer) -> None:
        record = self.to_server if direction == "to_server" else self.to_caller
        try:
            # the handshake, in clear: hello then proof from the caller; the challenge, and in a full handshake
            # the server's proof, from the server
            first = await self._frame(reader, writer, record)
            if direction == "to_server" or not DirectChallenge.FromString(first).proof:
                await self._frame(reader, writer, record)
            sealed = bytearray()
            if direction == "to_server":
                self.sealed_to_server.append(sealed)
                if self.replace_with is not None:
                    writer.write(self.replace_with)
            while chunk := await reader.read(2**16):
                chunk = bytearray(chunk)
                if self.flip is not None and self.flip[0] == direction:
                    offset = self.flip[1] - len(sealed)
                    if 0 <= offset < len(chunk):
                        chunk[offset] ^= 0x01
                start = len(sealed)
                sealed += chunk
                record += chunk
                if direction == "to_server" and self.replace_with is not None:
                    continue
                end = LENGTH_BYTES + int.from_bytes(sealed[:LENGTH_BYTES], "big")
                if direction == "to_server" and self.replay_first_frame and len(sealed) >= LENGTH_BYTES:
                    if start < end <= len(sealed):  # the whole first frame once more, right after itself
                        chunk = chunk[: end - start] + sealed[:end] + chunk[end - start :]
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _frame(reader, writer, record: bytearray) -> bytes:
        head = await reader.readexactly(HEADER_BYTES)
        body = await reader.readexactly(int.from_bytes(head, "big"))
        record += head + body
        writer.write(head + body)
        await writer.drain()
        return body


async def _caller(
    peer_id: str, address: tuple[str, int], cipher: str | None = None, shared_memory: bool = False
) -> DirectPlane:
    options = {} if cipher is None else {"cipher": cipher}
    plane = DirectPlane(NoLibp2p(), load_identity(None), shared_memory=shared_memory, **options)
    plane.addresses[peer_id] = address
    return plane


async def _echo(plane: DirectPlane, peer_id: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    parts = [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
    frames = pack_frames(StageRequest(), parts)
    _, back = await exchange(plane, PeerID.from_base58(peer_id), ECHO, frames, StageReply, LIMITS)
    return decode_tensors(back, LIMITS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [False, True])
def test_the_socket_carries_no_tensor_bytes_sealed_and_every_byte_of_them_in_clear(shared: bool):
    # one in 512 KiB parts (with shared memory: through the file), one in the frame with the header
    tensors = [_marked(2**20), _marked(64)]
    if shared and not shared_memory_available():
        pytest.skip("needs a writable /dev/shm")

    async def main():
        for cipher, shows in ((None, False), ("", True)):  # sealed; and the plain baseline, where the test must see it
            echo = EchoServer(cipher, ArenaPool() if shared else None)
            tap = Wiretap(await echo.start())
            caller = await _caller(echo.identity.peer_id, await tap.start(), cipher, shared)
            for _ in range(2):  # a full handshake, then a resumed one
                back = await _echo(caller, echo.identity.peer_id, tensors)
                assert all(torch.equal(a, b) for a, b in zip(tensors, back))
            assert caller.calls["direct"] == 2 and echo.served == 2
            assert caller.calls["shared_memory"] == (2 if shared else 0)
            for wire in (tap.to_server, tap.to_caller):
                assert (MARKER in wire) == shows
                assert (bytes(tensors[1].numpy()[:32]) in wire) == shows
            await echo.server.close()
            for plane in (caller, echo):
                arenas = plane.arenas if isinstance(plane, DirectPlane) else plane.server.arenas
                if arenas is not None:
                    arenas.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "direction, offset",
    [
        ("to_server", 0),  # the first sealed frame's length
        ("to_server", 40),  # the request's header
        ("to_server", 300_000),  # inside a tensor's part
        ("to_caller", 40),  # the reply's header
        ("to_caller", 600_000),
    ],
)
def test_a_man_in_the_middle_flipping_one_byte_after_the_handshake_gets_the_call_refused(direction, offset):
    tensors = [torch.randn(2**18)]  # 1 MiB

    async def main():
        echo = EchoServer()
        tap = Wiretap(await echo.start())
        caller = await _caller(echo.identity.peer_id, await tap.start())
        assert torch.equal((await _echo(caller, echo.identity.peer_id, tensors))[0], tensors[0])
        tap.flip = (direction, offset)
        with pytest.raises((WireError, ConnectionError)) as refused:
            await _echo(caller, echo.identity.peer_id, tensors)
        if direction == "to_server":  # the server cut the call before its handler saw a request
            assert echo.served == 1 and echo.server.refused["tampered"] == 1
        else:  # the caller found the reply altered
            assert isinstance(refused.value, FrameTampered) and "fails authentication" in str(refused.value)
        tap.flip = None
        assert torch.equal((await _echo(caller, echo.identity.peer_id, tensors))[0], tensors[0])  # and it goes on
        await echo.server.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_frame_replayed_in_its_connection_or_in_another_is_refused():
    tensors = [torch.randn(2**16)]

    async def main():
        echo = EchoServer()
        tap = Wiretap(await echo.start())
        caller = await _caller(echo.identity.peer_id, await tap.start())
        await _echo(caller, echo.identity.peer_id, tensors)
        await _echo(caller, echo.identity.peer_id, tensors)  # resumed: the connection the replays copy
        recorded = bytes(tap.sealed_to_server[-1])
        tap.replay_first_frame = True
        with pytest.raises((WireError, ConnectionError)):
            await _echo(caller, echo.identity.peer_id, tensors)
        assert echo.served == 2 and echo.server.refused["tampered"] == 1
        # a whole request recorded on one connection, sent on another of the same session: other keys
        tap.replay_first_frame, tap.replace_with = False, recorded
        with pytest.raises((WireError, ConnectionError, asyncio.TimeoutError)):
            await asyncio.wait_for(_echo(caller, echo.identity.peer_id, tensors), 10)
        assert echo.served == 2 and echo.server.refused["tampered"] == 2
        tap.replace_with = None
        assert torch.equal((await _echo(caller, echo.identity.peer_id, tensors))[0], tensors[0])
        await echo.server.close()

    asyncio.run(main())
