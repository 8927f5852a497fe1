"""Sizing the microbatches in flight from the pipeline's round trip and delivery rate (swarm.policy.in_flight)."""

from __future__ import annotations

import asyncio
import heapq
import json
import statistics

import pytest
from conftest import peer_flags, trainer_flags, wait_for_records
from test_peer_death import trainer_exit_code

from swarm.policy.in_flight import InFlightGate, InFlightWindow
from swarm.records.stage_records import SERVING

Route = list[tuple]  # ("delay", seconds) or ("server", name, seconds a microbatch): FIFO, one at a time


def simulate(window: InFlightWindow, route: Route, microbatches: int) -> tuple[list[int], float]:
    """A closed loop: microbatches go out while fewer than the window are in flight, and travel `route`.
    Returns the window after each return and the samples/s delivered over the second half."""
    free_at: dict[str, float] = {}
    events: list[tuple[float, int, int, float, int]] = []  # (time, order, next hop, time sent, delivered then)
    sent = done = in_flight = order = 0
    sizes, half_time, now = [], 0.0, 0.0

    def launch(now: float) -> None:
        nonlocal sent, in_flight, order
        while in_flight < window.size:
            heapq.heappush(events, (now, order, 0, now, window.delivered))
            sent, in_flight, order = sent + 1, in_flight + 1, order + 1

    launch(0.0)
    while done < microbatches:
        now, _, hop, sent_at, delivered = heapq.heappop(events)
        if hop == len(route):
            in_flight, done = in_flight - 1, done + 1
            sizes.append(window.completed(window.microbatch_samples, now - sent_at, delivered))
            half_time = now if done == microbatches // 2 else half_time
            launch(now)
            continue
        kind, *what = route[hop]
        if kind == "delay":
            later = now + what[0]
        else:
            name, seconds = what
            later = free_at[name] = max(now, free_at.get(name, 0.0)) + seconds
        heapq.heappush(events, (later, order, hop + 1, sent_at, delivered))
        order += 1
    return sizes, (microbatches - microbatches // 2) * window.microbatch_samples / (now - half_time)


ONE_STAGE = [("delay", 0.5), ("server", "stage", 0.2), ("delay", 0.5)]
# five calls over 2 s links; stage b's link is crossed twice (forward, then backward with more to carry)
FIVE_CALLS = [("delay", 2.0), ("server", "a", 0.2), ("delay", 2.0), ("server", "b", 0.4), ("delay", 2.0)]
FIVE_CALLS += [("server", "c", 0.2), ("delay", 2.0), ("server", "b", 0.8), ("delay", 2.0), ("server", "a", 0.3)]
FIVE_CALLS += [("delay", 2.0)]


def test_the_window_grows_to_the_pipelines_bandwidth_delay_product():
    """A 1 s round trip and a stage of 40 samples/s in microbatches of 8 hold 6 microbatches: from 3, the
    window reaches gain (2) times that, the stage is kept busy, and the estimates are the pipeline's own."""
    window = InFlightWindow(initial=3, maximum=1000, microbatch_samples=8, gain=2.0)
    sizes, rate = simulate(window, ONE_STAGE, microbatches=600)
    assert sizes[0] == 3 and 11 <= statistics.median(sizes[-200:]) <= 14, sizes[-200:]
    assert rate == pytest.approx(40.0, rel=0.03) and window.rate == pytest.approx(40.0, rel=0.05)
    assert window.round_trip == pytest.approx(1.2)  # the links and one microbatch's service


def test_the_window_fills_a_pipeline_whose_slowest_link_is_crossed_twice():
    """Behind 2 s links, 8 in flight (the trainer's default) leave the pipeline a third idle; the window
    finds enough to keep its slowest link (b: 1.2 s a microbatch) busy, without running away."""
    capacity = 8 / 1.2
    _, fixed_rate = simulate(InFlightWindow(initial=8, maximum=8, microbatch_samples=8, minimum=8), FIVE_CALLS, 600)
    window = InFlightWindow(initial=3, maximum=1000, microbatch_samples=8)
    sizes, rate = simulate(window, FIVE_CALLS, microbatches=1500)
    assert fixed_rate < 0.75 * capacity
    assert rate > 0.97 * capacity, (rate, sizes[-50:])
    assert window.largest <= 40, window.largest  # the product (about 12) twice over, and some


def test_a_pipeline_that_holds_hundreds_of_microbatches_is_filled():
    """4 s of links in front of a stage taking 400 samples/s hold 200 microbatches of 8. Each microbatch's
    estimate spans its own round trip, however many are in flight (an average over the last 64
    completions spanned less than a round trip past a window of about 128, stopped giving estimates, and
    left this pipeline at 57% of its rate)."""
    window = InFlightWindow(initial=3, maximum=1000, microbatch_samples=8)
    sizes, rate = simulate(window, [("delay", 2.0), ("server", "stage", 0.02), ("delay", 2.0)], microbatches=6000)
    assert rate > 0.97 * 400, (rate, sizes[-20:])
    assert 300 <= statistics.median(sizes[-200:]) <= 450, sizes[-200:]  # twice the product of 200


def test_the_first_flight_raises_the_window_a_round_trip_sooner_and_never_lowers_it():
    """The first 8 microbatches go out together; as they come back, what has come back so far is a rate the
    pipeline held at least: the first one back (1 of 8 in 4 s) does not shrink the window, the last one back
    doubles it, a round trip before microbatches sent after them could say so."""
    window = InFlightWindow(initial=8, maximum=1000, microbatch_samples=8)
    sizes, _ = simulate(window, [("delay", 2.0), ("server", "stage", 0.02), ("delay", 2.0)], microbatches=8)
    assert sizes[0] == 8 and sizes == sorted(sizes) and sizes[-1] == 16, sizes


def test_the_window_stays_within_its_bounds():
    capped = InFlightWindow(initial=1, maximum=4, microbatch_samples=8)
    assert max(simulate(capped, ONE_STAGE, microbatches=200)[0]) == 4
    floored = InFlightWindow(initial=8, maximum=64, microbatch_samples=8, minimum=3)
    # a stage close by: the product is about one microbatch, the floor holds
    near = [("delay", 0.0001), ("server", "stage", 0.08)]
    assert min(simulate(floored, near, microbatches=200)[0][50:]) == 3
    with pytest.raises(ValueError):
        InFlightWindow(initial=1, maximum=0, microbatch_samples=8)


def test_the_gate_admits_up_to_the_window_and_follows_it_as_it_changes():
    async def go() -> list[int]:
        window = InFlightWindow(initial=2, maximum=8, microbatch_samples=1)
        gate = InFlightGate(limit=8, window=window)
        peaks: list[int] = []
        release = asyncio.Event()

        async def microbatch() -> None:
            async with gate as sent:
                peaks.append(gate.in_flight)
                await release.wait()
                gate.completed(1, sent)

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
    """Behind 250 ms links, a trainer started with 16 microbatches in flight (twice the floor) finds that the
    pipeline holds more and raises its window, within --in-flight-ceiling, while it trains (no --max-in-flight:
    the window follows the links by default). Steps of 48 one-sample microbatches: the window, not the step, is
    what holds the flight back, and the links, not the stages' compute on a loaded machine, set the round trip."""
    local_swarm.start_bootstrap()
    for stage in range(3):
        flags = peer_flags(tmp_path / f"peer{stage}", "--target-batch-size", "48")
        local_swarm.start_peer(f"peer{stage}", stage, flags)
    wait_for_records(local_swarm.initial_peers, lambda r: all(any(p.state == SERVING for p in r[s]) for s in range(3)))
    summary_file = tmp_path / "summary.json"
    flags = [*trainer_flags(4, summary_file, microbatch_size=1, in_flight=None), "--in-flight-ceiling", "64"]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--emulate-latency-ms", "250"])
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 4 and summary["last_loss"] < summary["first_loss"], summary
    # the window grows past its start of 16, never past its ceiling
    assert 16 < summary["in_flight_window_largest"] <= 64, summary
    assert 1 <= summary["in_flight_window"] <= summary["in_flight_window_largest"], summary
    # and says how it got there: its size at the end of each step, and the round trip it measured
    assert len(summary["in_flight_window_per_step"]) == 4 and max(summary["in_flight_window_per_step"]) > 16, summary
    assert summary["in_flight_round_trip_s"] > 0.25, summary  # the 250 ms links, at the least
