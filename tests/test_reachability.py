"""The reachability check over real libp2p daemons on 127.0.0.1: a member dials the asker back, and
refuses what it must not dial. (The same check across a NAT is tests/test_nat.py.)"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID

from swarm.config import ConfigError, DHTConfig, NetworkConfig, PeerConfig, TrainerConfig
from swarm.net.dht_node import relay_options
from swarm.net.reachability import (
    MAX_MESSAGE_BYTES,
    REACH_VERSION,
    Reachability,
    ReachabilityService,
    ReachError,
    advise,
    check_before_start,
    probe,
    read_message,
)
from swarm.proto.reachability_pb2 import ReachRequest


def test_a_member_dials_the_asker_back(local_swarm):
    initial_peers = local_swarm.start_bootstrap()
    config = NetworkConfig(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    result = asyncio.run(probe(config))
    assert result.reachable is True, result
    (address,) = result.addresses
    assert address.startswith("/ip4/127.0.0.1/tcp/") and result.checked_by == initial_peers[0].rsplit("/", 1)[-1]
    # reached on a private network only: the daemon is not told it is public, and the operator is told why
    assert result.on_private_network and result.for_daemon is None
    assert "members on other networks may not reach it" in advise(result, config, []).message
    # a process that only listens on loopback is not checked: nobody outside could reach it anyway
    assert check_before_start(config).reachable is None


def test_a_member_dials_only_the_askers_own_address_and_refuses_bad_requests():
    async def main():
        member, listener = await P2P.create(), await P2P.create()
        try:
            service = ReachabilityService(member)
            caller = PeerID.from_base58("QmRMUvia16n8ZC9wQFro5GhFNQ9oNFAFKTPGDobmhDyQkq")  # a stranger's id
            seen_at = "/ip4/127.0.0.1/tcp/40000"

            def request(ports, listener_id=listener.peer_id.to_bytes(), version=REACH_VERSION):
                return ReachRequest(protocol_version=version, listener_id=listener_id, ports=ports)

            (port,) = {int(str(m).split("/")[4]) for m in await listener.get_visible_maddrs()}
            reply = await service.answer(caller, seen_at, request([port]))
            assert [(r.address, r.reachable) for r in reply.results] == [(f"/ip4/127.0.0.1/tcp/{port}", True)]
            # a listener gone: nothing listens on its port any more
            gone = await P2P.create()
            (gone_port,) = {int(str(m).split("/")[4]) for m in await gone.get_visible_maddrs()}
            await gone.shutdown()
            reply = await service.answer(caller, seen_at, request([gone_port], listener_id=gone.peer_id.to_bytes()))
            (result,) = reply.results
            assert not result.reachable and result.error == "connection refused", reply

            refusals = [
                (request([port], version=99), seen_at),
                (request(list(range(1000, 1005))), seen_at),  # more than MAX_PORTS
                (request([0]), seen_at),
                (request([port], listener_id=b"\x00" * 500), seen_at),
                (request([port], listener_id=caller.to_bytes()), seen_at),  # would prove nothing
                (request([port]), f"/ip4/11.0.0.1/tcp/4100/p2p/{caller}/p2p-circuit"),  # no address to dial
            ]
            for bad, address in refusals:
                reply = await service.answer(caller, address, bad)
                assert reply.error and not reply.results, (bad, reply)
        finally:
            await member.shutdown()
            await listener.shutdown()

    asyncio.run(main())


def test_an_oversized_or_cut_message_is_refused_before_it_is_read():
    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_message(reader, ReachRequest)

    with pytest.raises(ReachError, match="over the limit"):
        asyncio.run(read((MAX_MESSAGE_BYTES + 1).to_bytes(8, "big")))
    with pytest.raises(ReachError, match="ended"):
        asyncio.run(read((100).to_bytes(8, "big") + b"\x08"))


def test_the_advice_names_the_port_to_open_and_the_relay():
    config = NetworkConfig(host_maddrs=["/ip4/0.0.0.0/tcp/4100"])
    unreachable = Reachability(False, (("/ip4/1.2.3.4/tcp/4100", False, "connection refused"),), checked_by="QmA")
    relay = "/ip4/5.6.7.8/tcp/4100/p2p/QmR/p2p-circuit/p2p/QmMe"
    advice = advise(unreachable, config, ["/ip4/192.168.1.2/tcp/4100/p2p/QmMe", relay])
    assert advice.message.startswith("NOT reachable") and "open TCP port 4100" in advice.message
    assert advice.message.endswith(f"serving through relay {relay}")
    advice = advise(unreachable, NetworkConfig(host_maddrs=["/ip4/0.0.0.0/tcp/0"]), ["/ip4/10.0.0.2/tcp/39999"])
    assert "fixed port" in advice.message and "39999" in advice.message and "No relay" in advice.message
    reachable = Reachability(True, (("/ip4/1.2.3.4/tcp/4100", True, ""),), checked_by="QmA")
    assert advise(reachable, config, []).message.startswith("reachable directly at /ip4/1.2.3.4/tcp/4100")


def test_relay_flags_reach_the_daemon_and_bad_ones_are_refused():
    boot = "/ip4/1.2.3.4/tcp/4100/p2p/QmRMUvia16n8ZC9wQFro5GhFNQ9oNFAFKTPGDobmhDyQkq"
    same_node_on_loopback = boot.replace("1.2.3.4", "127.0.0.1")
    options, flags = relay_options(NetworkConfig(initial_peers=[boot, same_node_on_loopback]), reachable=False)
    assert options["use_auto_relay"] and options["force_reachability"] == "private"
    # one address per relay: the daemon waits for as many relays as it is given addresses
    assert flags == {"relayDiscovery": False, "trustedRelays": boot}
    options, flags = relay_options(NetworkConfig(initial_peers=[boot], client_mode=True, relay_service=False))
    assert options["client_mode"] and not options["use_auto_relay"]
    assert flags == {"relayService": False}
    for config_type in (PeerConfig, DHTConfig):
        with pytest.raises(ConfigError, match="--client-mode"):
            config_type(client_mode=True).check()
    TrainerConfig(client_mode=True).check()
    with pytest.raises(ConfigError, match="--trusted-relays"):
        NetworkConfig(trusted_relays=["/ip4/1.2.3.4/tcp/4100"]).check()
