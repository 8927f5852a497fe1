"""Clipping mates' contributions against the group: outliers scaled to the bound, honest ones untouched."""

from __future__ import annotations

import pytest
import torch

from swarm.peer import contribution_bounds
from swarm.peer.contribution_bounds import CLIP_FACTOR, centered_sum, clip_scales, left_out


def test_contributions_of_one_size_are_taken_as_they_are():
    assert clip_scales([1.0, 1.3, 0.8]) == [1.0, 1.0, 1.0]
    assert clip_scales([2.0]) == [1.0]
    assert clip_scales([]) == []


def test_an_outlier_is_scaled_down_to_the_bound_of_the_lower_median():
    scales = clip_scales([1.0, 1e30, 1.2])
    assert scales[0] == scales[2] == 1.0
    assert scales[1] * 1e30 == pytest.approx(CLIP_FACTOR * 1.2)  # the median of three
    # of two, the smaller sets the bound: a hostile mate cannot raise it
    big, small = clip_scales([1e6, 2.0])
    assert small == 1.0 and big * 1e6 == pytest.approx(CLIP_FACTOR * 2.0)


def test_an_all_zero_contribution_sets_no_bound():
    assert clip_scales([0.0, 3.0]) == [1.0, 1.0]


def test_honest_contributions_of_few_and_many_samples_are_not_clipped():
    # noisy per-sample gradients (no common direction): the norm of a sum of n grows like sqrt(n)
    generator = torch.Generator().manual_seed(0)
    counts = [5, 200, 20, 1]
    sums = [torch.randn(n, 10_000, generator=generator).sum(dim=0) for n in counts]
    norms = [float(s.norm()) / n for s, n in zip(sums, counts)]
    assert max(norms) / min(norms) > CLIP_FACTOR  # per sample alone, the one-sample mate would look hostile
    assert clip_scales(norms, counts) == [1.0] * len(counts)
    # a hostile one is still scaled down, few samples or many
    hostile = clip_scales([*norms, 1e6], [*counts, 1])
    assert hostile[:-1] == [1.0] * len(counts) and hostile[-1] < 1e-3


def test_with_vouched_counts_a_near_zero_gradient_sets_the_bound_only_with_most_of_the_samples():
    honest, tiny = 1.0, 1e-6  # per-sample norms
    # two members: by contribution, the near-zero one sets the bound and the honest gradient is cut a million-fold
    assert clip_scales([honest, tiny], [14, 10])[0] < 1e-4
    # by sample, it takes half of the samples to set it: with fewer, nothing is clipped
    assert clip_scales([honest, tiny], [14, 10], by_samples=True) == [1.0, 1.0]
    assert clip_scales([honest, tiny], [12, 12], by_samples=True)[0] < 1e-4
    assert clip_scales([honest, tiny], [11, 13], by_samples=True)[0] < 1e-4
    # and a huge one more than half: where two hold half each, the smaller gradient sets the bound
    assert clip_scales([1e6 * honest, honest], [12, 12], by_samples=True)[0] < 1e-4
    assert clip_scales([1e6 * honest, honest], [13, 11], by_samples=True) == [1.0, 1.0]
    # a huge gradient of few samples is still clipped to the bound the median sample sets
    big, small = clip_scales([1e6, 2.0], [2, 22], by_samples=True)
    assert small == 1.0 and big == pytest.approx(CLIP_FACTOR * 2.0 * (22 / 2) ** 0.5 / 1e6)


def test_of_two_a_contribution_beyond_the_bound_is_left_out_not_scaled():
    # of two, the one a round would scale down is left out whole; the one that sets the bound stays
    assert left_out([1.0, 1e6], [8, 8]) == [1]
    assert left_out([1e-6, 1.0], [8, 8]) == [1]  # without vouched counts the smaller sets it, whoever lies
    assert left_out([1.0, 1e6], [8, 8], by_samples=True) == [1]
    assert left_out([1.0, 1e6], [7, 9], by_samples=True) == []  # more than half the samples set the bound
    # honest gradients of few and many samples stay in; three or more are scaled instead (`clip_scales`)
    assert left_out([3.0, 1.0], [1, 9]) == []
    assert left_out([10.5, 1.0], [8, 24]) == []  # one microbatch against three, as measured under churn
    assert left_out([1.0, 1e6, 1.1], [8, 8, 8]) == []
    assert left_out([1.0], [8]) == []


def honest_pieces(
    counts: list[int], size: int = 4000, seed: int = 0, noise: float = 3.0
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Sums of `counts` samples' gradients: a common direction plus per-sample noise `noise` times as large;
    and the direction."""
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(size, generator=generator)
    pieces = [n * direction + torch.randn(size, generator=generator) * n**0.5 * noise for n in counts]
    return pieces, direction


def test_honest_contributions_are_left_to_the_plain_sum():
    for seed, counts in enumerate([[1, 1, 1], [1, 8, 30], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 50]]):
        pieces, _ = honest_pieces(counts, seed=seed)
        assert centered_sum(pieces, counts) == (None, [])


def test_a_flipped_contribution_among_three_or_more_pulls_the_sum_only_so_far():
    # its pull is bounded by its share of the samples times a few honest spreads: small where the samples agree
    for noise, bound in [(0.5, 0.3), (3.0, 1.5)]:
        counts = [8, 8, 8, 8]
        pieces, _ = honest_pieces(counts, noise=noise)
        pieces[2] = -10 * pieces[2]  # the usual direction reversed, ten times over
        total, outliers = centered_sum(pieces, counts)
        assert outliers == [2]
        honest_mean = sum(pieces[i] for i in (0, 1, 3)) / 24
        plain_error = float((sum(pieces) / 32 - honest_mean).norm() / honest_mean.norm())
        robust_error = float((total / 32 - honest_mean).norm() / honest_mean.norm())
        assert plain_error > 2.5 and robust_error < bound, (noise, plain_error, robust_error)


def test_the_outliers_are_those_far_from_most_others():
    # two liars of five, each its own way: each is far from every other, the honest three are close
    counts = [4, 4, 4, 4, 4]
    pieces, _ = honest_pieces(counts, noise=0.5)
    pieces[1], pieces[4] = -5 * pieces[1], pieces[4] + 40 * torch.randn(4000)
    _, outliers = centered_sum(pieces, counts)
    assert outliers == [1, 4]


def test_fewer_than_three_contributions_or_empty_ones_are_not_centered():
    pieces, _ = honest_pieces([8, 8])
    assert centered_sum([pieces[0], -pieces[1] * 100], [8, 8]) == (None, [])
    assert centered_sum([pieces[0], -pieces[1] * 100, torch.zeros(4000)], [8, 8, 0]) == (None, [])


def test_chunks_of_coordinates_add_up_to_the_whole(monkeypatch):
    counts = [3, 5, 8, 2]
    pieces, _ = honest_pieces(counts, size=1000, noise=0.5)
    pieces[0] = -8 * pieces[0]
    whole, outliers = centered_sum(pieces, counts)
    monkeypatch.setattr(contribution_bounds, "CHUNK", 7)  # 143 chunks, the last one short
    chunked, chunked_outliers = centered_sum(pieces, counts)
    assert outliers == chunked_outliers == [0]
    assert torch.allclose(whole, chunked, rtol=1e-5, atol=1e-5)
