"""Whether other members can open connections to this process, and what its operator should do if not.

A peer behind NAT or a firewall can dial out but nobody can dial in: trainers and stage-mates could
not call it. Before its DHT node starts, a peer asks a member (an initial peer) to dial it back:

1. it starts a *listener*, a throwaway libp2p daemon with a new identity on the peer's --host-maddrs,
   that dials no one, so that nothing can reach it over a connection it opened itself;
2. from a second throwaway daemon it asks the member, over `/swarm/reach`, to dial the listener's
   peer id on the listener's ports (or those of --announce-maddrs) at the address the request came
   from: the member dials only the asker's own address, never one the asker names;
3. the member opens a new direct connection (the listener must prove its peer id in the handshake)
   and says what happened.

The answer decides how the peer's own daemon starts (see `swarm.net.dht_node.relay_options`): reachable,
it serves directly; unreachable, it reserves a slot on a relay and serves through it. Once serving,
the peer says plainly which it is and, if unreachable, which port to open. Every answer from the
network is bounded before it is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.config import NetworkConfig
from swarm.proto.reachability_pb2 import DialResult, ReachReply, ReachRequest

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

REACH_PROTOCOL = "/swarm/reach"
REACH_VERSION = 1
MAX_PORTS = 4  # ports a member dials for one request
MAX_TEXT = 300  # characters kept of an address or error a member sends
MAX_PEER_ID_BYTES = 128
MAX_MESSAGE_BYTES = 4096
FRAME_HEADER_BYTES = 8  # big-endian length, as in swarm.net.wire (whose torch this module does without)
READ_TIMEOUT = 10.0
DIAL_TIMEOUT = 5.0  # a member's dial back; a NAT that drops packets makes it wait this long
ASK_TIMEOUT = DIAL_TIMEOUT * MAX_PORTS + 10.0
MAX_MEMBERS_ASKED = 3
MAX_CONCURRENT_DIALS = 2  # requests a member answers at once; the others wait their turn
RELAY_WAIT = 20.0  # seconds a peer waits for its relay reservation before it reports without one


@dataclass(frozen=True)
class Reachability:
    """What a member found when it dialled this process back; `reachable` is None when nobody could tell."""

    reachable: bool | None
    results: tuple[tuple[str, bool, str], ...] = ()  # (address dialled, reached, error)
    checked_by: str = ""  # peer id of the member that dialled
    detail: str = ""  # why nobody could tell

    @property
    def addresses(self) -> list[str]:
        return [address for address, _, _ in self.results]

    @property
    def on_private_network(self) -> bool:
        """Reached, but only at private or loopback addresses: members on other networks may not."""
        return bool(self.reachable) and not any(_is_global(a) for a, reached, _ in self.results if reached)

    @property
    def for_daemon(self) -> bool | None:
        """What this process's daemon is told (see `swarm.net.dht_node.relay_options`): unreachable; reachable,
        if reached at a public address; else unknown, and the daemon's own AutoNAT decides."""
        return None if self.on_private_network else self.reachable


def observed_address(addr: Multiaddr | str) -> tuple[str, str] | None:
    """(ip4 or ip6, address) of a stream's remote end as a member sees it; None for a relayed one."""
    parts = str(addr).split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return parts[1], str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def dial_error(error: Exception) -> str:
    """The gist of a failed dial, on one line: the daemon's last reason, e.g. 'connection refused'."""
    text = " ".join(str(error).split()) or type(error).__name__
    if "connect: " in text:  # the socket's own error, after the daemon's account of its attempts
        return text.rsplit("connect: ", 1)[-1][:MAX_TEXT]
    return text[-MAX_TEXT:]


def _is_global(maddr: str) -> bool:
    parts = maddr.split("/")
    try:
        return len(parts) > 2 and parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_global
    except ValueError:
        return False


def _loopback(maddr: str) -> bool:
    parts = maddr.split("/")
    try:
        return len(parts) > 2 and parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


