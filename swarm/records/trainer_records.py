"""What trainers publish about their progress in the DHT, for `swarm monitor`, and how it is read back.

Every trainer stores one small record under its run's trainers key and renews it every few
seconds: its step, last loss, recent samples/s, the bans it has issued and the peers it bans now,
and its last few steps as (time, step, loss, samples/s) points. A monitor that runs for a while
keeps the history itself; the points let one started late show the recent past too.

Signed and read like the stage records (`swarm.records.stage_records`): the subkey is the trainer's public
key and the record is signed with it, so no one can write or shadow another trainer's progress;
a record whose peer id is not the one its key hashes to is skipped. Every field is bounded where
it is read (finite numbers in range, lists and strings capped), and a record that breaks a bound
is dropped whole and counted in `dropped_records`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.records.stage_records import MAX_MODEL_NAME, PEER_ID, ownership_problem

logger = logging.getLogger(__name__)

MAX_POINTS = 32  # recent steps carried in one record
MAX_BANNED = 32  # peer ids of current bans carried in one record
MAX_TRAINERS = 256  # sound records kept per run at most: a flood of strangers' records cannot grow a reader
RATE_WINDOW = 10.0  # seconds over which samples/s is measured
PUBLISH_PERIOD = 2.0
RECORD_TTL = 30.0
# a finished trainer's last record stays up this long: stages short of its lost samples learn not to wait for them
FINISHED_TTL = 600.0
MAX_LOSS = 1e6
MAX_RATE = 1e9  # samples/s
MAX_COUNT = 2**53
MAX_ADDRESSES = 8  # multiaddrs a trainer lists for peers behind NAT to dial
MAX_ADDRESS_CHARS = 200
dropped_records: Counter[str] = Counter()  # records skipped by this process, per reason


@dataclass(frozen=True)
class ProgressPoint:
    """One finished step of one trainer: when (DHT time), which step, its loss and the samples/s then."""

    time: float
    step: int
    loss: float
    samples_per_second: float

    @classmethod
    def from_value(cls, value: object) -> ProgressPoint | None:
        """Parses a [time, step, loss, samples/s] list from the network; None unless every item is in bounds."""
        if not isinstance(value, (list, tuple)) or len(value) != 4:
            return None
        t, step, loss, rate = value
        if not (_is_float(t, 0.0, 1e11) and _is_int(step) and _is_float(loss, 0.0, MAX_LOSS)):
            return None
        if not _is_float(rate, 0.0, MAX_RATE):
            return None
        return cls(float(t), step, float(loss), float(rate))

    def to_value(self) -> list:
        return [self.time, self.step, self.loss, self.samples_per_second]


@dataclass(frozen=True)
class TrainerRecord:
    """One trainer's published progress."""

    peer_id: str
    model: str
    num_stages: int
    step: int
    samples: int  # trained by this trainer since it started
    loss: float  # of its last step
    samples_per_second: float  # over its last RATE_WINDOW seconds
    bans_issued: int
    banned: tuple[str, ...]  # peers it bans now
    points: tuple[ProgressPoint, ...]  # its last steps, oldest first
    # where it listens: a peer behind NAT dials it there, so the trainer's calls reach that peer over a
    # direct connection instead of through a relay
    addresses: tuple[str, ...] = ()
    expiration: float = 0.0
    # the trainer finished training and sends nothing again: a stage short of its lost samples steps without them
    finished: bool = False

    def to_value(self) -> dict:
        return {
            "peer_id": self.peer_id,
            "model": self.model,
            "num_stages": self.num_stages,
            "step": self.step,
            "samples": self.samples,
            "loss": self.loss,
            "samples_per_second": self.samples_per_second,
            "bans_issued": self.bans_issued,
            "banned": list(self.banned),
            "points": [p.to_value() for p in self.points],
            "addresses": list(self.addresses),
            "finished": self.finished,
        }

    @classmethod
    def from_value(cls, value: object, expiration: float) -> TrainerRecord | None:
        """Parses a DHT value; None if any field is missing, of the wrong type or out of bounds."""
        if not isinstance(value, dict):
            return None
        peer_id, model, banned, raw_points = (value.get(k) for k in ("peer_id", "model", "banned", "points"))
        if not isinstance(peer_id, str) or not PEER_ID.fullmatch(peer_id):
            return None
        if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME:
            return None
        if not isinstance(banned, list) or len(banned) > MAX_BANNED:
            return None
        if not all(isinstance(b, str) and PEER_ID.fullmatch(b) for b in banned):
            return None
        if not isinstance(raw_points, list) or len(raw_points) > MAX_POINTS:
            return None
        points = [ProgressPoint.from_value(p) for p in raw_points]
        if any(p is None for p in points):
            return None
        addresses = parse_addresses(value.get("addresses", []))
        finished = value.get("finished", False)  # absent from a record of an older trainer
        if addresses is None or not isinstance(finished, bool):
            return None
        num_stages, step, samples, bans = (value.get(k) for k in ("num_stages", "step", "samples", "bans_issued"))
        if not (_is_int(num_stages, 1, 1024) and _is_int(step) and _is_int(samples) and _is_int(bans)):
            return None
        loss, rate = value.get("loss"), value.get("samples_per_second")
        # a trainer that has not finished a step yet has no loss: NaN would not survive the check, so it sends 0
        if not (_is_float(loss, 0.0, MAX_LOSS) and _is_float(rate, 0.0, MAX_RATE)):
            return None
        return cls(
            peer_id,
            model,
            num_stages,
            step,
            samples,
            float(loss),
            float(rate),
            bans,
            tuple(banned),
            tuple(points),
            addresses,
            float(expiration),
            finished,
        )


