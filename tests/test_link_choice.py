"""The codec choice per link and the link shaper, without a network."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CODECS
from swarm.compression.link_choice import (
    CodecChooser,
    CodecProfile,
    LinkEstimator,
    activation_like,
    choose_codec,
    profile_codecs,
)
from swarm.net.link_shaper import LinkShape, LinkShaper

# made-up but typical: coding costs in s/byte, errors as measured by scripts/bench_compression.py
PROFILES = [
    CodecProfile("none", 1.0, 0.5e-9, 0.0),
    CodecProfile("fp16", 0.5, 2e-9, 3e-4),
    CodecProfile("8bit", 0.27, 8e-9, 7e-3),
    CodecProfile("4bit", 0.14, 8e-9, 0.1),
]
MBIT = 1e6 / 8  # bytes per second


def test_fast_links_send_raw_and_slow_links_compress():
    assert choose_codec(PROFILES, 10_000 * MBIT, max_error=0.01) == "none"
    assert choose_codec(PROFILES, 1_000 * MBIT, max_error=0.01) == "fp16"
    assert choose_codec(PROFILES, 100 * MBIT, max_error=0.01) == "8bit"
    assert choose_codec(PROFILES, math.inf, max_error=0.01) == "none"


def test_quality_floor_is_never_crossed():
    assert choose_codec(PROFILES, 1 * MBIT, max_error=0.01) == "8bit"  # 4bit would be cheaper but too coarse
    assert choose_codec(PROFILES, 1 * MBIT, max_error=0.5) == "4bit"
    assert choose_codec(PROFILES, 1 * MBIT, max_error=0.0) == "none"
    with pytest.raises(ValueError, match="no codec"):
        choose_codec(PROFILES[1:], 1 * MBIT, max_error=0.0)


def test_estimator_recovers_latency_and_bandwidth():
    link = LinkEstimator()
    assert link.estimate() is None
    for size in (100_000, 400_000, 200_000, 800_000, 300_000):
        link.observe(size, 0.1 + size / (100 * MBIT))  # 50 ms each way, 100 Mbit/s
    latency, bandwidth = link.estimate()
    assert latency == pytest.approx(0.1, rel=1e-6) and bandwidth == pytest.approx(100 * MBIT, rel=1e-6)


def test_chooser_starts_compact_then_follows_the_link():
    chooser = CodecChooser(PROFILES, max_error=0.01)
    assert chooser.codec_for("fast") == "8bit"  # unmeasured: the most compact allowed
    for size in (100_000, 200_000, 300_000, 400_000):
        chooser.observe("fast", size, 1e-4 + size / (20_000 * MBIT))
        chooser.observe("slow", size, 0.1 + size / (50 * MBIT))
    assert chooser.choices() == {"fast": "none", "slow": "8bit"}


def test_measured_profiles_order_codecs_by_size_and_error():
    profiles = {p.name: p for p in profile_codecs(CODECS.values(), activation_like((8, 64, 128)), repeats=1)}
    assert profiles["none"].relative_error == 0 and profiles["none"].wire_ratio == pytest.approx(1, abs=0.01)
    assert profiles["fp16"].wire_ratio == pytest.approx(0.5, abs=0.01)
    assert profiles["8bit"].wire_ratio < 0.3 and profiles["8bit"].relative_error < 0.01
    assert profiles["4bit"].wire_ratio < profiles["8bit"].wire_ratio
    assert profiles["4bit"].relative_error > profiles["8bit"].relative_error


def test_shaper_queues_messages_on_one_link_and_adds_latency():
    shaper = LinkShaper(LinkShape(bandwidth_mbit=8, latency_ms=50))  # 1 MB/s
    assert shaper.delay("a", "up", 100_000, now=0.0) == pytest.approx(0.15)
    # a second message on the same link waits for the first
    assert shaper.delay("a", "up", 100_000, now=0.0) == pytest.approx(0.25)
    # other directions and peers have links of their own
    assert shaper.delay("a", "down", 100_000, now=0.0) == pytest.approx(0.15)
    assert shaper.delay("b", "up", 100_000, now=0.0) == pytest.approx(0.15)
    assert LinkShaper(LinkShape()).delay("a", "up", 10**9, now=0.0) == 0.0


def test_in_a_bf16_swarm_sending_raw_costs_half_and_is_exact():
    sample = activation_like((8, 64, 128)).to(torch.bfloat16)
    profiles = {p.name: p for p in profile_codecs(CODECS.values(), sample, repeats=1)}
    assert profiles["none"].wire_ratio == 0.5 and profiles["none"].relative_error == 0.0
    assert profiles["bf16"].relative_error == 0.0  # already bf16: nothing to round
    assert profiles["8bit"].wire_ratio < 0.5
