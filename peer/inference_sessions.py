"""The generation sessions a peer keeps: one KV cache per (caller, session), bounded and expiring.

A caller names its sessions; they are kept per caller, so no one reaches another's. What one identity can
hold is bounded (sessions per caller), what all of them hold together too (bytes, the least recently used
session given up first), and a session idle for `idle_seconds` is dropped. A session asked for at a position
its cache does not hold (dropped, expired, or never opened here: its peer died and the caller moved) is
answered SESSION_LOST, and the caller replays the prefix.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from swarm.models.kv_cache import StageCache
from swarm.proto import ErrorCode

DEFAULT_IDLE_SECONDS = 120.0
DEFAULT_PER_CALLER = 8


class SessionError(Exception):
    """A session call this peer cannot serve; `code` is the wire error to answer with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Session:
    cache: StageCache
    used_at: float
    busy: bool = False  # a call of it is under way: a second one at once would interleave positions


class InferenceSessions:
    """The KV caches of one stage's generation sessions (see the module's docstring)."""

    def __init__(
        self,
        num_blocks: int,
        seq_len: int,
        max_bytes: int,
        per_caller: int = DEFAULT_PER_CALLER,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
    ) -> None:
        self.num_blocks = num_blocks
        self.seq_len = seq_len
        self.max_bytes = max_bytes
        self.per_caller = per_caller
        self.idle_seconds = idle_seconds
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()  # least recently used first
        self.dropped = 0  # sessions dropped to stay within the bytes, or idle

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def nbytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values())

    def take(self, caller: str, name: str, position: int, positions: int) -> StageCache:
        """The cache a call extends by `positions` after `position`, marked busy until `release`; SessionError
        if the session is not held at that position, is busy, or the call would not fit."""
        self._expire(time.monotonic())
        if position + positions > self.seq_len:
            raise SessionError(
                ErrorCode.BAD_REQUEST,
                f"session {name!r}: positions {position}..{position + positions} exceed the model's {self.seq_len}",
            )
        key = (caller, name)
        session = self._sessions.get(key)
        if session is not None and session.busy:
            raise SessionError(ErrorCode.BAD_REQUEST, f"session {name!r} has a call under way; send one at a time")
        if position == 0:
            if session is None and sum(k[0] == caller for k in self._sessions) >= self.per_caller:
                raise SessionError(
                    ErrorCode.TOO_LARGE,
                    f"this peer holds {self.per_caller} sessions of yours, its limit per caller: end one first",
                )
            session = self._sessions[key] = _Session(StageCache(self.num_blocks), time.monotonic())
        elif session is None or session.cache.length != position:
            held = "not held here" if session is None else f"at position {session.cache.length}"
            raise SessionError(
                ErrorCode.SESSION_LOST,
                f"session {name!r} is {held}, not at position {position}: replay its prefix from position 0",
            )
        self._sessions.move_to_end(key)
        session.busy = True
        return session.cache

    def release(self, caller: str, name: str, failed: bool = False, end: bool = False) -> None:
        """The call of a session is over: kept for the next one, or dropped (`end`, or a call that `failed`
        midway, whose cache holds part of its positions); then the sessions shed bytes over the bound."""
        key = (caller, name)
        session = self._sessions.get(key)
        if session is None:
            return
        session.busy = False
        session.used_at = time.monotonic()
        if failed or end:
            del self._sessions[key]
        self._shed()

    def end(self, caller: str, name: str) -> bool:
        """Drops a session (unless a call of it is under way); whether it was held."""
        session = self._sessions.get((caller, name))
        if session is None or session.busy:
            return False
        del self._sessions[(caller, name)]
        return True

    def _expire(self, now: float) -> None:
        for key, session in list(self._sessions.items()):
            if not session.busy and now - session.used_at > self.idle_seconds:
                del self._sessions[key]
                self.dropped += 1

    def _shed(self) -> None:
        """Drops the least recently used idle sessions while all of them hold more than `max_bytes`."""
        total = self.nbytes
        for key, session in list(self._sessions.items()):
            if total <= self.max_bytes:
                return
            if not session.busy:
                total -= session.cache.nbytes
                del self._sessions[key]
                self.dropped += 1