def parse_addresses(value: object) -> tuple[str, ...] | None:
    """A record's listening addresses: a short list of direct (not relayed) multiaddrs; None if malformed."""
    if not isinstance(value, list) or len(value) > MAX_ADDRESSES:
        return None
    if not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_CHARS for a in value):
        return None
    from hivemind.utils.multiaddr import Multiaddr

    for address in value:
        try:
            protocols = {p.name for p in Multiaddr(address).protocols()}
        except Exception:
            return None
        if "p2p-circuit" in protocols or "tcp" not in protocols:
            return None
    return tuple(value)


def _is_int(value: object, low: int = 0, high: int = MAX_COUNT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_float(value: object, low: float, high: float) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and low <= value <= high


def trainers_key(run_id: str) -> str:
    """The DHT key under which the trainers of a run publish their progress."""
    return f"{run_id}.trainers"


def publish(dht: DHT, run_id: str, record: TrainerRecord, ttl: float = RECORD_TTL) -> bool:
    """Stores (or renews) a trainer's record for `ttl` seconds, signed by its key; blocking, so call it off the loop.

    `dht` must be this process's `TetheredDHT`: its identity is the record's owner.
    """
    return bool(
        dht.store(
            trainers_key(run_id),
            record.to_value(),
            expiration_time=get_dht_time() + ttl,
            subkey=dht.identity.owner,
        )
    )


def fetch_trainer_records(dht: DHT, run_id: str) -> list[TrainerRecord]:
    """The live, sound trainer records of a run, read from the DHT; blocking, so call it off the loop."""
    found = dht.get(trainers_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return sound_trainer_records(found.value.items(), get_dht_time(), getattr(dht, "allowlist", None))


def sound_trainer_records(items: Iterable[tuple[object, object]], now: float, allowlist=None) -> list[TrainerRecord]:
    """The live records among the (subkey, DHT item) pairs of a run's trainers key, at most MAX_TRAINERS of them.

    The cap applies after each record is checked (its fields and its signer), so records that are dropped
    cannot crowd out sound ones; past the cap, those training are kept first, then those renewed last (a trainer
    that stopped goes first).
    """
    records = []
    for subkey, item in items:
        record = TrainerRecord.from_value(getattr(item, "value", None), getattr(item, "expiration_time", 0.0))
        problem = "malformed" if record is None else ownership_problem(record.peer_id, subkey, allowlist)
        if problem is not None:
            dropped_records[problem] += 1
            logger.debug(f"Ignoring a {problem} trainer record: {str(item)[:200]}")
        elif record.expiration > now:
            records.append(record)
    if len(records) > MAX_TRAINERS:
        dropped_records["over_cap"] += len(records) - MAX_TRAINERS
        records = sorted(records, key=lambda r: (r.finished, -r.expiration, r.peer_id))[:MAX_TRAINERS]
    return records


class TrainerProgress:
    """A trainer's progress as it trains: its recent steps, and the record that says so."""

    def __init__(self, peer_id: str, model: str, num_stages: int, clock=time.monotonic) -> None:
        self.peer_id, self.model, self.num_stages = peer_id, model, num_stages
        self.clock = clock
        self.points: deque[ProgressPoint] = deque(maxlen=MAX_POINTS)
        self.step = 0
        self.samples = 0
        self.bans_issued = 0
        self.banned: tuple[str, ...] = ()
        self.addresses: tuple[str, ...] = ()  # where the trainer listens (see TrainerRecord.addresses)
        self.finished = False  # set once the trainer sends nothing more (see TrainerRecord.finished)
        self._step_ends: deque[tuple[float, int]] = deque()  # (clock, samples so far) at the end of recent steps
        self._started = clock()

    def begin(self) -> None:
        """Marks the start of training: the first step's samples/s counts from here, not from joining."""
        self._started = self.clock()

    def add_step(self, step: int, loss: float, samples: int, bans_issued: int, banned: list[str]) -> None:
        """Records a finished step: `step` reached, its mean `loss`, `samples` in it, and the router's bans."""
        now = self.clock()
        self.step, self.bans_issued = step, bans_issued
        self.banned = tuple(b for b in banned if PEER_ID.fullmatch(b))[:MAX_BANNED]
        self.samples += samples
        self._step_ends.append((now, self.samples))
        while len(self._step_ends) > 2 and now - self._step_ends[1][0] >= RATE_WINDOW:
            self._step_ends.popleft()
        if math.isfinite(loss) and 0 <= loss <= MAX_LOSS:
            self.points.append(ProgressPoint(get_dht_time(), step, float(loss), self.samples_per_second()))

    def samples_per_second(self) -> float:
        """Samples/s over about the last RATE_WINDOW seconds (since the start, over the first steps)."""
        if not self._step_ends:
            return 0.0
        now, total = self._step_ends[-1]
        since, before = (self._started, 0) if len(self._step_ends) < 2 else self._step_ends[0]
        return min(MAX_RATE, (total - before) / max(now - since, 1e-6))

    def record(self) -> TrainerRecord:
        """The record to publish now."""
        last = self.points[-1] if self.points else None
        return TrainerRecord(
            self.peer_id,
            self.model,
            self.num_stages,
            self.step,
            self.samples,
            last.loss if last else 0.0,
            last.samples_per_second if last else 0.0,
            self.bans_issued,
            self.banned,
            tuple(self.points),
            self.addresses,
            finished=self.finished,
        )


async def publish_now(dht: DHT, run_id: str, progress: TrainerProgress, timeout: float = 10.0) -> bool:
    """Publishes `progress` once, off the event loop, within `timeout` seconds; never raises."""
    loop = asyncio.get_running_loop()
    try:
        ttl = FINISHED_TTL if progress.finished else RECORD_TTL
        store = loop.run_in_executor(None, publish, dht, run_id, progress.record(), ttl)
        return await asyncio.wait_for(store, timeout)
    except Exception as e:
        logger.debug(f"Could not publish training progress: {type(e).__name__}: {e}")
        return False


async def publish_forever(dht: DHT, run_id: str, progress: TrainerProgress, period: float = PUBLISH_PERIOD) -> None:
    """Publishes `progress` every `period` seconds until cancelled; never raises."""
    while True:
        await publish_now(dht, run_id, progress)
        await asyncio.sleep(period)


async def direct_addresses(p2p: P2P) -> tuple[str, ...]:
    """The addresses this process listens on, relayed ones left out, as a trainer record lists them."""
    try:
        maddrs = await p2p.get_visible_maddrs(latest=True)
    except Exception as e:  # the record goes out without them: peers behind NAT then reach it through relays
        logger.debug(f"Could not read this trainer's addresses: {e}")
        return ()
    found = [str(m).rsplit("/p2p/", 1)[0] for m in maddrs if "p2p-circuit" not in str(m)]
    found = [a for a in found if len(a) <= MAX_ADDRESS_CHARS]
    return tuple(parse_addresses(found[:MAX_ADDRESSES]) or ())
