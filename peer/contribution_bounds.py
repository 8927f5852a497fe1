"""How much of each mate's gradient a round takes: contributions far larger than the group's are clipped.

A stranger in a public swarm can send a finite but huge gradient sum; summed in as it is, it would
steer every replica of the stage. Each contribution's gradient per sample is compared with the
group's: one whose norm exceeds `CLIP_FACTOR` times the lower median of the group's norms is scaled
down to that bound. Honest replicas' per-sample gradients are of one size (they are means over
samples from one distribution), so in honest training nothing is clipped and rounds stay exact.
Every member computes the same scales from the same agreed contributions, so replicas stay equal.
"""

from __future__ import annotations

import math

CLIP_FACTOR = 5.0


def clip_scales(per_sample_norms: list[float], factor: float = CLIP_FACTOR) -> list[float]:
    """The factor each contribution is multiplied by (1.0: taken as it is), in the order given.

    With one contribution there is nothing to compare with; a bound of zero (an all-zero gradient
    in the lower half) clips nothing, since it says nothing about the others' size.
    """
    if len(per_sample_norms) < 2:
        return [1.0] * len(per_sample_norms)
    ordered = sorted(per_sample_norms)
    bound = factor * ordered[(len(ordered) - 1) // 2]  # the lower median: one outlier cannot raise it
    if not math.isfinite(bound) or bound <= 0:
        return [1.0] * len(per_sample_norms)
    return [bound / norm if norm > bound else 1.0 for norm in per_sample_norms]
