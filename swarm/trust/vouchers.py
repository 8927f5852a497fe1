"""The trust root and its vouchers: the organizer's key, and the trainer keys it signs.

The organizer makes a root key once (`swarm trust-root`) and publishes its public half in the swarm
file (`trust_root`). For each trainer it runs, it makes a voucher (`swarm vouch`): a new Ed25519 key
for the trainer's receipts, with the root's signature over the key and a name. The voucher file
holds the private key too, so it is kept like an identity file: readable by its owner only.

Ed25519 rather than the RSA identity keys: a trainer signs one receipt per backward, and a peer
checks hundreds per round; Ed25519 signs in about 30 us and verifies in about 80 us here.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections import OrderedDict
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.proto import Voucher

VOUCHER_DOMAIN = b"swarm-voucher-v1\0"  # what a root signature is for: never mistaken for another message
KEY_BYTES = 32
MAX_NAME = 128
CACHE_SIZE = 4096  # vouchers whose verdict is remembered: one check per trainer key, not per receipt


class TrustError(ValueError):
    """A trust root, root key or voucher that cannot be used: the message says what to fix."""


def encode_key(raw: bytes) -> str:
    """A key's 32 bytes as the text the swarm file and key files hold."""
    return base64.b64encode(raw).decode()


def decode_key(text: str, what: str) -> bytes:
    """A key from its base64 text: 32 bytes, or a TrustError naming `what`."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise TrustError(f"{what}: not base64 text") from None
    if len(raw) != KEY_BYTES:
        raise TrustError(f"{what}: expected a {KEY_BYTES}-byte Ed25519 key, got {len(raw)} bytes")
    return raw


def _write_private(path: Path, content: dict) -> None:
    """Writes a file that holds a private key: created for its owner only, never over an existing one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise TrustError(f"{path} exists: a key file is never overwritten; choose another path") from None
    with os.fdopen(fd, "w") as file:
        json.dump(content, file, indent=1)
        file.write("\n")


def _read_json(path: Path, kind: str) -> dict:
    try:
        content = json.loads(Path(path).read_text())
    except OSError as e:
        raise TrustError(f"cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise TrustError(f"{path} is not a {kind} file (not JSON)") from None
    if not isinstance(content, dict) or content.get("kind") != kind:
        raise TrustError(f"{path} is not a {kind} file")
    return content


def private_key_bytes(key: Ed25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def make_root_key(path: Path) -> str:
    """Makes the organizer's root key at `path`; returns its public half, the swarm file's `trust_root`."""
    key = Ed25519PrivateKey.generate()
    _write_private(Path(path), {"kind": "swarm-trust-root", "private_key": encode_key(private_key_bytes(key))})
    return encode_key(key.public_key().public_bytes_raw())


def load_root_key(path: Path) -> Ed25519PrivateKey:
    """The organizer's root key from its file."""
    content = _read_json(Path(path), "swarm-trust-root")
    return Ed25519PrivateKey.from_private_bytes(decode_key(str(content.get("private_key", "")), f"{path}"))


def voucher_message(name: str, public_key: bytes) -> bytes:
    """What the root signs: the trainer key and its name."""
    return VOUCHER_DOMAIN + name.encode() + b"\0" + public_key


def make_voucher(root: Ed25519PrivateKey, name: str, path: Path) -> Voucher:
    """Makes a new trainer key vouched for by `root`, saved with its voucher at `path`."""
    if not name or len(name) > MAX_NAME or "\0" in name:
        raise TrustError(f"a voucher's name is 1 to {MAX_NAME} characters, without NUL")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes_raw()
    voucher = Voucher(name=name, public_key=public, signature=root.sign(voucher_message(name, public)))
    content = {
        "kind": "swarm-voucher",
        "name": name,
        "public_key": encode_key(public),
        "signature": base64.b64encode(voucher.signature).decode(),
        "private_key": encode_key(private_key_bytes(key)),
    }
    _write_private(Path(path), content)
    return voucher


def load_voucher(path: Path) -> tuple[Voucher, Ed25519PrivateKey]:
    """A trainer's voucher and receipt key from its voucher file."""
    content = _read_json(Path(path), "swarm-voucher")
    try:
        signature = base64.b64decode(str(content.get("signature", "")), validate=True)
    except (binascii.Error, ValueError):
        raise TrustError(f"{path}: its signature is not base64 text") from None
    voucher = Voucher(
        name=str(content.get("name", "")),
        public_key=decode_key(str(content.get("public_key", "")), f"{path} public_key"),
        signature=signature,
    )
    key = Ed25519PrivateKey.from_private_bytes(decode_key(str(content.get("private_key", "")), f"{path} private_key"))
    if key.public_key().public_bytes_raw() != voucher.public_key:
        raise TrustError(f"{path}: its private key does not match the key vouched for")
    return voucher, key


class TrustRoot:
    """The organizer's public key: says which trainer keys it vouched for."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key
        self._key = Ed25519PublicKey.from_public_bytes(public_key)
        self._verdicts: OrderedDict[tuple[str, bytes, bytes], bool] = OrderedDict()

    @classmethod
    def from_text(cls, text: str) -> TrustRoot:
        """From the swarm file's `trust_root` (base64 of the root's public key)."""
        return cls(decode_key(text, "trust_root"))

    def vouches(self, voucher: Voucher) -> bool:
        """Whether this root signed `voucher` (remembered per voucher: it is checked once per trainer)."""
        entry = (voucher.name, bytes(voucher.public_key), bytes(voucher.signature))
        verdict = self._verdicts.get(entry)
        if verdict is None:
            verdict = len(voucher.public_key) == KEY_BYTES and len(voucher.name) <= MAX_NAME
            if verdict:
                try:
                    self._key.verify(voucher.signature, voucher_message(voucher.name, voucher.public_key))
                except InvalidSignature:
                    verdict = False
            self._verdicts[entry] = verdict
            while len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return verdict
