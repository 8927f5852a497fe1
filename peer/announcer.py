"""A peer's announcements: every store of its record, renewals included, from one thread of its own.

A record lapses when it is not renewed within its TTL, and then the peer vanishes from everyone's
view although it is alive: trainers stop routing to it and the balance rule plans without it (a
stage can look empty). Renewals must therefore never wait on anything else the peer does. They do
not run on the event loop (a busy loop, or a DHT read of tens of seconds awaited before the next
renewal, delayed them past the TTL), nor in the shared executor (where slow reads queue ahead of
them), but on a thread that does nothing else.

One thread also keeps stores in order: a record is built at the moment it is stored, so a renewal
that was due just before a change of state can never store the old state after the new one (a
LEAVING peer announced as SERVING again until its record expires).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from swarm.records.stage_records import StageRecord

logger = logging.getLogger(__name__)


class Announcer:
    """Stores `make_record()` every `period` seconds, and at once whenever asked, from its own thread.

    `make_record` may return None: nothing is stored that time.
    """

    def __init__(
        self,
        store: Callable[[StageRecord], object],
        make_record: Callable[[], StageRecord | None],
        period: float,
        name: str = "announcer",
    ) -> None:
        self.store = store
        self.make_record = make_record
        self.period = period
        self.renewals = 0
        self.failures = 0
        self.longest_gap = 0.0  # seconds between two successful stores, the most seen
        self._pending: list[tuple[StageRecord | None, concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._last_stored: float | None = None

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def announce_now(self, record: StageRecord | None = None) -> concurrent.futures.Future:
        """Stores `record` (default: the current one) as soon as the store before it is done; the future tells when."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending.append((record, done))
        self._wake.set()
        return done

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stopping.is_set():
            self._wake.wait(timeout=max(0.0, due - time.monotonic()))
            self._wake.clear()
            if self._stopping.is_set():
                break
            with self._lock:
                pending, self._pending = self._pending, []
            for record, done in pending:
                try:
                    self._store(record)
                except Exception as e:
                    done.set_exception(e)
                else:
                    done.set_result(True)
            if pending or time.monotonic() >= due:
                if not pending:
                    try:
                        self._store(None)
                        self.renewals += 1
                    except Exception as e:
                        self.failures += 1
                        logger.warning(f"Could not renew this peer's record ({e}); retrying in {self.period}s")
                due = time.monotonic() + self.period
        with self._lock:
            pending, self._pending = self._pending, []
        for _, done in pending:
            done.cancel()

    def _store(self, record: StageRecord | None) -> None:
        record = record if record is not None else self.make_record()
        if record is None:
            return  # nothing to announce at this moment (the peer is between two stages)
        self.store(record)
        now = time.monotonic()
        if self._last_stored is not None:
            self.longest_gap = max(self.longest_gap, now - self._last_stored)
        self._last_stored = now
