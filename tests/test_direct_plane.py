"""The direct data plane: both sides prove their identity key, strangers get nothing, and a swarm whose
peers are reached directly, through a dead address and over libp2p trains exactly as one process."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest
import torch
from conftest import assert_matches_reference, peer_flags, reference_run, trainer_flags, wait_for_records
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P, PeerID

from swarm.net import direct_handshake
from swarm.net.direct_handshake import HandshakeError, Session, prove_to_server
from swarm.net.direct_plane import DirectPlane, DirectServer, PeerGone, announce_host, listen_host, parse_direct_address
from swarm.net.direct_stream import open_direct_stream
from swarm.net.frame_cipher import CIPHER
from swarm.net.identity import load_identity
from swarm.net.transport import exchange, nothing_listens
from swarm.net.wire import HEADER_BYTES, WireLimits, read_frames, write_frames
from swarm.peer.checkpoint import load_checkpoint
from swarm.proto import PROTOCOL_VERSION, DirectChallenge, DirectHello, DirectProof, PeerInfo, PeerInfoRequest
from swarm.records.stage_records import SERVING

ECHO = "/swarm/test/echo"


class EchoServer:
    """A direct server whose one protocol answers with the peer id the handshake proved."""

    def __init__(self, cipher: str = CIPHER) -> None:
        self.identity = load_identity(None)
        self.server = DirectServer(self.identity, cipher=cipher)
        self.server.handlers[ECHO] = self._echo
        self.callers: list[str] = []

    async def _echo(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frames(reader, PeerInfoRequest, WireLimits())
        self.callers.append(info.peer_id.to_base58())
        await write_frames(writer, [PeerInfo(model=info.peer_id.to_base58())])
        writer.close()

    async def start(self) -> tuple[str, int]:
        return "127.0.0.1", await self.server.start("127.0.0.1", 0)


async def _call(identity, server_peer_id: str, address, session: Session | None = None):
    """One echo call over a fresh connection: (the peer id the server says it saw, the session to resume)."""
    stream = await open_direct_stream(*address)
    try:
        opened = await prove_to_server(identity, server_peer_id, ECHO, stream, stream, session)
        if opened is None:
            return None, None
        stream.seal(opened.keys)
        await write_frames(stream, [PeerInfoRequest()])
        reply, _ = await read_frames(stream, PeerInfo, WireLimits(frame_timeout=10))
        return reply.model, opened.session
    finally:
        stream.close()


@pytest.mark.timeout(60)
def test_both_sides_prove_their_key_and_later_calls_resume_the_session():
    async def main():
        echo = EchoServer()
        address = await echo.start()
        caller = load_identity(None)
        seen, session = await _call(caller, echo.identity.peer_id, address)
        assert seen == caller.peer_id and session is not None and len(echo.server.sessions) == 1
        seen_again, resumed = await _call(caller, echo.identity.peer_id, address, session)
        assert seen_again == caller.peer_id and resumed is session
        assert len(echo.server.sessions) == 1  # resumed, not a second full handshake
        # a server that has forgotten the session says so, and the caller starts over
        forgotten = Session(os.urandom(16), os.urandom(32), echo.identity.peer_id, 0.0)
        assert await _call(caller, echo.identity.peer_id, address, forgotten) == (None, None)
        assert echo.callers == [caller.peer_id, caller.peer_id] and echo.server.accepted == 2
        await echo.server.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_server_at_the_address_that_is_not_the_peer_meant_is_refused():
    async def main():
        echo = EchoServer()
        address = await echo.start()
        someone_else = load_identity(None).peer_id  # a record that names this address for another peer
        with pytest.raises(HandshakeError, match="not " + someone_else):
            await _call(load_identity(None), someone_else, address)
        # another server at the address a caller holds a session for: it has no such session, and it
        # cannot pass the full handshake that follows as the peer the caller meant
        caller = load_identity(None)
        _, session = await _call(caller, echo.identity.peer_id, address)
        impostor = EchoServer()
        impostor_address = await impostor.start()
        assert await _call(caller, echo.identity.peer_id, impostor_address, session) == (None, None)
        with pytest.raises(HandshakeError, match="not " + echo.identity.peer_id):
            await _call(caller, echo.identity.peer_id, impostor_address)
        assert impostor.callers == []
        await echo.server.close()
        await impostor.server.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_caller_that_cannot_prove_its_key_is_served_nothing_and_costs_the_server_no_signature(monkeypatch):
    signatures = []
    sign = direct_handshake._sign

    def counted(identity, data: bytes) -> bytes:
        signatures.append(identity)
        return sign(identity, data)

    monkeypatch.setattr(direct_handshake, "_sign", counted)

    async def main():
        echo = EchoServer()
        address = await echo.start()
        victim = load_identity(None)
        # someone sends the victim's public key and a session id it saw on the wire, without the keys to prove them
        victim_key = victim.key._private_key.public_key()
        der = victim_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        _, session = await _call(victim, echo.identity.peer_id, address)
        # the full handshake: the caller signed, then the server, once the caller had proved its key
        assert [identity.peer_id for identity in signatures] == [victim.peer_id, echo.identity.peer_id]
        hellos = [
            DirectHello(public_key=der, ephemeral_key=b"k" * 32),
            DirectHello(session=session.session_id),
        ]
        for hello in hellos:
            hello.protocol_version, hello.protocol, hello.nonce = PROTOCOL_VERSION, ECHO, os.urandom(32)
            hello.cipher = CIPHER
            reader, writer = await asyncio.open_connection(*address)
            await write_frames(writer, [hello])
            await read_frames(reader, DirectChallenge, WireLimits())
            await write_frames(writer, [DirectProof(proof=os.urandom(256))])
            assert await reader.read() == b""  # closed, unserved
            writer.close()
        # garbage, and a huge frame announced: closed, unserved
        for junk in (b"\x00" * 3 + b"garbage!" * 4, (2**40).to_bytes(HEADER_BYTES, "big")):
            reader, writer = await asyncio.open_connection(*address)
            writer.write(junk)
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
        assert echo.callers == [victim.peer_id] and echo.server.refused["handshake"] == 4
        assert len(signatures) == 2  # the server signed for none of them
        seen, _ = await _call(victim, echo.identity.peer_id, address)  # and it still serves honest callers
        assert seen == victim.peer_id
        await echo.server.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_caller_or_a_server_that_does_not_seal_is_refused_in_the_handshake():
    async def older_server(reader, writer) -> None:  # answers as servers did before sealing: no cipher
        await read_frames(reader, DirectHello, WireLimits())
        await write_frames(writer, [DirectChallenge(protocol_version=PROTOCOL_VERSION, nonce=os.urandom(32))])

    async def main():
        caller = load_identity(None)
        older = await asyncio.start_server(older_server, "127.0.0.1", 0)
        with pytest.raises(HandshakeError, match="seals with 'nothing', not 'aes-256-gcm'"):
            await _call(caller, load_identity(None).peer_id, ("127.0.0.1", older.sockets[0].getsockname()[1]))
        older.close()
        sealing, plain = EchoServer(), EchoServer(cipher="")
        address = await sealing.start()
        stream = await open_direct_stream(*address)
        with pytest.raises(HandshakeError, match="VERSION_MISMATCH this peer seals its direct calls"):
            await prove_to_server(caller, sealing.identity.peer_id, ECHO, stream, stream, None, cipher="")
        stream.close()
        # the plain baseline of the benchmark serves only callers built alike
        with pytest.raises(HandshakeError, match="VERSION_MISMATCH this peer does not seal"):
            await _call(caller, plain.identity.peer_id, await plain.start())
        assert sealing.callers == plain.callers == [] and sealing.server.refused["handshake"] == 1
        await sealing.server.close()
        await plain.server.close()

    asyncio.run(main())


async def until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
def test_calls_go_direct_where_the_address_answers_and_over_libp2p_otherwise():
    async def main():
        server_identity, caller_identity = load_identity(None), load_identity(None)
        server_p2p = await P2P.create(identity_path=server_identity.path)
        server = DirectPlane(server_p2p, server_identity)

        async def echo(info, reader, writer):
            await read_frames(reader, PeerInfoRequest, WireLimits())
            await write_frames(writer, [PeerInfo(model=info.peer_id.to_base58())])
            writer.close()

        await server.add_binary_stream_handler(ECHO, echo)
        address = await server.serve("127.0.0.1", 0, "127.0.0.1")
        maddrs = [str(m) for m in await server_p2p.get_visible_maddrs()]
        caller_p2p = await P2P.create(identity_path=caller_identity.path, initial_peers=maddrs)
        caller = DirectPlane(caller_p2p, caller_identity)
        gone: list[str] = []
        caller.on_gone.append(gone.append)  # a standby keeper's wake-up: its stage may be lost
        peer_id = PeerID.from_base58(server_identity.peer_id)

        async def call() -> str:
            reply, _ = await exchange(caller, peer_id, ECHO, [PeerInfoRequest()], PeerInfo, WireLimits())
            return reply.model

        assert await call() == caller_identity.peer_id and caller.calls["libp2p"] == 1  # no address known yet
        caller.addresses[server_identity.peer_id] = parse_direct_address(address)
        assert await call() == caller_identity.peer_id and caller.calls["direct"] == 1
        assert server.server.accepted == 1
        # a dead address: one failed try, then libp2p until the address changes or time passes
        caller.addresses[server_identity.peer_id] = ("127.0.0.2", parse_direct_address(address)[1])
        assert await call() == caller_identity.peer_id and await call() == caller_identity.peer_id
        assert caller.calls["direct_failed"] == 1 and caller.calls["libp2p"] == 3
        # that address refused, but the peer never answered there: no sign the peer is gone
        assert not caller.refused_since_answered(server_identity.peer_id)
        # where it answered, its port still takes a connection and holds it: alive. The server counts the connection
        # left unsaid apart, with no warning; a peer never reached is no sign either
        assert not await caller.confirm_refusal(server_identity.peer_id)
        await until(lambda: server.server.refused["empty"] == 1)
        assert server.server.refused["handshake"] == 0
        assert not await caller.confirm_refusal(caller_identity.peer_id)
        # where it answered, its process is being torn down: it takes one more connection and drops it, then
        # refuses. The call fails rather than go over libp2p (a killed peer's daemon can take the stream and hold
        # it for seconds), and so does the next, which tries the address again at the cost of a round trip (a peer
        # back there would answer)
        host, port = parse_direct_address(address)
        caller.addresses[server_identity.peer_id] = (host, port)
        await server.server.close()
        dropped = asyncio.Event()

        async def drop(reader, writer):
            writer.close()
            torn_down.close()
            dropped.set()

        torn_down = await asyncio.start_server(drop, host, port)
        with pytest.raises(PeerGone):
            await call()
        assert dropped.is_set() and caller.calls["direct_failed"] == 2
        assert caller.refused_since_answered(server_identity.peer_id)
        with pytest.raises(PeerGone):
            await call()
        assert caller.calls["direct_failed"] == 3 and caller.calls["libp2p"] == 3
        assert gone == [server_identity.peer_id], "told once, of the calls that found it gone"
        assert nothing_listens(caller, server_identity.peer_id, RuntimeError("stream reset"))
        assert not nothing_listens(server, caller_identity.peer_id, RuntimeError("stream reset"))
        await caller.shutdown()
        await server.shutdown()

    asyncio.run(main())


def test_addresses_are_parsed_strictly_and_the_announced_host_is_one_others_can_dial():
    assert parse_direct_address("10.0.0.5:4000") == ("10.0.0.5", 4000)
    assert parse_direct_address("[::1]:80") == ("::1", 80)
    assert parse_direct_address("gpu-7.lab:31337") == ("gpu-7.lab", 31337)
    for bad in ("10.0.0.5", "10.0.0.5:0", "10.0.0.5:70000", "a b:1", "x" * 80 + ":1", 5, None, "h:1:2"):
        assert parse_direct_address(bad) is None, bad
    assert listen_host(["/ip4/0.0.0.0/tcp/31337"]) == "0.0.0.0"
    assert listen_host([]) == "127.0.0.1"
    assert announce_host("127.0.0.1", []) == "127.0.0.1"
    visible = ["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/10.1.2.3/tcp/1/p2p/Qm"]
    assert announce_host("0.0.0.0", visible) == "10.1.2.3"
    assert announce_host("0.0.0.0", visible[:1]) == "127.0.0.1"


@pytest.mark.timeout(300)
def test_a_swarm_reached_directly_through_a_dead_address_and_over_libp2p_trains_as_one_process(local_swarm, tmp_path):
    steps = 3
    checkpoints = tmp_path / "checkpoints"
    local_swarm.start_bootstrap()
    local_swarm.start_peer("peer0", 0, peer_flags(checkpoints))  # direct
    # announces an address where nothing listens (it listens on 127.0.0.1): callers fall back to libp2p
    local_swarm.start_peer("peer1", 1, peer_flags(checkpoints, "--direct-host", "127.0.0.2"))
    local_swarm.start_peer("peer2", 2, peer_flags(checkpoints, "--direct-port", "-1"))  # libp2p only
    records = wait_for_records(
        local_swarm.initial_peers, lambda r: all(any(p.state == SERVING for p in r[s]) for s in range(3))
    )
    assert records[0][0].direct.startswith("127.0.0.1:") and records[1][0].direct.startswith("127.0.0.2:")
    assert records[2][0].direct == ""
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(steps, summary_file))
    assert trainer.wait(180) == 0, local_swarm.log_path("trainer").read_text()
    for stage in range(3):
        assert local_swarm.stop(f"peer{stage}") == 0
    summary = json.loads(summary_file.read_text())
    calls = summary["calls_by_path"]
    assert summary["steps"] == steps and calls["direct"] > 0 and calls["libp2p"] > 0 and calls["direct_failed"] >= 1
    assert "Cannot call" in local_swarm.log_path("trainer").read_text()
    # start-up as the summary and the peers tell it, counted from each process's launch
    assert 0 < summary["found_swarm_after_launch_s"] <= summary["first_step_after_launch_s"] < 180
    assert re.search(r"s after launch \(imports [\d.]+s, DHT", local_swarm.log_path("peer0").read_text())
    reference = reference_run(steps)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    for stage, module in enumerate(reference.stages):
        checkpoint = load_checkpoint(checkpoints, "gpt-tiny", stage, 3)
        assert checkpoint is not None and checkpoint.step == steps
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}")
