"""What peers announce about themselves in the DHT, and how it is read back.

Every peer stores one record under its stage's key, with its peer id as the subkey, and renews it
before it expires; a peer that vanishes drops out when its record expires. Records come from
remote processes, so reading them never trusts their content: a malformed one is skipped.
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, asdict, dataclass, fields

from hivemind import DHT
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

JOINING, SERVING, LEAVING = "joining", "serving", "leaving"
STATES = (JOINING, SERVING, LEAVING)


@dataclass(frozen=True)
class StageRecord:
    """One peer's announcement: who it is, what it hosts, and how busy and fast it is."""

    peer_id: str
    stage: int
    model: str
    num_stages: int
    state: str
    step: int
    throughput: float  # samples per second of backward work (which recomputes the forward)
    queue_length: int
    target_batch_size: int
    stale_gradients: int
    protocol_version: int
    expiration: float = 0.0
    # False for a peer that never rebalances (`--rebalance-period 0`): others must not plan its move
    movable: bool = True

    def to_value(self) -> dict:
        value = asdict(self)
        value.pop("expiration")
        return value

    @classmethod
    def from_value(cls, value: object, expiration: float) -> StageRecord | None:
        """Parses a DHT value; None if it is not a well-formed record."""
        if not isinstance(value, dict):
            return None
        try:
            # a field with a default may be missing: records of peers from before it existed
            kwargs = {
                f.name: value[f.name]
                for f in fields(cls)
                if f.name != "expiration" and (f.name in value or f.default is MISSING)
            }
            record = cls(**kwargs, expiration=float(expiration))
        except (KeyError, TypeError, ValueError):
            return None
        types_ok = (
            isinstance(record.peer_id, str)
            and all(
                isinstance(getattr(record, name), int)
                for name in ("stage", "num_stages", "step", "queue_length", "stale_gradients")
            )
            and isinstance(record.throughput, (int, float))
            and isinstance(record.movable, bool)
            and record.state in STATES
        )
        return record if types_ok else None


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key under which the peers of one stage announce themselves."""
    return f"{run_id}.stage{stage}"


def announce(dht: DHT, run_id: str, record: StageRecord, ttl: float) -> bool:
    """Stores (or renews) a peer's record for `ttl` seconds; blocking, so call it off the event loop."""
    expiration = get_dht_time() + ttl
    return bool(
        dht.store(
            stage_key(run_id, record.stage),
            record.to_value(),
            expiration_time=expiration,
            subkey=record.peer_id,
        )
    )


def fetch_stage_records(
    dht: DHT, run_id: str, num_stages: int, only: int | None = None
) -> dict[int, list[StageRecord]]:
    """The live records of every stage (or of stage `only`), read from the DHT; blocking, so call it off the loop."""
    stages = range(num_stages) if only is None else [only]
    futures = {stage: dht.get(stage_key(run_id, stage), latest=True, return_future=True) for stage in stages}
    now = get_dht_time()
    records: dict[int, list[StageRecord]] = {}
    for stage, future in futures.items():
        found = future.result()
        records[stage] = []
        if found is None or not isinstance(found.value, dict):
            continue
        for subkey, item in found.value.items():
            record = StageRecord.from_value(getattr(item, "value", None), getattr(item, "expiration_time", 0.0))
            if record is None or record.peer_id != subkey or record.stage != stage:
                logger.debug(f"Ignoring a malformed record under stage {stage}: {item!r}")
                continue
            if record.expiration > now:
                records[stage].append(record)
    return records
