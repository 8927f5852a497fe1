"""The balance rule as the simulated peers apply it: the plan on the view they read, held and with spreads measured.

Every simulated peer reads the same view, so the plan is computed once per view and shared. The
pieces are the real peer's (`swarm.peer.rebalancing`): `HeldRecords` holds records that lapsed and
measures each peer's spread, `plan_moves` asks a move to clear that noise, and a peer's
the moves `HeldRecords` has seen bar returns within the cool-down for every peer alike; a peer's
own `ReturnCooldown` bars the stages it left too: a peer whose shared plan still sends it back to
one (a move the view missed) computes the plan again with its bar, as the real peer computes its
plan with its own.
"""

from __future__ import annotations

from simulation.actors import SimPeer
from simulation.scenario import SimConfig
from swarm.policy.balance import Move, MoveCost, PeerLoad, loads_from_records, plan_moves
from swarm.policy.held_records import HeldRecords
from swarm.records.stage_records import StageRecord


class BalanceView:
    """The plan every simulated peer computes from the current view, and each peer's own where its bar differs."""

    def __init__(self, config: SimConfig, costs: list[float], counters: dict[str, int]) -> None:
        self.config = config
        self.costs = costs
        self.counters = counters
        self.held = HeldRecords(config.grace, cooldown=config.cooldown_seconds)
        self.cost = MoveCost.of_state(config.state_mb, config.bandwidth_mbit, config.move_seconds, config.move_horizon)
        self._raw: list[PeerLoad] | None = None
        self._loads: list[PeerLoad] | None = None
        self._plan: dict[str, Move] | None = None
        self._own: dict[str, Move | None] = {}

    @property
    def ready(self) -> bool:
        """Whether the view rests on enough reads to plan on (`HeldRecords.ready`)."""
        return self.held.ready()

    def changed(self) -> None:
        """The view changed: plans are computed afresh."""
        self._raw = self._loads = self._plan = None
        self._own = {}

    def raw_loads(self, view: dict[int, list[StageRecord]]) -> list[PeerLoad]:
        """The view as one read shows it: what a newcomer choosing its stage reads."""
        if self._raw is None:
            self._raw = loads_from_records(view, self.costs)
        return self._raw

    def _held_loads(self, view: dict[int, list[StageRecord]], now: float) -> list[PeerLoad] | None:
        if self._loads is None:
            held = self.held.update(view, now)
            if not self.held.ready():
                return None
            self._loads = loads_from_records(held, self.costs, self.held.spreads())
        return self._loads

    def _plan_for(self, loads: list[PeerLoad], barred: dict[str, frozenset[int]] | None = None) -> dict[str, Move]:
        config = self.config
        moves = plan_moves(
            loads, config.stages, config.margin, self.costs, move_cost=self.cost, deviations=config.deviations,
            barred=barred,
        )  # fmt: skip
        self.counters["plans_computed"] += 1
        return {m.peer_id: m for m in moves}

    def planned_move(self, peer: SimPeer, view: dict[int, list[StageRecord]], now: float) -> Move | None:
        """The peer's move in its plan on the view, if the plan moves it from the stage it serves."""
        loads = self._held_loads(view, now)
        if loads is None:
            return None
        if self._plan is None:
            self._plan = self._plan_for(loads, self.held.barred(now))
        move = self._plan.get(peer.peer_id)
        barred = peer.cooldown.barred(now)
        if move is not None and move.target in barred:
            # the shared plan sends it back within its cool-down: its own plan, with its bar, decides
            self.counters["returns_barred"] += 1
            if peer.peer_id not in self._own:
                own = {**self.held.barred(now), peer.peer_id: barred}
                self._own[peer.peer_id] = self._plan_for(loads, own).get(peer.peer_id)
            move = self._own[peer.peer_id]
        return move if move is not None and move.source == peer.stage else None
