"""The handshake that opens a call on the direct data plane: both sides prove their identity key, and agree on
the keys that seal everything after it.

libp2p authenticates and encrypts every stream; a plain TCP connection does neither, so each one starts
with this exchange (messages in `swarm.proto`, framed as in `swarm.net.wire`). A full handshake:

    caller -> server  DirectHello      protocol, nonce, cipher, RSA public key, X25519 key
    server -> caller  DirectChallenge  nonce, cipher, RSA public key, X25519 key, session id
    caller -> server  DirectProof      the caller's RSA signature of the transcript
    server -> caller  DirectProof      the server's RSA signature of the transcript

Each signature covers everything both sides sent before it (the transcript), so neither can be replayed
into another connection. The caller checks that the server's key hashes to the peer id it meant to call
before it signs; the server takes the caller's peer id from the caller's key, and signs only once the
caller has proved that key: a stranger cannot make a server spend signatures (about a millisecond each)
without spending as much itself. An X25519 exchange inside the signed transcript gives both sides a session
key that nobody watching the wire learns.

Later calls between the same two processes resume that session, in three messages: the hello names the
session instead of keys, and each proof is an HMAC of the new transcript with the session key (microseconds
where a signature costs a millisecond). The server proves first, which costs it nothing worth saving.

Every connection then derives its own pair of keys from the session key and its transcript (both sides'
fresh nonces in it), and all that follows is sealed (`swarm.net.frame_cipher`): encrypted and
authenticated, in both directions. A hello or challenge that names another cipher is refused: a peer that
does not seal (an older version) is called over libp2p instead.

In a private swarm (`swarm.net.swarm_key`), every transcript is an HMAC with a key derived from the swarm
key, so every proof, session and connection key holds only between holders of it; and a server's challenge
to a full handshake carries an HMAC proving it holds the key. A caller checks that proof before it signs, and
names which side lacks the key; the server checks the caller's signature over the keyed transcript before it
signs anything, so a caller without the key costs it one X25519 key and one HMAC.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, x25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.net.frame_cipher import CIPHER, TrafficKeys, traffic_keys
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


def _transcript(
    swarm_key: bytes, role: bytes, hello: DirectHello, challenge: DirectChallenge, shared_accepted: bool = False
) -> bytes:
    """What a proof or a connection's keys cover: who proves (`role`), every field both sides sent in the hello
    and the challenge, and whether the caller took up the server's shared memory (its proof says so). With a
    swarm key (b"": none), an HMAC of all that with it: proofs and keys then hold only between its holders."""
    fields = (
        hello.protocol.encode(),
        hello.nonce,
        hello.public_key,
        hello.ephemeral_key,
        hello.session,
        hello.cipher.encode(),
        hello.shared_memory.encode(),
        hello.shared_token,
        challenge.nonce,
        challenge.public_key,
        challenge.ephemeral_key,
        challenge.session,
        challenge.cipher.encode(),
        challenge.shared_memory.encode(),
        challenge.shared_token,
        bytes([shared_accepted]),
    )
    digest = hashlib.sha256(b"swarm-direct/2/" + role)
    for field in fields:
        digest.update(len(field).to_bytes(4, "big") + field)
    return _mac(swarm_key, b"swarm-direct/key/" + digest.digest()) if swarm_key else digest.digest()


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


class Opened(NamedTuple):
    """What a caller's handshake gives: the session to resume with next time, and this connection's keys
    (None where both ends were built not to seal, for a benchmark's baseline)."""

    session: Session
    keys: TrafficKeys | None


async def prove_to_server(
    identity: Identity,
    server_peer_id: str,
    protocol: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    session: Session | None,
    shared: SharedMemoryLink | None = None,
    cipher: str = CIPHER,
    swarm_key: bytes = b"",
) -> Opened | None:
    """The caller's side, on a fresh connection: the session to resume with next time (a new one after a full
    handshake, `session` after a resumed one) and the keys to seal the connection with. Raises
    HandshakeError if the server is not `server_peer_id` or breaks the rules; returns None, with the
    connection useless, if the server has forgotten `session` (then start over on a new connection with no
    session). With `shared`, offers the server shared memory and fills `shared` with what the two agreed on.
    With `swarm_key` (a private swarm's, derived for this plane), a server that cannot prove it holds the same
    key is refused before this side signs anything."""
    hello = DirectHello(
        protocol_version=PROTOCOL_VERSION, protocol=protocol, nonce=os.urandom(NONCE_BYTES), cipher=cipher
    )
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
    if challenge.cipher != cipher:
        raise HandshakeError(f"the server seals with {challenge.cipher or 'nothing'!r}, not {cipher or 'nothing'!r}")
    proof = DirectProof()
    if shared is not None:
        shared.writes = bool(challenge.shared_memory)  # the server could read this side's arena
        proof.shared_memory = shared.accept(challenge.shared_memory, challenge.shared_token)
    said = (hello, challenge, proof.shared_memory)
    if session is not None:
        if not hmac.compare_digest(
            challenge.proof, _mac(session.key, _transcript(swarm_key, b"server", hello, challenge))
        ):
            raise HandshakeError(f"the server cannot prove it is {server_peer_id} (bad session proof)")
        proof.proof = _mac(session.key, _transcript(swarm_key, b"caller", *said))
        await write_frames(writer, [proof])
        return Opened(session, _keys(cipher, session.key, said, caller=True, swarm_key=swarm_key))
    _check_member(swarm_key, hello, challenge, server_peer_id)
    key = _load_public_key(challenge.public_key)
    if peer_id_of_public_key(key) != server_peer_id:
        raise HandshakeError(f"the server at this address is {peer_id_of_public_key(key)}, not {server_peer_id}")
    if len(challenge.session) != SESSION_ID_BYTES:
        raise HandshakeError("bad session id")
    proof.proof = _sign(identity, _transcript(swarm_key, b"caller", *said))
    await write_frames(writer, [proof])
    server_proof = await _read(reader, DirectProof)
    if not _verify(key, server_proof.proof, _transcript(swarm_key, b"server", *said)):
        raise HandshakeError(f"the server cannot prove it is {server_peer_id} (bad signature)")
    session = Session(
        challenge.session,
        _session_key(ephemeral, challenge.ephemeral_key, _transcript(swarm_key, b"session", hello, challenge)),
        server_peer_id,
        time.monotonic(),
    )
    return Opened(session, _keys(cipher, session.key, said, caller=True, swarm_key=swarm_key))


def _member_proof(swarm_key: bytes, hello: DirectHello, challenge: DirectChallenge) -> bytes:
    """What a server of a private swarm puts in its challenge to a full handshake: proof that it holds the key."""
    return _mac(swarm_key, _transcript(swarm_key, b"member", hello, challenge))


def _check_member(swarm_key: bytes, hello: DirectHello, challenge: DirectChallenge, server_peer_id: str) -> None:
    """HandshakeError, saying which side lacks what, unless both sides hold the same swarm key or neither any."""
    if not swarm_key and challenge.proof:
        raise HandshakeError(
            f"{server_peer_id} belongs to a private swarm: this process must start with its --swarm-key-file"
        )
    if swarm_key and not challenge.proof:
        raise HandshakeError(f"{server_peer_id} holds no swarm key: it is not a member of this private swarm")
    if swarm_key and not hmac.compare_digest(challenge.proof, _member_proof(swarm_key, hello, challenge)):
        raise HandshakeError(
            f"{server_peer_id} holds another swarm key than this process's --swarm-key-file: check that every "
            "member has a copy of the same key file (compare fingerprints: `swarm swarm-key --swarm-key-file PATH`)"
        )


def _keys(cipher: str, session_key: bytes, said: tuple, caller: bool, swarm_key: bytes = b"") -> TrafficKeys | None:
    """This connection's keys, from the session key and everything both sides said (None: no sealing)."""
    return traffic_keys(session_key, _transcript(swarm_key, b"frames", *said), caller) if cipher else None


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


class Proven(NamedTuple):
    """What a server's handshake gives: who called, what it calls, and the keys to seal the connection with
    (None where both ends were built not to seal)."""

    peer_id: str
    protocol: str
    keys: TrafficKeys | None


async def prove_to_caller(
    identity: Identity,
    sessions: SessionStore,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    shared: SharedMemoryLink | None = None,
    cipher: str = CIPHER,
    swarm_key: bytes = b"",
) -> Proven:
    """The server's side, on an accepted connection. Raises HandshakeError if the caller cannot prove its key
    or breaks the rules; signs nothing before the caller has proved its key (and, with `swarm_key`, proved it
    holds that too: its signature covers a transcript only holders of the key can compute). With `shared`,
    takes up a caller's offer of shared memory where the caller runs on this host, and fills `shared`."""
    hello = await _read(reader, DirectHello)
    if hello.protocol_version != PROTOCOL_VERSION:
        await _refuse(writer, ErrorCode.VERSION_MISMATCH, f"this peer speaks protocol version {PROTOCOL_VERSION}")
        raise HandshakeError(f"protocol version {hello.protocol_version}")
    if len(hello.nonce) != NONCE_BYTES or not 0 < len(hello.protocol) <= MAX_PROTOCOL_NAME:
        await _refuse(writer, ErrorCode.BAD_REQUEST, "malformed hello")
        raise HandshakeError("malformed hello")
    if hello.cipher != cipher:
        sealing = f"seals its direct calls with {cipher!r}" if cipher else "does not seal its direct calls"
        await _refuse(writer, ErrorCode.VERSION_MISMATCH, f"this peer {sealing}")
        raise HandshakeError(f"a caller that seals with {hello.cipher or 'nothing'!r}, not {cipher or 'nothing'!r}")
    challenge = DirectChallenge(protocol_version=PROTOCOL_VERSION, nonce=os.urandom(NONCE_BYTES), cipher=cipher)
    if shared is not None and shared.accept(hello.shared_memory, hello.shared_token):
        challenge.shared_memory, challenge.shared_token = shared.offer()
    if hello.session:
        return await _resume(sessions, reader, writer, shared, hello, challenge, swarm_key)
    try:
        caller_key = _load_public_key(hello.public_key)
    except HandshakeError as e:
        await _refuse(writer, ErrorCode.BAD_REQUEST, str(e))
        raise
    ephemeral, challenge.ephemeral_key = _ephemeral()
    challenge.public_key = _public_der(identity)
    challenge.session = os.urandom(SESSION_ID_BYTES)
    if swarm_key:
        challenge.proof = _member_proof(swarm_key, hello, challenge)
    await write_frames(writer, [challenge])
    proof = await _read(reader, DirectProof)
    said = (hello, challenge, proof.shared_memory)
    caller = peer_id_of_public_key(caller_key)
    if not _verify(caller_key, proof.proof, _transcript(swarm_key, b"caller", *said)):
        lacking = " (or does not hold this swarm's key)" if swarm_key else ""
        raise HandshakeError(f"a caller claiming to be {caller} cannot prove it{lacking} (bad signature)")
    session_key = _session_key(ephemeral, hello.ephemeral_key, _transcript(swarm_key, b"session", hello, challenge))
    await write_frames(writer, [DirectProof(proof=_sign(identity, _transcript(swarm_key, b"server", *said)))])
    sessions.add(Session(challenge.session, session_key, caller, time.monotonic()))
    _agreed(shared, proof)
    return Proven(caller, hello.protocol, _keys(cipher, session_key, said, caller=False, swarm_key=swarm_key))


async def _resume(
    sessions: SessionStore,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    shared: SharedMemoryLink | None,
    hello: DirectHello,
    challenge: DirectChallenge,
    swarm_key: bytes = b"",
) -> Proven:
    """The server's side of a resumed handshake: both proofs are HMACs with the session's key."""
    session = sessions.get(hello.session)
    if session is None:
        await _refuse(writer, ErrorCode.UNAVAILABLE, "unknown session: start a full handshake")
        raise HandshakeError("unknown session")
    challenge.proof = _mac(session.key, _transcript(swarm_key, b"server", hello, challenge))
    await write_frames(writer, [challenge])
    proof = await _read(reader, DirectProof)
    said = (hello, challenge, proof.shared_memory)
    if not hmac.compare_digest(proof.proof, _mac(session.key, _transcript(swarm_key, b"caller", *said))):
        raise HandshakeError(f"a caller resuming {session.peer_id}'s session cannot prove it (bad proof)")
    _agreed(shared, proof)
    keys = _keys(challenge.cipher, session.key, said, caller=False, swarm_key=swarm_key)
    return Proven(session.peer_id, hello.protocol, keys)


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
