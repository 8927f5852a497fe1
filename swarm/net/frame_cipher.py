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

    def seal(self, data: bytes | bytearray | memoryview) -> list[bytearray]:
        """`data` as sealed frames, each a buffer of its own ready for the socket (one frame unless `data` is
        longer than MAX_SEALED_BYTES; none if it is empty)."""
        view = memoryview(data).cast("B")
        frames = []
        for start in range(0, len(view), MAX_SEALED_BYTES):
            piece = view[start : start + MAX_SEALED_BYTES]
            length = (len(piece) + TAG_BYTES).to_bytes(LENGTH_BYTES, "big")
            frame = bytearray(LENGTH_BYTES + len(piece) + TAG_BYTES)
            frame[:LENGTH_BYTES] = length
            if self._sent >= MAX_FRAMES:
                raise FrameTampered("too many frames for one key")
            self._aead.encrypt_into(_nonce(self._sent), piece, length, memoryview(frame)[LENGTH_BYTES:])
            self._sent += 1
            frames.append(frame)
        return frames


class FrameOpener:
    """The receiving side: opens sealed frames in the order they were sealed, or raises FrameTampered."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._received = 0

    @staticmethod
    def sealed_length(head: bytes | bytearray) -> int:
        """The length of the sealed frame after its `head` (LENGTH_BYTES); FrameTampered if out of bounds."""
        length = int.from_bytes(head, "big")
        if not TAG_BYTES <= length <= MAX_SEALED_BYTES + TAG_BYTES:
            raise FrameTampered(f"a sealed frame of {length} bytes")
        return length

    def open_into(self, head: bytes, sealed: bytearray, out: memoryview) -> None:
        """Opens `sealed` (ciphertext and tag) into `out`, which has exactly the room of its plaintext. What
        `out` holds is only meaningful if this returns."""
        try:
            self._aead.decrypt_into(_nonce(self._received), sealed, head, out)
        except InvalidTag:
            raise FrameTampered(f"sealed frame {self._received} fails authentication (altered or replayed)") from None
        self._received += 1

    def open(self, head: bytes, sealed: bytearray) -> bytes:
        """The plaintext of `sealed`; FrameTampered if it fails authentication."""
        try:
            plain = self._aead.decrypt(_nonce(self._received), sealed, head)
        except InvalidTag:
            raise FrameTampered(f"sealed frame {self._received} fails authentication (altered or replayed)") from None
        self._received += 1
        return plain
