"""Discrete-event simulation of a swarm at internet scale, driving the real Router and balance rule.

Thousands of peers and their trainers run in simulated time on one machine. The objects that
decide where work goes are the ones the real system uses: every trainer routes its calls with a
`swarm.policy.router.Router` (the clock is simulated time), every peer decides whether to move with
`swarm.policy.balance.plan_moves`, and every newcomer picks its stage with `swarm.policy.balance.choose_stage`.
Prints one JSON object on stdout; progress goes to stderr.

What is modelled:
- Peers: a speed in samples/s of backward work on a stage of cost 1 (integers, spread 10x by
  default), one FIFO server each. A call of n samples on a stage of cost c takes n*c/speed
  seconds for a backward and a third of that for a forward (a backward recomputes the forward).
- Measured throughput, as the real runtime measures it: a peer starting on a stage times one batch,
  then folds every backward it runs into a moving average (0.9 old, 0.1 new) of seconds per sample
  (`swarm.policy.throughput_average`, the runtime's own); each timing is off by a relative error
  drawn with deviation `--throughput-noise`.
- Announcements: a single DHT-like view holds each peer's record (state, stage, measured
  throughput, queue length) with `expiration = now + --record-ttl`, renewed every
  `--announce-period` seconds; a change of state is announced at once, as the real peer does.
  Every router is updated from the view at each renewal; a vanished peer's last records stay in
  it until they expire, as in the real DHT, so it is still routed to and still counted by the
  balance rule until then.
- Trainers: `--trainers` trainers, each with its own Router, together keep `--in-flight`
  microbatches of `--microbatch` samples in flight. A microbatch goes forward through stages
  0..S-1, then backward S-1..0; serving is stateless, so any peer of a stage may take a backward.
  A call to a peer that is not serving that stage is refused at once (UNAVAILABLE if the peer
  still hosts the stage, WRONG_STAGE if it already moved on; both retried elsewhere, as the real
  trainer does); a call to a vanished peer fails after `--connection-error-seconds`; a call
  running past `router.deadline` times out (the peer still does the work). Every failure is
  reported to the router and the call retried on another peer; after `max_retries` attempts it
  is re-queued after a backoff, as the real trainer does (which stops training when a call runs
  out of attempts after its stage has completed no call for `stage_wait_timeout`; the simulation
  counts how often that would have happened instead).
- Rebalancing, as the real peer does it, timed by its own `swarm.policy.rebalance_timing`: every
  `--rebalance-period` seconds times a random factor in [0.5, 1.5] (the first time in [0, 1], so a
  whole plan is carried out within one period), a serving peer computes `plan_moves` on the current
  view (computed once per view and shared, since every peer reading that view computes the same
  plan), with the cost of a move from `--state-mb`, `--bandwidth-mbit`, `--move-seconds` and
  `--move-horizon` (`swarm.policy.balance.MoveCost`). If the plan moves it, a second look 1 to 2
  announce periods later must still move it (to the target that look gives). It announces LEAVING on
  its source at once, naming its target, so that every plan counts it there while it is on its way,
  and finishes its queue; only then does it announce JOINING on the target (with a fresh timing)
  (`--target-at-decision`: it announces JOINING on the target at once, a change to the peer worth
  weighing). It serves the target after the state download, and checks again after a random
  [0.5, 1.5] periods.
- Newcomers, as the real `--stage auto` peer: after a random pause of up to `--announce-period`,
  it reads the view, picks `choose_stage`, and announces JOINING there at once with its speed as
  throughput, so newcomers after it see its choice; it serves after the state download. Its first
  look at the plan then comes after [0.5, 1.5] periods, as after a move (the real newcomer's first
  look comes within one period, as a peer's that has not moved yet).
- Churn: `--trace FILE` replays a spot trace (`time_ms,add|remove,node`) compressed into
  `--trace-minutes`, as a live-instance count scaled so that the trace's peak is `--peers`
  (`harness.spot_trace.live_peer_targets`, never below one instance per stage). A rise launches
  fresh instances (fresh speeds; started at once, or spread over `--join-spread` seconds of boot
  time); a fall preempts instances at random, all at once, as a spot market reclaims many
  together. An instance preempted before it has picked a stage never joins. The count at time 0
  is the starting layout.

What is not modelled: network transfers and latency (a call costs only its compute), optimizer
steps and averaging between stage-mates (no pause per step), stale gradients, a peer merging
queued calls into one batch (total work is the same), partial failures other than a peer
vanishing, the time a moving peer takes to hand over its gradients and build the new stage
(part of `--move-seconds`), and DHT read delays beyond the announce period.

Overload: a peer serves its calls in order; as the real runtime, it drops a queued call whose
caller's deadline passed before it could start it (the caller has retried elsewhere), but a call
it has started runs to the end. `--compute-abandoned` computes every call, as the runtime did
before: under overload the queues then fill with work nobody waits for, the retries pile on, and
the swarm stays congested after the overload has passed.

Measures, per window of `--window` simulated seconds: samples completed per second; the
assignment throughput (the least stage capacity from the true speeds of serving peers), at the
window's end and averaged over it; the ideal for the live peers at the window's end
(`ideal_assignment`, its search capped, while at most 200 peers are live, otherwise the upper
bound sum(speeds)/sum(costs); `ideal_method` counts which). Capacities are in backward samples/s,
the unit peers announce; a pipeline completes at most capacity / (1 + 1/3) samples/s, since each
sample also takes a forward, and the measured fractions are taken against that.

Reported per scenario (the steady state is the last half of the windows):
`steady_state_fraction_of_ideal` (mean assignment / ideal), `measured_fraction_of_ideal` (from
samples completed), `measured_fraction_of_capacity` (samples completed against the assignment in
force), `time_to_90pct_s` (first window at 0.9 of ideal), `moves`, `moves_per_peer_hour`,
`oscillations` (a peer moving back to a stage it left less than 5 minutes before),
`empty_stage_seconds`, how often a stage lost its last serving peer (`stage_emptied_by_move`:
a move the view itself allowed no room for; `_by_stale_move`: the view showed another serving
peer that had vanished; `_by_churn`: a preemption), failed calls by kind, and the wall time. The
scenario runs once per `--margins` value (`by_margin`) and once with rebalancing off
(`no_rebalance`), all from the same seed, so the same peers, speeds and churn. A margin is the
balance rule's hysteresis: a move must lift the lower of its two stages by more than margin
times the mover's own throughput; a sweep such as `--margins 0,0.1,0.25,0.5,1.0` shows the trade
between reaching the ideal and the moves it costs.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import swarm.policy.balance
import swarm.policy.router
from harness.spot_trace import live_peer_targets, read_trace
from swarm.config import PeerConfig, TrainerConfig
from swarm.policy.balance import (
    Move,
    MoveCost,
    PeerLoad,
    assignment_throughput,
    choose_stage,
    ideal_assignment,
    loads_from_records,
    plan_moves,
    upper_bound_throughput,
)
from swarm.policy.rebalance_timing import LOOK, RebalanceTiming, Wait
from swarm.policy.router import FORWARD_SHARE_OF_BACKWARD, Router
from swarm.policy.throughput_average import ThroughputAverage
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord
from swarm.trainer.trainer import REQUEUE_PAUSE_MAX

# a sample costs a forward and a backward on every stage: capacity (backward samples/s) over this
WORK_PER_SAMPLE = 1 + FORWARD_SHARE_OF_BACKWARD
EXACT_IDEAL_MAX_PEERS = 200
# the exact search gives up after this many nodes; past it the best assignment found is used
IDEAL_NODE_LIMIT = 20_000
OSCILLATION_SECONDS = 300.0
REJECT_SECONDS = 0.1  # a refusal (peer not serving the stage) comes back after a round trip
STAGE_POLL_SECONDS = 0.5  # a trainer with no live peer for a stage looks again this often
TRAINER_DEFAULTS = TrainerConfig()  # the real trainer's attempts per call and patience with a stalled stage
PEER_DEFAULTS = PeerConfig()  # the real peer's rebalancing period and margin are the simulation's defaults
DEFAULT_MARGINS = (0.0, 0.1, 0.25, 0.5, 1.0)  # the sweep of hysteresis margins a study runs

# peer states in the simulation: a moving peer announces LEAVING on its source while it drains its
# queue, then JOINING on its target; a newcomer announces JOINING from the moment it has chosen
SIM_SERVING, SIM_MOVING, SIM_JOINING = "serving", "moving", "joining"


@dataclass(frozen=True)
class SimConfig:
    """One scenario's parameters."""

    peers: int = 1000
    stages: int = 8
    minutes: float = 20.0
    start: str = "skewed"
    speed_min: int = 2
    speed_max: int = 20
    stage_costs: tuple[float, ...] | None = None
    # 32 keeps the slowest peer's backward (16 s at speed 2) well inside the trainer's 60 s deadline
    # ceiling; smaller microbatches are as faithful but cost more events
    microbatch: int = 32
    in_flight: int | None = None  # None: twice the peers
    trainers: int = 4
    rebalance: bool = True
    rebalance_period: float = PEER_DEFAULTS.rebalance_period
    margin: float = PEER_DEFAULTS.rebalance_margin
    announce_period: float = 2.0
    record_ttl: float = 10.0
    move_seconds: float = 2.0
    state_mb: float = 500.0
    bandwidth_mbit: float = 400.0
    # seconds a move's gain is counted for, against its cost (`swarm.policy.balance.MoveCost`)
    move_horizon: float = PEER_DEFAULTS.rebalance_horizon
    throughput_noise: float = 0.05  # relative error of one batch's timing
    # False: as the real peer, a mover announces JOINING on its target only once it has drained its
    # queue; True: at once, when it decides to move (a proposed change to the peer)
    target_at_decision: bool = False
    # True: as the real runtime, a peer drops a queued call whose caller has given up (False: computes it)
    skip_abandoned: bool = True
    connection_error_seconds: float = 1.0
    deadline_floor: float = 15.0
    deadline_ceiling: float = 60.0
    window: float = 10.0
    trace: str | None = None
    trace_minutes: float | None = None  # None: the whole trace spans --minutes
    join_spread: float = 0.0
    seed: int = 0
    series: bool = False

    @property
    def costs(self) -> list[float]:
        """Each stage's relative cost per sample (all 1 unless --stage-costs)."""
        return list(self.stage_costs) if self.stage_costs else [1.0] * self.stages

    @property
    def download_seconds(self) -> float:
        """Time a moving or joining peer serves nothing: a fixed part plus the state over the link."""
        return self.move_seconds + self.state_mb * 8 / self.bandwidth_mbit

    @property
    def microbatches_in_flight(self) -> int:
        """Microbatches the trainers keep in flight together."""
        return self.in_flight if self.in_flight is not None else 2 * self.peers


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
        self.microbatches = [Microbatch(self) for _ in range(microbatches)]
        self.parked: dict[int, list[Microbatch]] = {}  # stage -> microbatches waiting for a live peer
        self.last_success: dict[int, float] = {}  # stage -> when a call to it last completed
        self.polling = False


