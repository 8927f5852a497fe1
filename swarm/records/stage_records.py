"""What peers announce about themselves in the DHT, and how it is read back.

Every peer stores one record under its stage's key and renews it before it expires; a peer that
vanishes drops out when its record expires. The record's subkey is the peer's public key and the
record is signed with it (`swarm.net.identity`): DHT nodes refuse, at store and at read, a record under
that subkey that its owner did not sign, and a reader skips a record whose peer id is not the one
that key hashes to. So nobody can announce, renew or shadow another peer's record.

Records come from remote processes, so reading them never trusts their content: a record with a
field of the wrong type or out of its range (`RANGES`: a NaN or absurd throughput, a negative step,
a stage outside the model) is skipped where it is read and counted in `dropped_records`, as is one
that is unsigned, misfiled or (in a private swarm) from a peer outside the allowlist.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, fields

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.net.direct_plane import parse_direct_address
from swarm.net.identity import owner_peer_id

logger = logging.getLogger(__name__)

JOINING, SERVING, LEAVING = "joining", "serving", "leaving"
STATES = (JOINING, SERVING, LEAVING)

# inclusive bounds of a record's numeric fields: anything outside is no honest peer's announcement
RANGES: dict[str, tuple[float, float]] = {
    "stage": (0, 1023),
    "num_stages": (1, 1024),
    "step": (0, 2**53),
    "throughput": (0.0, 1e9),  # samples/s
    "queue_length": (0, 10**9),
    "target_batch_size": (1, 2**31),
    "stale_gradients": (0, 2**53),
    "protocol_version": (0, 2**31),
    "vocab_size": (0, 2**31),  # 0: a peer from before the field existed (byte-level)
    "moving_to": (-1, 1023),  # -1: not moving
    "max_microbatch": (0, 2**31),  # 0: a peer from before the field existed (announces no limit)
    "short_step": (-1, 2**53),  # -1: not short
}
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58, as libp2p writes peer ids
MAX_MODEL_NAME = 128
ANNOUNCED_DTYPES = ("", "fp32", "bf16")  # a record's dtype: none (from before the field), or a compute dtype
MAX_STANDBYS = 64  # standby copies one record may list: far above any sensible --standby-stages
MAX_CAUGHT = 16  # mates one record may name as caught lying
MAX_SHORT = 64  # lost microbatches one record may name (a short step names the rest in its SHORT replies)
RECENT_VERSIONS = 8  # (step, fingerprint) pairs a record announces: the last steps a holder's catch-up may aim at
# the list fields of a record and the most entries each may have, far above what a sound record announces
LIST_FIELDS = {
    "standbys": MAX_STANDBYS,
    "short": MAX_SHORT,
    "versions": RECENT_VERSIONS,
    "empty": MAX_STANDBYS,
    "stage_blocks": 1024,
    "caught": MAX_CAUGHT,
}
FINGERPRINT = re.compile(r"[0-9a-f]{16}|")  # `swarm.peer.stage_state.state_fingerprint`, or none yet
dropped_records: Counter[str] = Counter()  # records skipped by this process, per reason


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
    # token ids the peer's model knows: peers and trainers of one swarm must agree (`--vocab-size`)
    vocab_size: int = 0
    # (stage, step, parameter fingerprint) of each other stage's standby copy the peer holds
    # (`swarm.peer.standby`); step -1 and no fingerprint while it fetches its first copy. A stage's peers
    # give their state to the holders these records name.
    standbys: tuple[tuple[int, int, str], ...] = ()
    # while LEAVING for another stage: that stage, so that the balance rule counts the peer where it is
    # going (not serving there yet) and nobody plans a second move for the gap it fills; -1 otherwise
    moving_to: int = -1
    # "HOST:PORT" of the peer's direct data plane (`swarm.net.direct_plane`), or "" if it serves none
    direct: str = ""
    # what the stage computes in and its boundary tensors travel in (`--dtype` as it resolved on the peer's
    # device: fp32 or bf16); peers and trainers of one swarm must agree. "": a peer from before the field
    dtype: str = ""
    # the most samples one call may carry (`--max-microbatch`, within `--max-request-mb`): a trainer splits
    # larger microbatches into parts of at most this (`swarm.net.request_limits`); 0: not announced
    max_microbatch: int = 0
    # mates of its stage this peer caught lying in its rounds (an owner's sum its audit refuted,
    # `swarm.peer.slice_audit`): trainers call no peer that two others of its stage name (`reported_liars`)
    caught: tuple[str, ...] = ()
    # the peer saw a peer die (its record vanish unannounced) within the last ten minutes: a peer that joins
    # a churning swarm learns it here and keeps its standby copies close from the start (`swarm.peer.standby`)
    saw_death: bool = False
    # blocks of each stage where the swarm's cut is uneven (`--stage-blocks`); (): as even as possible
    stage_blocks: tuple[int, ...] = ()
    # while the peer's step is short of samples lost with a mate: that step (-1 otherwise), and the microbatches
    # it waits for as (trainer, microbatch, samples). A trainer whose calls wait at another stage, and so never
    # hear this one's SHORT reply, learns here which of its own to send again
    short_step: int = -1
    short: tuple[tuple[str, int, int], ...] = ()
    # (step, parameter fingerprint) of the peer's last `RECENT_VERSIONS` steps: a standby holder catching its copy
    # up by step deltas takes a version two of the stage's records show, with no call to each peer (records
    # built a moment apart show different steps, so one step each would seldom agree)
    versions: tuple[tuple[int, str], ...] = ()
    # stages the peer sees with no live peer (`swarm.peer.standby`): every peer that reads this probes their
    # peers too, so that the one that fills such a stage need not wait for their records to lapse
    empty: tuple[int, ...] = ()

    def standby_of(self, stage: int) -> tuple[int, str] | None:
        """(step, fingerprint) of this peer's standby copy of `stage`, step -1 while it fetches one; None if none."""
        return next(((step, fingerprint) for held, step, fingerprint in self.standbys if held == stage), None)

    def to_value(self) -> dict:
        value = asdict(self)
        value.pop("expiration")
        value["standbys"] = [list(entry) for entry in self.standbys]
        value["stage_blocks"] = list(self.stage_blocks)
        value["short"] = [list(entry) for entry in self.short]
        value["versions"] = [list(entry) for entry in self.versions]
        value["empty"] = list(self.empty)
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
            for name, limit in LIST_FIELDS.items():  # read from the DHT as lists (of lists): made tuples, bounded
                if name in kwargs:
                    kwargs[name] = _bounded_tuple(kwargs[name], limit, name)
            record = cls(**kwargs, expiration=float(expiration))
        except (KeyError, TypeError, ValueError):
            return None
        return record if record.problem() is None else None

    def problem(self) -> str | None:
        """What makes this record unacceptable (a field's type or range), or None if it is sound."""
        if not isinstance(self.peer_id, str) or not PEER_ID.fullmatch(self.peer_id):
            return "peer_id"
        if not isinstance(self.model, str) or not 0 < len(self.model) <= MAX_MODEL_NAME:
            return "model"
        if self.state not in STATES or not isinstance(self.movable, bool) or not isinstance(self.saw_death, bool):
            return "state"
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            number = is_int or (name == "throughput" and isinstance(value, float) and math.isfinite(value))
            if not number or not low <= value <= high:
                return name
        if self.stage >= self.num_stages:
            return "stage"
        if self.moving_to >= self.num_stages:
            return "moving_to"
        if not isinstance(self.direct, str) or (self.direct and parse_direct_address(self.direct) is None):
            return "direct"
        if self.dtype not in ANNOUNCED_DTYPES:
            return "dtype"
        if not isinstance(self.standbys, tuple) or len(self.standbys) > MAX_STANDBYS:
            return "standbys"
        for entry in self.standbys:
            if not (isinstance(entry, tuple) and len(entry) == 3 and all(type(x) is int for x in entry[:2])):
                return "standbys"
            stage, step, fingerprint = entry
            if not (0 <= stage < self.num_stages and stage != self.stage and -1 <= step <= 2**53):
                return "standbys"
            if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
                return "standbys"
        if not isinstance(self.stage_blocks, tuple) or (
            self.stage_blocks and len(self.stage_blocks) != self.num_stages
        ):
            return "stage_blocks"
        if not all(type(b) is int and 1 <= b <= 2**31 for b in self.stage_blocks):
            return "stage_blocks"
        if not isinstance(self.caught, tuple) or len(self.caught) > MAX_CAUGHT:
            return "caught"
        if not all(isinstance(p, str) and PEER_ID.fullmatch(p) for p in self.caught):
            return "caught"
        if not isinstance(self.short, tuple) or len(self.short) > MAX_SHORT or (self.short and self.short_step < 0):
            return "short"
        for entry in self.short:
            if not (isinstance(entry, tuple) and len(entry) == 3 and all(type(x) is int for x in entry[1:])):
                return "short"
            trainer, microbatch, samples = entry
            if not (isinstance(trainer, str) and PEER_ID.fullmatch(trainer) and 0 <= microbatch < 2**64):
                return "short"
            if not 0 < samples <= 2**31:
                return "short"
        if not isinstance(self.empty, tuple) or len(self.empty) > self.num_stages:
            return "empty"
        if not all(type(s) is int and 0 <= s < self.num_stages for s in self.empty):
            return "empty"
        if not isinstance(self.versions, tuple) or len(self.versions) > RECENT_VERSIONS:
            return "versions"
        for entry in self.versions:
            if not (isinstance(entry, tuple) and len(entry) == 2 and type(entry[0]) is int and 0 <= entry[0] <= 2**53):
                return "versions"
            if not isinstance(entry[1], str) or not entry[1] or not FINGERPRINT.fullmatch(entry[1]):
                return "versions"
        return None


