"""The discrete-event simulation of one scenario: a heap of timed events moving peers, calls and churn."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable

from harness.spot_trace import live_peer_targets, read_trace
from simulation.actors import SIM_JOINING, SIM_MOVING, SIM_SERVING, Microbatch, SimPeer, SimTrainer
from simulation.averaging import AveragingModel
from simulation.balance_view import BalanceView
from simulation.report import Window, scenario_report
from simulation.scenario import SimConfig
from simulation.view_faults import ViewFaults
from swarm.config import TrainerConfig
from swarm.policy.balance import (
    Move,
    PeerLoad,
    assignment_throughput,
    choose_stage,
    ideal_assignment,
    upper_bound_throughput,
)
from swarm.policy.rebalance_timing import LOOK, RebalanceTiming, ReturnCooldown, Wait
from swarm.policy.router import FORWARD_SHARE_OF_BACKWARD, Router
from swarm.records.stage_records import SERVING, StageRecord
from swarm.trainer.stage_calls import REQUEUE_PAUSE_MAX

EXACT_IDEAL_MAX_PEERS = 200
# the exact search gives up after this many nodes; past it the best assignment found is used
IDEAL_NODE_LIMIT = 20_000
# a move back to a stage the peer left less than this long before is an oscillation: longer than the
# peer's cool-down (its rebalance horizon, 600 s by default), so that the bar alone does not hide one
OSCILLATION_SECONDS = 900.0
REJECT_SECONDS = 0.1  # a refusal (peer not serving the stage) comes back after a round trip
STAGE_POLL_SECONDS = 0.5  # a trainer with no live peer for a stage looks again this often
TRAINER_DEFAULTS = TrainerConfig()  # the real trainer's attempts per call and patience with a stalled stage


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
                "moves_back",
                "returns_barred",
                "returns_within_cooldown",
            ),
            0,
        )
        self.balance = BalanceView(config, self.costs, self.counters)
        self.faults = ViewFaults(config, self.num_stages, random.Random(config.seed * 7919 + 5))
        self.averaging = AveragingModel(config, self.costs, random.Random(config.seed * 7919 + 6))
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
        peer.cooldown = ReturnCooldown(self.config.cooldown_seconds)
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
        self.faults.renew(list(self.live), self.now)
        # a vanished peer's last records stay in the DHT until they expire
        self._ghosts = [r for r in self._ghosts if r.expiration > self.now]
        for record in self._ghosts:
            if not self.faults.hidden(record.peer_id, record.stage, self.now):
                view[record.stage].append(record)
        for peer in self.live.values():
            peer.announced = self._records(peer)
            for record in peer.announced:
                if not self.faults.hidden(peer.peer_id, record.stage, self.now):
                    view[record.stage].append(record)
        self.view = view
        self.balance.changed()
        for trainer in self.trainers:
            trainer.router.update(view, self.now)
        self._at(self.now + config.announce_period, self._refresh_view)

    def _announce(self, peer: SimPeer, throughput: float | None = None) -> None:
        """A change of the peer's state, visible at once to the balance rule (routers read at renewals)."""
        for stage in {r.stage for r in peer.announced}:
            self.view[stage] = [r for r in self.view[stage] if r.peer_id != peer.peer_id]
        peer.announced = self._records(peer, throughput)
        for record in peer.announced:
            if not self.faults.hidden(peer.peer_id, record.stage, self.now):
                self.view[record.stage].append(record)
        self.balance.changed()

    def _records(self, peer: SimPeer, throughput: float | None = None) -> list[StageRecord]:
        target = None
        if self.config.target_at_decision and peer.draining(self.now) and peer.source is not None:
            # what it would announce for the target: its throughput, scaled by the stages' costs
            target = self.costs[peer.source] / self.costs[peer.stage] / peer.measured.seconds_per_sample
        if throughput is None:
            throughput = self.faults.noisy(peer.measured.samples_per_second)  # what it measures, noise and all
        return peer.records(self.now, self.config.record_ttl, self.num_stages, throughput, target)

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
        if peer.averaging_until > self.now and peer.state == SIM_SERVING:
            peer.running = None  # its stage averages: it starts nothing until the round is over
            if not peer.resume_pending:
                peer.resume_pending = True
                self._at(peer.averaging_until, self._resume, peer)
            return
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

    def _resume(self, peer: SimPeer) -> None:
        """Its stage's round is over: the peer takes its queued calls again."""
        peer.resume_pending = False
        if peer.alive and peer.running is None:
            self._start_next(peer)

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
        service = mb.trainer.timer.served(peer.peer_id, mb.start, self.now)
        mb.trainer.router.report_success(peer.peer_id, backward, self.config.microbatch, service)
        if backward and peer.state == SIM_SERVING:
            # the runtime's moving average of its backward timings (a draining peer's is thrown away)
            peer.measured.add(self._timing(peer))
            if self.averaging.enabled and self.averaging.add(peer.stage, self.config.microbatch):
                mates = [p for p in self.live.values() if p.state == SIM_SERVING and p.stage == peer.stage]
                self.averaging.start_round(peer.stage, mates, self.now)
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
        """The peer's move in its plan on the current view, if the plan moves it from the stage it serves."""
        return self.balance.planned_move(peer, self.view, self.now)

    def _check(self, peer: SimPeer, token: int) -> None:
        """A serving peer's periodic look at the plan; it moves if the plan has a move for it."""
        if not peer.alive or token != peer.check_token or peer.state != SIM_SERVING:
            return
        move = self._planned_move(peer)
        wait = peer.timing.looked(move is not None, settled=self.balance.ready)
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
        if target in peer.left_at:
            self.counters["moves_back"] += 1
        if now - peer.left_at.get(target, -math.inf) <= OSCILLATION_SECONDS:
            self.counters["oscillations"] += 1
        if now - peer.left_at.get(target, -math.inf) < self.config.cooldown_seconds:
            self.counters["returns_within_cooldown"] += 1
        peer.left_at[peer.stage] = now
        peer.cooldown.left(peer.stage, now)
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
        stage = choose_stage(self.balance.raw_loads(self.view), self.num_stages, self.costs, self.rng)
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
        report = scenario_report(self, time.perf_counter() - started)
        report["record_lapses"] = {"peer": self.faults.lapses, "stage": self.faults.stage_lapses}
        if self.averaging.enabled:
            report["averaging"] = self.averaging.report(end / 2, end)
        if config.trace:
            span = max(t for t, _ in read_trace(config.trace)) / 1000
            report["trace_seconds_per_simulated_second"] = round(span / (minutes * 60), 2)
        return report
