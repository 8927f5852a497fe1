"""How much of each mate's gradient a round takes: contributions far larger than the group's are clipped.

A stranger in a public swarm can send a finite but huge gradient sum; summed in as it is, it would
steer every replica of the stage. Each contribution's gradient per sample is compared with the
group's: one whose norm exceeds `CLIP_FACTOR` times the lower median of the group's norms is scaled
down to that bound.

A contribution of few samples is allowed a larger gradient per sample: early in training, and
whenever the noise between samples outweighs their common direction, the norm of a sum of n
per-sample gradients grows like the square root of n, not like n, so its norm per sample shrinks
like 1 / sqrt(n). A mate that joined mid-step with 5 samples beside one with 45 then shows three
times the per-sample norm while being perfectly honest. Its bound is raised by sqrt(n_ref / n),
n_ref the sample count of the contribution that sets the bound, so in honest training nothing is
clipped and rounds stay exact. Every member computes the same scales from the same agreed
contributions, so replicas stay equal.
"""

from __future__ import annotations

import math

CLIP_FACTOR = 5.0


def clip_scales(
    per_sample_norms: list[float],
    samples: list[int] | None = None,
    factor: float = CLIP_FACTOR,
    by_samples: bool = False,
) -> list[float]:
    """The factor each contribution is multiplied by (1.0: taken as it is), in the order given.

    `samples` are the contributions' sample counts (all alike if not given). With one contribution there
    is nothing to compare with; a bound of zero (an all-zero gradient in the lower half) clips nothing,
    since it says nothing about the others' size. `by_samples`: the bound is set by the median sample
    rather than the median contribution (`reference`), for counts that vouched trainers' receipts prove.
    """
    if len(per_sample_norms) < 2:
        return [1.0] * len(per_sample_norms)
    counts = samples if samples is not None else [1] * len(per_sample_norms)
    reference = _reference(per_sample_norms, counts, by_samples)
    bound = factor * per_sample_norms[reference]
    if not math.isfinite(bound) or bound <= 0:
        return [1.0] * len(per_sample_norms)
    scales = []
    for norm, count in zip(per_sample_norms, counts):
        own_bound = bound * math.sqrt(max(1.0, counts[reference] / max(count, 1)))
        scales.append(own_bound / norm if norm > own_bound else 1.0)
    return scales


def _reference(per_sample_norms: list[float], counts: list[int], by_samples: bool) -> int:
    """The contribution whose norm sets the bound.

    The lower median contribution: one outlier cannot raise it, but with two members either can lower it
    (a near-zero gradient would clip the other's). With `by_samples`, the contribution holding the median
    sample, ordered by norm: lowering the bound then takes more than half of the samples the round sums,
    so a member moves it only with more than half of the stage's vouched work."""
    order = sorted(range(len(per_sample_norms)), key=lambda i: per_sample_norms[i])
    if not by_samples:
        return order[(len(order) - 1) // 2]
    total, seen = sum(max(c, 0) for c in counts), 0
    for index in order:
        seen += max(counts[index], 0)
        if 2 * seen > total:
            return index
    return order[-1]
