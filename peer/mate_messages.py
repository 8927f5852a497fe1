"""What a stage-mate's message must be before this peer uses it, and the wire form of microbatch ids.

Every peer is a stranger: a message names this stage and this protocol version, and every list it
carries (microbatch ids, member peer ids) is bounded before it costs memory, a send or a sample.
"""

from __future__ import annotations

from swarm.peer.runtime import SampleKey
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, SampleId
from swarm.records.stage_records import PEER_ID

PROGRESS_TIMEOUT = 5.0  # seconds a mate has to take a progress message, or to say its step and fingerprint
MAX_IDS = 65536  # microbatch ids a mate may name in one message: far above any step's
MAX_MEMBERS = 256  # peers a mate may name as its group in one message: far above any stage's replicas

Held = dict[SampleKey, int]  # microbatch id -> samples


def ids_to_wire(held: Held) -> list[SampleId]:
    """Microbatch ids and their sample counts as the wire carries them."""
    return [SampleId(trainer=trainer, microbatch=mb, samples=n) for (trainer, mb), n in held.items()]


def ids_from_wire(ids) -> Held:
    """Microbatch ids and their sample counts from the wire (bounded first: see `check_ids`)."""
    return {(i.trainer, int(i.microbatch)): int(i.samples) for i in ids}


def as_triples(held: Held) -> list[tuple[str, int, int]]:
    """(trainer, microbatch, samples) for each microbatch, in a fixed order."""
    return [(trainer, mb, n) for (trainer, mb), n in sorted(held.items())]


def named_ids(held: Held, limit: int = 8) -> str:
    """The microbatches of `held` as a log line names them (trainer id's tail/microbatch), at most `limit`, so that
    a loss can be followed by id through the ledgers and the other peers' logs."""
    names = [f"{trainer[-8:]}/{mb}" for trainer, mb, _ in as_triples(held)]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_header(message, model: str, stage: int) -> Error | None:
    """A mate message speaks this protocol version and names this peer's model and stage."""
    if message.protocol_version != PROTOCOL_VERSION:
        return Error(code=ErrorCode.VERSION_MISMATCH, message=f"this peer speaks protocol {PROTOCOL_VERSION}")
    if message.model != model or message.stage != stage:
        return Error(code=ErrorCode.WRONG_STAGE, message=f"this peer hosts stage {stage} of {model}")
    return None


def check_ids(max_batch_samples: int, *id_lists) -> Error | None:
    """A remote's microbatch ids are bounded before they cost memory or count as samples."""
    for ids in id_lists:
        if len(ids) > MAX_IDS:
            return Error(code=ErrorCode.BAD_REQUEST, message=f"more than {MAX_IDS} microbatch ids")
        if any(not 0 < i.samples <= max_batch_samples for i in ids):
            return Error(code=ErrorCode.BAD_REQUEST, message="a microbatch id with an impossible sample count")
    return None


def check_members(members) -> Error | None:
    """A remote's list of peers is bounded and holds peer ids only: each one would cost a send."""
    if len(members) > MAX_MEMBERS:
        return Error(code=ErrorCode.BAD_REQUEST, message=f"more than {MAX_MEMBERS} members named")
    if not all(PEER_ID.fullmatch(member) for member in members):
        return Error(code=ErrorCode.BAD_REQUEST, message="a member that is no peer id")
    return None
