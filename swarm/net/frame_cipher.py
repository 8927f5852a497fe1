"""Sealed frames: the direct plane's bytes after its handshake, encrypted and authenticated with AES-256-GCM.

Once both sides of a direct connection have proved their keys (`swarm.net.direct_handshake`), every byte
either side writes goes out in sealed frames:

    4 bytes  big-endian length of what follows
    n bytes  the written bytes, encrypted (AES-256-GCM, the 4 length bytes as associated data)
    16 bytes the GCM tag

Each direction has a key of its own, derived from the handshake's secret and this connection's transcript
(both sides' random nonces in it): a resumed session gets fresh keys on every connection. The nonce of a
sealed frame is its number in its direction (0, 1, 2, ...), never sent: a frame altered, dropped, replayed
from this or another connection, or put out of order fails its tag, and the connection ends with
`FrameTampered` (a `WireError`, so a call that meets one fails with a clear error, as on a malformed frame).

AES-GCM runs at several GB/s per core where the CPU has AES instructions (every x86 and ARM server CPU of
the last decade); `scripts/bench_transport.py` measures it against the plain socket and against TLS.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.net.wire import WireError
from swarm.proto import ErrorCode

CIPHER = "aes-256-gcm"  # what a handshake names; "" (no sealing) only where both ends were built without it
KEY_BYTES = 32
LENGTH_BYTES = 4
TAG_BYTES = 16
MAX_SEALED_BYTES = 2**20  # bytes of one write per sealed frame: a longer write is cut into several
MAX_FRAMES = 2**64  # sealed frames per direction and connection before the nonces would repeat
POOLED_BYTES = 64 * 1024  # a frame at least this large is received into a pooled buffer, reused once opened
MAX_POOLED = 8  # buffers the pool keeps, of MAX_SEALED_BYTES + TAG_BYTES each

# buffers for large sealed frames as they arrive: a frame is done with once opened, and a fresh buffer of its
# size would cost zeroing half a megabyte per frame
_pool: list[bytearray] = []


def _frame_buffer(length: int) -> bytearray | memoryview:
    if length < POOLED_BYTES:
        return bytearray(length)
    try:
        buffer = _pool.pop()
    except IndexError:
        buffer = bytearray(MAX_SEALED_BYTES + TAG_BYTES)
    return memoryview(buffer)[:length]


def _reuse(frame: bytearray | memoryview) -> None:
    if isinstance(frame, memoryview):
        buffer = frame.obj
        try:
            frame.release()
        except BufferError:  # a view of it still held elsewhere: it is not the pool's to lend again
            return
        if len(_pool) < MAX_POOLED:
            _pool.append(buffer)


class FrameTampered(WireError):
    """A sealed frame that does not open: altered, dropped, replayed or reordered on the way, or sealed with
    another key. The connection is closed; the call on it fails with this error."""

    def __init__(self, what: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, f"direct connection: {what}; connection closed")


@dataclass(frozen=True)
class TrafficKeys:
    """The two keys of one connection, seen from one side: the one it seals with and the one it opens with."""

    send: bytes
    receive: bytes


def traffic_keys(secret: bytes, transcript: bytes, caller: bool) -> TrafficKeys:
    """The keys of one connection: from the handshake's `secret` (the session key) and this connection's
    `transcript` (a digest covering both sides' nonces), one per direction."""
    derived = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=None, info=b"swarm-direct/frames" + transcript)
    keys = derived.derive(secret)
    to_server, to_caller = keys[:KEY_BYTES], keys[KEY_BYTES:]
    return TrafficKeys(to_server, to_caller) if caller else TrafficKeys(to_caller, to_server)


def _nonce(number: int) -> bytes:
    return bytes(4) + number.to_bytes(8, "big")


