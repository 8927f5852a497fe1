"""Direct connections from a peer behind NAT to the trainers that call it.

A peer nobody can dial serves through a relay, and a relay is a poor road for training traffic: it
carries every byte twice, and some relays cut a relayed connection after its first ~128 KiB. The
peer can still dial out. Trainers list where they listen in their signed progress records, so a
peer behind NAT opens a connection to each of them; a trainer's next call to the peer then travels
over that direct connection (libp2p prefers it to a relayed one) and never crosses the relay.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.records.trainer_records import fetch_trainer_records

logger = logging.getLogger(__name__)

PERIOD = 2.0  # seconds between reads of the trainers' records
DIAL_TIMEOUT = 5.0
FAILED_REDIAL_AFTER = 5.0  # a trainer still without a direct connection is dialled again after this
REDIAL_AFTER = 300.0  # a trainer not dialled for this long is forgotten


async def keep_direct_links(p2p: P2P, dht: DHT, run_id: str, period: float = PERIOD) -> None:
    """Until cancelled: keeps a direct connection open to every trainer of the run that lists its addresses."""
    loop = asyncio.get_running_loop()
    own = p2p.peer_id.to_base58()
    next_dial: dict[str, float] = {}
    linked: set[str] = set()
    while True:
        try:
            records = await loop.run_in_executor(None, fetch_trainer_records, dht, run_id)
            connections = await _connections(p2p)
        except Exception as e:
            logger.debug(f"Could not read the trainers' records or this peer's connections: {e}")
            records, connections = [], {}
        now = time.monotonic()
        for record in records:
            kinds = connections.get(record.peer_id, set())
            if record.peer_id == own or not record.addresses or record.finished or "direct" in kinds:
                continue
            if next_dial.get(record.peer_id, 0.0) > now:
                continue
            error = await _dial(p2p, record.peer_id, record.addresses, drop_relayed="relayed" in kinds)
            next_dial[record.peer_id] = now + FAILED_REDIAL_AFTER
            if error is None and record.peer_id not in linked:
                linked.add(record.peer_id)
                logger.info(f"Opened a direct connection to trainer {record.peer_id}: its calls skip the relay")
            elif error is not None:
                logger.debug(f"Could not dial trainer {record.peer_id} at {list(record.addresses)}: {error}")
        for peer_id in [p for p, t in next_dial.items() if t < now - REDIAL_AFTER]:  # trainers long gone
            next_dial.pop(peer_id)
            linked.discard(peer_id)
        await asyncio.sleep(period)


async def _connections(p2p: P2P) -> dict[str, set[str]]:
    """Peer id -> the kinds of connection this peer's daemon has open to it: "direct", "relayed"."""
    kinds: dict[str, set[str]] = {}
    for info in await p2p._client.list_peers():  # one entry per connection, named by its remote address
        for addr in info.addrs:
            kinds.setdefault(info.peer_id.to_base58(), set()).add("relayed" if "p2p-circuit" in str(addr) else "direct")
    return kinds


async def _dial(p2p: P2P, peer_id: str, addresses: tuple[str, ...], drop_relayed: bool) -> str | None:
    """Connects to `peer_id` at `addresses`; the error in words, or None.

    With a relayed connection open, libp2p counts the peer as connected and would not dial: that one is
    closed first (a call in flight on it fails, and its caller retries over the direct connection).
    """
    try:
        peer = PeerID.from_base58(peer_id)
        if drop_relayed:
            await asyncio.wait_for(p2p._client.disconnect(peer), DIAL_TIMEOUT)
        # hivemind exposes no public dial; its daemon client is the one way to ask for it
        await asyncio.wait_for(p2p._client.connect(peer, [Multiaddr(a) for a in addresses]), DIAL_TIMEOUT)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