def tcp_ports(maddrs: Sequence[Multiaddr | str]) -> list[int]:
    """The distinct TCP ports of direct (not relayed) multiaddrs, in order."""
    ports: dict[int, None] = {}
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "p2p-circuit" in parts or "tcp" not in parts:
            continue
        with contextlib.suppress(ValueError, IndexError):
            ports[int(parts[parts.index("tcp") + 1])] = None
    return list(ports)


class ReachError(Exception):
    """A reachability message that breaks the rules: too large, malformed, cut short or late."""


async def write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    data = message.SerializeToString()
    writer.write(len(data).to_bytes(FRAME_HEADER_BYTES, "big") + data)
    await writer.drain()


async def read_message(reader: asyncio.StreamReader, message_type: type[M]) -> M:
    """One framed message of at most MAX_MESSAGE_BYTES, within READ_TIMEOUT."""
    try:
        header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER_BYTES), READ_TIMEOUT)
        size = int.from_bytes(header, "big")
        if size > MAX_MESSAGE_BYTES:
            raise ReachError(f"message of {size} bytes is over the limit of {MAX_MESSAGE_BYTES}")
        data = await asyncio.wait_for(reader.readexactly(size), READ_TIMEOUT)
        return message_type.FromString(data)
    except asyncio.IncompleteReadError:
        raise ReachError("stream ended in the middle of a message") from None
    except asyncio.TimeoutError:
        raise ReachError(f"no message within {READ_TIMEOUT:.0f}s") from None
    except DecodeError as e:
        raise ReachError(f"malformed {message_type.__name__}: {e}") from None


class ReachabilityService:
    """A member's side of `/swarm/reach`: dials an asker's listener back from this member's daemon.

    hivemind's P2P has no call that connects to a peer at given addresses; the daemon's client has
    (`connect`), and this uses it. The dial goes only to the address the request came from, at most
    MAX_PORTS ports, MAX_CONCURRENT_DIALS requests at a time, each dial bounded by DIAL_TIMEOUT: a
    stranger cannot make a member dial anyone but itself, nor tie it up.
    """

    def __init__(self, p2p: P2P) -> None:
        self.p2p = p2p
        self.dials = asyncio.Semaphore(MAX_CONCURRENT_DIALS)
        self.answered = 0

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Handler of REACH_PROTOCOL (a binary stream handler)."""
        try:
            request = await read_message(reader, ReachRequest)
            reply = await self.answer(stream_info.peer_id, stream_info.addr, request)
            await write_message(writer, reply)
            self.answered += 1
            # the asker closes once it has the reply; closing first could lose the reply
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(1), READ_TIMEOUT)
        except (ReachError, ConnectionError) as e:
            logger.debug(f"Reachability request from {stream_info.peer_id} failed: {e}")
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def answer(self, caller: PeerID, addr: Multiaddr, request: ReachRequest) -> ReachReply:
        """Dials the listener the request names at the caller's own address; says what happened."""
        if request.protocol_version != REACH_VERSION:
            return ReachReply(error=f"protocol version {request.protocol_version} is not {REACH_VERSION}")
        ports = list(dict.fromkeys(request.ports))
        if not 1 <= len(ports) <= MAX_PORTS or not all(1 <= port <= 65535 for port in ports):
            return ReachReply(error=f"give 1 to {MAX_PORTS} TCP ports within 1..65535")
        if not 0 < len(request.listener_id) <= MAX_PEER_ID_BYTES:
            return ReachReply(error="no valid listener peer id")
        try:
            listener = PeerID(request.listener_id)
            listener.to_base58()
        except Exception:
            return ReachReply(error="no valid listener peer id")
        if listener in (caller, self.p2p.peer_id):
            # a connection that already exists would prove nothing
            return ReachReply(error="the listener must be a peer that has not connected to this member")
        observed = observed_address(addr)
        if observed is None:
            return ReachReply(error="the request came through a relay; this member cannot see the asker's address")
        family, ip = observed
        reply = ReachReply()
        async with self.dials:
            for port in ports:
                address = f"/{family}/{ip}/tcp/{port}"
                error = await self._dial(listener, address)
                reply.results.append(DialResult(address=address, reachable=not error, error=error))
        return reply

    async def _dial(self, listener: PeerID, address: str) -> str:
        """'' if a new connection to `listener` at `address` succeeded, else why not."""
        client = self.p2p._client  # the daemon's client: hivemind's P2P does not expose connect
        try:
            await asyncio.wait_for(client.connect(listener, [Multiaddr(address)]), DIAL_TIMEOUT)
            return ""
        except asyncio.TimeoutError:
            return f"no answer in {DIAL_TIMEOUT:.0f}s"
        except Exception as e:
            return dial_error(e)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.disconnect(listener), DIAL_TIMEOUT)


