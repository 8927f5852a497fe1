"""How much of each mate's gradient a round takes: contributions far larger than the group's are clipped.

A stranger in a public swarm can send a finite but huge gradient sum; summed in as it is, it would
steer every replica of the stage. Each contribution's gradient per sample is compared with the
group's: one whose norm exceeds `CLIP_FACTOR` times the lower median of the group's norms is scaled
down to that bound; with only two contributions, it is left out of the round instead (`left_out`).

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

import torch

# honest heavy tails: one hard microbatch of 5 samples beside 19 others measured 5.15 times the 5-fold bound its
# square-root allowance gives (a rebalancing run: its peers clipped, and the stage left the one-process path);
# a steering gradient (reversed and 100 times larger) stays far beyond 10
CLIP_FACTOR = 10.0
# of two, one beyond this many times the bound is left out: leaving out throws its samples away by id, and one
# microbatch of an honest gradient against three measured up to 10.5 times the bound under churn, while a
# steering gradient (reversed and 100 times larger: scripts/harness/hostile_peer.py) stays far beyond it
LEAVE_OUT_FACTOR = 20.0


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


def left_out(
    per_sample_norms: list[float], samples: list[int], by_samples: bool = False, factor: float = LEAVE_OUT_FACTOR
) -> list[int]:
    """With exactly two contributions, the one beyond the bound (`clip_scales`), to be left out of the round.

    Three or more have a majority to scale an outlier toward; two have none, and a gradient scaled down to
    the bound still pulls the sum its way with the full weight of the samples it claims. So it is not
    averaged in at all: the round steps on the other contribution alone and reports the one left out."""
    if len(per_sample_norms) != 2:
        return []
    scales = clip_scales(per_sample_norms, samples, factor, by_samples)
    return [index for index, scale in enumerate(scales) if scale < 1.0]


def _reference(per_sample_norms: list[float], counts: list[int], by_samples: bool) -> int:
    """The contribution whose norm sets the bound.

    The lower median contribution: one outlier cannot raise it, but with two members either can lower it
    (a near-zero gradient would clip the other's). With `by_samples`, the contribution holding the lower
    median sample, ordered by norm: raising the bound takes more than half of the samples the round sums,
    lowering it half of them. Where two members hold half each the smaller gradient sets it, since a step
    too small costs a step while one too large (reversed, say) steers every replica."""
    order = sorted(range(len(per_sample_norms)), key=lambda i: per_sample_norms[i])
    if not by_samples:
        return order[(len(order) - 1) // 2]
    total, seen = sum(max(c, 0) for c in counts), 0
    for index in order:
        seen += max(counts[index], 0)
        if 2 * seen >= total:
            return index
    return order[-1]


# --- direction: a minority of contributions cannot pull the sum far ------------------------------------------

CENTER_FACTOR = 4.0  # a contribution this many typical spreads from the others' is an outlier, clipped toward them
CENTER_ITERATIONS = 4
MIN_CENTERED = 3  # below this many contributions there is no majority to compare with
CHUNK = 1 << 20  # coordinates handled at once: the work's memory stays a few chunks, whatever the slice


def centered_sum(pieces: list[torch.Tensor], samples: list[int], factor: float = CENTER_FACTOR):
    """The sum of the contributions' `pieces` (each a sum over its `samples`), robust to a minority pulling it away.

    Norm clipping bounds a contribution's size, not its direction: one of the usual norm that points
    elsewhere (a flipped or made-up gradient) goes into the sum whole. Each contribution's mean per sample
    is compared with every other's, their distance scaled to the noise two honest means of those sample
    counts show (which shrinks like the square root of the samples); a contribution's score is the lower
    median of its distances. One that scores more than `factor` times the typical (lower median) score is
    an outlier, and the sum is then CenteredClip's (Karimireddy et al., 2021): from the mean of the others,
    each contribution pulls the center by at most `factor` typical spreads, weighted by its samples, a few
    times over.

    Returns (None, []) where no contribution stands out, as in honest training: the plain sum is exact
    then and is the caller's to take. Otherwise (the robust sum, the indices of the outliers).
    """
    used = [i for i, n in enumerate(samples) if n > 0]
    if len(used) < MIN_CENTERED:
        return None, []
    rows = [pieces[i] for i in used]
    counts = torch.tensor([float(samples[i]) for i in used], dtype=torch.float64)
    weights = (counts / counts.sum()).float()
    gram = torch.zeros(len(rows), len(rows), dtype=torch.float64)
    for lo in range(0, rows[0].numel(), CHUNK):
        means = _means(rows, counts, lo)
        deviations = means - weights @ means  # about the mean: the products below lose no precision to it
        gram += (deviations @ deviations.T).double()
    squares = gram.diagonal()
    distances = ((squares[:, None] + squares[None, :] - 2 * gram).clamp_min(0) / _noise(counts)).sqrt().tolist()
    scores = [_lower_median([d for j, d in enumerate(row) if j != i]) for i, row in enumerate(distances)]
    typical = _lower_median(scores)
    outliers = [i for i, score in enumerate(scores) if score > factor * typical]
    if not math.isfinite(typical) or typical <= 0 or not outliers:
        return None, []
    radii = factor * typical / counts.sqrt()
    center = _clipped_center(rows, counts, weights, radii, outliers)
    total = (center * float(counts.sum())).to(rows[0].dtype)
    return total, [used[i] for i in outliers]


def _means(rows: list[torch.Tensor], counts: torch.Tensor, lo: int) -> torch.Tensor:
    """The contributions' means per sample over one chunk of coordinates from `lo`, float32, a row each."""
    return torch.stack([row[lo : lo + CHUNK].float() / float(n) for row, n in zip(rows, counts)])


def _noise(counts: torch.Tensor) -> torch.Tensor:
    """Per pair, how the squared distance of two honest means grows with their noise: 1/n_i + 1/n_j."""
    inverse = 1 / counts
    return inverse[:, None] + inverse[None, :]


def _lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def _clipped_center(rows, counts, weights, radii, outliers: list[int]) -> torch.Tensor:
    """CenteredClip: from the weighted mean of the contributions not among `outliers`, each pulls the center
    toward its own mean by at most its radius, a few times over."""
    kept = torch.tensor([0.0 if i in outliers else float(w) for i, w in enumerate(weights)])
    kept = kept / kept.sum()
    size = rows[0].numel()
    center = torch.cat([kept @ _means(rows, counts, lo) for lo in range(0, size, CHUNK)])
    for _ in range(CENTER_ITERATIONS):
        squares = torch.zeros(len(rows), dtype=torch.float64)
        for lo in range(0, size, CHUNK):
            squares += (_means(rows, counts, lo) - center[lo : lo + CHUNK]).double().square().sum(1)
        pull = weights * torch.clamp(radii / squares.sqrt().clamp_min(1e-30), max=1.0).float()
        for lo in range(0, size, CHUNK):
            part = center[lo : lo + CHUNK]
            part += pull @ (_means(rows, counts, lo) - part)
    return center
