"""A study: one scenario at each hysteresis margin asked for, and once with rebalancing off, from one seed."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import swarm.policy.balance
import swarm.policy.held_records
import swarm.policy.rebalance_timing
import swarm.policy.router
from simulation.engine import EXACT_IDEAL_MAX_PEERS, IDEAL_NODE_LIMIT, Simulation
from simulation.scenario import SimConfig


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
    report["config"]["hold_seconds"] = config.grace
    report["config"]["cooldown_seconds"] = config.cooldown_seconds
    # the rule and the router evolve: say which versions this report is about
    report["sources_sha256"] = {
        name: hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:12]
        for name, module in (
            ("swarm/policy/balance.py", swarm.policy.balance),
            ("swarm/policy/router.py", swarm.policy.router),
            ("swarm/policy/held_records.py", swarm.policy.held_records),
            ("swarm/policy/rebalance_timing.py", swarm.policy.rebalance_timing),
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
