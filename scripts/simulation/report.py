"""What a scenario measured: its sampling windows, and the report made of them and its tallies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from simulation.actors import SimPeer, SimTrainer
from simulation.scenario import SimConfig
from swarm.policy.router import FORWARD_SHARE_OF_BACKWARD

# a sample costs a forward and a backward on every stage: capacity (backward samples/s) over this
WORK_PER_SAMPLE = 1 + FORWARD_SHARE_OF_BACKWARD


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


class Measured(Protocol):
    """The tallies of a run (`simulation.engine.Simulation`) that its report reads."""

    config: SimConfig
    windows: list[Window]
    counters: dict[str, int]
    peer_seconds: float
    empty_stage_seconds: float
    trainers: list[SimTrainer]
    live: dict[str, SimPeer]
    peak_live: int
    serving_count: list[int]


def scenario_report(simulation: Measured, wall: float) -> dict:
    """One scenario's report (see scripts/simulate.py), from its windows and tallies; `wall`: seconds it ran."""
    windows = simulation.windows
    steady = windows[len(windows) // 2 :] or windows
    counters = simulation.counters

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    reached = next((w.time for w in windows if w.assignment_fraction >= 0.9), None)
    capacity = [w.mean_assignment / WORK_PER_SAMPLE for w in steady]
    methods: dict[str, int] = {}
    for w in windows:
        methods[w.ideal_method] = methods.get(w.ideal_method, 0) + 1
    peer_hours = simulation.peer_seconds / 3600
    report: dict[str, object] = {
        "margin": simulation.config.margin,
        "rebalance": simulation.config.rebalance and simulation.config.rebalance_period > 0,
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
        "moves_back": counters["moves_back"],
        "returns_barred": counters["returns_barred"],
        "returns_within_cooldown": counters["returns_within_cooldown"],
        "empty_stage_seconds": round(simulation.empty_stage_seconds, 1),
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
        "bans": sum(t.router.bans_issued for t in simulation.trainers),
        "joins": counters["joins"],
        "removals": counters["removals"],
        "preempted_before_joining": counters["preempted_before_joining"],
        "peak_live_peers": simulation.peak_live,
        "final_live_peers": len(simulation.live),
        "final_serving_per_stage": list(simulation.serving_count),
        "plans_computed": counters["plans_computed"],
        "ideal_method": methods,
        "wall_seconds": round(wall, 2),
    }
    if simulation.config.series:
        report["series"] = {
            "time": [w.time for w in windows],
            "live_peers": [w.live_peers for w in windows],
            "assignment_fraction": [round(w.assignment_fraction, 4) for w in windows],
            "measured_fraction": [round(w.measured_fraction, 4) for w in windows],
        }
    return report
