"""Owners' sums audited by their mates (`slice_audit`): a lie beyond the owner's own bound is caught, the
truth never is. A round of real gradient vectors, summed and audited by the functions the peers run."""

from __future__ import annotations

import math
import random

import pytest
import torch

from swarm.peer.round_slices import SliceMessage, owner_scales, reduce_slice, slice_bounds, squared_norms
from swarm.peer.slice_audit import answer_audit, audit_seeds, audit_sums, seeds_for_owner
from swarm.peer.step_machine import Contribution

SIZE = 30_001


def contributions(scales: list[float], seed: int = 0) -> dict[str, Contribution]:
    """Three members' contributions, gradients of the given sizes (each stating its norm truly)."""
    generator = torch.Generator().manual_seed(seed)
    box = {}
    for name, scale in zip("abc", scales):
        grad = torch.randn(SIZE, generator=generator) * scale
        box[name] = Contribution(8, grad, frozenset("abc"), norm=float(grad.norm()))
    return box


def run_round(box: dict[str, Contribution], lie=None, misstate: str | None = None) -> dict[str, dict[str, str]]:
    """Each member sums its slice and audits the others'; `lie(total)` is what owner `c` sends instead of its sum,
    `misstate` a member whose norm `c` states wrong. Returns what each member caught."""
    owners = sorted(box)
    bounds = slice_bounds(SIZE, len(owners))
    # fixed seeds: the audit's four projections estimate a share, and now and then an owner that
    # adds its own gradient once more reads past the factor (the margin is about the estimate's spread there)
    rng = random.Random(11)
    seeds = {m: [0 if i == owners.index(m) else 1 + rng.randrange(2**62) for i in range(len(owners))] for m in owners}
    sums, reduced = {}, {}
    for index, owner in enumerate(owners):
        lo, hi = bounds[index]
        parts = [box[p].grad_sum[lo:hi] for p in owners]
        squares = squared_norms(parts)
        claims = [box[p].norm for p in owners]
        scales = owner_scales(claims, [math.sqrt(s) for s in squares], [8, 8, 8])
        total = reduce_slice(parts, scales)
        if owner == "c" and lie is not None:
            total = lie(total)
        if owner == "c" and misstate is not None:
            squares[owners.index(misstate)] *= 0.25
        sums[index] = total
        reduced[owner] = {
            m: SliceMessage(
                b"",
                3,
                index,
                total,
                slice_norms=squares,
                audits=answer_audit(seeds_for_owner(seeds[m], index), box[owner].grad_sum, bounds),
            )
            for m in owners
        }
    found = {
        m: audit_sums(m, seeds[m], owners, owners, box, bounds, sums, {o: reduced[o][m] for o in owners}, False)
        for m in owners
    }
    assert not any(disagreeing for _, disagreeing in found.values())
    return {m: caught for m, (caught, _) in found.items()}


@pytest.mark.parametrize(
    "sizes", [[1.0, 1.0, 1.0], [1.0, 3.0, 0.5], [1.0, 1.0, 50.0]], ids=["even", "uneven", "clipped"]
)
def test_true_sums_are_never_refuted(sizes):
    for seed in range(20):
        caught = run_round(contributions(sizes, seed))
        assert caught == {"a": {}, "b": {}, "c": {}}, (seed, caught)


def test_an_owner_returning_a_reversed_sum_is_caught_by_every_other_member():
    caught = run_round(contributions([1.0, 1.0, 1.0]), lie=lambda total: -100 * total)
    assert set(caught["a"]) == set(caught["b"]) == {"c"} and not caught["c"]
    assert "bound" in caught["a"]["c"]


def test_an_owner_adding_its_own_gradient_again_is_within_what_it_may_put_in():
    # the bound: an owner can put in a few times its own bound's worth, no more (the class the norm bound leaves)
    box = contributions([1.0, 1.0, 1.0])
    lo, hi = slice_bounds(SIZE, 3)[2]
    caught = run_round(box, lie=lambda total: total + box["c"].grad_sum[lo:hi])
    assert caught == {"a": {}, "b": {}, "c": {}}
    caught = run_round(box, lie=lambda total: total + 10 * box["c"].grad_sum[lo:hi])
    assert set(caught["a"]) == set(caught["b"]) == {"c"}


def test_an_owner_misstating_a_member_s_norm_is_caught_by_that_member():
    caught = run_round(contributions([1.0, 1.0, 1.0]), misstate="a")
    assert set(caught["a"]) == {"c"} and "stated this peer's part" in caught["a"]["c"]


def test_seeds_are_never_sent_to_the_owner_of_the_slice_they_audit():
    seeds = audit_seeds(4, 1)
    assert seeds[1] == 0 and all(seeds[i] for i in (0, 2, 3))
    for owner in range(4):
        sent = seeds_for_owner(seeds, owner)
        assert sent[owner] == 0 and all(sent[i] == seeds[i] for i in range(4) if i != owner)
