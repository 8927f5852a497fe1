"""Accusations: a vouched trainer's signed word that a peer answered a forward wrongly, and how peers read it.

A trainer that spot-checks a forward (`swarm.trainer.spot_checks`) and finds one peer's outputs
disagreeing with two others' at the same step signs an accusation with its vouched Ed25519 key (the
key of its receipts), naming the run, the stage, the accused, the step, the microbatch and the digests
of both answers, and carrying its voucher. It publishes its accusations under the run's accusations
key, subkey its own identity (signed like every record: no one writes another trainer's accusations).

Readers check each accusation against their trust root before it costs anything: fields bounded,
the voucher the root's, the signature good, the publisher the trainer named. Without a trust root
no accusation counts (anyone could make one). An accused peer stays accused for the reader's life.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.proto import Voucher
from swarm.records.stage_records import PEER_ID, ownership_problem
from swarm.trust.receipts import ReceiptSigner
from swarm.trust.vouchers import KEY_BYTES, MAX_NAME, TrustRoot

logger = logging.getLogger(__name__)

ACCUSATION_DOMAIN = b"swarm-accusation-v1\0"  # what the signature is for: never mistaken for a receipt
MAX_PER_TRAINER = 32  # accusations one trainer's record carries (its latest)
MAX_ACCUSED = 1024  # distinct accused peers a reader remembers
MAX_SEEN = 65536  # accusations whose check is remembered
MAX_RUN_ID = 128
MAX_WITNESSES = 4
MAX_DIGEST = 64
SIGNATURE_BYTES = 64
RECORD_TTL = 300.0  # seconds; the trainer renews its record while it runs
MAX_INT = 2**62


def accusations_key(run_id: str) -> str:
    """The DHT key under which the trainers of a run publish their accusations."""
    return f"{run_id}.accusations"


@dataclass(frozen=True)
class Accusation:
    """One trainer's signed word that `accused` answered a forward of `stage` wrongly."""

    run_id: str
    trainer: str  # the accuser's peer id (the record it comes in is signed by that identity)
    stage: int
    accused: str
    step: int  # the step every answer was computed at
    microbatch: int
    accused_digest: str  # of the accused's outputs
    witness_digest: str  # of the outputs the witnesses agreed on
    witnesses: tuple[str, ...]  # the peers whose answers agreed with each other, not with the accused's
    voucher_name: str
    voucher_key: bytes
    voucher_signature: bytes
    signature: bytes = b""

    def voucher(self) -> Voucher:
        return Voucher(name=self.voucher_name, public_key=self.voucher_key, signature=self.voucher_signature)

    def message(self) -> bytes:
        """The bytes the signature covers: every field but the signature, as canonical JSON."""
        fields = self.to_value()
        del fields["signature"]
        return ACCUSATION_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_value(self) -> dict:
        value = asdict(self)
        value["witnesses"] = list(self.witnesses)
        for name in ("voucher_key", "voucher_signature", "signature"):
            value[name] = base64.b64encode(value[name]).decode()
        return value

    @classmethod
    def from_value(cls, value: object) -> Accusation | None:
        """Parses one accusation from the network; None unless every field is present and in bounds."""
        if not isinstance(value, dict) or set(value) != {f for f in cls.__dataclass_fields__}:
            return None
        try:
            raw = {name: base64.b64decode(value[name], validate=True) for name in _BYTES}
        except (binascii.Error, ValueError, TypeError):
            return None
        texts = (value["run_id"], value["voucher_name"], value["accused_digest"], value["witness_digest"])
        if not all(isinstance(t, str) for t in texts) or len(value["run_id"]) > MAX_RUN_ID:
            return None
        if (
            len(value["voucher_name"]) > MAX_NAME
            or max(len(value["accused_digest"]), len(value["witness_digest"])) > MAX_DIGEST
        ):
            return None
        witnesses = value["witnesses"]
        if not isinstance(witnesses, list) or not 0 < len(witnesses) <= MAX_WITNESSES:
            return None
        if not all(
            isinstance(p, str) and PEER_ID.fullmatch(p) for p in [value["trainer"], value["accused"], *witnesses]
        ):
            return None
        if not all(_is_int(value[name]) for name in ("stage", "step", "microbatch")):
            return None
        if len(raw["voucher_key"]) != KEY_BYTES or len(raw["signature"]) != SIGNATURE_BYTES:
            return None
        return cls(**{**value, **raw, "witnesses": tuple(witnesses)})

    def problem(self, root: TrustRoot, run_id: str) -> str | None:
        """What keeps this accusation from counting under `root` for `run_id` (None: it counts)."""
        if self.run_id != run_id:
            return "an accusation of another run"
        if self.accused in self.witnesses or self.trainer == self.accused:
            return "an accusation whose accused is its own witness"
        if not root.vouches(self.voucher()):
            return "an accusation signed by a key the trust root did not vouch for"
        try:
            Ed25519PublicKey.from_public_bytes(self.voucher_key).verify(self.signature, self.message())
        except InvalidSignature:
            return "an accusation whose signature does not hold"
        return None


