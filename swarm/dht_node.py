"""Starting this process's node of the swarm's DHT from a network config."""

from __future__ import annotations

from hivemind import DHT

from swarm.config import NetworkConfig


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
