"""Starting this process's node of the swarm's DHT from a network config."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from hivemind import DHT
from hivemind.p2p import P2P

from swarm.allowlist import Allowlist, AllowlistError, AllowlistValidator, load_allowlist
from swarm.config import NetworkConfig
from swarm.identity import Identity, IdentityError, forget_generated, load_identity
from swarm.lifeline import child_pids, watch_parent

logger = logging.getLogger(__name__)


class TetheredDHT(DHT):
    """A hivemind DHT whose child process, with its libp2p daemon, ends when its parent process dies.

    hivemind's child outlives a parent killed by SIGKILL (or by any signal before it shut the DHT
    down): it holds both ends of its command pipe, so it never sees the parent go, and its p2pd
    stays with it. Here the child watches its parent and shuts down when it has gone.

    It also holds this process's identity (a new one unless `identity` is given): its daemon's
    peer id, whose key signs every record this node stores and whose signature validator checks
    every record it stores for others or reads (see `swarm.identity`). With an allowlist, it
    refuses to store or return records of peers outside it.
    """

    def __init__(
        self,
        initial_peers: list[str] | None = None,
        *,
        identity: Identity | None = None,
        allowlist: Allowlist | None = None,
        **kwargs,
    ) -> None:
        self.identity = identity or load_identity(None)
        self.allowlist = allowlist
        validators = [self.identity.validator]
        if allowlist is not None:
            validators.append(AllowlistValidator(allowlist))
        # a key made for this run cannot be in use elsewhere: skip hivemind's check (a second daemon)
        kwargs.setdefault("check_if_identity_free", not self.identity.generated)
        try:
            super().__init__(initial_peers, identity_path=self.identity.path, record_validators=validators, **kwargs)
        finally:
            if kwargs.get("start"):
                forget_generated(self.identity)  # the daemon has read it, or failed to

    def run(self) -> None:
        """The child process: hivemind's DHT loop, and a thread that ends it when the parent dies."""
        # hivemind stops a child that does not shut down in time with SIGTERM, but the child inherits
        # its parent's handling of it: a handler, or blocked (the bootstrap node waits for it in sigwait)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        watch_parent(self._parent_pid, self._shutdown_orphan, name="dht-parent-watch")
        super().run()

    def _shutdown_orphan(self) -> None:
        logger.warning("The process that started this DHT node has gone; shutting the node down")
        # the request DHT.shutdown sends: the node stops its libp2p daemon and removes its sockets
        with contextlib.suppress(OSError, ValueError):
            self._outer_pipe.send(("_shutdown", [], {}))
        time.sleep(self.shutdown_timeout)
        # still here: the node's loop is stuck; end its daemon too rather than count on SIGPIPE
        for pid in child_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(1)


class JoinError(RuntimeError):
    """This process could not start its DHT node or join the swarm: the message says what to check."""


def start_dht(config: NetworkConfig) -> DHT:
    """Starts a DHT node (a child process with its own libp2p daemon) and joins the swarm.

    The node's process and daemon end with this process, however it ends. It forks, so call it
    before starting threads or touching CUDA. Raises JoinError when the node cannot start or none
    of the initial peers answers.
    """
    try:
        identity = load_identity(config.identity_path)
        allowlist = load_allowlist(config.allowlist)
    except (IdentityError, AllowlistError) as e:
        raise JoinError(str(e)) from None
    if allowlist is not None and not allowlist.admits(identity.peer_id):
        logger.warning(
            f"This process's peer id {identity.peer_id} is not in --allowlist {allowlist.path}: the other members "
            "will refuse it. Add it there (and start with the same --identity-path), or use an identity on the list"
        )
    try:
        return TetheredDHT(
            initial_peers=config.initial_peers or None,
            identity=identity,
            allowlist=allowlist,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs or None,
            startup_timeout=config.startup_timeout,
            start=True,
        )
    except Exception as e:
        if "bootstrap failed" in str(e) or "failed to connect to bootstrap peers" in str(e):
            raise JoinError(
                f"none of --initial-peers answered ({' '.join(config.initial_peers)}): check the addresses, "
                "and that those peers are up and reachable from here"
            ) from None
        raise JoinError(
            f"could not start this process's DHT node on {' '.join(config.host_maddrs)} "
            f"({type(e).__name__}: {e}); check --host-maddrs and --identity-path"
        ) from None


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