class FrameSealer:
    """The sending side: seals each write into frames, numbered in order."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._sent = 0

    def seal(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """`data` as sealed frames, for the socket in this order: each frame's length, then its ciphertext and
        tag (one frame unless `data` is longer than MAX_SEALED_BYTES; none if it is empty)."""
        view = memoryview(data).cast("B")
        pieces = []
        for start in range(0, len(view), MAX_SEALED_BYTES):
            if self._sent >= MAX_FRAMES:
                raise FrameTampered("too many frames for one key")
            piece = view[start : start + MAX_SEALED_BYTES]
            length = (len(piece) + TAG_BYTES).to_bytes(LENGTH_BYTES, "big")
            pieces += [length, self._aead.encrypt(_nonce(self._sent), piece, length)]
            self._sent += 1
        return pieces


class SealedReader:
    """The receiving side: sorts the bytes that arrive into sealed frames, and opens them in order when the
    reader wants them, or straight into the buffer a reader waits to fill.

    Each frame's length is received alone, then the frame into a buffer of its own (`receive_buffer`,
    `received`): nothing is read ahead into a scratch buffer to be copied out again."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._opened = 0
        self._head = bytearray(LENGTH_BYTES)  # the length of the next frame, as it comes in
        self._head_filled = 0
        self._frame: bytearray | memoryview | None = None  # that frame, once its length is known
        self._filled = 0
        self._pending: deque[tuple[bytes, bytearray | memoryview]] = deque()  # received whole, not yet opened
        self.pending_bytes = 0  # their plaintext

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def receive_buffer(self) -> memoryview:
        """Where the next bytes should arrive: the rest of the next frame's length, or of the frame."""
        if self._frame is None:
            return memoryview(self._head)[self._head_filled :]
        return memoryview(self._frame)[self._filled :]

    def received(self, nbytes: int) -> None:
        """`nbytes` arrived in the buffer `receive_buffer` gave; FrameTampered if a length is out of bounds."""
        if self._frame is not None:
            self._filled += nbytes
            if self._filled == len(self._frame):
                self._complete()
            return
        self._head_filled += nbytes
        if self._head_filled == LENGTH_BYTES:
            length = int.from_bytes(self._head, "big")
            if not TAG_BYTES <= length <= MAX_SEALED_BYTES + TAG_BYTES:
                raise FrameTampered(f"a sealed frame of {length} bytes")
            self._frame, self._filled = _frame_buffer(length), 0

    def feed(self, data: memoryview) -> None:
        """Bytes that arrived before sealing began (read ahead with the handshake's last message)."""
        while data:
            view = self.receive_buffer()
            take = min(len(view), len(data))
            view[:take] = data[:take]
            data = data[take:]
            self.received(take)

    def _complete(self) -> None:
        frame = self._frame
        self._pending.append((bytes(self._head), frame))
        self.pending_bytes += len(frame) - TAG_BYTES
        self._head_filled, self._frame = 0, None

    def open_next(self) -> bytes:
        """The plaintext of the next frame received; FrameTampered if it fails authentication."""
        head, frame = self._pending.popleft()
        self.pending_bytes -= len(frame) - TAG_BYTES
        try:
            plain = self._aead.decrypt(_nonce(self._opened), frame, head)
        except InvalidTag:
            raise self._tampered() from None
        self._opened += 1
        _reuse(frame)
        return plain

    def open_next_into(self, out: memoryview, rest: bytearray) -> int:
        """Opens the next frame received into `out`, and what of it `out` has no room for onto `rest`; returns
        how many bytes went into `out`. FrameTampered if it fails authentication (then `out` means nothing)."""
        head, frame = self._pending[0]
        size = len(frame) - TAG_BYTES
        if size > len(out):
            plain = self.open_next()
            out[:] = plain[: len(out)]
            rest += memoryview(plain)[len(out) :]
            return len(out)
        self._pending.popleft()
        self.pending_bytes -= size
        try:
            self._aead.decrypt_into(_nonce(self._opened), frame, head, out[:size])
        except InvalidTag:
            raise self._tampered() from None
        self._opened += 1
        _reuse(frame)
        return size

    def _tampered(self) -> FrameTampered:
        self._pending.clear()
        self.pending_bytes = 0
        return FrameTampered(f"sealed frame {self._opened} fails authentication (altered, replayed or out of order)")