_BYTES = ("voucher_key", "voucher_signature", "signature")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def sign_accusation(signer: ReceiptSigner, trainer: str, **fields) -> Accusation:
    """An accusation by `trainer` of the named fields, signed with its receipt key and carrying its voucher."""
    voucher = signer.voucher
    unsigned = Accusation(
        run_id=signer.run_id,
        trainer=trainer,
        voucher_name=voucher.name,
        voucher_key=bytes(voucher.public_key),
        voucher_signature=bytes(voucher.signature),
        **fields,
    )
    return Accusation(
        **{**asdict(unsigned), "witnesses": unsigned.witnesses, "signature": signer.key.sign(unsigned.message())}
    )


def publish_accusations(dht: DHT, run_id: str, accusations: list[Accusation], ttl: float = RECORD_TTL) -> bool:
    """Stores (or renews) this trainer's latest accusations, signed by its identity; blocking, call it off the loop."""
    value = {"accusations": [a.to_value() for a in accusations[-MAX_PER_TRAINER:]]}
    return bool(dht.store(accusations_key(run_id), value, get_dht_time() + ttl, subkey=dht.identity.owner))


def fetch_accusations(dht: DHT, run_id: str) -> list[Accusation]:
    """The well-formed accusations of a run, each in the record of the trainer it names; blocking."""
    found = dht.get(accusations_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return parse_records(found.value.items(), getattr(dht, "allowlist", None))


def parse_records(items: Iterable[tuple[object, object]], allowlist=None) -> list[Accusation]:
    """The well-formed accusations among (subkey, DHT item) pairs: at most MAX_PER_TRAINER per record, each
    naming as its trainer the identity that signed the record (signatures are checked by `AccusationBook`)."""
    found = []
    for subkey, item in items:
        value = getattr(item, "value", None)
        entries = value.get("accusations") if isinstance(value, dict) else None
        if not isinstance(entries, list) or len(entries) > MAX_PER_TRAINER:
            continue
        for entry in entries:
            accusation = Accusation.from_value(entry)
            if accusation is not None and ownership_problem(accusation.trainer, subkey, allowlist) is None:
                found.append(accusation)
    return found


class AccusationBook:
    """The peers accused by accusations that hold under a trust root; each named once in the log."""

    def __init__(self, root: TrustRoot, run_id: str, reader: str) -> None:
        self.root = root
        self.run_id = run_id
        self.reader = reader  # who reads: named in the log line ("trainer", "stage 1 peer ...")
        self.accused: dict[str, Accusation] = {}  # per accused peer, the first accusation that held
        self._seen: set[bytes] = set()  # hashes of the accusations already checked
        self.refused = 0  # accusations that did not hold

    def take(self, accusations: Iterable[Accusation]) -> list[str]:
        """Checks the accusations not seen before; returns the peers newly accused."""
        new = []
        for accusation in accusations:
            # the whole accusation, not its signature alone: a forged copy of a good one must not hide it
            seen = hashlib.sha256(accusation.message() + accusation.signature).digest()
            if seen in self._seen or len(self.accused) >= MAX_ACCUSED:
                continue
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()  # checked again, at 80 us each: never more than a bounded memory
            self._seen.add(seen)
            if (problem := accusation.problem(self.root, self.run_id)) is not None:
                self.refused += 1
                logger.debug(f"Ignoring {problem} (of {accusation.accused} by {accusation.trainer})")
                continue
            if accusation.accused not in self.accused:
                self.accused[accusation.accused] = accusation
                new.append(accusation.accused)
                logger.warning(
                    f"{self.reader}: peer {accusation.accused} of stage {accusation.stage} is accused by trainer "
                    f"{accusation.trainer} ({accusation.voucher_name}): its forward of microbatch "
                    f"{accusation.microbatch} at step {accusation.step} gave {accusation.accused_digest}, peers "
                    f"{', '.join(accusation.witnesses)} gave {accusation.witness_digest}; it is left out from now on"
                )
        return new

    async def read(self, dht: DHT) -> list[str]:
        """Reads the run's accusations from the DHT (off the loop) and takes them in (on it, where the book is
        read); returns the newly accused."""
        found = await asyncio.get_running_loop().run_in_executor(None, fetch_accusations, dht, self.run_id)
        return self.take(found)


def accusation_book(trust_root: str | None, run_id: str, reader: str) -> AccusationBook | None:
    """The book of a process whose swarm has `trust_root` (None in an open swarm: accusations do not count)."""
    if trust_root is None:
        return None
    return AccusationBook(TrustRoot.from_text(trust_root), run_id, reader)
