"""A private swarm's shared key: the file every member holds, and the keys derived from it.

With `--swarm-key-file`, a process answers nothing to a process that cannot prove it holds the same key:
hivemind's own DHT calls (`swarm.net.dht_auth`), every libp2p stream of the swarm's protocols
(`swarm.net.keyed_p2p`) and every direct-plane handshake (`swarm.net.direct_handshake`) carry a proof made
with it. Each of those uses its own key derived from the swarm key, so a proof for one can never pass as
another.

The file is libp2p's private-network key format (a go-libp2p PSK file reads it unchanged):

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits: 32 random bytes>

Like an SSH private key, a key file that anyone but its owner may read is refused: a shared key that has
leaked lets anyone in. `swarm swarm-key --swarm-key-file PATH` makes one (mode 600) and prints its
fingerprint, which members compare to tell whether they hold the same key without showing it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field

HEADER = b"/key/swarm/psk/1.0.0/"
ENCODING = b"/base16/"
KEY_BYTES = 32
MAX_KEY_FILE_BYTES = 4096


class SwarmKeyError(ValueError):
    """A swarm key file that cannot be used: the message says why and what to do."""


@dataclass(frozen=True)
class SwarmKey:
    """The 32 secret bytes of a private swarm, and where they came from."""

    secret: bytes = field(repr=False)
    path: str = ""

    @property
    def fingerprint(self) -> str:
        """A short public name of the key (a hash of it): equal on every member holding the same key."""
        return hashlib.sha256(b"swarm-key/fingerprint/" + self.secret).hexdigest()[:16]

    def derive(self, purpose: str) -> bytes:
        """A key for one purpose only (e.g. "dht", "stream", "direct"), so no proof passes for another."""
        return hmac.new(self.secret, b"swarm-key/" + purpose.encode(), hashlib.sha256).digest()

    def describe(self) -> str:
        """Which key, for error messages: its file and fingerprint, never the key."""
        return f"--swarm-key-file {self.path or '(given in code)'} (fingerprint {self.fingerprint})"


def encode_key(secret: bytes) -> bytes:
    """The file's contents for `secret`."""
    return HEADER + b"\n" + ENCODING + b"\n" + secret.hex().encode() + b"\n"


def parse_key(data: bytes, path: str = "") -> SwarmKey:
    """The key in a file's contents; SwarmKeyError if they are not a swarm key."""
    lines = [line.strip() for line in data.splitlines() if line.strip()]
    if len(lines) != 3 or lines[0] != HEADER or lines[1] != ENCODING:
        raise SwarmKeyError(
            f"{path or 'the key file'} is not a swarm key (want the lines {HEADER.decode()}, {ENCODING.decode()} and "
            f"{KEY_BYTES * 2} hex digits); make one with `swarm swarm-key --swarm-key-file PATH`"
        )
    try:
        secret = bytes.fromhex(lines[2].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != KEY_BYTES:
        raise SwarmKeyError(f"{path or 'the key file'}: the key must be {KEY_BYTES * 2} hex digits")
    return SwarmKey(secret, path)


def read_swarm_key(path: str) -> SwarmKey:
    """The key in the file at `path`; SwarmKeyError if it is missing, unreadable, malformed or readable by others."""
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise SwarmKeyError(
            f"cannot read {path}: {e.strerror}; every member needs a copy of the swarm's key file "
            "(`swarm swarm-key --swarm-key-file PATH` makes a new one)"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SwarmKeyError(
            f"{path} may be read by other users (mode {stat.S_IMODE(mode):o}): a shared key others can read lets "
            f"them into the swarm; run `chmod 600 {path}`"
        )
    if len(data) > MAX_KEY_FILE_BYTES:
        raise SwarmKeyError(f"{path} is over {MAX_KEY_FILE_BYTES} bytes: not a swarm key")
    return parse_key(data, path)


def load_swarm_key(path: str | None) -> SwarmKey | None:
    """The key at `path`, or None (a swarm open to anyone who knows a member's address)."""
    return None if path is None else read_swarm_key(path)


def make_swarm_key(path: str) -> SwarmKey:
    """Writes a new random key to `path` (readable by its owner only); SwarmKeyError if the file exists."""
    secret = os.urandom(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{path} exists: not overwritten (a swarm's members must all hold the same key)") from None
    except OSError as e:
        raise SwarmKeyError(f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as file:
        file.write(encode_key(secret))
    return SwarmKey(secret, path)


def keyed_mac(key: bytes, *fields: bytes) -> bytes:
    """HMAC-SHA256 of `fields`, each length-prefixed so that no two different lists give the same input."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for item in fields:
        mac.update(len(item).to_bytes(4, "big") + item)
    return mac.digest()
