"""Private swarms: the peer ids allowed in, and the gates that keep everyone else out.

With `--allowlist FILE`, a process serves nothing to a peer whose (libp2p-authenticated) peer id is
not in the file: its streams are closed unanswered (`StreamGate`, which also bounds the streams any
one caller holds open). Its DHT records are refused where they are
stored (`AllowlistValidator`, run by every honest DHT node) and skipped where they are read.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from swarm.net.identity import OWNER, owner_peer_id

logger = logging.getLogger(__name__)

MAX_ALLOWLIST_BYTES = 16 * 2**20


class AllowlistError(ValueError):
    """An allowlist file that cannot be used: the message says why."""


class Allowlist:
    """The peer ids of a private swarm, one per line of a file (`#` starts a comment)."""

    def __init__(self, peer_ids: set[str], path: str = "") -> None:
        self.peer_ids = frozenset(peer_ids)
        self.path = path

    @classmethod
    def read(cls, path: str) -> Allowlist:
        from swarm.records.stage_records import PEER_ID

        try:
            with open(path, "rb") as file:
                data = file.read(MAX_ALLOWLIST_BYTES + 1)
        except OSError as e:
            raise AllowlistError(f"cannot read {path}: {e.strerror}") from None
        if len(data) > MAX_ALLOWLIST_BYTES:
            raise AllowlistError(f"{path} is over {MAX_ALLOWLIST_BYTES // 2**20} MiB: not a list of peer ids")
        peer_ids = set()
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if not PEER_ID.fullmatch(entry):
                raise AllowlistError(f"{path}:{number}: {entry[:80]!r} is not a peer id")
            peer_ids.add(entry)
        if not peer_ids:
            raise AllowlistError(f"{path} names no peer id: nobody could join")
        return cls(peer_ids, str(Path(path)))

    def admits(self, peer_id: str) -> bool:
        return peer_id in self.peer_ids

    def __len__(self) -> int:
        return len(self.peer_ids)


def load_allowlist(path: str | None) -> Allowlist | None:
    """The allowlist at `path`, or None (an open swarm)."""
    return None if path is None else Allowlist.read(path)


class AllowlistValidator(RecordValidatorBase):
    """A DHT validator that refuses records not owned (signed, see `swarm.net.identity`) by an allowed peer."""

    def __init__(self, allowlist: Allowlist) -> None:
        self.allowlist = allowlist

    def validate(self, record: DHTRecord) -> bool:
        owners = OWNER.findall(record.subkey or b"")
        if len(owners) != 1:
            return False
        peer_id = owner_peer_id(b"[owner:" + owners[0] + b"]")
        return peer_id is not None and self.allowlist.admits(peer_id)

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 5  # after the signature check (10): a record is someone's only once its signature holds

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


Handler = Callable[..., Awaitable[None]]


class StreamGate:
    """The door of every protocol a peer serves: outsiders of a private swarm are turned away, and no
    caller holds more than `max_per_caller` streams open at once (a stream over either is closed unanswered).

    One gate per process, shared by all its protocols, so the per-caller count is over all of them.
    """

    def __init__(self, allowlist: Allowlist | None, max_per_caller: int) -> None:
        self.allowlist = allowlist
        self.max_per_caller = max_per_caller
        self.open: Counter[str] = Counter()  # streams open now, per caller
        self.refused: Counter[str] = Counter()  # streams closed unanswered, per reason

    def guard(self, handler: Handler, protocol: str) -> Handler:
        """`handler` behind this gate."""

        async def admit(stream_info, reader, writer) -> None:
            caller = str(stream_info.peer_id)
            if self.allowlist is not None and not self.allowlist.admits(caller):
                self._refuse(writer, "outsider", f"{protocol} from {caller}: not in --allowlist")
                return
            if self.open[caller] >= self.max_per_caller:
                self._refuse(writer, "busy", f"{protocol} from {caller}: over --max-streams-per-caller")
                return
            self.open[caller] += 1
            try:
                await handler(stream_info, reader, writer)
            finally:
                self.open[caller] -= 1
                if not self.open[caller]:
                    del self.open[caller]

        return admit

    def _refuse(self, writer, reason: str, what: str) -> None:
        self.refused[reason] += 1
        if self.refused[reason] in (1, 10, 100) or self.refused[reason] % 1000 == 0:
            logger.warning(f"Refused {self.refused[reason]} stream(s) so far; lately {what}")
        with contextlib.suppress(Exception):
            writer.close()
