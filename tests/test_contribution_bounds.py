"""Clipping mates' contributions against the group: outliers scaled to the bound, honest ones untouched."""

from __future__ import annotations

import pytest
import torch

from swarm.peer.contribution_bounds import CLIP_FACTOR, clip_scales


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
    counts = [5, 45, 20, 1]
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
    # by sample, it takes more than half of the samples to set it: with fewer, nothing is clipped
    assert clip_scales([honest, tiny], [14, 10], by_samples=True) == [1.0, 1.0]
    assert clip_scales([honest, tiny], [12, 12], by_samples=True) == [1.0, 1.0]
    assert clip_scales([honest, tiny], [11, 13], by_samples=True)[0] < 1e-4
    # a huge gradient of few samples is still clipped to the bound the median sample sets
    big, small = clip_scales([1e6, 2.0], [2, 22], by_samples=True)
    assert small == 1.0 and big == pytest.approx(CLIP_FACTOR * 2.0 * (22 / 2) ** 0.5 / 1e6)
