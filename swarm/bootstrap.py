"""`swarm dht`: a stable entry point to the swarm's DHT that hosts no stage."""

from __future__ import annotations

import logging
import os
import signal
import tempfile

from swarm.config import DHTConfig
from swarm.dht_node import start_dht

logger = logging.getLogger(__name__)


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` so that readers see either nothing or all of it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def run_bootstrap(config: DHTConfig) -> None:
    """Runs a DHT node until SIGTERM or Ctrl-C, printing the addresses others join with."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    dht = start_dht(config)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        logger.info("DHT node is up. Join with: --initial-peers " + " ".join(maddrs))
        if config.address_file:
            write_atomically(config.address_file, "\n".join(maddrs) + "\n")
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        logger.info("Stopping the DHT node")
    finally:
        dht.shutdown()
