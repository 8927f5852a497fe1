"""hivemind's own DHT calls (ping, store, find) behind a private swarm's key.

hivemind's DHT protocol passes every request and response through an authorizer (`AuthRPCWrapper`): the
caller signs its request, the server drops one that does not validate (the caller gets an error, never a
record), and the caller drops a response that does not validate. Here both are an HMAC with a key derived
from the swarm key, over the whole message, its time and a random nonce: a process without the key can
neither read nor store a record, nor enter a member's routing table, and a member never takes a record
from a process without it. A request is good for a minute and once (its nonce is remembered).
"""

from __future__ import annotations

import hmac
import logging
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from swarm.net.swarm_key import SwarmKey, keyed_mac

logger = logging.getLogger(__name__)

MAX_CLOCK_SKEW = 60.0  # seconds a request's time may differ from this node's clock
NONCE_BYTES = 16
MAX_NONCES = 200_000  # requests remembered against replay (each for 3 x MAX_CLOCK_SKEW)


def _message_mac(key: bytes, role: bytes, message) -> bytes:
    """The MAC of `message` with its signature field empty (as it is when signed)."""
    return keyed_mac(key, role, message.SerializeToString(deterministic=True))


class SwarmKeyAuthorizer(AuthorizerBase):
    """Signs and checks every DHT request and response with the swarm key (see the module's docstring)."""

    def __init__(self, swarm_key: SwarmKey) -> None:
        self.key = swarm_key.derive("dht")
        self.described = swarm_key.describe()
        self.refused = {"request": 0, "response": 0}
        self._nonces: TimedStorage[bytes, None] = TimedStorage(maxsize=MAX_NONCES)

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: RSAPublicKey | None) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = _message_mac(self.key, b"request", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        if not hmac.compare_digest(signature, _message_mac(self.key, b"request", request)):
            return self._refuse("request", "a DHT request without this swarm's key")
        now = get_dht_time()
        if abs(auth.time - now) > MAX_CLOCK_SKEW:
            return self._refuse("request", f"a DHT request made {now - auth.time:.0f}s ago (clocks apart, or replayed)")
        with self._nonces.freeze():
            if auth.nonce in self._nonces:
                return self._refuse("request", "a replayed DHT request")
        self._nonces.store(auth.nonce, None, now + 3 * MAX_CLOCK_SKEW)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = _message_mac(self.key, b"response", response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        if auth.nonce != request.auth.nonce or not hmac.compare_digest(
            signature, _message_mac(self.key, b"response", response)
        ):
            return self._refuse("response", "a DHT answer from a node without this swarm's key")
        return True

    def _refuse(self, kind: str, what: str) -> bool:
        self.refused[kind] += 1
        count = self.refused[kind]
        if count in (1, 10, 100) or count % 1000 == 0:
            logger.warning(
                f"Ignored {count} DHT {kind}(s) so far; lately {what}. Members must all start with the same "
                f"key file: this node holds {self.described}"
            )
        return False
