"""Private swarms with a shared key: the key file, the DHT's own calls, libp2p streams and direct-plane
handshakes behind it, and one clear error for a process with no key or another one."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import model_flags, trainer_flags
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm.config import NetworkConfig
from swarm.net import direct_handshake
from swarm.net.dht_node import JoinError, TetheredDHT, connect_to_daemon, start_dht
from swarm.net.direct_handshake import HandshakeError
from swarm.net.direct_plane import DirectPlane, DirectServer, parse_direct_address
from swarm.net.identity import load_identity
from swarm.net.keyed_p2p import KeyedP2P
from swarm.net.swarm_key import SwarmKeyError, make_swarm_key, read_swarm_key
from swarm.net.transport import get_peer_info
from swarm.records.stage_records import SERVING, fetch_stage_records

FLAGS = [*model_flags(), "--target-batch-size", "16", "--announce-period", "0.5"]
ECHO = "/swarm/test/keyed-echo"


def _swarm_key_command(path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "swarm.cli", "swarm-key", "--swarm-key-file", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_swarm_key_command_makes_a_key_only_its_owner_reads_and_refuses_one_others_can_read(tmp_path):
    path = tmp_path / "swarm.key"
    made = _swarm_key_command(path)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().startswith("/key/swarm/psk/1.0.0/\n/base16/\n")
    again = _swarm_key_command(path)  # an existing key is read, never replaced
    assert again.returncode == 0 and again.stdout == made.stdout and len(made.stdout.strip()) == 16
    path.chmod(0o644)
    refused = _swarm_key_command(path)
    assert refused.returncode == 2 and "chmod 600" in refused.stderr, refused.stderr
    with pytest.raises(SwarmKeyError, match="may be read by other users"):
        read_swarm_key(str(path))
    command = [
        sys.executable,
        "-m",
        "swarm",
        "status",
        "--initial-peers",
        "/ip4/127.0.0.1/tcp/9/p2p/" + load_identity(None).peer_id,
    ]
    started = subprocess.run([*command, "--swarm-key-file", str(path)], capture_output=True, text=True, timeout=60)
    assert started.returncode == 2, started.stderr
    assert started.stderr.strip().splitlines()[-1].startswith("swarm status: error: --swarm-key-file: "), started.stderr
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    with pytest.raises(SwarmKeyError, match="is not a swarm key"):
        read_swarm_key(str(bad))
    with pytest.raises(SwarmKeyError, match="exists"):
        make_swarm_key(str(bad))


def _keys(tmp_path: Path) -> tuple:
    return make_swarm_key(str(tmp_path / "a.key")), make_swarm_key(str(tmp_path / "b.key"))


@pytest.mark.timeout(180)
def test_outsiders_read_no_dht_record_and_a_wrong_or_missing_key_fails_to_join_with_one_clear_line(tmp_path):
    key, other = _keys(tmp_path)
    boot = TetheredDHT(swarm_key=key, start=True)
    peers = [str(a) for a in boot.get_visible_maddrs()]
    member = TetheredDHT(initial_peers=peers, swarm_key=key, start=True)
    outsiders = []
    try:
        assert member.store("private-record", b"secret", get_dht_time() + 120)
        assert boot.get("private-record", latest=True).value == b"secret"
        outsiders = [DHT(initial_peers=peers, start=True, ensure_bootstrap_success=False)]  # raw hivemind, no key
        outsiders.append(TetheredDHT(initial_peers=peers, swarm_key=other, start=True, ensure_bootstrap_success=False))
        for outsider in outsiders:
            assert outsider.get("private-record", latest=True) is None, "an outsider read a member's record"
            outsider.store("planted", b"x", get_dht_time() + 120)
        assert member.get("planted", latest=True) is None, "a member read a record an outsider stored"

        started = time.monotonic()
        with pytest.raises(JoinError, match="a private swarm answers only processes started with its --swarm-key-file"):
            start_dht(NetworkConfig(initial_peers=peers, check_reachability=False))
        with pytest.raises(JoinError, match=rf"{other.path} \(fingerprint {other.fingerprint}\); check that the"):
            start_dht(NetworkConfig(initial_peers=peers, swarm_key_file=other.path, check_reachability=False))
        assert time.monotonic() - started < 60, "a wrong key must fail fast, not hang"
    finally:
        for dht in (*outsiders, member, boot):
            dht.shutdown()


class NoLibp2p:
    """Stands in for the process's P2P: these calls go direct or not at all."""

    async def call_binary_stream_handler(self, *_):
        raise ConnectionError("libp2p is not part of this test")


