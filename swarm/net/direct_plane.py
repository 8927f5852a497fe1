"""The direct data plane: the swarm's protocols over plain TCP, beside libp2p, where peers can reach each other.

Every byte on libp2p goes through the p2pd daemon, which moves a 4 MiB tensor an order of magnitude
slower than a TCP socket does (`scripts/bench_transport.py`). On a lab's network the wire, not the
GPUs, would set the pace. So a peer also serves its protocols on a TCP address it announces in its
record (`StageRecord.direct`); a caller that knows the address dials it, and falls back to libp2p
(NAT, relays, a firewall, a peer that moved) when it cannot.

A call is one TCP connection, as on libp2p it is one stream: the handshake of
`swarm.net.direct_handshake` (both sides prove their identity key and agree on keys), then the very
frames, limits, codecs and handlers of the libp2p path, sealed (`swarm.net.frame_cipher`): encrypted and
authenticated, so that nobody on the path reads or alters gradients, activations or state. `DirectPlane`
stands in for the process's `P2P` object, so every call helper (`swarm.net.transport.exchange`) and every
handler works on both paths unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

from swarm.net.direct_handshake import HandshakeError, Session, SessionStore, prove_to_caller, prove_to_server
from swarm.net.direct_stream import DirectStream, open_direct_stream, start_direct_server
from swarm.net.frame_cipher import CIPHER, FrameTampered
from swarm.net.identity import Identity
from swarm.net.keyed_p2p import KeyedP2P
from swarm.net.shared_memory import ArenaPool, SharedMemoryLink, remove_stale_arenas, shared_memory_available

logger = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[None]]

CONNECT_TIMEOUT = 3.0  # seconds to connect and finish the handshake before falling back to libp2p
UNREACHABLE_FOR = 60.0  # seconds a peer's direct address is left alone after it failed
MAX_HANDSHAKES = 64  # connections a server lets finish their handshake at once; more are closed unread
MAX_ADDRESS_CHARS = 64
ADDRESS = re.compile(r"([0-9A-Za-z.\-]{1,48}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


class PeerGone(ConnectionRefusedError):
    """A call's peer refuses connections at the direct address it answered at: its process is gone."""


@dataclass(frozen=True)
class DirectStreamInfo:
    """What a handler learns about a call on the direct plane, as hivemind's stream info tells it on libp2p."""

    peer_id: PeerID  # proven by the handshake
    proto: str
    addr: str  # the caller's TCP address