LIAR_REPORTS = 2  # serving peers of a stage that must name a mate as caught lying before trainers leave it out


def reported_liars(records: list[StageRecord]) -> set[str]:
    """Peers of one stage that at least `LIAR_REPORTS` other serving peers of it name as caught lying: one peer's
    word is not enough, so a lone insider cannot have an honest mate left out."""
    reports: dict[str, set[str]] = {}
    for record in records:
        if record.state == SERVING:
            for peer_id in record.caught:
                if peer_id != record.peer_id:
                    reports.setdefault(peer_id, set()).add(record.peer_id)
    return {peer_id for peer_id, reporters in reports.items() if len(reporters) >= LIAR_REPORTS}


def _bounded_tuple(value: object, limit: int, name: str) -> tuple:
    """A list field of a record as read from the DHT, made a tuple (its list entries too); ValueError past `limit`
    entries or if not a list. Entries are checked by `problem`."""
    if not isinstance(value, (list, tuple)) or len(value) > limit:
        raise ValueError(name)
    return tuple(tuple(entry) if isinstance(entry, (list, tuple)) else entry for entry in value)


def short_entries(lost: dict[tuple[str, int], int]) -> tuple[tuple[str, int, int], ...]:
    """What a record announces of the microbatches a short step waits for: at most MAX_SHORT, in id order."""
    return tuple((trainer, microbatch, samples) for (trainer, microbatch), samples in sorted(lost.items()))[:MAX_SHORT]


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key under which the peers of one stage announce themselves."""
    return f"{run_id}.stage{stage}"


# a store that no node accepted (a node that has just joined may know no neighbour yet) is tried again
# after these pauses, in seconds: about 3 s in all, well inside any record's time to live
STORE_RETRY_PAUSES = (0.1, 0.2, 0.4, 0.8, 1.6)
# a read answers within seconds (hivemind's own calls time out sooner); one that takes this long means this
# process's DHT node is stuck, and a caller told so can say what it waits for rather than wait forever
READ_TIMEOUT = 60.0


def announce(dht: DHT, run_id: str, record: StageRecord, ttl: float) -> bool:
    """Stores (or renews) a peer's record for `ttl` seconds, signed by its key; blocking, so call it off the loop.

    `dht` must be this process's `TetheredDHT`: its identity is the record's owner. A store that no DHT
    node accepted is retried a few times (`STORE_RETRY_PAUSES`); returns whether one was accepted.
    """
    for pause in (*STORE_RETRY_PAUSES, None):
        stored = dht.store(
            stage_key(run_id, record.stage),
            record.to_value(),
            expiration_time=get_dht_time() + ttl,
            subkey=dht.identity.owner,
        )
        if stored:
            return True
        if pause is None:
            logger.warning(
                "no DHT node accepted the record of %s for stage %d after %d tries: other processes will not see "
                "it until a renewal is stored; check that --initial-peers reach a live node",
                record.peer_id[-8:],
                record.stage,
                len(STORE_RETRY_PAUSES) + 1,
            )
            return False
        time.sleep(pause)
    return False


def fetch_stage_records(
    dht: DHT, run_id: str, num_stages: int, only: int | Iterable[int] | None = None, timeout: float = READ_TIMEOUT
) -> dict[int, list[StageRecord]]:
    """The live records of every stage (or of stage `only`, or of the stages `only` lists), read from the DHT;
    blocking, so call it off the loop. TimeoutError if the DHT node has not answered within `timeout`."""
    stages = range(num_stages) if only is None else [only] if isinstance(only, int) else sorted(set(only))
    keys = [stage_key(run_id, stage) for stage in stages]
    future = dht.run_coroutine(functools.partial(_latest_values, keys), return_future=True)
    try:
        values = future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(
            f"this process's DHT node has not answered a read of the stages' records in {timeout:.0f}s"
        ) from None
    allowlist = getattr(dht, "allowlist", None)
    now = get_dht_time()
    records: dict[int, list[StageRecord]] = {}
    for stage, key in zip(stages, keys):
        found = values.get(key)
        records[stage] = []
        if found is None or not isinstance(found.value, dict):
            continue
        for subkey, item in found.value.items():
            record = StageRecord.from_value(getattr(item, "value", None), getattr(item, "expiration_time", 0.0))
            problem = _record_problem(record, subkey, stage, allowlist)
            if problem is not None:
                dropped_records[problem] += 1
                logger.debug(f"Ignoring a {problem} record under stage {stage}: {str(item)[:200]}")
                continue
            if record.expiration > now:
                records[stage].append(record)
    return records


async def _latest_values(keys: list[str], _dht: DHT, node) -> dict:
    """In the DHT's process: the newest value of each of `keys`, found in one walk of the DHT (a walk per key
    asked every node as many times: the DHT processes' CPU grew with the stages a peer reads)."""
    return await node.get_many(keys, sufficient_expiration_time=float("inf"))


def _record_problem(record: StageRecord | None, subkey: object, stage: int, allowlist) -> str | None:
    """Why a record read from the DHT cannot be used, or None."""
    if record is None:
        return "malformed"
    if record.stage != stage:
        return "misfiled"
    return ownership_problem(record.peer_id, subkey, allowlist)


def ownership_problem(peer_id: str, subkey: object, allowlist) -> str | None:
    """Why a signed record that names `peer_id` cannot be trusted as that peer's, or None.

    The DHT checked the signature against the key in `subkey`; the record must also name the peer
    that key belongs to, and in a private swarm one on the allowlist.
    """
    if owner_peer_id(subkey) != peer_id:
        return "unsigned"  # not under its own key: anyone may have written it
    if allowlist is not None and not allowlist.admits(peer_id):
        return "outsider"
    return None