def _caller(key) -> DirectPlane:
    p2p = NoLibp2p() if key is None else KeyedP2P(NoLibp2p(), key)
    return DirectPlane(p2p, load_identity(None), shared_memory=False)


@pytest.mark.timeout(120)
def test_a_direct_call_needs_the_swarm_key_and_a_server_signs_nothing_for_a_caller_without_it(tmp_path, monkeypatch):
    key, other = _keys(tmp_path)
    signed = []
    sign = direct_handshake._sign
    monkeypatch.setattr(direct_handshake, "_sign", lambda identity, data: signed.append(1) or sign(identity, data))

    async def main() -> None:
        server_identity = load_identity(None)
        server = DirectServer(server_identity, swarm_key=key.derive("direct"))

        async def echo(_info, reader, writer) -> None:
            writer.write(await reader.readexactly(4))
            await writer.drain()

        server.handlers[ECHO] = echo
        address = ("127.0.0.1", await server.start("127.0.0.1", 0))
        server_id = PeerID.from_base58(server_identity.peer_id)
        try:
            for plane in (_caller(key), _caller(key)):  # a full handshake, then a resumed one
                for _ in range(2):
                    _, reader, writer = await plane._open(server_id, server_identity.peer_id, address, ECHO)
                    writer.write(b"ping")
                    assert await reader.readexactly(4) == b"ping"
                    writer.close()
            served = len(signed)
            expected = {
                None: "belongs to a private swarm: this process must start with its --swarm-key-file",
                other: "holds another swarm key than this process's --swarm-key-file",
            }
            for caller_key, message in expected.items():
                with pytest.raises(HandshakeError, match=message):
                    await _caller(caller_key)._open(server_id, server_identity.peer_id, address, ECHO)
            # a caller that ignores the server's proof and signs anyway is refused before the server signs
            monkeypatch.setattr(direct_handshake, "_check_member", lambda *_: None)
            with pytest.raises((HandshakeError, asyncio.IncompleteReadError, ConnectionError)):
                await _caller(None)._open(server_id, server_identity.peer_id, address, ECHO)
            await asyncio.sleep(0.2)  # the server's side of that handshake ends
            assert len(signed) == served + 1, "the server signed for a caller without the key"  # the caller's own
            assert server.refused["handshake"] >= 3
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_keyed_caller_refuses_a_server_without_the_key(tmp_path):
    key, _ = _keys(tmp_path)

    async def main() -> None:
        server_identity = load_identity(None)
        server = DirectServer(server_identity)
        server.handlers[ECHO] = lambda *_: asyncio.sleep(0)
        address = ("127.0.0.1", await server.start("127.0.0.1", 0))
        try:
            with pytest.raises(HandshakeError, match="holds no swarm key: it is not a member"):
                server_id = PeerID.from_base58(server_identity.peer_id)
                await _caller(key)._open(server_id, server_identity.peer_id, address, ECHO)
        finally:
            await server.close()

    asyncio.run(main())


def _member_dht(local_swarm, key) -> TetheredDHT:
    return TetheredDHT(initial_peers=local_swarm.initial_peers, swarm_key=key, start=True)


