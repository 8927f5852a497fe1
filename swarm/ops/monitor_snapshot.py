"""What `swarm monitor` shows, as plain data: built from the records read from the DHT. Pure: no network.

A snapshot holds the stages (peers, capacity, the balance rule's ideal and its planned moves), the
peers, the trainers and each trainer's loss and samples/s over time. The history is kept here, by
the monitor, as it reads the trainers' records: a trainer publishes only its last few steps.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from swarm.models import get_model_spec
from swarm.policy.balance import capacities, ideal_assignment, loads_from_records, plan_moves, stage_costs
from swarm.records.stage_records import JOINING, SERVING, StageRecord
from swarm.records.trainer_records import ProgressPoint, TrainerRecord

MAX_HISTORY = 2000  # points kept per trainer
MAX_TRAINERS_KEPT = 64  # trainers whose history is kept; the one seen longest ago goes first
# the exact ideal is a branch and bound search: a monitor reading a large swarm every few seconds caps it
IDEAL_NODE_LIMIT = 200_000
IDEAL_MAX_EXACT_PEERS = 200


@dataclass
class MonitorHistory:
    """Each trainer's points by step, as seen over the monitor's life: bounded in trainers and points."""

    points: OrderedDict[str, dict[int, ProgressPoint]] = field(default_factory=OrderedDict)

    def add(self, trainers: list[TrainerRecord]) -> None:
        """Folds in the points of freshly read records (a step seen again keeps its first point)."""
        for record in trainers:
            mine = self.points.setdefault(record.peer_id, {})
            self.points.move_to_end(record.peer_id)
            for point in record.points:
                mine.setdefault(point.step, point)
            if len(mine) > MAX_HISTORY:
                for step in sorted(mine)[: len(mine) - MAX_HISTORY]:
                    del mine[step]
        while len(self.points) > MAX_TRAINERS_KEPT:
            self.points.popitem(last=False)

    def series(self) -> dict[str, list[list[float]]]:
        """Per trainer, its points as [time, step, loss, samples/s], in step order."""
        return {
            trainer: [points[step].to_value() for step in sorted(points)] for trainer, points in self.points.items()
        }


def _stage_costs(records: dict[int, list[StageRecord]], num_stages: int) -> tuple[str | None, list[float]]:
    """The model and cut most peers announce and its stages' relative costs (all 1 if it is unknown here)."""
    models = Counter((r.model, r.stage_blocks) for found in records.values() for r in found)
    if not models:
        return None, [1.0] * num_stages
    model, cut = models.most_common(1)[0][0]
    try:
        spec = get_model_spec(model, **({"stage_blocks": cut} if cut and len(cut) == num_stages else {}))
        if num_stages <= spec.n_layer:
            return model, stage_costs(spec, num_stages)
    except ValueError:
        pass
    return model, [1.0] * num_stages


def build_snapshot(
    run_id: str,
    num_stages: int,
    records: dict[int, list[StageRecord]],
    trainers: list[TrainerRecord],
    history: MonitorHistory,
    now: float,
) -> dict:
    """The JSON-ready view of the swarm at DHT time `now`: stages, peers, balance, trainers and history.

    The trainers' points are folded into `history` first, so the view holds all the monitor has seen.
    """
    model, costs = _stage_costs(records, num_stages)
    loads = [p for p in loads_from_records(records, costs) if 0 <= p.stage < num_stages]
    caps = capacities(loads, num_stages)
    ideal, _, proven = ideal_assignment(
        [p.throughput * costs[p.stage] for p in loads],
        num_stages,
        costs,
        node_limit=IDEAL_NODE_LIMIT,
        max_exact_peers=IDEAL_MAX_EXACT_PEERS,
    )
    moves = plan_moves(loads, num_stages, costs=costs)
    banned_by = Counter(b for t in trainers if not t.finished for b in set(t.banned))  # a finished one calls no one
    throughput = min(caps) if caps else 0.0
    served = [stage for stage in range(num_stages) if any(r.state == SERVING for r in records.get(stage, []))]
    # the stage holding the pipeline back; none while nothing has been measured yet
    bottleneck = min(range(num_stages), key=lambda s: (caps[s], s)) if num_stages and max(caps) > 0 else None
    stages = [
        _stage_row(stage, records.get(stage, []), caps[stage], costs[stage], ideal, stage == bottleneck)
        for stage in range(num_stages)
    ]
    peers = _peer_rows(records, banned_by, now)
    history.add(trainers)
    return {
        "run_id": run_id,
        "model": model,
        "num_stages": num_stages,
        "time": now,
        "stages_served": len(served),
        "stages": stages,
        "peers": peers,
        "balance": {
            "throughput": throughput,
            "ideal_throughput": ideal,
            "ideal_proven": proven,
            "bottleneck": bottleneck,
            "moves": [{"peer_id": m.peer_id, "source": m.source, "target": m.target} for m in moves],
        },
        "trainers": _trainer_rows(trainers, now),
        "bans_issued": sum(t.bans_issued for t in trainers),
        "history": history.series(),
    }


def _stage_row(
    stage: int, found: list[StageRecord], capacity: float, cost: float, ideal: float, bottleneck: bool
) -> dict:
    """One stage's line: its peers by state, step, queue, capacity, cost and load against the ideal."""
    return {
        "stage": stage,
        "peers": len(found),
        "serving": sum(r.state == SERVING for r in found),
        "joining": sum(r.state == JOINING for r in found),
        "step": max((r.step for r in found), default=None),
        "queue": sum(r.queue_length for r in found),
        "stale_gradients": sum(r.stale_gradients for r in found),
        "capacity": capacity,
        "cost": cost,
        # balanced, every stage could carry the best pipeline throughput these peers allow
        "load": capacity / ideal if ideal > 0 else None,
        "bottleneck": bottleneck,
    }


def _peer_rows(records: dict[int, list[StageRecord]], banned_by: Counter[str], now: float) -> list[dict]:
    """Every peer's line, by stage and peer id; `banned_by` counts the trainers that ban each peer."""
    return [
        {
            "peer_id": r.peer_id,
            "stage": stage,
            "state": r.state,
            "model": r.model,
            "step": r.step,
            "throughput": r.throughput,
            "queue": r.queue_length,
            "stale_gradients": r.stale_gradients,
            "movable": r.movable,
            "expires_in": r.expiration - now,
            "banned_by": banned_by.get(r.peer_id, 0),
        }
        for stage in sorted(records)
        for r in sorted(records[stage], key=lambda r: r.peer_id)
    ]


def _trainer_rows(trainers: list[TrainerRecord], now: float) -> list[dict]:
    """Every trainer's line, by peer id."""
    return [
        {
            "peer_id": t.peer_id,
            "model": t.model,
            "step": t.step,
            "samples": t.samples,
            "loss": t.loss,
            "samples_per_second": t.samples_per_second,
            "bans_issued": t.bans_issued,
            "banned": list(t.banned),
            "expires_in": t.expiration - now,
            "finished": t.finished,
        }
        for t in sorted(trainers, key=lambda t: t.peer_id)
    ]