@dataclass
class Window:
    """Measurements of one sampling window."""

    time: float
    live_peers: int
    completed_per_s: float
    assignment: float  # at the window's end
    mean_assignment: float  # averaged over the window, to compare with what completed in it
    ideal: float
    ideal_method: str

    @property
    def assignment_fraction(self) -> float:
        """The assignment throughput at the window's end against the ideal."""
        return self.assignment / self.ideal if self.ideal > 0 else 0.0

    @property
    def measured_fraction(self) -> float:
        """Samples completed in the window, in backward work, against the ideal."""
        return self.completed_per_s * WORK_PER_SAMPLE / self.ideal if self.ideal > 0 else 0.0


class Simulation:
    """One scenario: peers, trainers and churn, run by a heap of timed events."""

    def __init__(self, config: SimConfig, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.log = log or (lambda _message: None)
        self.num_stages = config.stages
        self.costs = config.costs
        if len(self.costs) != self.num_stages or min(self.costs) <= 0:
            raise ValueError(f"--stage-costs needs {self.num_stages} positive numbers")
        self.now = 0.0
        self.events: list[tuple] = []
        self.serial = itertools.count()
        # separate streams, so that a scenario's speeds and churn do not depend on its margin
        self.speed_rng = random.Random(config.seed * 7919 + 1)
        self.rng = random.Random(config.seed * 7919 + 2)
        self.noise_rng = random.Random(config.seed * 7919 + 3)
        self.churn_rng = random.Random(config.seed * 7919 + 4)
        self.peers: dict[str, SimPeer] = {}
        self.live: dict[str, SimPeer] = {}
        self.launches: dict[int, None] = {}  # instances booting, not yet on a stage, in launch order
        self.next_peer = itertools.count()
        self.serving_count = [0] * self.num_stages
        self.serving_capacity = [0.0] * self.num_stages
        self.view: dict[int, list[StageRecord]] = {s: [] for s in range(self.num_stages)}
        self._ghosts: list[StageRecord] = []  # the last records of vanished peers, until they expire
        self._loads: list[PeerLoad] | None = None
        self._plan: dict[str, Move] | None = None
        self._ideal_cache: dict[tuple[int, ...], tuple[float, str]] = {}
        self.windows: list[Window] = []
        self.window_samples = 0
        self.counters = dict.fromkeys(
            (
                "calls",
                "completed_calls",
                "samples_completed",
                "timeouts",
                "rejected",
                "wrong_stage",
                "connection_errors",
                "requeues",
                "would_stop_training",
                "moves",
                "moves_not_confirmed",
                "abandoned_computed",
                "abandoned_skipped",
                "oscillations",
                "joins",
                "removals",
                "preempted_before_joining",
                "plans_computed",
                "stage_emptied_by_move",
                "stage_emptied_by_stale_move",
                "stage_emptied_by_churn",
            ),
            0,
        )
        self.empty_stage_seconds = 0.0
        self.peer_seconds = 0.0
        self.capacity_seconds = 0.0  # integral of the assignment throughput over time
        self._capacity_at_window = 0.0
        self._integrated_at = 0.0
        self.peak_live = 0
        self.trainers = self._make_trainers()

    # --- setup -----------------------------------------------------------------------------------

    def _make_trainers(self) -> list[SimTrainer]:
        config = self.config
        count = max(1, config.trainers)
        total = max(count, config.microbatches_in_flight)
        trainers = []
        for i in range(count):
            router = Router(
                rng=random.Random(config.seed * 7919 + 100 + i),
                clock=lambda: self.now,
                deadline_floor=config.deadline_floor,
                deadline_ceiling=config.deadline_ceiling,
            )
            trainers.append(SimTrainer(router, total // count + (i < total % count)))
        return trainers

    def _new_peer(self, stage: int, state: str) -> SimPeer:
        peer = SimPeer(
            f"peer{next(self.next_peer)}",
            self.speed_rng.randint(self.config.speed_min, self.config.speed_max),
            stage,
            state,
        )
        peer.measured.reset(self._timing(peer))  # the runtime times one batch as it starts
        self._integrate()
        self.peers[peer.peer_id] = peer
        self.live[peer.peer_id] = peer
        self.peak_live = max(self.peak_live, len(self.live))
        return peer

    def _initial_stages(self, count: int) -> list[int]:
        """Stages for `count` peers starting together, by `--start` (auto is decided as they are placed)."""
        start, stages = self.config.start, self.num_stages
        if start == "all-in-one":
            return [0] * count
        if start == "skewed":
            on_first = round(0.7 * count) if stages > 1 else count
            rest = [1 + i % (stages - 1) for i in range(count - on_first)] if stages > 1 else []
            layout = [0] * on_first + rest
            self.rng.shuffle(layout)
            return layout
        return [-1] * count

    def _place_initial(self, count: int) -> list[SimPeer]:
        """Starts `count` peers already serving, laid out by `--start`."""
        placed = []
        for stage in self._initial_stages(count):
            if stage < 0:
                # auto: as newcomers that each see the choices of those before them (their JOINING
                # records carry their speeds), so the bottleneck of the true capacities so far
                stage = choose_stage(self._stage_totals(), self.num_stages, self.costs, self.rng)
            peer = self._new_peer(stage, SIM_SERVING)
            self._serving_changed(peer, +1, cause="start")
            # as the real peer: its first look comes within one period, so a whole plan is carried out in one
            self._start_checks(peer, first_look=True)
            placed.append(peer)
        return placed

    def _stage_totals(self) -> list[PeerLoad]:
        """One load per stage holding its true serving capacity: all that choose_stage looks at."""
        return [PeerLoad(f"stage{s}", s, c) for s, c in enumerate(self.serving_capacity)]

    # --- event plumbing --------------------------------------------------------------------------

    def _at(self, when: float, handler: Callable, *args: object) -> None:
        heapq.heappush(self.events, (when, next(self.serial), handler, args))

    def _integrate(self) -> None:
        """Accumulates live peer-seconds, empty stage-seconds and assignment throughput up to now."""
        elapsed = self.now - self._integrated_at
        if elapsed > 0:
            self.peer_seconds += elapsed * len(self.live)
            self.empty_stage_seconds += elapsed * sum(1 for c in self.serving_count if c == 0)
            self.capacity_seconds += elapsed * max(0.0, min(self.serving_capacity))
            self._integrated_at = self.now

    def _serving_changed(self, peer: SimPeer, delta: int, cause: str) -> None:
        self._integrate()
        stage = peer.stage if delta > 0 or peer.source is None else peer.source
        self.serving_count[stage] += delta
        self.serving_capacity[stage] += delta * peer.speed / self.costs[stage]
        if delta < 0 and self.serving_count[stage] == 0 and cause in ("move", "churn"):
            if cause == "move" and sum(r.state == SERVING for r in self.view.get(stage, [])) >= 2:
                cause = "stale_move"  # the view showed another serving peer, which has vanished since
            self.counters[f"stage_emptied_by_{cause}"] += 1
            self.log(f"t={self.now:.0f}s: stage {stage} has no serving peer left ({cause.replace('_', ' ')})")

    # --- the view, shared by routers and the balance rule ----------------------------------------

    def _timing(self, peer: SimPeer) -> float:
        """Seconds per sample of backward work on its stage, as one timed batch measures it."""
        exact = self.costs[peer.stage] / peer.speed
        noise = self.config.throughput_noise
        return exact * max(0.05, 1 + self.noise_rng.gauss(0.0, noise)) if noise > 0 else exact

    def _refresh_view(self) -> None:
        """Every peer renews its record (measured throughput, queue length); routers read them all."""
        config = self.config
        view: dict[int, list[StageRecord]] = {s: [] for s in range(self.num_stages)}
        # a vanished peer's last records stay in the DHT until they expire
        self._ghosts = [r for r in self._ghosts if r.expiration > self.now]
        for record in self._ghosts:
            view[record.stage].append(record)
        for peer in self.live.values():
            peer.announced = self._records(peer)
            for record in peer.announced:
                view[record.stage].append(record)
        self.view = view
        self._loads = None
        self._plan = None
        for trainer in self.trainers:
            trainer.router.update(view, self.now)
        self._at(self.now + config.announce_period, self._refresh_view)

    def _announce(self, peer: SimPeer, throughput: float | None = None) -> None:
        """A change of the peer's state, visible at once to the balance rule (routers read at renewals)."""
        for stage in {r.stage for r in peer.announced}:
            self.view[stage] = [r for r in self.view[stage] if r.peer_id != peer.peer_id]
        peer.announced = self._records(peer, throughput)
        for record in peer.announced:
            self.view[record.stage].append(record)
        self._loads = None
        self._plan = None

    def _records(self, peer: SimPeer, throughput: float | None = None) -> list[StageRecord]:
        target = None
        if self.config.target_at_decision and peer.draining(self.now) and peer.source is not None:
            # what it would announce for the target: its throughput, scaled by the stages' costs
            target = self.costs[peer.source] / self.costs[peer.stage] / peer.measured.seconds_per_sample
        return peer.records(self.now, self.config.record_ttl, self.num_stages, throughput, target)

    def _view_loads(self) -> list[PeerLoad]:
        if self._loads is None:
            self._loads = loads_from_records(self.view, self.costs)
        return self._loads

    def _view_plan(self) -> dict[str, Move]:
        """The plan every peer computes from the current view: computed once, since they all agree."""
        if self._plan is None:
            config = self.config
            cost = MoveCost.of_state(config.state_mb, config.bandwidth_mbit, config.move_seconds, config.move_horizon)
            moves = plan_moves(self._view_loads(), self.num_stages, config.margin, self.costs, move_cost=cost)
            self._plan = {m.peer_id: m for m in moves}
            self.counters["plans_computed"] += 1
        return self._plan

    # --- calls -----------------------------------------------------------------------------------

    def _stage_of(self, mb: Microbatch) -> int:
        """The stage of the microbatch's current call: forwards go 0..S-1, then backwards S-1..0."""
        stages = self.num_stages
        return mb.position if mb.position < stages else 2 * stages - 1 - mb.position

    def _dispatch(self, mb: Microbatch) -> None:
        """Routes the microbatch's next call with its trainer's router and starts it on the chosen peer."""
        stages, samples = self.num_stages, self.config.microbatch
        backward = mb.position >= stages
        stage = self._stage_of(mb)
        router = mb.trainer.router
        record = router.choose(stage, backward, samples, exclude=mb.tried)
        if record is None:
            self._park(mb, stage)
            return
        peer = self.peers[record.peer_id]
        now = self.now
        mb.token += 1
        mb.peer, mb.start = peer, now
        mb.deadline = router.deadline(record, backward, samples)
        self.counters["calls"] += 1
        if not peer.alive:
            mb.fail = "connection_errors"
            self._at(now + min(mb.deadline, self.config.connection_error_seconds), self._call_failed, mb, mb.token)
        elif peer.state != SIM_SERVING or peer.stage != stage:
            # the real handler checks the stage first: a peer that has moved on says WRONG_STAGE
            mb.fail = "wrong_stage" if peer.hosted_stage(now) != stage else "rejected"
            self._at(now + REJECT_SECONDS, self._call_failed, mb, mb.token)
        else:
            work = samples * self.costs[stage] / peer.speed
            peer.queue.append((mb, mb.token, work if backward else work * FORWARD_SHARE_OF_BACKWARD))
            mb.fail = "timeouts"  # if the deadline passes first, the caller gives up
            self._at(now + mb.deadline, self._call_failed, mb, mb.token)
            if peer.running is None:
                self._start_next(peer)

    def _start_next(self, peer: SimPeer) -> None:
        """The peer takes its next queued call; a moving peer whose queue is done goes on to its target."""
        while peer.queue:
            mb, token, work = peer.queue.popleft()
            if token != mb.token and self.config.skip_abandoned:
                self.counters["abandoned_skipped"] += 1  # its caller gave up: no use computing it
                continue
            peer.running = (mb, token)
            peer.busy_until = self.now + work
            self._at(peer.busy_until, self._finished, peer, mb, token)
            return
        peer.running = None
        if peer.state == SIM_MOVING and peer.drained_at == math.inf:
            peer.drained_at = self.now
            self._at(self.now, self._drained, peer, peer.check_token)

    def _finished(self, peer: SimPeer, mb: Microbatch, token: int) -> None:
        """The peer has computed a call: the caller gets the reply if it still waits for it."""
        if not peer.alive:
            return
        if token != mb.token:
            self.counters["abandoned_computed"] += 1
        self._start_next(peer)
        if token == mb.token:
            self._call_done(mb, token)

    def _call_done(self, mb: Microbatch, token: int) -> None:
        if token != mb.token:
            return
        mb.token += 1
        peer = mb.peer
        stages = self.num_stages
        backward = mb.position >= stages
        mb.trainer.router.report_success(peer.peer_id, backward, self.config.microbatch, self.now - mb.start)
        if backward and peer.state == SIM_SERVING:
            # the runtime's moving average of its backward timings (a draining peer's is thrown away)
            peer.measured.add(self._timing(peer))
        self.counters["completed_calls"] += 1
        mb.trainer.last_success[self._stage_of(mb)] = self.now
        mb.tried, mb.attempts, mb.requeues, mb.since = [], 0, 0, self.now
        mb.position += 1
        if mb.position == 2 * stages:
            self.counters["samples_completed"] += self.config.microbatch
            self.window_samples += self.config.microbatch
            mb.position = 0  # the trainer starts its next microbatch at once
        self._dispatch(mb)

    def _call_failed(self, mb: Microbatch, token: int) -> None:
        if token != mb.token:
            return
        mb.token += 1
        self.counters[mb.fail] += 1
        mb.trainer.router.report_failure(mb.peer.peer_id)
        mb.tried.append(mb.peer.peer_id)
        mb.attempts += 1
        if mb.attempts < TRAINER_DEFAULTS.max_retries:
            self._dispatch(mb)
            return
        mb.requeues += 1
        self.counters["requeues"] += 1
        stage = self._stage_of(mb)
        if self.now - max(mb.trainer.last_success.get(stage, 0.0), mb.since) > TRAINER_DEFAULTS.stage_wait_timeout:
            self.counters["would_stop_training"] += 1
            mb.since = self.now  # counted once per stall
        mb.attempts, mb.tried = 0, []
        self._at(self.now + min(REQUEUE_PAUSE_MAX, 2.0**mb.requeues), self._retry, mb, mb.token)

    def _retry(self, mb: Microbatch, token: int) -> None:
        if token == mb.token:
            self._dispatch(mb)

    def _park(self, mb: Microbatch, stage: int) -> None:
        trainer = mb.trainer
        trainer.parked.setdefault(stage, []).append(mb)
        if not trainer.polling:
            trainer.polling = True
            self._at(self.now + STAGE_POLL_SECONDS, self._poll, trainer)

    def _poll(self, trainer: SimTrainer) -> None:
        """Retries parked microbatches; one refusal per stage says the rest would be refused too."""
        parked, trainer.parked = trainer.parked, {}
        trainer.polling = False
        for stage, waiting in parked.items():
            for i, mb in enumerate(waiting):
                if not trainer.router.live_peers(stage):
                    trainer.parked.setdefault(stage, []).extend(waiting[i:])
                    break
                self._dispatch(mb)
        if trainer.parked and not trainer.polling:
            trainer.polling = True
            self._at(self.now + STAGE_POLL_SECONDS, self._poll, trainer)

    # --- peers: rebalancing, joining, leaving ----------------------------------------------------

    def _start_checks(self, peer: SimPeer, first_look: bool) -> None:
        """The peer starts serving a stage: its rebalancing timing starts afresh, as the real peer's loop.

        The first wait is drawn even with rebalancing off, so that the runs with and without it draw alike.
        """
        config = self.config
        peer.timing = RebalanceTiming(config.rebalance_period, config.announce_period, self.rng, first_look)
        self._schedule_check(peer, peer.timing.start())

    def _schedule_check(self, peer: SimPeer, wait: Wait) -> None:
        if not self.config.rebalance or self.config.rebalance_period <= 0:
            return
        peer.check_token += 1
        self._at(self.now + wait.seconds, self._check, peer, peer.check_token)

    def _planned_move(self, peer: SimPeer) -> Move | None:
        """The peer's move in the plan on the current view, if the plan moves it from the stage it serves."""
        move = self._view_plan().get(peer.peer_id)
        return move if move is not None and move.source == peer.stage else None

    def _check(self, peer: SimPeer, token: int) -> None:
        """A serving peer's periodic look at the plan; it moves if the plan has a move for it."""
        if not peer.alive or token != peer.check_token or peer.state != SIM_SERVING:
            return
        move = self._planned_move(peer)
        wait = peer.timing.looked(move is not None)
        if wait.action == LOOK:
            self._schedule_check(peer, wait)
            return
        # as the real peer: a second look a moment later must show the same move
        peer.check_token += 1
        self._at(self.now + wait.seconds, self._confirm, peer, move.target, peer.check_token)

    def _confirm(self, peer: SimPeer, target: int, token: int) -> None:
        """The second look: the peer moves only if the plan on the view now still moves it (to where it says now)."""
        if not peer.alive or token != peer.check_token or peer.state != SIM_SERVING:
            return
        move = self._planned_move(peer)
        wait = peer.timing.confirmed(move is not None)
        if wait.action == LOOK:
            self.counters["moves_not_confirmed"] += 1
            self._schedule_check(peer, wait)
            return
        self._start_move(peer, move.target)

    def _start_move(self, peer: SimPeer, target: int) -> None:
        now = self.now
        self.counters["moves"] += 1
        if now - peer.left_at.get(target, -math.inf) <= OSCILLATION_SECONDS:
            self.counters["oscillations"] += 1
        peer.left_at[peer.stage] = now
        peer.source, peer.stage, peer.state = peer.stage, target, SIM_MOVING
        self._serving_changed(peer, -1, cause="move")  # judged on the view the move was planned from
        # it finishes what is queued on it, serving nothing new, then builds the target stage
        busy = peer.running is not None or bool(peer.queue)
        peer.drained_at = math.inf if busy else now
        self._announce(peer)  # LEAVING on the source
        peer.check_token += 1
        if not busy:
            self._at(now, self._drained, peer, peer.check_token)

    def _drained(self, peer: SimPeer, token: int) -> None:
        """A moving peer's queue is done: it times a batch on the target, announces JOINING, downloads."""
        if not peer.alive or token != peer.check_token:
            return
        peer.measured.reset(self._timing(peer))
        self._announce(peer)
        self._at(self.now + self.config.download_seconds, self._serve, peer, token)

    def _serve(self, peer: SimPeer, token: int) -> None:
        if not peer.alive or token != peer.check_token:
            return
        peer.state = SIM_SERVING
        self._serving_changed(peer, +1, cause="serve")
        peer.source = None
        self._announce(peer)
        self._start_checks(peer, first_look=False)  # its balance loop starts afresh

    def _launch(self) -> None:
        """A new spot instance: it boots, pauses at random, then joins."""
        launch = next(self.serial)
        self.launches[launch] = None
        config = self.config
        # boot times differ by up to --join-spread; the real peer then pauses up to an announce period,
        # so that peers started together read the records one after the other
        delay = self.churn_rng.uniform(0.0, config.join_spread) + self.churn_rng.uniform(0.0, config.announce_period)
        self._at(self.now + delay, self._join, launch)

    def _join(self, launch: int) -> None:
        """A newcomer picks the bottleneck of the view, announces JOINING there at once, downloads, then serves."""
        if launch not in self.launches:
            return  # preempted while booting
        del self.launches[launch]
        stage = choose_stage(self._view_loads(), self.num_stages, self.costs, self.rng)
        peer = self._new_peer(stage, SIM_JOINING)
        # its first record carries its speed on that stage, until its own measurement is announced
        self._announce(peer, throughput=peer.speed / self.costs[stage])
        peer.check_token += 1
        self._at(self.now + self.config.download_seconds, self._serve, peer, peer.check_token)
        self.counters["joins"] += 1

    def _remove(self, peer: SimPeer) -> None:
        """A preemption: the peer vanishes at once; its queued calls fail when their callers notice."""
        if not peer.alive:
            return
        self._integrate()
        if peer.state == SIM_SERVING:
            self._serving_changed(peer, -1, cause="churn")
        peer.alive = False
        del self.live[peer.peer_id]
        self._ghosts += peer.announced
        self.counters["removals"] += 1
        now = self.now
        held = [(mb, token) for mb, token, _ in peer.queue]
        for mb, token in held + ([peer.running] if peer.running is not None else []):
            if token == mb.token:
                mb.token += 1
                notice = now + self.config.connection_error_seconds
                mb.fail = "connection_errors" if notice < mb.start + mb.deadline else "timeouts"
                self._at(min(notice, mb.start + mb.deadline), self._call_failed, mb, mb.token)
        peer.queue.clear()
        peer.running = None

    def _trace_target(self, wanted: int) -> None:
        """The trace's live-instance count changes: launch fresh instances, or preempt random ones."""
        instances: list[SimPeer | int] = [*self.live.values(), *self.launches]
        for _ in range(wanted - len(instances)):
            self._launch()
        for victim in self.churn_rng.sample(instances, max(0, len(instances) - wanted)):
            if isinstance(victim, SimPeer):
                self._remove(victim)
            else:
                del self.launches[victim]
                self.counters["preempted_before_joining"] += 1

    # --- measurement -----------------------------------------------------------------------------

    def _ideal(self) -> tuple[float, str]:
        """The best throughput the live peers could reach, and how it was found."""
        speeds = tuple(sorted(p.speed for p in self.live.values()))
        if not speeds:
            return 0.0, "upper_bound"
        if len(speeds) > EXACT_IDEAL_MAX_PEERS:
            return upper_bound_throughput(speeds, self.num_stages, self.costs), "upper_bound"
        if speeds not in self._ideal_cache:
            value, _, proven = ideal_assignment(speeds, self.num_stages, self.costs, node_limit=IDEAL_NODE_LIMIT)
            # with unit costs capacities are whole numbers, so reaching the rounded-down bound proves it
            integral = all(c == 1 for c in self.costs)
            bound = upper_bound_throughput(speeds, self.num_stages, self.costs)
            if proven or (integral and value >= math.floor(bound + 1e-9)):
                self._ideal_cache[speeds] = (value, "exact")
            else:
                self._ideal_cache[speeds] = (value, "best_found")
        return self._ideal_cache[speeds]

    def _sample(self) -> None:
        window = self.config.window
        ideal, method = self._ideal()
        serving = [p for p in self.live.values() if p.state == SIM_SERVING]
        assignment = assignment_throughput(
            [p.speed for p in serving], [p.stage for p in serving], self.num_stages, self.costs
        )
        self._integrate()
        mean_assignment = (self.capacity_seconds - self._capacity_at_window) / window
        self._capacity_at_window = self.capacity_seconds
        self.windows.append(
            Window(self.now, len(self.live), self.window_samples / window, assignment, mean_assignment, ideal, method)
        )
        self.window_samples = 0
        if len(self.windows) % max(1, round(60 / window)) == 0:
            last = self.windows[-1]
            self.log(
                f"t={self.now:.0f}s live={last.live_peers} assignment={last.assignment_fraction:.3f} "
                f"measured={last.measured_fraction:.3f} moves={self.counters['moves']} "
                f"per stage={self.serving_count}"
            )
        self._at(self.now + window, self._sample)

    # --- running ---------------------------------------------------------------------------------

    def run(self) -> dict:
        """Runs the scenario to its end and returns its report."""
        config = self.config
        end = config.minutes * 60
        started = time.perf_counter()
        if config.trace:
            minutes = config.trace_minutes if config.trace_minutes is not None else config.minutes
            # one instance per stage at the least, as the other trace replays keep a swarm alive
            targets = live_peer_targets(config.trace, minutes, config.peers, min_peers=self.num_stages)
            self._place_initial(targets[0][1] if targets[0][0] <= 0 else 0)
            for t, wanted in targets:
                if 0 < t < end:
                    self._at(t, self._trace_target, wanted)
        else:
            self._place_initial(config.peers)
        self._refresh_view()
        for trainer in self.trainers:
            for mb in trainer.microbatches:
                self._dispatch(mb)
        self._at(config.window, self._sample)
        events = self.events
        while events and events[0][0] <= end:
            when, _, handler, args = heapq.heappop(events)
            self.now = when
            handler(*args)
        self.now = end
        self._integrate()
        report = self._report(time.perf_counter() - started)
        if config.trace:
            span = max(t for t, _ in read_trace(config.trace)) / 1000
            report["trace_seconds_per_simulated_second"] = round(span / (minutes * 60), 2)
        return report

    def _report(self, wall: float) -> dict:
        windows = self.windows
        steady = windows[len(windows) // 2 :] or windows
        counters = self.counters

        def mean(values: list[float]) -> float | None:
            return round(sum(values) / len(values), 4) if values else None

        reached = next((w.time for w in windows if w.assignment_fraction >= 0.9), None)
        capacity = [w.mean_assignment / WORK_PER_SAMPLE for w in steady]
        methods: dict[str, int] = {}
        for w in windows:
            methods[w.ideal_method] = methods.get(w.ideal_method, 0) + 1
        peer_hours = self.peer_seconds / 3600
        report: dict[str, object] = {
            "margin": self.config.margin,
            "rebalance": self.config.rebalance and self.config.rebalance_period > 0,
            "steady_state_fraction_of_ideal": mean([w.assignment_fraction for w in steady]),
            "measured_fraction_of_ideal": mean([w.measured_fraction for w in steady]),
            "measured_fraction_of_capacity": (
                round(sum(w.completed_per_s for w in steady) / sum(capacity), 4) if sum(capacity) > 0 else None
            ),
            "steady_state_samples_per_s": mean([w.completed_per_s for w in steady]),
            "steady_state_assignment_capacity": mean([w.assignment for w in steady]),
            "steady_state_ideal": mean([w.ideal for w in steady]),
            "final_fraction_of_ideal": round(windows[-1].assignment_fraction, 4) if windows else None,
            "time_to_90pct_s": reached,
            "moves": counters["moves"],
            "moves_not_confirmed": counters["moves_not_confirmed"],
            "moves_per_peer_hour": round(counters["moves"] / peer_hours, 3) if peer_hours > 0 else None,
            "oscillations": counters["oscillations"],
            "empty_stage_seconds": round(self.empty_stage_seconds, 1),
            "stage_emptied_by_move": counters["stage_emptied_by_move"],
            "stage_emptied_by_stale_move": counters["stage_emptied_by_stale_move"],
            "stage_emptied_by_churn": counters["stage_emptied_by_churn"],
            "samples_completed": counters["samples_completed"],
            "calls": counters["calls"],
            "failed_calls": {
                k: counters[k] for k in ("timeouts", "rejected", "wrong_stage", "connection_errors", "requeues")
            },
            "would_stop_training": counters["would_stop_training"],
            "abandoned_calls_computed": counters["abandoned_computed"],
            "abandoned_calls_skipped": counters["abandoned_skipped"],
            "bans": sum(t.router.bans_issued for t in self.trainers),
            "joins": counters["joins"],
            "removals": counters["removals"],
            "preempted_before_joining": counters["preempted_before_joining"],
            "peak_live_peers": self.peak_live,
            "final_live_peers": len(self.live),
            "final_serving_per_stage": list(self.serving_count),
            "plans_computed": counters["plans_computed"],
            "ideal_method": methods,
            "wall_seconds": round(wall, 2),
        }
        if self.config.series:
            report["series"] = {
                "time": [w.time for w in windows],
                "live_peers": [w.live_peers for w in windows],
                "assignment_fraction": [round(w.assignment_fraction, 4) for w in windows],
                "measured_fraction": [round(w.measured_fraction, 4) for w in windows],
            }
        return report


def run_scenario(config: SimConfig, log: Callable[[str], None] | None = None) -> dict:
    """Runs one scenario and returns its report."""
    return Simulation(config, log).run()


def run_study(
    config: SimConfig,
    margins: Sequence[float] = (),
    baseline: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """The scenario at `config.margin`, once more per extra margin, and once with rebalancing off."""
    started = time.perf_counter()
    log = log or (lambda _message: None)
    results: dict[float, dict] = {}
    for margin in dict.fromkeys([config.margin, *margins]):
        if not config.rebalance and margin != config.margin:
            continue
        log(f"scenario: margin {margin}, rebalancing {'on' if config.rebalance else 'off'}")
        results[margin] = run_scenario(replace(config, margin=margin), log)
    report = {"config": {k: v for k, v in asdict(config).items() if k != "series"}, **results[config.margin]}
    report["config"]["download_seconds"] = config.download_seconds
    # the rule and the router evolve: say which versions this report is about
    report["sources_sha256"] = {
        name: hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:12]
        for name, module in (
            ("swarm/policy/balance.py", swarm.policy.balance),
            ("swarm/policy/router.py", swarm.policy.router),
        )
    }
    report["config"]["in_flight"] = config.microbatches_in_flight
    report["ideal_basis"] = (
        f"ideal_assignment (node limit {IDEAL_NODE_LIMIT}) while at most {EXACT_IDEAL_MAX_PEERS} peers are live, "
        "else upper_bound_throughput; per-window counts under ideal_method"
    )
    if margins:
        report["by_margin"] = {str(m): r for m, r in results.items()}
    if baseline and config.rebalance:
        log("scenario: rebalancing off")
        report["no_rebalance"] = run_scenario(replace(config, rebalance=False), log)
    report["total_wall_seconds"] = round(time.perf_counter() - started, 2)
    return report


def parse_floats(text: str) -> tuple[float, ...]:
    """'0.1,0.2' -> (0.1, 0.2)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--peers", type=int, default=d.peers, help="peers (with --trace: peak live peers)")
    p.add_argument("--stages", type=int, default=d.stages, help="pipeline stages")
    p.add_argument("--minutes", type=float, default=d.minutes, help="simulated minutes")
    p.add_argument(
        "--start",
        choices=("skewed", "all-in-one", "auto"),
        default=d.start,
        help="starting layout: skewed (70%% on stage 0, the rest spread), all-in-one (all on stage 0), "
        "auto (each peer picks choose_stage in random order)",
    )
    p.add_argument("--speed-min", type=int, default=d.speed_min, help="slowest peer, samples/s of backward work")
    p.add_argument("--speed-max", type=int, default=d.speed_max, help="fastest peer, samples/s of backward work")
    p.add_argument("--stage-costs", type=parse_floats, default=None, help="relative cost per stage, e.g. 1,1,2 (all 1)")
    p.add_argument(
        "--microbatch", type=int, default=d.microbatch, help="samples per microbatch (larger: fewer events, faster)"
    )
    p.add_argument("--in-flight", type=int, default=None, help="microbatches in flight over all trainers (2x peers)")
    p.add_argument("--trainers", type=int, default=d.trainers, help="trainers, each with its own Router")
    p.add_argument("--no-rebalance", action="store_true", help="peers never move (newcomers still pick a stage)")
    p.add_argument(
        "--rebalance-period", type=float, default=d.rebalance_period, help="mean seconds between a peer's checks"
    )
    p.add_argument(
        "--margin",
        type=float,
        default=d.margin,
        help="hysteresis of the balance rule: a move must lift the lower of its two stages by more than this "
        "times the mover's own throughput",
    )
    p.add_argument(
        "--margins",
        type=parse_floats,
        default=DEFAULT_MARGINS,
        help="comma list: run once per margin too, reported under by_margin ('' for none)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the comparison run with rebalancing off")
    p.add_argument("--announce-period", type=float, default=d.announce_period, help="seconds between view refreshes")
    p.add_argument("--record-ttl", type=float, default=d.record_ttl, help="seconds a record outlives its peer")
    p.add_argument("--move-seconds", type=float, default=d.move_seconds, help="fixed part of a state download")
    p.add_argument("--state-mb", type=float, default=d.state_mb, help="state downloaded by a moving or joining peer")
    p.add_argument("--bandwidth-mbit", type=float, default=d.bandwidth_mbit, help="download bandwidth, Mbit/s")
    p.add_argument(
        "--move-horizon",
        type=float,
        default=d.move_horizon,
        help="seconds a move's gain is counted for against its cost (the peer's --rebalance-horizon)",
    )
    p.add_argument(
        "--throughput-noise",
        type=float,
        default=d.throughput_noise,
        help="relative error of one batch's timing; a peer announces a moving average of them",
    )
    p.add_argument(
        "--target-at-decision",
        action="store_true",
        help="a moving peer announces JOINING on its target as soon as it decides to move, not once it has "
        "drained its queue as the real peer does (to weigh that change)",
    )
    p.add_argument(
        "--compute-abandoned",
        action="store_true",
        help="a peer computes a queued call even after its caller has given up, instead of dropping it as the "
        "real runtime does (to weigh that rule)",
    )
    p.add_argument(
        "--connection-error-seconds",
        type=float,
        default=d.connection_error_seconds,
        help="seconds until a call to a vanished peer fails (at most its deadline)",
    )
    p.add_argument("--deadline-floor", type=float, default=d.deadline_floor, help="router's shortest call deadline")
    p.add_argument("--deadline-ceiling", type=float, default=d.deadline_ceiling, help="router's longest call deadline")
    p.add_argument("--window", type=float, default=d.window, help="simulated seconds per measurement window")
    p.add_argument(
        "--trace", default=None, help="spot trace to replay as a live-instance count (time_ms,add|remove,node lines)"
    )
    p.add_argument(
        "--trace-minutes", type=float, default=None, help="simulated minutes the whole trace spans (--minutes)"
    )
    p.add_argument(
        "--join-spread",
        type=float,
        default=d.join_spread,
        help="instances launched together boot over up to this many seconds (0: all at once)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="random seed")
    p.add_argument("--series", action="store_true", help="include the per-window time series")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The scenario the command line describes; ValueError if it makes no sense."""
    config = SimConfig(
        peers=args.peers,
        stages=args.stages,
        minutes=args.minutes,
        start=args.start,
        speed_min=args.speed_min,
        speed_max=args.speed_max,
        stage_costs=args.stage_costs,
        microbatch=args.microbatch,
        in_flight=args.in_flight,
        trainers=args.trainers,
        rebalance=not args.no_rebalance,
        rebalance_period=args.rebalance_period,
        margin=args.margin,
        announce_period=args.announce_period,
        record_ttl=args.record_ttl,
        move_seconds=args.move_seconds,
        state_mb=args.state_mb,
        bandwidth_mbit=args.bandwidth_mbit,
        move_horizon=args.move_horizon,
        throughput_noise=args.throughput_noise,
        target_at_decision=args.target_at_decision,
        skip_abandoned=not args.compute_abandoned,
        connection_error_seconds=args.connection_error_seconds,
        deadline_floor=args.deadline_floor,
        deadline_ceiling=args.deadline_ceiling,
        window=args.window,
        trace=args.trace,
        trace_minutes=args.trace_minutes,
        join_spread=args.join_spread,
        seed=args.seed,
        series=args.series,
    )
    if config.peers < 1 or config.stages < 1 or config.minutes <= 0 or config.microbatch < 1:
        raise ValueError("--peers, --stages, --minutes and --microbatch must be positive")
    if not 1 <= config.speed_min <= config.speed_max:
        raise ValueError("need 1 <= --speed-min <= --speed-max")
    if config.stage_costs is not None and (len(config.stage_costs) != config.stages or min(config.stage_costs) <= 0):
        raise ValueError(f"--stage-costs needs {config.stages} positive numbers")
    if min(config.announce_period, config.window, config.bandwidth_mbit, config.move_horizon) <= 0:
        raise ValueError("--announce-period, --window, --bandwidth-mbit and --move-horizon must be positive")
    if config.margin < 0 or any(m < 0 for m in args.margins):
        raise ValueError("margins must be 0 or more")
    if config.throughput_noise < 0 or (config.trace_minutes is not None and config.trace_minutes <= 0):
        raise ValueError("--throughput-noise must be 0 or more, --trace-minutes positive")
    if min(config.rebalance_period, config.join_spread, config.move_seconds, config.state_mb) < 0:
        raise ValueError("--rebalance-period, --join-spread, --move-seconds and --state-mb must be 0 or more")
    if config.trace is not None:
        if not Path(config.trace).is_file():
            raise ValueError(f"--trace {config.trace}: no such file")
        read_trace(config.trace)  # a malformed line is refused here, with its number
    if config.trainers < 1 or (config.in_flight is not None and config.in_flight < 1):
        raise ValueError("--trainers and --in-flight must be at least 1")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"simulate.py: {e}", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    report = run_study(config, args.margins, baseline=not args.no_baseline, log=log)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
