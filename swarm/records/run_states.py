"""The runs of a swarm as their stage records show them, for the runs rule (`swarm.policy.run_choice`).

A run's capacity per stage is the throughput its serving peers announce, each claim bounded as the
balance rule bounds it (`swarm.policy.claim_bounds`); a joining peer counts as a peer of its stage (it
will serve soon, and the next chooser must not pile onto the same gap) but adds no throughput yet, and
holds none of the stage's state. Its
progress is the lower median of the steps its serving peers announce (one record cannot make it look
done), and its remaining work the steps its file says it trains in all, less that step, times its
batch. A peer's speed in flops/s is its throughput times the flops a sample costs at its stage. A move into
the run is priced as the balance rule prices one within it (`move_gain`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from swarm.config.run_files import RunFile
from swarm.models.gpt import partition_layers
from swarm.planning.cluster import ModelCosts
from swarm.policy.balance import MoveCost
from swarm.policy.claim_bounds import bounded_claims, lower_median
from swarm.policy.run_choice import RUN_MOVE_FIXED_SECONDS, Placement, RunState
from swarm.records.stage_records import JOINING, SERVING, StageRecord


def _cut(run: RunFile) -> tuple[ModelCosts, list[tuple[int, bool, bool]]]:
    """The run's model costs, and each stage as (blocks, is first, is last) as the run is cut."""
    spec = run.config.model_spec()
    stages = run.config.num_stages
    layers = partition_layers(spec.n_layer, stages, spec.stage_blocks)
    return ModelCosts.from_spec(spec), [(len(layers[s]), s == 0, s == stages - 1) for s in range(stages)]


def stage_flops(run: RunFile) -> tuple[float, ...]:
    """Flops one sample costs at each stage of the run, forward and backward."""
    costs, stages = _cut(run)
    return tuple(costs.stage_flops(*stage) for stage in stages)


def move_gain(run: RunFile) -> float:
    """The least gain that pays for a move into the run: its largest stage's state downloaded at the run's
    `--move-bandwidth-mbit` after a peer process's start, against its `--rebalance-horizon`."""
    costs, stages = _cut(run)
    state_mb = max(costs.stage_state_bytes(*stage) for stage in stages) / 2**20
    config = run.config
    cost = MoveCost.of_state(state_mb, config.move_bandwidth_mbit, RUN_MOVE_FIXED_SECONDS, config.rebalance_horizon)
    return cost.least_gain()


def run_state(run: RunFile, records: dict[int, list[StageRecord]]) -> RunState:
    """The run's state from its stages' records."""
    flops = stage_flops(run)
    capacities, peers, holders, steps = [], [], [], []
    for stage in range(len(flops)):
        live = [r for r in records.get(stage, []) if r.state in (SERVING, JOINING)]
        serving = [r for r in live if r.state == SERVING]
        # a claim far above its stage's counts as a typical peer's, as in the balance rule
        capacities.append(sum(bounded_claims({r.peer_id: r.throughput for r in serving})[0].values()))
        peers.append(len(live))
        holders.append(len(serving))
        steps += [r.step for r in serving]
    # the lower median: one record announcing a far step cannot make the run look done
    remaining = max(0, run.total_steps - int(lower_median(steps))) * run.config.target_batch_size
    return RunState(
        run.run_id,
        run.priority,
        float(remaining),
        flops,
        tuple(capacities),
        tuple(peers),
        holders=tuple(holders),
        move_gain=move_gain(run),
    )


def placement_of(peer_id: str, records_by_run: dict[str, dict[int, list[StageRecord]]]) -> Placement | None:
    """Where a peer's own record says it serves (or joins), if anywhere."""
    for run_id, records in records_by_run.items():
        for stage, stage_records in records.items():
            if any(r.peer_id == peer_id and r.state in (SERVING, JOINING) for r in stage_records):
                return Placement(run_id, stage)
    return None


def peer_speed(
    peer_id: str | None, states: Sequence[RunState], records_by_run: dict[str, dict[int, list[StageRecord]]]
) -> float:
    """A peer's flops/s: from its own record once it has measured a throughput, else the median of the peers
    that have (a newcomer's guess), else 1 (no one has: any positive speed compares the runs alike)."""
    flops = {state.run_id: state.stage_flops for state in states}
    own, others = [], []
    for run_id, records in records_by_run.items():
        for stage, stage_records in records.items():
            for r in stage_records:
                if r.state == SERVING and r.throughput > 0 and stage < len(flops[run_id]):
                    (own if r.peer_id == peer_id else others).append(r.throughput * flops[run_id][stage])
    if own:
        return max(own)
    return statistics.median(others) if others else 1.0
