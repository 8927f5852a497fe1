"""The direct plane's stream over real loopback TCP: large reads land in their own buffer, small ones are
buffered, a sender that runs ahead is paused and resumed, and a stream that ends mid-read says so; sealed,
the same bytes cross unchanged and in order, however the reads and the sealed frames fall."""

from __future__ import annotations

import asyncio
import os

import pytest

from swarm.net.direct_stream import (
    DIRECT_READ_BYTES,
    MAX_BUFFERED,
    DirectStream,
    open_direct_stream,
    start_direct_server,
)
from swarm.net.frame_cipher import MAX_SEALED_BYTES, TrafficKeys
from swarm.process.event_loop import run


async def _pair(serve, sealed: bool = False) -> tuple[DirectStream, asyncio.AbstractServer]:
    """A client stream connected to a server that runs `serve` on its end; both ends sealed if `sealed` (the
    keys a handshake would have given them)."""
    to_server, to_client = os.urandom(32), os.urandom(32)

    async def sealed_serve(stream: DirectStream) -> None:
        stream.seal(TrafficKeys(send=to_client, receive=to_server))
        await serve(stream)

    server = await start_direct_server(sealed_serve if sealed else serve, "127.0.0.1", 0)
    client = await open_direct_stream("127.0.0.1", server.sockets[0].getsockname()[1])
    if sealed:
        client.seal(TrafficKeys(send=to_server, receive=to_client))
    return client, server


async def _echo_frames(stream: DirectStream) -> None:
    """Answers every (8-byte length, payload) message with the same message, until the caller hangs up."""
    try:
        while True:
            size = int.from_bytes(await stream.readexactly(8), "big")
            data = await stream.readexactly(size)
            stream.write(size.to_bytes(8, "big"))
            stream.write(data)
            await stream.drain()
    except asyncio.IncompleteReadError:
        stream.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sealed", [False, True])
def test_messages_of_every_size_cross_unchanged_around_the_direct_read_threshold(sealed: bool):
    sizes = [0, 1, 7, DIRECT_READ_BYTES - 1, DIRECT_READ_BYTES, DIRECT_READ_BYTES + 1, 3 * 2**20 + 5]
    sizes += [MAX_SEALED_BYTES - 1, MAX_SEALED_BYTES, MAX_SEALED_BYTES + 1, 5, 2 * MAX_SEALED_BYTES + 3]

    async def main() -> None:
        client, server = await _pair(_echo_frames, sealed)
        try:
            # sent back to back, so that a large read often starts with part of it buffered already
            payloads = [os.urandom(size) for size in sizes]

            async def send() -> None:
                for payload in payloads:
                    client.write(len(payload).to_bytes(8, "big"))
                    client.write(payload)
                # and in one write: sealed, one frame then spans the end of a read and the start of the next
                client.write(b"".join(len(payload).to_bytes(8, "big") + payload for payload in payloads))
                await client.drain()

            sending = asyncio.ensure_future(send())  # read meanwhile: the echoes outgrow the socket buffers
            for payload in payloads + payloads:
                size = int.from_bytes(await client.readexactly(8), "big")
                assert size == len(payload)
                assert bytes(await client.readexactly(size)) == payload
            await sending
        finally:
            client.close()
            server.close()

    run(main())


def _kernel_buffer_limit() -> int:
    """The most a loopback connection's socket buffers may hold, both ends together (the kernel's autotuning
    limits), or 8 MiB where unreadable."""
    try:
        limits = [int(open(f"/proc/sys/net/ipv4/tcp_{kind}").read().split()[2]) for kind in ("rmem", "wmem")]
    except (OSError, ValueError, IndexError):
        return 8 * MAX_BUFFERED
    return sum(limits)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sealed", [False, True])
def test_a_reader_that_falls_behind_pauses_the_sender_and_loses_nothing(sealed: bool):
    # more than the kernel's buffers and the stream's together can take, however far autotuning grows them
    total = _kernel_buffer_limit() + 8 * MAX_BUFFERED

    async def main() -> None:
        sender_waited, received = asyncio.Event(), asyncio.get_running_loop().create_future()

        async def slow_reader(stream: DirectStream) -> None:
            # nothing is read until the sender had to wait: the stream stopped taking data from the socket
            await sender_waited.wait()
            chunks = []
            while chunk := await stream.read(2**16):
                chunks.append(chunk)
            received.set_result(b"".join(chunks))
            stream.close()

        client, server = await _pair(slow_reader, sealed)
        payload = os.urandom(total)
        try:
            client.write(payload)
            drained = asyncio.ensure_future(client.drain())
            done, _ = await asyncio.wait([drained], timeout=1.0)
            assert not done, "the sender was never held back: the reader buffered everything"
            sender_waited.set()
            await asyncio.wait_for(drained, 30)
            client.close()
            assert await asyncio.wait_for(received, 30) == payload
        finally:
            server.close()

    run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [100, 4 * DIRECT_READ_BYTES])
def test_a_stream_that_ends_mid_read_raises_with_what_came(size: int):
    async def main() -> None:
        outcome = asyncio.get_running_loop().create_future()

        async def reader(stream: DirectStream) -> None:
            try:
                await stream.readexactly(size)
            except asyncio.IncompleteReadError as e:
                outcome.set_result(e)
            else:
                outcome.set_result(None)

        client, server = await _pair(reader)
        try:
            client.write(b"x" * (size // 2))
            await client.drain()
            client.close()
            error = await asyncio.wait_for(outcome, 30)
            assert isinstance(error, asyncio.IncompleteReadError)
            assert error.expected == size and error.partial == b"x" * (size // 2)
        finally:
            server.close()

    run(main())


@pytest.mark.timeout(60)
def test_writing_to_a_peer_that_hung_up_fails_on_drain():
    async def hang_up(stream: DirectStream) -> None:
        stream.close()

    async def main() -> None:
        client, server = await _pair(hang_up)
        try:
            assert await asyncio.wait_for(client.read(10), 30) == b""
            with pytest.raises(ConnectionError):
                # the kernel may take the first writes; the peer's reset then ends the connection
                for _ in range(1000):
                    client.write(b"y" * 2**16)
                    await asyncio.wait_for(client.drain(), 30)
                    await asyncio.sleep(0)
        finally:
            client.close()
            server.close()

    run(main())
