"""A direct connection as a stream that reads large messages straight into their own buffer.

asyncio's StreamReader copies every byte it receives twice after the kernel: into its bytearray,
then out of it into the bytes that `readexactly` returns. On a 4 MiB tensor that is most of the
time a call spends on the CPU. `DirectStream` is the protocol of one connection and hands the
transport the buffer to receive into (`asyncio.BufferedProtocol`): while a reader waits for a large
read (a frame), the kernel writes the frame's bytes straight into the bytearray the read returns.
Small reads (handshakes, frame headers) go through a small buffer as before.

Once its handshake is done, a connection is sealed (`seal`, `swarm.net.frame_cipher`): every write goes out
encrypted and authenticated, and what arrives is opened before any reader sees it. Each sealed frame is
received into a buffer of its own and kept sealed until a read wants it, then opened into that read's buffer
where the read is large: sealing costs one pass of AES-GCM over the bytes each way and no copy more.

It offers what the swarm's handlers and call helpers use of a StreamReader and a StreamWriter
(`readexactly`, `read`, `write`, `drain`, `close`, `get_extra_info`), so one object serves as both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from swarm.net.frame_cipher import FrameSealer, FrameTampered, SealedReader, TrafficKeys

DIRECT_READ_BYTES = 64 * 1024  # reads at least this large go straight into their own buffer
SCRATCH_BYTES = 256 * 1024  # what the kernel may hand over at once outside such a read
MAX_BUFFERED = 2**20  # bytes received ahead of the reader before the transport stops reading


class DirectStream(asyncio.BufferedProtocol):
    """The reading and writing ends of one TCP connection of the direct plane."""

    def __init__(self, serve: Callable[[DirectStream], Awaitable[None]] | None = None) -> None:
        self._serve = serve  # on a server: run on the connection once it is made
        self.task: asyncio.Task | None = None
        self._transport: asyncio.Transport | None = None
        self._buffered = bytearray()  # received, not yet read
        self._scratch = bytearray(SCRATCH_BYTES)
        self._target: bytearray | None = None  # the buffer of a large read under way
        self._filled = 0
        self._into_target = False  # whether the transport was last handed the target
        self._eof = False
        self.received = 0  # bytes received so far
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # a read waiting for data
        self._paused_reading = False
        self._writable: asyncio.Future | None = None  # a drain waiting for the transport to take more
        self._closed: asyncio.Future | None = None
        # once sealed: the ciphers of both directions
        self._sealer: FrameSealer | None = None
        self._unsealer: SealedReader | None = None
        self._tampered: FrameTampered | None = None
        # what the handshake agreed on for shared memory (`swarm.net.shared_memory.SharedMemoryLink`), if any
        self.shared: Any = None

    # --- protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self._closed = loop.create_future()
        if self._serve is not None:
            self.task = loop.create_task(self._serve(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._unsealer is not None:  # sealed frames arrive in buffers of their own
            return self._unsealer.receive_buffer()
        # a full target may not have been taken by its reader yet: what comes after it is buffered
        self._into_target = self._target is not None and self._filled < len(self._target)
        return memoryview(self._target)[self._filled :] if self._into_target else memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._unsealer is not None:
            if self._tampered is not None:
                return
            try:
                self._unsealer.received(nbytes)
                self._deliver()
            except FrameTampered as e:
                self._fail(e)
            return
        if self._into_target:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._wake()
            return
        self._buffer(memoryview(self._scratch)[:nbytes])

    def _buffer(self, data: bytes | memoryview) -> None:
        """Keeps received bytes for the reader, pausing the transport once too many wait."""
        self._buffered += data
        if len(self._buffered) > MAX_BUFFERED and not self._paused_reading and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()
        self._wake()

    # --- sealing ----------------------------------------------------------------------------------

    def seal(self, keys: TrafficKeys) -> None:
        """From now on, writes go out sealed with `keys.send` and what arrives is opened with `keys.receive`.
        Called right after the handshake: anything already received past it is sealed too."""
        self._sealer, self._unsealer = FrameSealer(keys.send), SealedReader(keys.receive)
        early = bytes(self._buffered)
        self._buffered.clear()
        try:
            self._unsealer.feed(memoryview(early))
        except FrameTampered as e:
            self._fail(e)
        self._wake()

    @property
    def tampered(self) -> FrameTampered | None:
        """Why the connection was cut, if a sealed frame failed to open."""
        return self._tampered

    def _deliver(self) -> None:
        """Opens the sealed frames received whole straight into the large read waiting for them, if any, and
        wakes the reader when it has something; the rest wait, sealed, until a read wants them (opened
        then, into that read's buffer where it is large). FrameTampered if one fails to open."""
        target, unsealer = self._target, self._unsealer
        while target is not None and self._filled < len(target) and unsealer.pending:
            # the buffer is empty while a large read waits: what the read has no room for goes there
            self._filled += unsealer.open_next_into(memoryview(target)[self._filled :], self._buffered)
        waiting = unsealer.pending_bytes + len(self._buffered)
        if waiting > MAX_BUFFERED and not self._paused_reading and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()
        if (self._filled == len(target)) if target is not None else unsealer.pending:
            self._wake()  # only once there is something to read: most of what arrives is part of a frame

    def _unseal_next(self) -> bool:
        """Opens the next sealed frame received into the buffer; whether there was one. FrameTampered (the
        connection then cut) if it fails to open."""
        if self._unsealer is None or not self._unsealer.pending:
            return False
        try:
            self._buffered += self._unsealer.open_next()
        except FrameTampered as e:
            self._fail(e)
            raise
        return True

    def _fail(self, error: FrameTampered) -> None:
        """A sealed frame that does not open: the connection ends, and its readers and writers get `error`."""
        self._tampered = error
        if self._transport is not None:
            self._transport.abort()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # the other side may still read what this side writes

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if self.shared is not None:  # the call is over: its arena may serve the next one
            self.shared.close()
            self.shared = None
        if exc is not None and self._error is None:
            self._error = exc
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # the drain waiting on it raises
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        if self._tampered is not None:
            raise self._tampered
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        if self._paused_reading and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # --- reading ----------------------------------------------------------------------------------

    async def readexactly(self, n: int) -> bytes | bytearray:
        """Exactly `n` bytes (a bytearray for large reads); IncompleteReadError if the stream ends first.

        A large read allocates its `n` bytes at once: callers bound `n` first (the wire's frame limit)."""
        if n >= DIRECT_READ_BYTES and len(self._buffered) < n:
            return await self._read_into_own_buffer(n)
        while len(self._buffered) < n:
            if self._unseal_next():
                continue
            if self._tampered is not None:
                raise self._tampered
            if self._eof:
                partial = bytes(self._buffered)
                self._buffered.clear()
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait()
        data = bytes(memoryview(self._buffered)[:n])
        del self._buffered[:n]
        return data

    async def _read_into_own_buffer(self, n: int) -> bytearray:
        target = bytearray(n)
        have = len(self._buffered)
        target[:have] = self._buffered
        self._buffered.clear()
        self._target, self._filled = target, have
        try:
            if self._unsealer is not None:
                try:
                    self._deliver()  # the sealed frames that came before the read
                except FrameTampered as e:
                    self._fail(e)
                    raise
            while self._filled < n:
                if self._tampered is not None:
                    raise self._tampered
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(target[: self._filled]), n)
                await self._wait()
        finally:
            self._target = None
        return target

    async def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes (all until the end if n < 0) once any are there; b"" at the end of the stream."""
        if n < 0:
            while not self._eof:
                await self._wait()
            while self._unseal_next():
                pass
            n = len(self._buffered)
        else:
            while not self._buffered and not self._unseal_next() and not self._eof:
                await self._wait()
        if not self._buffered and self._tampered is not None:
            raise self._tampered
        data = bytes(memoryview(self._buffered)[:n])
        del self._buffered[:n]
        return data

    # --- writing ----------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queues `data` on the transport (dropped once the connection is lost: `drain` then raises)."""
        if self._transport is None or self._transport.is_closing():
            return
        if self._sealer is None:
            self._transport.write(data)
            return
        self._transport.writelines(self._sealer.seal(data))

    async def drain(self) -> None:
        """Waits until the transport takes more; ConnectionResetError (or the error it died of) once the
        connection is lost."""
        if self._writable is not None and not self._writable.done():
            await self._writable
        if self._tampered is not None:
            raise self._tampered
        if self._error is not None:
            raise self._error
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the connection is closed")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await self._closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default if self._transport is None else self._transport.get_extra_info(name, default)


async def open_direct_stream(host: str, port: int) -> DirectStream:
    """Connects to host:port."""
    _, stream = await asyncio.get_running_loop().create_connection(DirectStream, host, port)
    return stream


async def start_direct_server(
    serve: Callable[[DirectStream], Awaitable[None]], host: str, port: int
) -> asyncio.base_events.Server:
    """Listens on host:port; each connection runs `serve(stream)` in a task of its own (`stream.task`)."""
    return await asyncio.get_running_loop().create_server(lambda: DirectStream(serve), host, port)