async def serve_reachability(p2p: P2P, guard=None) -> ReachabilityService:
    """Serves REACH_PROTOCOL on `p2p` (behind `guard`, e.g. a StreamGate's, if given)."""
    service = ReachabilityService(p2p)
    handler = service.handle if guard is None else guard(service.handle, REACH_PROTOCOL)
    await p2p.add_binary_stream_handler(REACH_PROTOCOL, handler)
    return service


def _read_reply(reply: ReachReply, asked: list[int]) -> list[tuple[str, bool, str]]:
    """A member's dial results, bounded: at most one per port asked, text cut to MAX_TEXT."""
    results = []
    for result in list(reply.results)[: len(asked)]:
        results.append((result.address[:MAX_TEXT], bool(result.reachable), result.error[:MAX_TEXT]))
    return results


async def _ask(asker: P2P, member: PeerID, request: ReachRequest) -> ReachReply:
    _, reader, writer = await asker.call_binary_stream_handler(member, REACH_PROTOCOL)
    try:
        await write_message(writer, request)
        return await read_message(reader, ReachReply)
    finally:
        writer.close()


async def probe(config: NetworkConfig) -> Reachability:
    """Asks the initial peers, one after another, to dial this process back (see the module's docstring)."""
    members: dict[str, None] = {}
    for address in config.initial_peers:
        members.setdefault(address.rsplit("/p2p/", 1)[-1], None)
    if not members:
        return Reachability(None, detail="no --initial-peers to ask")
    listener = asker = None
    try:
        common = dict(use_relay=False, auto_nat=False, nat_port_map=False, startup_timeout=config.startup_timeout)
        listener = await P2P.create(host_maddrs=config.host_maddrs, dht_mode="client", **common)
        asker = await P2P.create(initial_peers=config.initial_peers, dht_mode="client", no_listen=True, **common)
        # a port forward's outside port is the one to try; else the ports the listener got
        ports = tcp_ports(config.announce_maddrs) or tcp_ports(await listener.get_visible_maddrs(latest=True))
        if not ports:
            return Reachability(None, detail="this process listens on no TCP port (see --host-maddrs)")
        request = ReachRequest(protocol_version=REACH_VERSION, listener_id=listener.peer_id.to_bytes())
        request.ports.extend(ports[:MAX_PORTS])
        errors = []
        for member in list(members)[:MAX_MEMBERS_ASKED]:
            try:
                reply = await asyncio.wait_for(_ask(asker, PeerID.from_base58(member), request), ASK_TIMEOUT)
            except Exception as e:
                errors.append(f"{member}: {str(e)[:MAX_TEXT] or type(e).__name__}")
                continue
            results = _read_reply(reply, list(request.ports))
            if not results:
                errors.append(f"{member}: {reply.error[:MAX_TEXT] or 'no answer'}")
                continue
            return Reachability(any(reached for _, reached, _ in results), tuple(results), checked_by=member)
        return Reachability(None, detail="; ".join(errors))
    except Exception as e:
        return Reachability(None, detail=f"the check could not run: {type(e).__name__}: {e}")
    finally:
        for p2p in (asker, listener):
            if p2p is not None:
                with contextlib.suppress(Exception):
                    await p2p.shutdown()


