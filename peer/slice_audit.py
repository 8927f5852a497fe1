"""Auditing the owners' sums of a round's slices: an owner that returns a wrong sum is caught by its mates.

Each slice's owner sums that slice of every contribution and sends the sum to every member
(`slice_exchange`). Nothing in the sum says it is the true one: an owner could return any vector, and
every replica would step on it. So every member that contributed audits the sums of the slices it does
not own (see `round_slices.audit_excess`):

- with its part of slice j, it sends owner j a secret seed for every other slice i (none for slice j);
- owner j answers, with its sum, the random projections of its own part of each such slice i under the
  seed the member sent for it;
- once it holds every sum, the member projects the sum of slice i on the Gaussian vectors of its seed
  and takes away the projections of every part but owner i's (its own and hand-overs' it computes; the
  other owners sent theirs). Owner i never saw that seed: what is left over is the projection of what it
  put in of its own, and it may put in at most its own gradient's bound.

An owner whose left-over is several times its bound is caught: the round fails, and the member leaves
it out of its rounds and state sources from then on (`MateMembership.catch`). A mate that lies about its
projections to a member can make that member blame an honest owner, which costs that member a retry;
it cannot make it take a wrong sum. Sums fetched from another member after their owner died, and sums
under a lossy codec or --robust-sum centered-clip (neither is the plain weighted sum), are not audited.
"""

from __future__ import annotations

import math
import secrets

import torch

from swarm.peer.round_slices import (
    AUDIT_PROJECTIONS,
    SliceMessage,
    audit_excess,
    audit_projections,
    bounded_norms,
    owner_scales,
    squared_norms,
)
from swarm.peer.step_machine import Contribution

OWN_NORM_TOLERANCE = 1e-4  # the owner's statement of this member's squared slice norm, relative (float32 rounding)


def audit_seeds(count: int, mine: int) -> list[int]:
    """A fresh secret seed for every slice of a round's `count` but this member's own (0 there)."""
    return [0 if index == mine else 1 + secrets.randbelow(2**62) for index in range(count)]


def seeds_for_owner(seeds: list[int], owner: int) -> list[int]:
    """What goes to the owner of slice `owner` with this member's part: every seed but that of its own slice."""
    return [0 if index == owner else seed for index, seed in enumerate(seeds)]


def answer_audit(seeds: list[int], own: torch.Tensor | None, bounds: list[tuple[int, int]]) -> list[float]:
    """The projections an owner sends a member with its sum: of this owner's part of each slice, under the seed
    the member sent for it (zeros where it sent none, or where this owner holds no gradient)."""
    if len(seeds) != len(bounds):
        return []
    projections: list[float] = []
    for seed, (lo, hi) in zip(seeds, bounds):
        projections += audit_projections(own[lo:hi], seed) if seed and own is not None else [0.0] * AUDIT_PROJECTIONS
    return projections


def audit_sums(
    me: str,
    seeds: list[int],
    owners: list[str],
    contributing: list[str],
    box: dict[str, Contribution],
    bounds: list[tuple[int, int]],
    sums: dict[int, torch.Tensor],
    reduced: dict[str, SliceMessage],
    by_samples: bool,
) -> tuple[dict[str, str], list[str]]:
    """The owners whose sums this member's audit refutes, each with why, and those whose sums came with norms
    for another set of contributions than this member's (the two disagree on the round: no one to blame, but
    no sum to step on either). `seeds`: the member's own; `reduced`: the owners' messages (sums, norms and
    projections) as they came; `sums`: every slice's sum, by index."""
    caught: dict[str, str] = {}
    disagreeing: list[str] = []
    for index, owner in enumerate(owners):
        message = reduced.get(owner)
        if not seeds[index] or owner == me or message is None or index not in sums:
            continue  # its own slice, or a sum fetched from a member after its owner died: not audited
        if len(message.slice_norms) != len(contributing):
            disagreeing.append(owner)
            continue
        why = _audit_one(
            me, seeds[index], index, owner, contributing, box, bounds[index], sums[index], reduced, by_samples
        )
        if why is not None:
            caught[owner] = why
    return caught, disagreeing


def _audit_one(
    me: str,
    seed: int,
    index: int,
    owner: str,
    contributing: list[str],
    box: dict[str, Contribution],
    bound: tuple[int, int],
    total: torch.Tensor,
    reduced: dict[str, SliceMessage],
    by_samples: bool,
) -> str | None:
    """Why owner `owner`'s sum of slice `index` is refuted, or None (it holds, or cannot be audited)."""
    lo, hi = bound
    stated = reduced[owner].slice_norms
    claims = [box[p].norm for p in contributing]
    seen = [math.sqrt(max(0.0, square)) for square in stated]
    counts = [box[p].samples for p in contributing]
    scales = owner_scales(claims, seen, counts, by_samples)
    norms = bounded_norms(claims, seen)
    if me in contributing:
        position = contributing.index(me)
        (actual,) = squared_norms([box[me].grad_sum[lo:hi]])
        if abs(stated[position] - actual) > OWN_NORM_TOLERANCE * actual + 1e-12:
            return f"it stated this peer's part of slice {index} at {stated[position]:.6g} squared, not {actual:.6g}"
    others, other_scales = [], []
    for position, peer in enumerate(contributing):
        if peer == owner:
            continue
        other_scales.append(scales[position])
        if peer == me or box[peer].handover:  # this peer's own part, or a hand-over's, which every member holds
            others.append(audit_projections(box[peer].grad_sum[lo:hi], seed))
            continue
        sent = reduced[peer].audits if peer in reduced else []
        if len(sent) < (index + 1) * AUDIT_PROJECTIONS:
            return None  # that owner's sum was fetched from another member, or it sent no projections: no audit
        others.append(sent[index * AUDIT_PROJECTIONS : (index + 1) * AUDIT_PROJECTIONS])
    own = contributing.index(owner) if owner in contributing else None
    owner_bound = scales[own] * norms[own] if own is not None else 0.0
    estimate, limit = audit_excess(
        audit_projections(total, seed), others, other_scales, owner_bound, [s * n for s, n in zip(scales, norms)]
    )
    if estimate <= limit:
        return None
    return (
        f"its own share of its sum of slice {index} measures about {estimate:.4g}, where its bound is {owner_bound:.4g}"
    )
