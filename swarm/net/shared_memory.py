"""Shared memory between two processes on one host: tensors pass through a file in /dev/shm, not a socket.

On one machine (a lab box with several GPUs, a test swarm) a direct-plane connection still moves every
tensor through the kernel's TCP stack: a copy into the socket, loopback processing, a copy out, in
512 KiB frames. Over shared memory the sender writes a tensor's bytes once into a file of its own in
/dev/shm and sends only where they lie; the receiver reads them once into its own buffer.

A sender's file is an `Arena`: created by the sender alone (mode 0600, a random name), written with
`pwrite`, reused from a pool across calls and removed at exit. The direct plane's handshake agrees on it
(`swarm.net.direct_handshake`): each side names its arena and a random token written at its start, and
the other side uses it only if it can open that file and finds that token there, which proves both run
on one host. A receiver reads a peer's arena through an `ArenaReader`, with `pread` into a buffer of its
own: never a mapping, so a sender that truncates or rewrites its file mid-read gets the reader a short
read or wrong bytes (refused, or caught by the same checks as bytes from a socket), never a crash, and
what the reader checks cannot change after the check.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import secrets
import stat
import threading

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME = re.compile(r"swarm-shm-([0-9]{1,10})-([0-9a-f]{32})")
TOKEN_BYTES = 16
SHARED_MIN_BYTES = 32 * 1024  # smaller parts stay in the frame: a pread costs more than it saves
MAX_IDLE_ARENAS = 16  # arenas a process keeps for later calls; more are removed
IDLE_TRIM_BYTES = 256 * 2**20  # an idle arena holding more than this is emptied before it is kept


class SharedMemoryError(Exception):
    """A shared-memory file that cannot be used: missing, not the sender's, or read short."""


def shared_memory_available() -> bool:
    """Whether this host has a /dev/shm this process can write to."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


class Arena:
    """A sender's file in /dev/shm: tensors are appended to it during one call, then it is reused."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.name = f"swarm-shm-{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(SHM_DIR, self.name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self.path, flags, 0o600)
        os.pwrite(self._fd, self.token, 0)
        self.end = TOKEN_BYTES

    def put(self, buffers: list[memoryview]) -> tuple[int, int]:
        """Appends `buffers` back to back; returns (offset, length) of what was written."""
        offset = position = self.end
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while view:
                written = os.pwrite(self._fd, view, position)
                view, position = view[written:], position + written
        self.end = position
        return offset, position - offset

    def reset(self) -> None:
        """Makes the arena empty for its next call (what was written stays allocated unless trimmed)."""
        if self.end > IDLE_TRIM_BYTES:
            os.ftruncate(self._fd, TOKEN_BYTES)
        self.end = TOKEN_BYTES

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class ArenaPool:
    """This process's arenas: one lent to each call that sends over shared memory, kept for later calls."""

    def __init__(self) -> None:
        self._idle: list[Arena] = []
        self._all: set[Arena] = set()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def take(self) -> Arena:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        arena = Arena()
        with self._lock:
            self._all.add(arena)
        return arena

    def give(self, arena: Arena) -> None:
        with self._lock:
            if arena not in self._all:
                return
            if len(self._idle) < MAX_IDLE_ARENAS:
                arena.reset()
                self._idle.append(arena)
                return
            self._all.discard(arena)
        arena.close()

    def close(self) -> None:
        """Removes every arena of this process (at exit)."""
        with self._lock:
            arenas, self._all, self._idle = list(self._all), set(), []
        for arena in arenas:
            arena.close()


class ArenaReader:
    """The receiving end: another process's arena, opened read-only after checking its name and token."""

    def __init__(self, name: str, token: bytes) -> None:
        if not NAME.fullmatch(name) or len(token) != TOKEN_BYTES:
            raise SharedMemoryError(f"not a shared-memory arena name: {name[:80]!r}")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(os.path.join(SHM_DIR, name), flags)
        except OSError as e:
            raise SharedMemoryError(f"cannot open {name}: {e.strerror}") from None
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise SharedMemoryError(f"{name} is not a file of this user")
            if os.pread(self._fd, TOKEN_BYTES, 0) != token:
                raise SharedMemoryError(f"{name} does not hold the token its sender named")
        except BaseException:
            os.close(self._fd)
            raise
        self.name = name

    def read(self, offset: int, length: int) -> bytearray:
        """`length` bytes at `offset`, copied into a new buffer; SharedMemoryError if the file holds fewer."""
        if offset < TOKEN_BYTES or length < 0:
            raise SharedMemoryError(f"no data at offset {offset} of {self.name}")
        buffer = bytearray(length)
        view, position = memoryview(buffer), offset
        while view:
            got = os.preadv(self._fd, [view], position)
            if got <= 0:
                raise SharedMemoryError(f"{self.name} ends before offset {offset} + {length}")
            view, position = view[got:], position + got
        return buffer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def remove_stale_arenas() -> int:
    """Removes the arenas of processes of this user that died without removing theirs; returns how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM_DIR):
            match = NAME.fullmatch(entry.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(match.group(1))):
                    continue
                os.unlink(entry.path)
                removed += 1
    if removed:
        logger.info(f"Removed {removed} shared-memory file(s) left in {SHM_DIR} by processes that died")
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedMemoryLink:
    """What one connection's handshake agreed on: the arena this side sends through, if the other side could
    read it, and the other side's arena this side reads from, if it could open it."""

    def __init__(self, pool: ArenaPool) -> None:
        self.pool = pool
        self.own: Arena | None = None
        self.writes = False  # the other side can read `own`: large parts go through it
        self.reader: ArenaReader | None = None

    def offer(self) -> tuple[str, bytes]:
        """This side's arena for the connection: (name, token) to tell the other side."""
        if self.own is None:
            self.own = self.pool.take()
        return self.own.name, self.own.token

    def accept(self, name: str, token: bytes) -> bool:
        """Opens the other side's arena; False (and nothing open) where it is not on this host."""
        if not name:
            return False
        try:
            self.reader = ArenaReader(name, token)
        except SharedMemoryError as e:
            logger.debug(f"Not using shared memory with a caller: {e}")
            return False
        return True

    @property
    def active(self) -> bool:
        return self.writes or self.reader is not None

    def close(self) -> None:
        """Ends the connection's use: the arena goes back to the pool, the other side's is closed."""
        if self.own is not None:
            self.pool.give(self.own)
            self.own = None
        self.writes = False
        if self.reader is not None:
            self.reader.close()
            self.reader = None
