"""Starting this process's node of the swarm's DHT from a network config."""

from __future__ import annotations

import asyncio
import logging

from hivemind import DHT
from hivemind.p2p import P2P

from swarm.config import NetworkConfig

logger = logging.getLogger(__name__)


def start_dht(config: NetworkConfig) -> DHT:
    """Starts a DHT node (a child process with its own libp2p daemon) and joins the swarm.

    It forks, so call it before starting threads or touching CUDA.
    """
    return DHT(
        initial_peers=config.initial_peers or None,
        host_maddrs=config.host_maddrs,
        announce_maddrs=config.announce_maddrs or None,
        identity_path=config.identity_path,
        startup_timeout=config.startup_timeout,
        start=True,
    )


async def connect_to_daemon(dht: DHT, attempts: int = 5) -> P2P:
    """A P2P client in this process on the DHT's libp2p daemon, so both share one peer id.

    Retried: on a loaded machine the daemon's control socket has refused the first connection.
    """
    for attempt in range(1, attempts + 1):
        try:
            return await dht.replicate_p2p()
        except OSError as e:
            if attempt == attempts or not dht.is_alive():
                raise RuntimeError(f"cannot reach the libp2p daemon of this process's DHT node: {e}") from e
            logger.warning(f"The libp2p daemon refused a connection ({e}); retrying ({attempt}/{attempts})")
            await asyncio.sleep(attempt)
    raise AssertionError("unreachable")
