"""Microbatches cut to what the swarm's peers accept in one call.

Every peer announces the most samples one call to it may carry (`max_microbatch` in its stage record,
`swarm.net.request_limits`). A trainer whose microbatch is larger than the smallest of those, over
every peer of every stage (the router may send a call to any of them), sends each microbatch as parts
of at most that many samples, each a microbatch of its own with its own id. A stage sums the same
gradients whichever way its samples arrive, so training stays exact, and the ledger counts each
part's samples under its id. The parts of a microbatch go through the pipeline together, so the
bound on microbatches in flight still bounds the same number of samples.

The trainer also reads each reply within its own limits (one boundary tensor per reply), so a part
never holds more samples than a reply of those limits carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from swarm.net.request_limits import CallTensors, largest_fitting_microbatch
from swarm.records.stage_records import LEAVING, StageRecord


@dataclass(frozen=True)
class SplitPlan:
    """How a trainer sends its microbatches: whole (part_size is the microbatch size) or in parts."""

    microbatch_size: int
    part_size: int
    stage: int = -1  # the stage whose peer accepts the fewest samples per call (-1: the trainer's own replies)
    peer_id: str = ""  # that peer ("" where the trainer's reply limit is the smaller)
    announced: int = 0  # what that peer announces (0: nobody announces less than the microbatch)

    @property
    def parts(self) -> int:
        """Parts each microbatch goes as (the last may hold fewer samples)."""
        return -(-self.microbatch_size // self.part_size)

    def notice(self) -> str:
        """What the trainer does and what to change, said once when the plan starts splitting (or stops)."""
        if self.part_size >= self.microbatch_size:
            return f"Every peer accepts this trainer's microbatches of {self.microbatch_size} samples whole"
        size, part = self.microbatch_size, self.part_size
        doing = (
            f"this trainer's microbatches of {size} samples go as {self.parts} parts of at most {part} samples, "
            "each a microbatch of its own (the gradients are the same)"
        )
        if self.peer_id:
            return (
                f"Peer {self.peer_id} of stage {self.stage} accepts at most {self.announced} samples per call: "
                f"{doing}. To send them whole, start this trainer with --microbatch-size {part}, or the peers with "
                f"--max-microbatch {size} or more (and --max-request-mb 0, or large enough)"
            )
        return (
            f"A reply to a microbatch of {size} samples is over what this trainer reads in one reply: {doing}. "
            f"To send them whole, start this trainer with --microbatch-size {part}"
        )


def plan_split(
    microbatch_size: int,
    records: Mapping[int, Iterable[StageRecord]],
    width: int,
    seq_len: int,
    max_reply_bytes: int,
) -> SplitPlan:
    """The parts this trainer's microbatches go as, given every stage's peer records (leaving peers aside,
    and peers that announce no limit) and the bytes the trainer reads in one reply (0: as many as a part's
    reply holds), whose one tensor is a [samples, seq_len, width] boundary tensor in float32."""
    plan = SplitPlan(microbatch_size, microbatch_size)
    if max_reply_bytes:
        reply_fits = largest_fitting_microbatch(CallTensors(boundary=1, ids=0), width, seq_len, max_reply_bytes)
        if reply_fits < plan.part_size:
            plan = SplitPlan(microbatch_size, max(1, reply_fits))
    for stage, stage_records in sorted(records.items()):
        for record in stage_records:
            if record.state != LEAVING and 0 < record.max_microbatch < plan.part_size:
                plan = SplitPlan(microbatch_size, record.max_microbatch, stage, record.peer_id, record.max_microbatch)
    return plan
