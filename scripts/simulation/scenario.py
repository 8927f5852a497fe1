"""A simulated scenario's parameters: the swarm, its trainers, its churn, and the rules under study."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import PeerConfig
from swarm.policy.balance import NOISE_DEVIATIONS
from swarm.policy.held_records import hold_grace

PEER_DEFAULTS = PeerConfig()  # the real peer's rebalancing period and margin are the simulation's defaults


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
    announce_noise: float = 0.0  # relative error of each announced throughput, uniform in +-this
    lapse_rate: float = 0.0  # per renewal, the chance a live peer's record lapses for a while
    stage_lapse_rate: float = 0.0  # per renewal, the chance a whole stage's records lapse for a while
    lapse_seconds: float = 20.0  # how long a lapse lasts, times a factor in [0.5, 1.5]
    # the balance rule's guards against noise and lapses, as the real peer's (None: the peer's defaults;
    # 0 for all three: the rule before them)
    deviations: float = NOISE_DEVIATIONS
    hold: float | None = None  # seconds a lapsed record is held (None: `hold_grace`, as the peer)
    cooldown: float | None = None  # seconds a peer may not return to a stage it left (None: move_horizon)
    # averaging between stage-mates (`simulation.averaging`); 0: not modelled
    target_batch_size: int = 0
    stage_params: float = 0.0  # parameters of a stage of mean cost (0: from --state-mb, 12 bytes each)
    link_mbit_min: float = 100.0
    link_mbit_max: float = 1000.0
    latency_ms_min: float = 5.0
    latency_ms_max: float = 100.0
    serve_during_rounds: bool = True  # mates serve on through a round, as peers do (False: held through it)
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
    def grace(self) -> float:
        """Seconds the balance rule holds a record missing from the view."""
        if self.hold is not None:
            return self.hold
        return hold_grace(self.rebalance_period, self.announce_period, self.record_ttl)

    @property
    def cooldown_seconds(self) -> float:
        """Seconds a peer may not move back to a stage it left."""
        return self.cooldown if self.cooldown is not None else self.move_horizon

    @property
    def download_seconds(self) -> float:
        """Time a moving or joining peer serves nothing: a fixed part plus the state over the link."""
        return self.move_seconds + self.state_mb * 8 / self.bandwidth_mbit

    @property
    def microbatches_in_flight(self) -> int:
        """Microbatches the trainers keep in flight together."""
        return self.in_flight if self.in_flight is not None else 2 * self.peers
