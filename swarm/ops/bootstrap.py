"""`swarm dht`: a stable entry point to the swarm's DHT that hosts no stage."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import threading

from swarm.config import DHTConfig
from swarm.net.allowlist import StreamGate
from swarm.net.dht_node import TetheredDHT, connect_to_daemon, start_dht
from swarm.net.reachability import serve_reachability

logger = logging.getLogger(__name__)


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` so that readers see either nothing or all of it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def answer_reachability(dht: TetheredDHT, ready: threading.Event) -> None:
    """Serves `/swarm/reach` from this node's daemon, on an event loop of its own, until the process ends."""

    async def serve() -> None:
        p2p = await connect_to_daemon(dht)
        gate = StreamGate(dht.allowlist, max_per_caller=8)
        await serve_reachability(p2p, gate.guard)
        ready.set()
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except Exception as e:
        logger.warning(f"This node cannot answer reachability checks ({type(e).__name__}: {e})")
    finally:
        ready.set()


def run_bootstrap(config: DHTConfig) -> None:
    """Runs a DHT node until SIGTERM or Ctrl-C, printing the addresses others join with."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    # a bootstrap node is there to be reached, and relays for members behind NAT: it is told so rather
    # than left to AutoNAT, whose late verdict would restart the daemon's relay and drop every slot on it
    dht = start_dht(config, reachable=True)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        logger.info("DHT node is up. Join with: --initial-peers " + " ".join(maddrs))
        # members about to join ask this node to dial them back (see swarm.net.reachability)
        answering = threading.Event()
        threading.Thread(target=answer_reachability, args=(dht, answering), name="reachability", daemon=True).start()
        answering.wait(timeout=config.startup_timeout)
        if config.address_file:
            write_atomically(config.address_file, "\n".join(maddrs) + "\n")
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        logger.info("Stopping the DHT node")
    finally:
        dht.shutdown()
