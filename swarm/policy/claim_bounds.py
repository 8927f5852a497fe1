"""How far a peer's announced throughput is believed: a claim is a number its peer writes, and nothing proves it.

The router costs a peer it has not timed yet from its claim, and the balance rule sums claims into
stage capacities, so one record claiming 1e9 samples/s would draw every call of a step, or make its
stage look rich enough that the rule sends honest peers away from it. A claim is therefore compared
with its stage: one above `CLAIM_MULTIPLE` times the stage's reference speed (the lower median of its
peers' nonzero claims, or what a trainer measured of the fastest of them, whichever is larger) is no honest
peer's, and counts as the stage's lower median instead, as a typical peer of the stage would. A claim
within the bound counts as it is, so honest peers of different speeds keep their weight; one peer's
claim counts for at most `CLAIM_MULTIPLE` typical peers. The lower median cannot be raised by one
claim while two peers or more announce: with two, it is the smaller claim. A claim of 0 (a peer that has
timed nothing yet) is no speed, and takes no part in the median.

Pure: every peer that reads the same records computes the same bounded claims, so the balance rule
(`swarm.policy.balance`) still gives every peer the same plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

CLAIM_MULTIPLE = 16.0  # well above the spread of honest hardware on one stage (the simulator's reaches 10x)


def lower_median(values: Iterable[float]) -> float:
    """The lower of the two middle values (the middle one of an odd count); 0 for none."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def claim_bound(claims: Iterable[float], measured: float = 0.0, multiple: float = CLAIM_MULTIPLE) -> float:
    """The largest believable claim among `claims` of one stage: `multiple` times the larger of the lower
    median of the nonzero ones and `measured` (the fastest speed a trainer timed there, 0 if none)."""
    return multiple * max(lower_median(c for c in claims if c > 0), measured)


def bounded_claims(
    claims: Mapping[str, float], measured: float = 0.0, multiple: float = CLAIM_MULTIPLE
) -> tuple[dict[str, float], dict[str, float]]:
    """Each peer's claim of one stage as it counts, and the claims that were out of bounds (as announced).

    A claim over `claim_bound` counts as the stage's lower median; the others count as they are.
    """
    bound = claim_bound(claims.values(), measured, multiple)
    typical = lower_median(c for c in claims.values() if c > 0)
    counted, ignored = {}, {}
    for peer_id, claim in claims.items():
        if claim > bound:
            counted[peer_id], ignored[peer_id] = typical, claim
        else:
            counted[peer_id] = claim
    return counted, ignored


def believed_claims(claims: Iterable[tuple[str, int, float]]) -> dict[str, float]:
    """Each peer's claim as it counts, from (peer id, stage, claim) triples: bounded within its stage."""
    per_stage: dict[int, dict[str, float]] = {}
    for peer_id, stage, claim in claims:
        per_stage.setdefault(stage, {})[peer_id] = claim
    believed: dict[str, float] = {}
    for stage_claims in per_stage.values():
        believed.update(bounded_claims(stage_claims)[0])
    return believed
