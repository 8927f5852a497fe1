"""Sizing the microbatches in flight from the pipeline's round trip and delivery rate (swarm.in_flight)."""

from __future__ import annotations

import asyncio
import heapq
import json
import statistics

import pytest
from conftest import peer_flags, trainer_flags, wait_for_records
from test_peer_death import trainer_exit_code

from swarm.in_flight import InFlightGate, InFlightWindow
from swarm.stage_records import SERVING


def simulate(window: InFlightWindow, delay: float, rate: float, microbatches: int) -> list[int]:
    """A closed loop through one link of `delay` seconds (both ways together) and a stage that serves
    `rate` samples/s one microbatch at a time, fed up to the window; returns the window after each return."""
    now, stage_free_at, sent, sizes = 0.0, 0.0, 0, []
    returns: list[float] = []  # (time back at the trainer) of microbatches in flight
    departures: dict[float, float] = {}
    service = window.microbatch_samples / rate
    while len(sizes) < microbatches:
        while len(returns) < window.size and sent < microbatches * 2:
            start = max(now + delay / 2, stage_free_at)  # queued at the stage behind the ones before it
            stage_free_at = start + service
            back = stage_free_at + delay / 2
            heapq.heappush(returns, back)
            departures[back] = now
            sent += 1
        now = heapq.heappop(returns)
        sizes.append(window.completed(window.microbatch_samples, now - departures.pop(now), now))
    return sizes


def test_the_window_grows_to_the_pipelines_bandwidth_delay_product_and_no_further():
    """A 1 s round trip and a stage of 40 samples/s in microbatches of 8 hold 5 microbatches (plus the one
    being served): from 1, the window reaches gain times that, and the rate estimate the stage's rate."""
    window = InFlightWindow(initial=1, maximum=1000, microbatch_samples=8, gain=2.0)
    sizes = simulate(window, delay=1.0, rate=40.0, microbatches=400)
    assert sizes[0] <= 2 and max(sizes[:20]) < max(sizes)  # it starts small and grows
    assert 10 <= statistics.median(sizes[-200:]) <= 14, sizes[-200:]
    assert window.rate == pytest.approx(40.0, rel=0.1)
    # the delay and one microbatch's service, measured again by drains while a queue hid it
    assert window.round_trip == pytest.approx(1.2, rel=0.05) and window.probes >= 2
    assert window.largest <= 16


def test_the_window_stays_within_its_bounds():
    capped = InFlightWindow(initial=1, maximum=4, microbatch_samples=8)
    assert max(simulate(capped, delay=1.0, rate=40.0, microbatches=200)) == 4
    floored = InFlightWindow(initial=8, maximum=64, microbatch_samples=8, minimum=3)
    # a fast stage close by: the product is under one microbatch, the floor holds
    assert min(simulate(floored, delay=0.0001, rate=100.0, microbatches=200)[50:]) == 3
    with pytest.raises(ValueError):
        InFlightWindow(initial=1, maximum=0, microbatch_samples=8)


def test_the_gate_admits_up_to_the_window_and_follows_it_as_it_changes():
    async def go() -> list[int]:
        window = InFlightWindow(initial=2, maximum=8, microbatch_samples=1)
        gate = InFlightGate(limit=8, window=window)
        peaks: list[int] = []
        release = asyncio.Event()

        async def microbatch() -> None:
            async with gate as sent_at:
                peaks.append(gate.in_flight)
                await release.wait()
                gate.completed(1, sent_at)

        tasks = [asyncio.create_task(microbatch()) for _ in range(6)]
        await asyncio.sleep(0.05)
        first = max(peaks)
        window.size = 4  # as an estimate would raise it: waiting microbatches go once others leave
        release.set()
        await asyncio.gather(*tasks)
        return [first, max(peaks), gate.in_flight]

    first, peak, left = asyncio.run(go())
    assert first == 2 and peak <= 4 and left == 0


def test_a_fixed_gate_is_a_semaphore_of_its_limit():
    async def go() -> int:
        gate, peak = InFlightGate(limit=3), 0

        async def one() -> None:
            nonlocal peak
            async with gate:
                peak = max(peak, gate.in_flight)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(one() for _ in range(10)))
        return peak

    assert asyncio.run(go()) == 3


@pytest.mark.timeout(300)
def test_a_trainer_sizes_its_microbatches_in_flight_from_slow_links(local_swarm, tmp_path):
    """Behind 40 ms links, a trainer started with 3 microbatches in flight (one per stage) finds that the
    pipeline holds more and raises its window, within --max-in-flight, while it trains."""
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    wait_for_records(local_swarm.initial_peers, lambda r: all(any(p.state == SERVING for p in r[s]) for s in range(3)))
    summary_file = tmp_path / "summary.json"
    flags = [*trainer_flags(4, summary_file, microbatch_size=2, in_flight=64), "--in-flight-from-links"]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--emulate-latency-ms", "40"])
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 4 and summary["last_loss"] < summary["first_loss"], summary
    # the window grows past its start of 3 (one microbatch per stage), never past --max-in-flight
    assert 3 < summary["in_flight_window_largest"] <= 64, summary
    assert 1 <= summary["in_flight_window"] <= summary["in_flight_window_largest"], summary
