"""The choice of codec per link: the cheapest one in transfer plus coding time, above a quality floor.

Each side of a link measures it as traffic flows: for every call, the bytes on the wire and the
time spent on the network (the call less the peer's own time). A least-squares fit of
time = latency + bytes / bandwidth over recent calls gives the link's bandwidth. Latency is the
same whatever the codec, so the choice depends on bandwidth alone: per float32 byte to send, a
codec costs `wire_ratio / bandwidth` to transfer plus its own encode-and-decode time, measured on
this machine at start-up. Codecs whose error exceeds the user's floor are never chosen.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swarm.compression.codecs import Codec

MIN_OBSERVATIONS = 4


@dataclass(frozen=True)
class CodecProfile:
    """What a codec costs and how much it changes values, per float32 byte."""

    name: str
    wire_ratio: float  # bytes on the wire per float32 byte
    seconds_per_byte: float  # encode plus decode time per float32 byte
    relative_error: float  # |decoded - x| / |x| (L2 norms) on activation-like values


def activation_like(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values with the heavy tails of transformer activations: Gaussian with log-normal scales."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * torch.randn(shape, generator=generator).mul(0.5).exp()


def profile_codecs(codecs: Iterable[Codec], sample: torch.Tensor, repeats: int = 3) -> list[CodecProfile]:
    """Measures each codec on `sample`, in the dtype boundary tensors travel in (float32, or bfloat16 in a
    swarm that computes in it, where sending it raw costs half): wire size and coding time per float32 byte
    of the sample (best of `repeats`), and error against the sample as it is."""
    sample = sample.contiguous()
    raw_bytes = sample.numel() * 4
    reference = sample.float()
    profiles = []
    for codec in codecs:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            payload = codec.encode(sample)
            decoded = codec.decode(payload, tuple(sample.shape), sample.dtype)
            best = min(best, time.perf_counter() - start)
        error = float((decoded.float() - reference).norm() / reference.norm().clamp_min(1e-30))
        profiles.append(CodecProfile(codec.name, len(payload) / raw_bytes, best / raw_bytes, error))
    return profiles


class LinkEstimator:
    """Bandwidth and latency of one link, fitted to its recent calls."""

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds >= 0:
            self.samples.append((num_bytes, seconds))

    def estimate(self) -> tuple[float, float] | None:
        """(latency in seconds, bandwidth in bytes/s), or None until enough calls were seen.

        Bandwidth is infinite when time does not grow with size (a link far faster than the rest).
        """
        if len(self.samples) < MIN_OBSERVATIONS:
            return None
        n = len(self.samples)
        mean_x = sum(x for x, _ in self.samples) / n
        mean_y = sum(y for _, y in self.samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self.samples)
        if var_x <= (0.05 * mean_x) ** 2 * n:
            # one message size only: charge all the time to bandwidth (pessimistic, never optimistic)
            return 0.0, (mean_x / mean_y if mean_y > 0 else math.inf)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self.samples) / var_x
        latency = max(0.0, mean_y - slope * mean_x)
        return latency, (1.0 / slope if slope > 0 else math.inf)


def choose_codec(profiles: Iterable[CodecProfile], bandwidth: float, max_error: float) -> str:
    """The codec with the least transfer plus coding time per byte on a link of `bandwidth` bytes/s."""
    allowed = [p for p in profiles if p.relative_error <= max_error]
    if not allowed:
        raise ValueError(f"no codec is within a relative error of {max_error}")
    return min(allowed, key=lambda p: p.wire_ratio / bandwidth + p.seconds_per_byte).name


class CodecChooser:
    """Picks a codec per peer from what its link has shown so far."""

    def __init__(self, profiles: list[CodecProfile], max_error: float) -> None:
        self.profiles = profiles
        self.max_error = max_error
        self.links: dict[str, LinkEstimator] = {}
        # before a link is measured: the most compact codec allowed (safe on a slow link, cheap to leave)
        allowed = [p for p in profiles if p.relative_error <= max_error]
        if not allowed:
            raise ValueError(f"no codec is within a relative error of {max_error}")
        self.initial = min(allowed, key=lambda p: p.wire_ratio).name

    def codec_for(self, peer: str) -> str:
        link = self.links.get(peer)
        estimate = link.estimate() if link is not None else None
        if estimate is None:
            return self.initial
        return choose_codec(self.profiles, estimate[1], self.max_error)

    def observe(self, peer: str, num_bytes: int, seconds: float) -> None:
        self.links.setdefault(peer, LinkEstimator()).observe(num_bytes, seconds)

    def choices(self) -> dict[str, str]:
        """The codec each measured peer gets now."""
        return {peer: self.codec_for(peer) for peer in self.links}
