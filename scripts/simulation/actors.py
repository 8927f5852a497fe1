"""The simulated peers, trainers and microbatches: what each holds, and the records a peer announces."""

from __future__ import annotations

from collections import deque

from swarm.policy.rebalance_timing import RebalanceTiming, ReturnCooldown
from swarm.policy.router import Router
from swarm.policy.service_timing import ServiceTimer
from swarm.policy.throughput_average import ThroughputAverage
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord

# peer states in the simulation: a moving peer announces LEAVING on its source while it drains its
# queue, then JOINING on its target; a newcomer announces JOINING from the moment it has chosen
SIM_SERVING, SIM_MOVING, SIM_JOINING = "serving", "moving", "joining"


class SimPeer:
    """One peer: a FIFO server of a fixed speed that hosts one stage, moves, and may vanish."""

    __slots__ = (
        "peer_id",
        "speed",
        "stage",
        "source",
        "state",
        "alive",
        "busy_until",
        "drained_at",
        "queue",
        "running",
        "check_token",
        "left_at",
        "announced",
        "measured",
        "timing",
        "cooldown",
        "averaging_until",
        "resume_pending",
    )

    def __init__(self, peer_id: str, speed: int, stage: int, state: str) -> None:
        self.peer_id, self.speed, self.stage, self.state = peer_id, speed, stage, state
        self.source: int | None = None  # while moving: the stage it leaves
        self.alive = True
        self.busy_until = 0.0
        self.drained_at = 0.0
        # (microbatch, its token, seconds of work) of every call accepted and not started yet, in order
        self.queue: deque[tuple[Microbatch, int, float]] = deque()
        self.running: tuple[Microbatch, int] | None = None  # the call it computes now
        self.check_token = 0
        self.left_at: dict[int, float] = {}
        self.announced: list[StageRecord] = []  # its latest records, which outlive it in the DHT
        self.measured = ThroughputAverage()  # its speed on its stage, as the real runtime measures it
        self.timing: RebalanceTiming | None = None  # when it next looks at the plan, as the real peer
        self.cooldown = ReturnCooldown(0.0)  # the stages it may not return to yet, as the real peer
        self.averaging_until = 0.0  # while its stage averages, it starts no call
        self.resume_pending = False

    def queue_length(self, now: float) -> int:
        """Calls accepted and not finished (including ones whose caller gave up)."""
        return len(self.queue) + (self.running is not None)

    def draining(self, now: float) -> bool:
        """Whether it is moving and still finishing the calls queued on its source."""
        return self.state == SIM_MOVING and self.source is not None and now < self.drained_at

    def hosted_stage(self, now: float) -> int:
        """The stage whose weights it holds: a moving peer holds its source until its queue is done."""
        return self.source if self.draining(now) and self.source is not None else self.stage

    def records(
        self, now: float, ttl: float, num_stages: int, throughput: float | None = None, target: float | None = None
    ) -> list[StageRecord]:
        """What it announces now: a record on the stage it serves, leaves or joins.

        `throughput` replaces the measured one (a newcomer's first record, before it has measured).
        A draining peer announces JOINING on its target too only if given its `target` throughput.
        """

        def record(stage: int, state: str, measured: float, moving_to: int = -1) -> StageRecord:
            queued = self.queue_length(now) if state == SERVING else 0
            return StageRecord(
                self.peer_id, stage, "sim", num_stages, state, 0, measured, queued, 0, 0, 1, now + ttl,
                moving_to=moving_to,
            )  # fmt: skip

        measured = throughput if throughput is not None else self.measured.samples_per_second
        if self.state == SIM_SERVING:
            return [record(self.stage, SERVING, measured)]
        if self.draining(now) and self.source is not None:
            # the real peer announces LEAVING, drains, and only then builds the target stage and
            # announces JOINING there
            # its LEAVING record names its target: the balance rule counts it there, not serving yet
            leaving = [record(self.source, LEAVING, measured, moving_to=self.stage)]
            return leaving if target is None else [*leaving, record(self.stage, JOINING, target)]
        return [record(self.stage, JOINING, measured)]


class Microbatch:
    """One microbatch of a trainer, and the one call of it that is out now."""

    __slots__ = (
        "trainer", "position", "tried", "attempts", "requeues", "token", "peer", "start", "deadline", "fail", "since",
    )  # fmt: skip

    def __init__(self, trainer: SimTrainer) -> None:
        self.trainer = trainer
        self.position = 0  # 0..S-1: forward on that stage; S..2S-1: backward on stage 2S-1-position
        self.tried: list[str] = []
        self.attempts = self.requeues = 0
        self.token = 0  # bumped at every dispatch, so events of an earlier attempt are ignored
        self.peer: SimPeer | None = None
        self.start = self.deadline = 0.0
        self.fail = ""  # how the call out now will fail, if it does
        self.since = 0.0  # when the current call (all its attempts) began


class SimTrainer:
    """A trainer: its own Router, and the microbatches it keeps in flight."""

    def __init__(self, router: Router, microbatches: int) -> None:
        self.router = router
        self.timer = ServiceTimer()  # as the real trainer times its peers
        self.microbatches = [Microbatch(self) for _ in range(microbatches)]
        self.parked: dict[int, list[Microbatch]] = {}  # stage -> microbatches waiting for a live peer
        self.last_success: dict[int, float] = {}  # stage -> when a call to it last completed
        self.polling = False
