"""The swarm's libp2p streams behind a private swarm's key.

hivemind 1.1.12's libp2p daemon has no private-network (PSK) option, so a connection cannot be refused for
want of the key; instead every stream of the swarm's own protocols starts with a proof of it. The caller
writes, before anything else, an HMAC (with a key derived from the swarm key) of its own peer id, the
callee's and the protocol; the callee reads those 32 bytes first and closes a stream whose proof does not
hold, before its handler sees a byte. libp2p authenticates both peer ids and encrypts the stream, so a proof
can be neither read on the wire nor used by anyone else, for another callee or another protocol. It costs
one HMAC and 32 bytes per stream, and no round trip.

`KeyedP2P` stands in for a `P2P` and does this on both sides; hivemind's DHT calls have their own check
(`swarm.net.dht_auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from swarm.net.swarm_key import SwarmKey, keyed_mac

logger = logging.getLogger(__name__)

PROOF_BYTES = 32
PROOF_TIMEOUT = 10.0  # seconds a caller has to send its proof
# streams one caller may hold open before sending a proof: the swarm's own gate (per-caller stream bound,
# allowlist) sits behind this check, so without a bound here a caller could hold streams open for free
MAX_UNPROVEN_PER_CALLER = 8

Handler = Callable[..., Awaitable[None]]


class KeyedP2P:
    """A `P2P` whose binary stream calls and handlers prove, and demand, the swarm key (see the module's
    docstring); anything else is passed on to the `P2P` itself."""

    def __init__(self, p2p: P2P, swarm_key: SwarmKey) -> None:
        self.p2p = p2p
        self.swarm_key = swarm_key
        self._key = swarm_key.derive("stream")
        self.refused: Counter[str] = Counter()  # streams closed unanswered, per reason
        self._unproven: Counter[str] = Counter()  # per caller: its streams waiting for a proof now

    def __getattr__(self, name: str):
        return getattr(self.p2p, name)

    def proof(self, caller: PeerID, callee: PeerID, protocol: str) -> bytes:
        """What `caller` sends first on a stream to `protocol` on `callee`."""
        return keyed_mac(self._key, caller.to_bytes(), callee.to_bytes(), protocol.encode())

    async def call_binary_stream_handler(self, peer_id: PeerID, protocol: str):
        """Opens a stream to `protocol` on `peer_id`, with this process's proof of the key sent first."""
        info, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, protocol)
        writer.write(self.proof(self.p2p.peer_id, peer_id, protocol))
        await writer.drain()
        return info, reader, writer

    async def add_binary_stream_handler(self, protocol: str, handler: Handler, *args, **kwargs) -> None:
        """Serves `protocol` with `handler` to callers that prove the key; a stream that does not is closed."""
        await self.p2p.add_binary_stream_handler(protocol, self._admit(handler, protocol), *args, **kwargs)

    def _admit(self, handler: Handler, protocol: str) -> Handler:
        async def admit(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            caller = str(stream_info.peer_id)
            if self._unproven[caller] >= MAX_UNPROVEN_PER_CALLER:
                self._refuse(
                    writer, "busy", f"{protocol} from {caller}: over {MAX_UNPROVEN_PER_CALLER} streams unproven"
                )
                return
            self._unproven[caller] += 1
            try:
                proof = await asyncio.wait_for(reader.readexactly(PROOF_BYTES), PROOF_TIMEOUT)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                proof = b""
            finally:
                self._unproven[caller] -= 1
                if not self._unproven[caller]:
                    del self._unproven[caller]
            if not hmac.compare_digest(proof, self.proof(stream_info.peer_id, self.p2p.peer_id, protocol)):
                self._refuse(writer, "no_key", f"{protocol} from {caller}")
                return
            await handler(stream_info, reader, writer)

        return admit

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, what: str) -> None:
        self.refused[reason] += 1
        count = self.refused[reason]
        if count in (1, 10, 100) or count % 1000 == 0:
            lacking = "without this swarm's key" if reason == "no_key" else "from a caller holding too many unproven"
            logger.warning(
                f"Refused {count} stream(s) {lacking} so far; lately {what}. This process holds "
                f"{self.swarm_key.describe()}: a member of this swarm must start with the same key file"
            )
        with contextlib.suppress(Exception):
            writer.close()
