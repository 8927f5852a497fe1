"""Checking each signed DHT record once, however many nodes hand it over.

A read of a stage's records gets the same signed records back from every node holding a replica of
the key (five, and the readers' caches), and every one of them was checked again: RSA verification
and the parsing of the owner's key, about 0.4 ms a record on a loaded core. A peer holding standby
copies reads more stages a period, and that checking was the largest part of the DHT process's
added CPU (scripts/bench_standby.py). A record's verdict depends on nothing but its key, subkey,
value and expiration, so it is remembered under their digest: a record seen again costs a hash.
"""

from __future__ import annotations

import hashlib
import struct

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord

MEMORY = 4096  # verdicts kept, the oldest forgotten first: a few periods of every record a swarm's reads return


def record_digest(record: DHTRecord) -> bytes:
    """A digest of everything a record's verdict depends on; each part length-prefixed, so no two records share
    one by moving bytes between parts."""
    digest = hashlib.blake2b(digest_size=20)
    for part in (record.key, record.subkey, record.value):
        data = part if isinstance(part, bytes) else repr(part).encode()
        digest.update(struct.pack("<?Q", isinstance(part, bytes), len(data)))
        digest.update(data)
    digest.update(struct.pack("<d", record.expiration_time))
    return digest.digest()


class SignatureMemoValidator(RSASignatureValidator):
    """hivemind's RSA record signatures, each distinct record verified once and its verdict kept (bounded)."""

    def __init__(self, *args, memory: int = MEMORY, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.memory = memory
        self.verdicts: dict[bytes, bool] = {}
        self.checked = 0  # records verified, not answered from memory

    def validate(self, record: DHTRecord) -> bool:
        key = record_digest(record)
        verdict = self.verdicts.get(key)
        if verdict is None:
            verdict = super().validate(record)
            self.checked += 1
            if len(self.verdicts) >= self.memory:
                del self.verdicts[next(iter(self.verdicts))]
            self.verdicts[key] = verdict
        return verdict
