"""A DHT read of several keys asks each node once, for all of them, over real libp2p DHT nodes."""

from __future__ import annotations

import asyncio

import hivemind.dht.node as hivemind_node
import pytest
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarm.net.packed_walks import packing_walk

KEYS = ["swarm_stage_0", "swarm_stage_1"]


async def read_counting_calls(nodes: int) -> tuple[int, dict]:
    """Starts `nodes` DHT nodes and a reader, stores a value under each of KEYS, and reads both at once as the peers
    read stages (every replica asked); returns the reader's find calls and what it read."""
    first = await DHTNode.create()
    maddrs = [str(m) for m in await first.get_visible_maddrs()]
    others = [await DHTNode.create(initial_peers=maddrs) for _ in range(nodes - 1)]
    reader = await DHTNode.create(initial_peers=maddrs, cache_locally=False)
    try:
        for index, key in enumerate(KEYS):
            assert await first.store(key, f"record {index}", get_dht_time() + 60)
        calls = []
        original = reader.protocol.call_find

        async def counting(peer, keys):
            calls.append(tuple(keys))
            return await original(peer, keys)

        reader.protocol.call_find = counting
        found = await asyncio.wait_for(reader.get_many(KEYS, sufficient_expiration_time=float("inf")), 30)
        return len(calls), {key: value.value if value is not None else None for key, value in found.items()}
    finally:
        for node in [reader, *others, first]:
            await node.shutdown()


@pytest.mark.timeout(120)
def test_a_read_of_two_keys_asks_each_node_once_and_finds_both(monkeypatch):
    nodes = 4
    monkeypatch.setattr(hivemind_node, "traverse_dht", packing_walk(hivemind_node.traverse_dht))
    calls, found = asyncio.run(read_counting_calls(nodes))
    assert found == {"swarm_stage_0": "record 0", "swarm_stage_1": "record 1"}
    assert calls <= nodes  # each of the other nodes once, both keys in the one call


@pytest.mark.timeout(120)
def test_hiveminds_own_walk_asks_each_node_once_per_key():
    # the cost packing takes away: without it the same read calls every node twice
    walk = hivemind_node.traverse_dht
    assert not getattr(walk, "packs_queries", False)
    calls, found = asyncio.run(read_counting_calls(4))
    assert found == {"swarm_stage_0": "record 0", "swarm_stage_1": "record 1"}
    assert calls > 4


def test_packing_twice_wraps_once():
    packed = packing_walk(hivemind_node.traverse_dht)
    assert packing_walk(packed) is packed
