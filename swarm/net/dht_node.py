"""Starting this process's node of the swarm's DHT from a network config."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import ValidationError
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.config import NetworkConfig
from swarm.net.allowlist import Allowlist, AllowlistError, AllowlistValidator, load_allowlist
from swarm.net.dht_auth import SwarmKeyAuthorizer
from swarm.net.identity import Identity, IdentityError, forget_generated, load_identity
from swarm.net.keyed_p2p import KeyedP2P
from swarm.net.packed_walks import pack_walk_queries
from swarm.net.swarm_key import SwarmKey, SwarmKeyError, load_swarm_key
from swarm.process.lifeline import child_pids, watch_parent

logger = logging.getLogger(__name__)

BOOTSTRAP_PINGS = 5  # rounds of pings to the initial peers, a second apart, before none answering is final


class TetheredDHT(DHT):
    """A hivemind DHT whose child process, with its libp2p daemon, ends when its parent process dies.

    hivemind's child outlives a parent killed by SIGKILL (or by any signal before it shut the DHT
    down): it holds both ends of its command pipe, so it never sees the parent go, and its p2pd
    stays with it. Here the child watches its parent and shuts down when it has gone.

    It also holds this process's identity (a new one unless `identity` is given): its daemon's
    peer id, whose key signs every record this node stores and whose signature validator checks
    every record it stores for others or reads (see `swarm.net.identity`). With an allowlist, it
    refuses to store or return records of peers outside it. With a swarm key, it answers only DHT calls
    signed with it, and takes answers only so signed (see `swarm.net.dht_auth`).
    """

    def __init__(
        self,
        initial_peers: list[str] | None = None,
        *,
        identity: Identity | None = None,
        allowlist: Allowlist | None = None,
        swarm_key: SwarmKey | None = None,
        daemon_flags: dict[str, Any] | None = None,
        **kwargs,
    ) -> None:
        self.identity = identity or load_identity(None)
        self.daemon_flags = daemon_flags or {}  # extra libp2p daemon flags (see add_daemon_flags)
        self.allowlist = allowlist
        self.swarm_key = swarm_key
        if swarm_key is not None:
            kwargs["authorizer"] = SwarmKeyAuthorizer(swarm_key)
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
        if self.daemon_flags:
            add_daemon_flags(self.daemon_flags)
        pack_walk_queries()  # a read of several stages: one call to each node asked, not one a stage
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


def relay_relays(config: NetworkConfig) -> list[str]:
    """The relays a process unreachable from outside reserves a slot on: one address per relay.

    The --trusted-relays, or else the --initial-peers. The daemon counts each address given as a relay
    of its own and waits (3 minutes) for as many as it was given, so a peer named twice, as a bootstrap
    node printing two addresses is, must be named once.
    """
    relays: dict[str, str] = {}
    for address in config.trusted_relays or config.initial_peers:
        relays.setdefault(address.rsplit("/p2p/", 1)[-1], address)
    return list(relays.values())


def relay_options(config: NetworkConfig, reachable: bool | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """hivemind's DHT options, and extra libp2p daemon flags, for NAT: relays, auto-relay, client mode.

    `reachable` is what the reachability check found (None: unknown). The daemon's own AutoNAT cannot
    tell: its helpers refuse to dial private addresses, so on a LAN, or behind NAT with helpers on
    one, it never decides and its auto-relay never starts. So the check's answer is forced on it:
    unreachable, it reserves a slot on a relay at once and announces the relayed address beside its
    own; reachable, it never uses one.

    hivemind always has the daemon look for relays among its DHT neighbours, and then waits until it
    has found four or 3 minutes have passed: the extra flags give it a fixed list of relays instead
    (see relay_relays), which it uses at once.
    """
    options: dict[str, Any] = {"use_relay": config.use_relay, "use_auto_relay": False}
    flags: dict[str, Any] = {} if config.relay_service else {"relayService": False}
    relays = relay_relays(config)
    if config.use_relay and config.use_auto_relay and not config.client_mode and relays:
        options["use_auto_relay"] = True
        flags.update(relayDiscovery=False, trustedRelays=",".join(relays))
    if reachable is not None:
        options["force_reachability"] = "public" if reachable else "private"
    if config.client_mode:
        # hivemind's client mode: no DHT duties. It still listens (on --host-maddrs): a member behind NAT
        # that it reaches through a relay dials back to it for a direct connection (libp2p's hole
        # punching), which spares the relay the bulk of the traffic
        options["client_mode"] = True
    return options, flags


def add_daemon_flags(flags: dict[str, Any]) -> None:
    """Has every libp2p daemon this process starts from now on run with `flags` too.

    hivemind 1.1.12 does not pass these through (`P2P.create` takes a fixed set of options); this
    adds them to the command line it builds. Called in the DHT's own child process only.
    """
    build = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        return build(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)


def start_dht(config: NetworkConfig, reachable: bool | None = None) -> DHT:
    """Starts a DHT node (a child process with its own libp2p daemon) and joins the swarm.

    The node's process and daemon end with this process, however it ends. It forks, so call it
    before starting threads or touching CUDA. Raises JoinError when the node cannot start or none
    of the initial peers answers. `reachable`: whether others can dial this process, if known (see
    `swarm.net.reachability`); one that cannot serves through a relay.
    """
    try:
        identity = load_identity(config.identity_path)
        allowlist = load_allowlist(config.allowlist)
        swarm_key = load_swarm_key(config.swarm_key_file)
    except (IdentityError, AllowlistError) as e:
        raise JoinError(str(e)) from None
    except SwarmKeyError as e:
        raise JoinError(f"--swarm-key-file: {e}") from None
    if allowlist is not None and not allowlist.admits(identity.peer_id):
        logger.warning(
            f"This process's peer id {identity.peer_id} is not in --allowlist {allowlist.path}: the other members "
            "will refuse it. Add it there (and start with the same --identity-path), or use an identity on the list"
        )
    options, flags = relay_options(config, reachable)
    try:
        dht = TetheredDHT(
            initial_peers=config.initial_peers or None,
            identity=identity,
            allowlist=allowlist,
            swarm_key=swarm_key,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs or None,
            startup_timeout=config.startup_timeout,
            start=True,
            daemon_flags=flags,
            # the first ping of the initial peers is one of several (`_answered_ping`), not the last word
            ensure_bootstrap_success=False,
            **options,
        )
    except Exception as e:
        if "bootstrap failed" in str(e) or "failed to connect to bootstrap peers" in str(e):
            raise JoinError(_unanswered(config, swarm_key)) from None
        if "local time must be within" in str(e):  # hivemind's check of the bootstrap node's clock
            raise JoinError(_clock_skew(e)) from None
        raise JoinError(
            f"could not start this process's DHT node on {' '.join(config.host_maddrs)} "
            f"({type(e).__name__}: {e}); check --host-maddrs and --identity-path"
        ) from None
    if config.initial_peers:
        _join(dht, config, swarm_key)
    return dht


def _join(dht: DHT, config: NetworkConfig, swarm_key: SwarmKey | None) -> None:
    """Has the started node find one of the initial peers answering (`_answered_ping`); shuts it down and raises
    JoinError, saying what to check, when none does."""
    try:
        answered = dht.run_coroutine(functools.partial(_answered_ping, config.initial_peers, BOOTSTRAP_PINGS))
    except ValidationError as e:  # hivemind's checks of the answering node's clock, and that it can dial back
        dht.shutdown()
        if "local time must be within" in str(e):
            raise JoinError(_clock_skew(e)) from None
        raise JoinError(f"joining the swarm's DHT failed ({e}); check --host-maddrs and --announce-maddrs") from None
    if not answered:
        dht.shutdown()
        raise JoinError(_unanswered(config, swarm_key))


async def _answered_ping(initial_peers: list[str], rounds: int, _dht: DHT, node: DHTNode) -> bool:
    """In the DHT's process: whether one of `initial_peers` answers a ping within `rounds` rounds, a second apart
    (each ping has the peer dial this node back, within hivemind's RPC timeout, and checks its clock); the node that
    answers enters the routing table, and the node then looks up its neighbours. One unanswered ping is no proof: a
    bootstrap node on a loaded machine missed it, and three newcomers in a row gave up on a swarm that was up."""
    peers = list({PeerID.from_base58(Multiaddr(address)["p2p"]) for address in initial_peers})
    for attempt in range(1, rounds + 1):
        answers = await asyncio.gather(*(node.protocol.call_ping(peer, validate=True, strict=True) for peer in peers))
        if any(answer is not None for answer in answers):
            await asyncio.wait([asyncio.ensure_future(node.find_nearest_nodes([node.node_id]))], timeout=10.0)
            return True
        if attempt < rounds:
            logger.warning(
                f"None of --initial-peers answered a DHT ping within {node.protocol.wait_timeout:.0f}s (a loaded "
                f"node?); asking again ({attempt}/{rounds - 1})"
            )
            await asyncio.sleep(1.0)
    return False


def _clock_skew(error: Exception) -> str:
    return (
        f"this machine's clock differs from the swarm's by more than 3 s ({error}): DHT records carry "
        "wall-clock expiry times, so clocks must agree; synchronize it (e.g. enable NTP: "
        "`timedatectl set-ntp true`) and start again"
    )


def _unanswered(config: NetworkConfig, swarm_key: SwarmKey | None) -> str:
    """Why joining failed when no initial peer answered, and what to check."""
    peers = " ".join(config.initial_peers)
    if swarm_key is not None:
        return (
            f"none of --initial-peers answered with this swarm's key ({peers}): this process holds "
            f"{swarm_key.describe()}; check that the members use a copy of the same key file (`swarm swarm-key "
            "--swarm-key-file PATH` prints a key's fingerprint), and that they are up and reachable from here"
        )
    return (
        f"none of --initial-peers answered ({peers}): check the addresses, and that those peers are up and "
        "reachable from here; a private swarm answers only processes started with its --swarm-key-file"
    )


async def connect_to_daemon(dht: DHT, attempts: int = 5) -> P2P | KeyedP2P:
    """A P2P client in this process on the DHT's libp2p daemon, so both share one peer id.

    With a swarm key (a `TetheredDHT`'s), the client is a `KeyedP2P`: its streams prove the key, and its
    handlers demand it. Retried: on a loaded machine the daemon's control socket has refused the first connection.
    """
    swarm_key = getattr(dht, "swarm_key", None)
    for attempt in range(1, attempts + 1):
        try:
            p2p = await dht.replicate_p2p()
            return p2p if swarm_key is None else KeyedP2P(p2p, swarm_key)
        except OSError as e:
            if attempt == attempts or not dht.is_alive():
                raise RuntimeError(f"cannot reach the libp2p daemon of this process's DHT node: {e}") from e
            logger.warning(f"The libp2p daemon refused a connection ({e}); retrying ({attempt}/{attempts})")
            await asyncio.sleep(attempt)
    raise AssertionError("unreachable")
