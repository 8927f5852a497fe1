"""Which of the stages a standby keeper holds copies of it reads from the DHT each period, and the records it
reuses for the others.

While the swarm shows churn, a keeper follows its held stages every period: it probes their peers and asks
them for their versions. Those answers say what a read would (who lives, how far the stage got), so a held
stage is read only every `HELD_READ_EVERY` periods and its last records stand in between; a peer among them
that fails a probe drops out of them at once (`LivenessProbes.live`), so a stage whose peers all die counts as
lost no later than if it had been read. Reads of held stages took about half of what the copies cost a swarm
after a death (scripts/bench_standby.py --after-a-death). In the calm the probes and asks stop, and every
held stage is read every period.
"""

from __future__ import annotations

from swarm.records.stage_records import StageRecord

HELD_READ_EVERY = 3  # announce periods between reads of a held stage while copies follow their stages


class HeldReads:
    """The last records read of each held stage, and when (the keeper's period count)."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, list[StageRecord]]] = {}

    def wanted(self, period: int, held: list[int], following: bool) -> list[int]:
        """The held stages to read in `period`: every one in the calm, else those not read in the last
        `HELD_READ_EVERY` - 1 periods."""
        if not following:
            return list(held)
        return [s for s in held if s not in self.last or period - self.last[s][0] >= HELD_READ_EVERY]

    def merge(
        self, period: int, records: dict[int, list[StageRecord]], held: list[int]
    ) -> dict[int, list[StageRecord]]:
        """`records` with the held stages this period did not read filled in from their last read (those read are
        kept for later periods; stages no longer held are forgotten)."""
        for stage in held:
            if stage in records:
                self.last[stage] = (period, records[stage])
        self.last = {stage: last for stage, last in self.last.items() if stage in held}
        return {**{s: self.last[s][1] for s in self.last if self.stood_in(s, period)}, **records}

    def stood_in(self, stage: int, period: int) -> bool:
        """Whether `stage`'s records in `period` are its last read's, standing in (they trail the stage)."""
        return stage in self.last and self.last[stage][0] < period
