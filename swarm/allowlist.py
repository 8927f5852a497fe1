"""Private swarms: the peer ids allowed in, and the gates that keep everyone else out.

With `--allowlist FILE`, a process serves nothing to a peer whose (libp2p-authenticated) peer id is
not in the file: its streams are closed unanswered. Its DHT records are refused where they are
stored (`AllowlistValidator`, run by every honest DHT node) and skipped where they are read.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from swarm.identity import OWNER, owner_peer_id

logger = logging.getLogger(__name__)

MAX_ALLOWLIST_BYTES = 16 * 2**20
refused_streams: Counter[str] = Counter()  # streams this process closed unanswered, per protocol


class AllowlistError(ValueError):
    """An allowlist file that cannot be used: the message says why."""


class Allowlist:
    """The peer ids of a private swarm, one per line of a file (`#` starts a comment)."""

    def __init__(self, peer_ids: set[str], path: str = "") -> None:
        self.peer_ids = frozenset(peer_ids)
        self.path = path

    @classmethod
    def read(cls, path: str) -> Allowlist:
        from swarm.stage_records import PEER_ID

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
    """A DHT validator that refuses records not owned (signed, see `swarm.identity`) by an allowed peer."""

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


def admitting(handler: Handler, allowlist: Allowlist | None, protocol: str) -> Handler:
    """`handler` for allowed peers only: another peer's stream is closed unanswered (no allowlist: all)."""
    if allowlist is None:
        return handler

    async def admit(stream_info, reader, writer) -> None:
        caller = str(stream_info.peer_id)
        if allowlist.admits(caller):
            await handler(stream_info, reader, writer)
            return
        refused_streams[protocol] += 1
        if refused_streams[protocol] in (1, 10, 100) or refused_streams[protocol] % 1000 == 0:
            logger.warning(
                f"Refused {refused_streams[protocol]} stream(s) on {protocol}, lately from {caller}: not in --allowlist"
            )
        with contextlib.suppress(Exception):
            writer.close()

    return admit
