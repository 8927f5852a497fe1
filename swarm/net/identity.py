"""A process's identity: one RSA key that is both its libp2p peer id and the signer of its DHT records.

libp2p authenticates every stream by the peer's key, so a handler knows for sure which peer id is
calling. Records in the DHT are signed with the same key: a record's subkey carries the owner's
public key (hivemind's `RSASignatureValidator` refuses, at store and at read, any record under that
subkey not signed by it), and the record's peer id must be the one that key hashes to. So a record
that says "peer X serves stage 2" can only have been written by X, and a mate protocol can trust
that the peer id on a stream is the one the records speak of.

Without `--identity-path`, a process gets a new key at every start.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.net.signature_memo import SignatureMemoValidator

OWNER = re.compile(rb"\[owner:(.+?)\]")  # how RSASignatureValidator marks a protected subkey


class IdentityError(ValueError):
    """An identity file that cannot be used: the message says why."""


class IdentityKey(RSAPrivateKey):
    """An RSA private key read from a libp2p identity file (hivemind's class generates new keys only)."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._private_key = private_key


def peer_id_of_public_key(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key: the sha2-256 multihash of its protobuf encoding."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


@functools.lru_cache(maxsize=4096)
def owner_peer_id(subkey: object) -> str | None:
    """The peer id of the key that owns a record's subkey, or None if the subkey names no RSA key."""
    if not isinstance(subkey, bytes) or len(subkey) > 4096:
        return None
    found = OWNER.fullmatch(subkey)
    if found is None:
        return None
    try:
        public_key = serialization.load_ssh_public_key(found.group(1))
    except (ValueError, TypeError):
        return None
    return peer_id_of_public_key(public_key) if isinstance(public_key, rsa.RSAPublicKey) else None


@dataclass
class Identity:
    """A process's key, its peer id, the subkey its records go under and the validator that signs them."""

    key: IdentityKey
    path: str
    generated: bool  # made for this run only: no other process can hold it
    validator: SignatureMemoValidator = field(init=False)
    peer_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.validator = SignatureMemoValidator(self.key)
        self.peer_id = peer_id_of_public_key(self.key._private_key.public_key())

    @property
    def owner(self) -> bytes:
        """The subkey of this process's records: its public key, which only its signature may write under."""
        return self.validator.local_public_key


def read_identity(path: str | os.PathLike) -> Identity:
    """The identity in a libp2p key file (as `swarm identity` or hivemind writes them); IdentityError if unusable."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read the identity file {path}: {e.strerror}") from None
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
        private_key = serialization.load_der_private_key(message.data, password=None)
    except Exception:
        raise IdentityError(f"{path} holds no libp2p private key") from None
    if message.key_type != crypto_pb2.RSA or not isinstance(private_key, rsa.RSAPrivateKey):
        raise IdentityError(f"{path} holds a {crypto_pb2.KeyType.Name(message.key_type)} key; swarm needs an RSA one")
    return Identity(IdentityKey(private_key), str(path), generated=False)


def create_identity_file(path: str | os.PathLike) -> None:
    """Writes a new RSA identity to `path`, readable by its owner only; whole or not at all, so that a process
    that sees the file (a launcher waiting for its peer's id) never reads half a key."""
    partial = Path(f"{path}.partial-{os.getpid()}")
    try:
        P2P.generate_identity(str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_identity(path: str | None) -> Identity:
    """The identity at `path` (made there if the file does not exist), or a new one for this run if None."""
    if path is None:
        directory = tempfile.mkdtemp(prefix="swarm-identity-")
        fresh = os.path.join(directory, "identity.key")
        create_identity_file(fresh)
        identity = read_identity(fresh)
        identity.generated = True
        return identity
    if not os.path.exists(path):
        try:
            create_identity_file(path)
        except OSError as e:
            raise IdentityError(f"cannot write a new identity to {path}: {e}") from None
    return read_identity(path)


def forget_generated(identity: Identity) -> None:
    """Removes the key file of an identity made for this run, once the daemon has read it."""
    if identity.generated:
        directory = os.path.dirname(identity.path)
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
