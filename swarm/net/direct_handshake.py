"""The handshake that opens a call on the direct data plane: both sides prove their identity key.

libp2p authenticates every stream by the peer's key; a plain TCP connection proves nothing, so
each one starts with this exchange (messages in `swarm.proto`, framed as in `swarm.net.wire`):

    caller -> server  DirectHello      protocol, nonce, [RSA public key, X25519 key] or [session id]
    server -> caller  DirectChallenge  nonce, [RSA public key, X25519 key, session id], proof
    caller -> server  DirectProof      proof

In a full handshake each proof is an RSA signature, with the signer's identity key, of everything
both sides sent so far (the transcript), so neither can be replayed into another connection. The
caller checks that the server's key hashes to the peer id it meant to call; the server takes the
caller's peer id from the caller's key. An X25519 exchange inside the signed transcript gives both
sides a session key that nobody watching the wire learns. Later calls between the same two
processes resume that session: the proofs are HMACs of the new transcript with the session key, which
costs microseconds where a signature costs about a millisecond.

The data after the handshake is neither encrypted nor integrity-protected: the direct plane is for
networks whose wires the swarm's members trust (a lab, a cluster); `--no-direct` keeps every call on
libp2p.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, x25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.net.identity import Identity, peer_id_of_public_key
from swarm.net.shared_memory import SharedMemoryLink
from swarm.net.wire import WireError, WireLimits, read_frames, write_frames
from swarm.proto import PROTOCOL_VERSION, DirectChallenge, DirectHello, DirectProof, Error, ErrorCode

NONCE_BYTES = 32
SESSION_ID_BYTES = 16
MAX_PUBLIC_KEY_BYTES = 1024  # DER of an RSA key of up to 4096 bits is about 550 bytes
RSA_KEY_BITS = (2048, 4096)  # accepted sizes of an identity key: a bigger one is costly to verify
MAX_PROTOCOL_NAME = 128
# a handshake message is small: a sender that says more, or stalls, is refused at once
HANDSHAKE_LIMITS = WireLimits(max_frame_bytes=4096, max_message_bytes=4096, max_tensor_bytes=0, frame_timeout=5.0)
SESSION_TTL = 3600.0  # seconds a session may be resumed
MAX_SESSIONS = 4096  # sessions a server remembers; the oldest is forgotten first


class HandshakeError(Exception):
    """A handshake that failed: the other side could not prove its key, or broke the rules."""


@dataclass(frozen=True)
class Session:
    """A key both sides hold after a full handshake, to resume with."""

    session_id: bytes
    key: bytes
    peer_id: str  # the other side's
    created: float


def _public_der(identity: Identity) -> bytes:
    return identity.key._private_key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _load_public_key(der: bytes) -> rsa.RSAPublicKey:
    """The RSA key in `der`; HandshakeError if it is none, or of a size outside RSA_KEY_BITS."""
    if not 0 < len(der) <= MAX_PUBLIC_KEY_BYTES:
        raise HandshakeError(f"public key of {len(der)} bytes")
    try:
        key = serialization.load_der_public_key(der)
    except (ValueError, TypeError) as e:
        raise HandshakeError(f"unreadable public key: {e}") from None
    if not isinstance(key, rsa.RSAPublicKey) or not RSA_KEY_BITS[0] <= key.key_size <= RSA_KEY_BITS[1]:
        raise HandshakeError("the identity key must be RSA of 2048 to 4096 bits")
    return key


def _transcript(role: bytes, hello: DirectHello, challenge: DirectChallenge) -> bytes:
    """What a proof covers: who proves (`role`) and every field both sides sent before it."""
    fields = (
        hello.protocol.encode(),
        hello.nonce,
        hello.public_key,
        hello.ephemeral_key,
        hello.session,
        challenge.nonce,
        challenge.public_key,
        challenge.ephemeral_key,
        challenge.session,
    )
    digest = hashlib.sha256(b"swarm-direct/" + role)
    for field in fields:
        digest.update(len(field).to_bytes(4, "big") + field)
    # the shared-memory offers, where made, are covered too (none made: the transcript of earlier versions)
    for field in (
        hello.shared_memory.encode(),
        hello.shared_token,
        challenge.shared_memory.encode(),
        challenge.shared_token,
    ):
        if field:
            digest.update(len(field).to_bytes(4, "big") + field)
    return digest.digest()


def _sign(identity: Identity, data: bytes) -> bytes:
    return identity.key._private_key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def _verify(key: rsa.RSAPublicKey, signature: bytes, data: bytes) -> bool:
    if len(signature) > 512:
        return False
    try:
        key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _session_key(own: x25519.X25519PrivateKey, theirs: bytes, transcript: bytes) -> bytes:
    try:
        shared = own.exchange(x25519.X25519PublicKey.from_public_bytes(theirs))
    except ValueError as e:
        raise HandshakeError(f"bad X25519 key: {e}") from None
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=transcript).derive(shared)


def _ephemeral() -> tuple[x25519.X25519PrivateKey, bytes]:
    private = x25519.X25519PrivateKey.generate()
    return private, private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


async def _read(reader: asyncio.StreamReader, message_type: type):
    try:
        message, _ = await read_frames(reader, message_type, HANDSHAKE_LIMITS)
    except WireError as e:
        raise HandshakeError(str(e)) from None
    except asyncio.TimeoutError:
        raise HandshakeError("no handshake message within the time limit") from None
    return message


async def prove_to_server(
    identity: Identity,
    server_peer_id: str,
    protocol: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    session: Session | None,
    shared: SharedMemoryLink | None = None,
) -> Session | None:
    """The caller's side, on a fresh connection. Returns the session to resume with next time (a new one
    after a full handshake, `session` after a resumed one). Raises HandshakeError if the server is not
    `server_peer_id` or breaks the rules; returns None, with the connection useless, if the server has
    forgotten `session` (then start over on a new connection with no session). With `shared`, offers the
    server shared memory and fills `shared` with what the two agreed on."""
    hello = DirectHello(protocol_version=PROTOCOL_VERSION, protocol=protocol, nonce=os.urandom(NONCE_BYTES))
    if shared is not None:
        hello.shared_memory, hello.shared_token = shared.offer()
    ephemeral = None
    if session is not None:
        hello.session = session.session_id
    else:
        ephemeral, hello.ephemeral_key = _ephemeral()
        hello.public_key = _public_der(identity)
    await write_frames(writer, [hello])
    challenge = await _read(reader, DirectChallenge)
    if challenge.error.code != ErrorCode.OK:
        if session is not None and challenge.error.code == ErrorCode.UNAVAILABLE:
            return None
        raise HandshakeError(f"refused: {ErrorCode.Name(challenge.error.code)} {challenge.error.message}")
    if len(challenge.nonce) != NONCE_BYTES:
        raise HandshakeError("bad nonce")
    server_says = _transcript(b"server", hello, challenge)
    proof = DirectProof()
    if shared is not None:
        shared.writes = bool(challenge.shared_memory)  # the server could read this side's arena
        proof.shared_memory = shared.accept(challenge.shared_memory, challenge.shared_token)
    if session is not None:
        if not hmac.compare_digest(challenge.proof, _mac(session.key, server_says)):
            raise HandshakeError(f"the server cannot prove it is {server_peer_id} (bad session proof)")
        proof.proof = _mac(session.key, _transcript(b"caller", hello, challenge))
        await write_frames(writer, [proof])
        return session
    key = _load_public_key(challenge.public_key)
    if peer_id_of_public_key(key) != server_peer_id:
        raise HandshakeError(f"the server at this address is {peer_id_of_public_key(key)}, not {server_peer_id}")
    if not _verify(key, challenge.proof, server_says):
        raise HandshakeError(f"the server cannot prove it is {server_peer_id} (bad signature)")
    if len(challenge.session) != SESSION_ID_BYTES:
        raise HandshakeError("bad session id")
    caller_says = _transcript(b"caller", hello, challenge)
    proof.proof = _sign(identity, caller_says)
    await write_frames(writer, [proof])
    session_key = _session_key(ephemeral, challenge.ephemeral_key, caller_says)
    return Session(challenge.session, session_key, server_peer_id, time.monotonic())


class SessionStore:
    """The sessions a server has opened, to be resumed by their callers: bounded and expiring."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, ttl: float = SESSION_TTL) -> None:
        self.max_sessions, self.ttl = max_sessions, ttl
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()

    def add(self, session: Session) -> None:
        self._sessions[session.session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def get(self, session_id: bytes) -> Session | None:
        session = self._sessions.get(session_id)
        if session is not None and time.monotonic() - session.created > self.ttl:
            del self._sessions[session_id]
            return None
        return session

    def __len__(self) -> int:
        return len(self._sessions)


async def prove_to_caller(
    identity: Identity,
    sessions: SessionStore,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    shared: SharedMemoryLink | None = None,
) -> tuple[str, str]:
    """The server's side, on an accepted connection: returns (the caller's proven peer id, the protocol it
    calls). Raises HandshakeError if the caller cannot prove its key or breaks the rules. With `shared`,
    takes up a caller's offer of shared memory where the caller runs on this host, and fills `shared`."""
    hello = await _read(reader, DirectHello)
    if hello.protocol_version != PROTOCOL_VERSION:
        await _refuse(writer, ErrorCode.VERSION_MISMATCH, f"this peer speaks protocol version {PROTOCOL_VERSION}")
        raise HandshakeError(f"protocol version {hello.protocol_version}")
    if len(hello.nonce) != NONCE_BYTES or not 0 < len(hello.protocol) <= MAX_PROTOCOL_NAME:
        await _refuse(writer, ErrorCode.BAD_REQUEST, "malformed hello")
        raise HandshakeError("malformed hello")
    challenge = DirectChallenge(protocol_version=PROTOCOL_VERSION, nonce=os.urandom(NONCE_BYTES))
    if shared is not None and shared.accept(hello.shared_memory, hello.shared_token):
        challenge.shared_memory, challenge.shared_token = shared.offer()
    if hello.session:
        session = sessions.get(hello.session)
        if session is None:
            await _refuse(writer, ErrorCode.UNAVAILABLE, "unknown session: start a full handshake")
            raise HandshakeError("unknown session")
        challenge.proof = _mac(session.key, _transcript(b"server", hello, challenge))
        await write_frames(writer, [challenge])
        proof = await _read(reader, DirectProof)
        if not hmac.compare_digest(proof.proof, _mac(session.key, _transcript(b"caller", hello, challenge))):
            raise HandshakeError(f"a caller resuming {session.peer_id}'s session cannot prove it (bad proof)")
        _agreed(shared, proof)
        return session.peer_id, hello.protocol
    try:
        caller_key = _load_public_key(hello.public_key)
    except HandshakeError as e:
        await _refuse(writer, ErrorCode.BAD_REQUEST, str(e))
        raise
    ephemeral, challenge.ephemeral_key = _ephemeral()
    challenge.public_key = _public_der(identity)
    challenge.session = os.urandom(SESSION_ID_BYTES)
    challenge.proof = _sign(identity, _transcript(b"server", hello, challenge))
    await write_frames(writer, [challenge])
    proof = await _read(reader, DirectProof)
    caller_says = _transcript(b"caller", hello, challenge)
    caller = peer_id_of_public_key(caller_key)
    if not _verify(caller_key, proof.proof, caller_says):
        raise HandshakeError(f"a caller claiming to be {caller} cannot prove it (bad signature)")
    session_key = _session_key(ephemeral, hello.ephemeral_key, caller_says)
    sessions.add(Session(challenge.session, session_key, caller, time.monotonic()))
    _agreed(shared, proof)
    return caller, hello.protocol


def _agreed(shared: SharedMemoryLink | None, proof: DirectProof) -> None:
    """The server sends through its arena only where the caller said it could read it."""
    if shared is not None:
        shared.writes = shared.own is not None and proof.shared_memory


async def _refuse(writer: asyncio.StreamWriter, code: int, message: str) -> None:
    challenge = DirectChallenge(protocol_version=PROTOCOL_VERSION, error=Error(code=code, message=message))
    try:
        await write_frames(writer, [challenge])
    except (ConnectionError, OSError):
        pass