def check_before_start(config: NetworkConfig) -> Reachability:
    """`probe`, from synchronous code before the DHT forks (it leaves no thread or daemon running).

    Skipped with --no-check-reachability, and in a private swarm: its members answer no outsider, and
    the check asks from a throwaway identity.
    """
    if not config.check_reachability:
        return Reachability(None, detail="not checked (--no-check-reachability)")
    if config.allowlist is not None:
        return Reachability(None, detail="not checked in a private swarm (--allowlist)")
    if config.swarm_key_file is not None:
        return Reachability(None, detail="not checked in a private swarm (--swarm-key-file)")
    if all(_loopback(address) for address in config.host_maddrs):
        return Reachability(None, detail="listening on loopback only (--host-maddrs): only this machine can reach it")
    started = time.monotonic()
    reachability = asyncio.run(probe(config))
    logger.info(
        f"Reachability check took {time.monotonic() - started:.1f}s: "
        + {True: "reachable", False: "not reachable", None: "unknown"}[reachability.reachable]
    )
    return reachability


@dataclass
class Advice:
    """What to tell an operator about this process's reachability, once it serves."""

    reachable: bool | None
    message: str
    relays: list[str] = field(default_factory=list)


def advise(reachability: Reachability, config: NetworkConfig, visible: Sequence[str]) -> Advice:
    """The plain-words report: reachable where, or which port to open and which relay serves meanwhile."""
    relays = [address for address in visible if "/p2p-circuit" in address]
    if reachability.reachable:
        reached = [address for address, ok, _ in reachability.results if ok]
        who = f" (member {reachability.checked_by} opened a new connection to it there)"
        if reachability.on_private_network:
            who += "; a private address: members on other networks may not reach it"
        return Advice(True, f"reachable directly at {' '.join(reached)}{who}", relays)
    who = f" (member {reachability.checked_by} tried to open a new connection to it)"
    if reachability.reachable is None:
        return Advice(None, f"could not check whether others can reach this process: {reachability.detail}", relays)
    failed = "; ".join(f"{address}: {error}" for address, _, error in reachability.results)
    own_ports = tcp_ports(visible)
    fixed = [port for port in tcp_ports(config.host_maddrs) if port != 0]
    if fixed:
        todo = f"open TCP port {' '.join(map(str, fixed))} on your router or firewall (forwarded to this machine)"
    else:
        todo = (
            "start with a fixed port (--host-maddrs /ip4/0.0.0.0/tcp/PORT) and open it on your router or firewall "
            f"(forwarded to this machine; this run got port {' '.join(map(str, own_ports)) or '?'})"
        )
    message = (
        f"NOT reachable from outside ({failed}){who}: trainers and stage-mates cannot open connections to this "
        f"process. To serve directly, {todo}, and set --announce-maddrs to your public address if it differs. "
    )
    if relays:
        message += f"Meanwhile serving through relay {relays[0]}"
    elif config.use_relay and config.use_auto_relay:
        message += "No relay took this process yet: nobody can call it until one does (see --trusted-relays)"
    else:
        message += "Relays are off (--use-relay/--use-auto-relay): nobody can call this process"
    return Advice(False, message, relays)


async def report_reachability(reachability: Reachability, config: NetworkConfig, visible_maddrs) -> Advice:
    """Logs `advise`'s report once the relay reservation (if one is due) is in place or RELAY_WAIT passed.

    `visible_maddrs`: an async function returning this process's multiaddrs as others see them now.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RELAY_WAIT
    visible = [str(m) for m in await visible_maddrs()]
    if reachability.reachable is False and config.use_relay and config.use_auto_relay:
        while not any("/p2p-circuit" in m for m in visible) and loop.time() < deadline:
            await asyncio.sleep(0.5)
            visible = [str(m) for m in await visible_maddrs()]
    advice = advise(reachability, config, visible)
    (logger.info if advice.reachable else logger.warning)(f"Reachability: {advice.message}")
    return advice