def _wait_serving(dht: TetheredDHT, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        records = fetch_stage_records(dht, "swarm", 3)
        if all(any(r.state == SERVING for r in records[s]) for s in range(3)):
            return records
        assert time.monotonic() < deadline, f"the private swarm did not come up: {records}"
        time.sleep(0.3)


@pytest.mark.timeout(420)
def test_a_private_swarm_trains_and_serves_nothing_to_a_process_without_its_key(local_swarm, tmp_path):
    key, other = _keys(tmp_path)
    keyed = ["--swarm-key-file", key.path]
    local_swarm.start_bootstrap(keyed)
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, [*FLAGS, *keyed])
    summary = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", [*trainer_flags(2, summary, microbatch_size=4), *keyed])
    member = _member_dht(local_swarm, key)
    outsiders = [
        DHT(initial_peers=local_swarm.initial_peers, start=True, ensure_bootstrap_success=False),
        TetheredDHT(
            initial_peers=local_swarm.initial_peers, swarm_key=other, start=True, ensure_bootstrap_success=False
        ),
    ]
    try:
        records = _wait_serving(member)
        for outsider in outsiders:
            assert not any(fetch_stage_records(outsider, "swarm", 3).values()), "an outsider read stage records"
        peer1 = next(r for r in records[1] if r.state == SERVING)
        assert peer1.direct, "the peer announced no direct address"

        async def calls(dht, key) -> list[str]:
            p2p = await dht.replicate_p2p()
            plane = DirectPlane(p2p if key is None else KeyedP2P(p2p, key), load_identity(None), shared_memory=False)
            answered = []
            peer_id = PeerID.from_base58(peer1.peer_id)
            try:
                await get_peer_info(plane.p2p, peer_id, timeout=10)  # over libp2p
                answered.append("libp2p")
            except Exception:  # refused: the stream closed, or no reply in time
                pass
            try:
                address = parse_direct_address(peer1.direct)
                _, _, writer = await plane._open(peer_id, peer1.peer_id, address, "/swarm/info")
                writer.close()
                answered.append("direct")
            except HandshakeError as e:
                answered.append(f"refused: {e}")
            await p2p.shutdown()
            return answered

        assert asyncio.run(calls(member, key)) == ["libp2p", "direct"], "a member was refused"
        no_key = asyncio.run(calls(outsiders[0], None))
        assert no_key == [f"refused: {peer1.peer_id} belongs to a private swarm: this process must start with its "
                          "--swarm-key-file"], no_key  # fmt: skip
        wrong_key = asyncio.run(calls(outsiders[1], other))
        assert len(wrong_key) == 1 and "holds another swarm key" in wrong_key[0], wrong_key
        assert trainer.wait(300) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
        assert summary.exists()
    finally:
        for dht in (*outsiders, member):
            dht.shutdown()
    assert "without this swarm's key" in local_swarm.log_path("peer1").read_text()


@pytest.mark.timeout(60)
def test_connect_to_daemon_gives_a_keyed_client_only_with_a_key(tmp_path):
    key, _ = _keys(tmp_path)

    async def kinds() -> list[type]:
        found = []
        for dht in (open_dht, keyed_dht):
            p2p = await connect_to_daemon(dht)
            found.append(type(p2p))
            await p2p.shutdown()
        return found

    open_dht, keyed_dht = TetheredDHT(start=True), TetheredDHT(swarm_key=key, start=True)
    try:
        plain, keyed = asyncio.run(kinds())
        assert plain is not KeyedP2P and keyed is KeyedP2P
    finally:
        open_dht.shutdown()
        keyed_dht.shutdown()


@pytest.mark.timeout(120)
def test_a_libp2p_stream_needs_the_key_and_a_caller_cannot_hold_unproven_streams_without_bound(tmp_path):
    from hivemind.p2p import P2P

    from swarm.net.keyed_p2p import MAX_UNPROVEN_PER_CALLER

    key, other = _keys(tmp_path)

    async def echo(_info, reader, writer) -> None:
        writer.write(await reader.readexactly(4))
        await writer.drain()

    async def answered(caller, server_id) -> bool:
        _, reader, writer = await caller.call_binary_stream_handler(server_id, ECHO)
        try:
            writer.write(b"ping")
            await writer.drain()
            return await asyncio.wait_for(reader.readexactly(4), 15) == b"ping"
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        finally:
            writer.close()

    async def main() -> None:
        server = KeyedP2P(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), key)
        await server.add_binary_stream_handler(ECHO, echo)
        maddrs = await server.get_visible_maddrs()
        plain = await P2P.create(initial_peers=maddrs)
        try:
            assert await answered(KeyedP2P(plain, key), server.peer_id), "a member was refused"
            assert not await answered(KeyedP2P(plain, other), server.peer_id), "a caller with another key was served"
            assert server.refused["no_key"] == 1
            # streams that send nothing: past the bound, each is closed at once, unread
            held = [
                await plain.call_binary_stream_handler(server.peer_id, ECHO) for _ in range(MAX_UNPROVEN_PER_CALLER)
            ]
            await asyncio.sleep(0.5)
            assert not await answered(plain, server.peer_id), "a caller without the key was served"
            assert server.refused["busy"] >= 1
            for _, _, writer in held:
                writer.close()
        finally:
            await plain.shutdown()
            await server.shutdown()

    asyncio.run(main())