def parse_direct_address(address: object) -> tuple[str, int] | None:
    """(host, port) of an announced direct address "HOST:PORT" ("[V6]:PORT" for IPv6); None if malformed."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS:
        return None
    found = ADDRESS.fullmatch(address)
    if found is None or not 0 < int(found.group(2)) < 65536:
        return None
    return found.group(1).strip("[]"), int(found.group(2))


def format_direct_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tune(stream: DirectStream) -> None:
    sock = stream.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class DirectServer:
    """Accepts direct calls: a handshake proves the caller's peer id, then the protocol's handler runs."""

    def __init__(
        self,
        identity: Identity,
        max_handshakes: int = MAX_HANDSHAKES,
        arenas: ArenaPool | None = None,
        cipher: str = CIPHER,
        swarm_key: bytes = b"",
    ) -> None:
        """`cipher`: what connections are sealed with; "" (nothing) only for a benchmark's plain baseline,
        and then only callers that say "" too are served. `swarm_key`: a private swarm's key, derived for this
        plane (b"": an open swarm); only callers that hold it are served."""
        self.identity = identity
        self.cipher = cipher
        self.swarm_key = swarm_key
        self.arenas = arenas  # None: no shared memory with callers on this host
        self.max_handshakes = max_handshakes
        self.handlers: dict[str, Handler] = {}
        self.sessions = SessionStore()
        self.accepted = 0  # calls whose caller proved its key
        self.shared_calls = 0  # of those, calls whose tensors pass through shared memory
        self.refused: Counter[str] = Counter()  # connections closed unserved, per reason
        self._handshaking = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (port 0: any free one); returns the port."""
        self._server = await start_direct_server(self._accept, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    async def _accept(self, stream: DirectStream) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._serve_connection(stream)
        finally:
            if task is not None:
                self._tasks.discard(task)
            with contextlib.suppress(Exception):
                stream.close()

    async def _serve_connection(self, stream: DirectStream) -> None:
        # the stream is the handlers' reader and writer both
        reader = writer = stream
        peer = stream.get_extra_info("peername")
        address = format_direct_address(str(peer[0]), int(peer[1])) if peer else "?"
        if self._handshaking >= self.max_handshakes:
            self._refuse("busy", f"over {self.max_handshakes} handshakes at once, lately from {address}")
            return
        _tune(stream)
        self._handshaking += 1
        shared = SharedMemoryLink(self.arenas) if self.arenas is not None else None
        try:
            caller, protocol, keys = await prove_to_caller(
                self.identity, self.sessions, reader, writer, shared, self.cipher, self.swarm_key
            )
        except (HandshakeError, ConnectionError, OSError) as e:
            if shared is not None:
                shared.close()
            if stream.received == 0:  # connected and left unsaid: a caller checking that the port is open
                self.refused["empty"] += 1
                return
            self._refuse("handshake", f"from {address}: {e}")
            return
        finally:
            self._handshaking -= 1
        if keys is not None:
            stream.seal(keys)
        if _use_shared_memory(stream, shared):
            self.shared_calls += 1
        handler = self.handlers.get(protocol)
        if handler is None:  # as libp2p does with a protocol nobody registered: the stream is closed
            self._refuse("protocol", f"{protocol!r} from {caller}: not served here")
            return
        self.accepted += 1
        try:
            await handler(DirectStreamInfo(PeerID.from_base58(caller), protocol, address), reader, writer)
        except FrameTampered:
            pass  # a handler that lets wire errors through: its call ends here, counted below
        if stream.tampered is not None:
            self._refuse("tampered", f"a call from {caller} at {address}: {stream.tampered}")

    def _refuse(self, reason: str, what: str) -> None:
        self.refused[reason] += 1
        count = self.refused[reason]
        if count in (1, 10, 100) or count % 1000 == 0:
            logger.warning(f"Refused {count} direct connection(s) ({reason}) so far; lately {what}")


class DirectPlane:
    """This process's network: its libp2p `P2P`, plus the direct TCP plane to the peers that announce one.

    It answers the calls a `P2P` does (anything else is passed on to the `P2P` itself): a handler is
    served on both paths, and a call goes direct when the callee's record gave an address and the
    address answered with the right peer id, else over libp2p.
    """

    def __init__(
        self,
        p2p: P2P | KeyedP2P,
        identity: Identity,
        dial: bool = True,
        shared_memory: bool = True,
        cipher: str = CIPHER,
    ) -> None:
        """`dial`: call peers directly where they announce an address; `shared_memory`: pass tensors through
        /dev/shm to and from processes on this host; `cipher`: what direct connections are sealed with (""
        only for a benchmark's plain baseline: such a plane calls and serves only planes built alike). In a private
        swarm `p2p` is a `KeyedP2P`, whose swarm key the direct plane demands and proves too."""
        self.p2p = p2p
        self.identity = identity
        self.cipher = cipher
        self.swarm_key = p2p.swarm_key.derive("direct") if isinstance(p2p, KeyedP2P) else b""
        self.dial = dial  # False: every call goes over libp2p (`--no-direct`)
        # callers and servers on one host pass tensors through /dev/shm (`--no-shared-memory`: never)
        self.arenas = ArenaPool() if shared_memory and shared_memory_available() else None
        if self.arenas is not None:
            remove_stale_arenas()
        # holds every protocol registered on this process; it listens only once `serve` starts it
        self.server = DirectServer(identity, arenas=self.arenas, cipher=cipher, swarm_key=self.swarm_key)
        self.address = ""  # what this process announces, once serving
        self.addresses: dict[str, tuple[str, int]] = {}  # peer id -> its announced direct address
        self.calls: Counter[str] = Counter()  # calls opened per path: direct, libp2p; and direct tries that failed
        self._sessions: dict[str, Session] = {}  # per peer id: the session to resume
        self._unreachable: dict[str, tuple[tuple[str, int], float]] = {}  # peer id -> (address, until)
        # peer id -> (address, time.monotonic()) of the last direct call it answered, and of the last one its
        # address refused: see `refused_since_answered`
        self._answered: dict[str, tuple[tuple[str, int], float]] = {}
        self._refused: dict[str, tuple[tuple[str, int], float]] = {}
        self._told_gone: dict[str, tuple[tuple[str, int], float]] = {}  # peer id -> the answer it was logged gone after
        # called with a peer's id once it is found gone (see `PeerGone`): a standby keeper learns of a stage's death
        # from the call that found it, not a period later from its record
        self.on_gone: list[Callable[[str], None]] = []

    def __getattr__(self, name: str):
        return getattr(self.p2p, name)

    async def serve(self, host: str, port: int, announce_host: str) -> str:
        """Serves the handlers registered so far, and later ones, on host:port; returns the address to
        announce ("" if `announce_host` is empty: others cannot be told how to reach this process)."""
        port = await self.server.start(host, port)
        self.address = format_direct_address(announce_host, port) if announce_host else ""
        listening = format_direct_address(host, port)
        logger.info(f"Direct data plane on {listening}, announced as {self.address or '(none: not reachable)'}")
        return self.address

    async def add_binary_stream_handler(self, protocol: str, handler: Handler, *args, **kwargs) -> None:
        await self.p2p.add_binary_stream_handler(protocol, handler, *args, **kwargs)
        self.server.handlers[protocol] = handler

    async def remove_binary_stream_handler(self, protocol: str) -> None:
        self.server.handlers.pop(protocol, None)
        await self.p2p.remove_binary_stream_handler(protocol)

    async def shutdown(self) -> None:
        await self.server.close()
        await self.p2p.shutdown()
        if self.arenas is not None:
            self.arenas.close()

    def learn(self, records: Iterable) -> None:
        """Takes note of the direct addresses in peers' records (anything with `peer_id` and `direct`)."""
        for record in records:
            address = parse_direct_address(record.direct) if record.direct else None
            if record.peer_id == self.identity.peer_id:
                continue
            if address is None:
                self.addresses.pop(record.peer_id, None)
                continue
            if self.addresses.get(record.peer_id) != address:
                self.addresses[record.peer_id] = address
                self._unreachable.pop(record.peer_id, None)

    async def call_binary_stream_handler(self, peer_id: PeerID, protocol: str):
        """Opens a call to `protocol` on a peer: (stream info, reader, writer), directly if it can.

        Raises `PeerGone` where the direct address the peer answered at refuses the connection, or drops it and
        then refuses the next (see `confirm_refusal`): its process is gone, and libp2p would reach only its daemon,
        which can take the stream and hold it for seconds before failing (a mate's round waited 2 s on one, the
        trainers with it; a restorer's join, 5 s).
        """
        peer = peer_id.to_base58()
        address = self.addresses.get(peer) if self.dial else None
        # a peer whose address refused since it answered is tried directly again: a refusal costs a round trip
        gone_before = self.refused_since_answered(peer)
        if address is not None and (gone_before or not self._known_unreachable(peer, address)):
            try:
                opening = asyncio.ensure_future(self._open(peer_id, peer, address, protocol))
                opening.add_done_callback(_retrieved)
                opened = await asyncio.wait_for(opening, CONNECT_TIMEOUT)
            except (OSError, HandshakeError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                self.calls["direct_failed"] += 1
                where = format_direct_address(*address)
                if isinstance(e, ConnectionRefusedError):
                    self._refused[peer] = (address, time.monotonic())
                elif not isinstance(e, asyncio.TimeoutError) and self._answered.get(peer, (None,))[0] == address:
                    # a process being torn down takes a connection and drops it: the next ones it refuses
                    await self.confirm_refusal(peer)
                if self.refused_since_answered(peer):
                    if self._told_gone.get(peer) != self._answered[peer]:  # once, of the calls in flight together
                        self._told_gone[peer] = self._answered[peer]
                        logger.info(f"Peer {peer} refuses connections at {where}, where it answered: it is gone")
                        for hook in self.on_gone:
                            hook(peer)
                    raise PeerGone(f"nothing listens at {where}, where peer {peer} answered: it is gone") from e
                self._unreachable[peer] = (address, time.monotonic() + UNREACHABLE_FOR)
                logger.info(
                    f"Cannot call {peer} directly at {where} ({type(e).__name__}: {e}); "
                    f"using libp2p for {UNREACHABLE_FOR:.0f}s"
                )
            else:
                self.calls["direct"] += 1
                self._answered[peer] = (address, time.monotonic())
                return opened
        self.calls["libp2p"] += 1
        return await self.p2p.call_binary_stream_handler(peer_id, protocol)

    def refused_since_answered(self, peer: str) -> bool:
        """Whether the direct address at which `peer` answered a call refused a connection since: nothing listens
        where the peer's process served (it is gone), which no slow answer on a loaded host looks like."""
        answered, refused = self._answered.get(peer), self._refused.get(peer)
        return answered is not None and refused is not None and refused[0] == answered[0] and refused[1] > answered[1]

    async def confirm_refusal(self, peer: str, tries: int = 10, pause: float = 0.1) -> bool:
        """After a call to `peer` failed otherwise: whether the direct address at which it answered before refuses
        connections now. A killed process's port can still take a connection while the process is torn down, which
        it then resets: that is tried again, `pause` seconds apart, `tries` times at most; a connection held open
        (a live process, slow to answer the call) ends the check at once."""
        answered = self._answered.get(peer)
        if answered is None:
            return False
        for _ in range(tries):
            if self.refused_since_answered(peer):
                break
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(*answered[0]), CONNECT_TIMEOUT)
            except ConnectionRefusedError:
                self._refused[peer] = (answered[0], time.monotonic())
                break
            except (OSError, asyncio.TimeoutError):
                return False
            try:
                await asyncio.wait_for(reader.read(1), pause)
            except asyncio.TimeoutError:
                return False  # held open: something serves there
            except OSError:
                pass  # reset: torn down
            finally:
                writer.close()
            await asyncio.sleep(pause)
        return self.refused_since_answered(peer)

    def _known_unreachable(self, peer: str, address: tuple[str, int]) -> bool:
        known = self._unreachable.get(peer)
        if known is None:
            return False
        if known[0] != address or time.monotonic() > known[1]:
            del self._unreachable[peer]
            return False
        return True

    async def _open(self, peer_id: PeerID, peer: str, address: tuple[str, int], protocol: str):
        for _ in range(2):  # a second, full handshake if the peer has forgotten the session
            stream = await open_direct_stream(*address)
            shared = SharedMemoryLink(self.arenas) if self.arenas is not None else None
            try:
                _tune(stream)
                session = self._sessions.get(peer)
                opened = await prove_to_server(
                    self.identity, peer, protocol, stream, stream, session, shared, self.cipher, self.swarm_key
                )
            except BaseException:
                if shared is not None:
                    shared.close()
                stream.close()
                raise
            if opened is not None:
                self._sessions[peer] = opened.session
                if opened.keys is not None:
                    stream.seal(opened.keys)
                if _use_shared_memory(stream, shared):
                    self.calls["shared_memory"] += 1
                return DirectStreamInfo(peer_id, protocol, format_direct_address(*address)), stream, stream
            if shared is not None:
                shared.close()
            self._sessions.pop(peer, None)
            stream.close()
        raise HandshakeError("the peer forgot the session twice")


def _use_shared_memory(stream: DirectStream, shared: SharedMemoryLink | None) -> bool:
    """Hands the stream what its handshake agreed on for shared memory; whether there was anything (if not,
    the link is closed)."""
    if shared is None:
        return False
    if not shared.active or stream.is_closing():
        shared.close()
        return False
    stream.shared = shared
    return True


def listen_host(host_maddrs: Iterable[str]) -> str:
    """The host the direct plane listens on: that of the first IP address libp2p listens on (127.0.0.1 if none)."""
    for maddr in host_maddrs:
        parts = str(maddr).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return "127.0.0.1"


def announce_host(listen_host: str, maddrs: Iterable[str]) -> str:
    """The host to announce for a direct plane listening on `listen_host`: that host itself, or where it
    listens on every interface, the first IPv4 address in `maddrs` other than loopback (then loopback)."""
    try:
        unspecified = ipaddress.ip_address(listen_host).is_unspecified
    except ValueError:
        return listen_host  # a host name: others resolve it
    if not unspecified:
        return listen_host
    found = [m.split("/")[2] for m in maddrs if m.startswith("/ip4/") and len(m.split("/")) > 2]
    public = [h for h in found if not (ipaddress.ip_address(h).is_loopback or ipaddress.ip_address(h).is_unspecified)]
    return public[0] if public else ("127.0.0.1" if found else "")


def _retrieved(task: asyncio.Future) -> None:
    """Marks a connection attempt's failure as seen: a call cancelled while it failed (its caller's deadline) would
    otherwise leave asyncio to log "Task exception was never retrieved" with a traceback, for an ordinary failure."""
    if not task.cancelled():
        task.exception()
