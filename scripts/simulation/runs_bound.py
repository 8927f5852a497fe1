"""A lower bound on the time to train several runs on churning peers: a linear program over the same peers.

No schedule finishes all runs by time T unless peer-seconds can be split among (run, stage) pairs so
that every stage of every run gets the flops its samples need, no peer gives more seconds than it is up
before T, and no run trains faster than its trainers feed it. That split is a linear program (a peer may
be split at will, moves cost nothing, stages need not run at once), so the smallest T for which it is
feasible, found by bisection, bounds every real schedule from below: the simulation's included.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import linprog

from simulation.runs_flow import SimRun


def up_seconds(spells: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end) a peer is up."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spells)


def feasible(
    speeds: Sequence[float], up_times: Sequence[Sequence[tuple[float, float]]], runs: Sequence[SimRun], end: float
) -> bool:
    """Whether the relaxation can train every run by `end` (from time 0)."""
    if any(r.samples / r.demand > end for r in runs):
        return False
    pairs = [(r, s) for r in runs for s in range(len(r.stage_flops))]
    n_peers, n_pairs = len(speeds), len(pairs)
    # variable (p, j): seconds peer p gives pair j; each pair needs samples x flops, each peer has its up-time
    rows, bounds = [], []
    for j, (run, s) in enumerate(pairs):
        row = np.zeros(n_peers * n_pairs)
        row[j::n_pairs] = -np.asarray(speeds, dtype=float)
        rows.append(row)
        bounds.append(-run.samples * run.stage_flops[s])
    for p in range(n_peers):
        row = np.zeros(n_peers * n_pairs)
        row[p * n_pairs : (p + 1) * n_pairs] = 1.0
        rows.append(row)
        bounds.append(up_seconds(up_times[p], 0.0, end))
    # each row scaled by its bound: flops and seconds differ by many orders of magnitude
    scale = np.maximum(np.abs(np.asarray(bounds)), 1.0)
    a_ub, b_ub = np.asarray(rows) / scale[:, None], np.asarray(bounds) / scale
    result = linprog(np.zeros(n_peers * n_pairs), A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
    return result.status == 0


def lower_bound(
    speeds: Sequence[float],
    up_times: Sequence[Sequence[tuple[float, float]]],
    runs: Sequence[SimRun],
    horizon: float,
    tolerance: float = 1e-3,
) -> float:
    """The least T (seconds, within `tolerance` of it) by which the relaxation trains every run."""
    low, high = 0.0, horizon
    if not feasible(speeds, up_times, runs, high):
        return float("inf")
    while high - low > tolerance * high:
        mid = (low + high) / 2
        if feasible(speeds, up_times, runs, mid):
            high = mid
        else:
            low = mid
    return high
