"""The swarm simulator: rebalancing nears the ideal, moves never empty a stage, throughput follows capacity."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "simulate.py"
SPOT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "aws-p3-spot.csv"


def load_simulator():
    spec = importlib.util.spec_from_file_location("simulate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


sim = load_simulator()

# small swarms: a peer is a large share of a stage, so single moves clear the hysteresis margin
SMALL = sim.SimConfig(peers=24, stages=4, minutes=6, microbatch=16, rebalance_period=10.0, window=10.0)


@pytest.mark.parametrize("start", ["skewed", "all-in-one"])
@pytest.mark.parametrize("seed", [0, 3])
def test_rebalancing_lifts_a_skewed_start_close_to_the_ideal(start, seed):
    config = replace(SMALL, start=start, seed=seed)
    moving = sim.run_scenario(config)
    staying = sim.run_scenario(replace(config, rebalance=False))

    assert moving["moves"] > 0
    assert moving["steady_state_fraction_of_ideal"] >= 0.9
    assert moving["time_to_90pct_s"] is not None and moving["time_to_90pct_s"] <= 180
    assert staying["moves"] == 0
    assert staying["steady_state_fraction_of_ideal"] <= 0.5
    # the assignment is what the trainers get: the measured throughput follows it
    assert moving["measured_fraction_of_ideal"] > 2 * staying["measured_fraction_of_ideal"]
    assert moving["ideal_method"] == {"exact": len(range(10, 361, 10))}


def test_no_stage_is_ever_emptied_by_a_move():
    """The balance rule promises that a donor keeps a serving peer; moves are not instantaneous."""
    # eager settings: no hysteresis, frequent checks, noisy throughputs, two peers a stage on average
    config = replace(
        SMALL, peers=8, start="all-in-one", margin=0.0, rebalance_period=4.0, throughput_noise=0.2, minutes=8
    )
    for seed in range(3):
        simulation = sim.Simulation(replace(config, seed=seed))
        left_behind: list[int] = []
        serving_changed = simulation._serving_changed

        def watch(peer, delta, cause, simulation=simulation, serving_changed=serving_changed, left=left_behind):
            serving_changed(peer, delta, cause)
            if cause == "move":  # counted independently of the simulation's own tally
                left.append(simulation.serving_count[peer.source])

        simulation._serving_changed = watch
        report = simulation.run()
        assert report["moves"] >= 3
        assert min(left_behind) >= 1, f"seed {seed}: a move left its stage with no serving peer"
        assert report["stage_emptied_by_move"] == 0


def test_throughput_follows_the_assignment_capacity_with_enough_work_in_flight():
    config = replace(SMALL, peers=16, start="auto", rebalance=False, microbatch=8, minutes=5)
    for seed in range(2):
        report = sim.run_scenario(replace(config, seed=seed))
        assert report["samples_completed"] > 0
        assert report["steady_state_samples_per_s"] > 0
        assert 0.9 <= report["measured_fraction_of_capacity"] <= 1.02
        # (seed 0: one call of about 8,000 outlived its deadline behind a burst at one peer)
        assert report["failed_calls"]["timeouts"] <= 1

    # too little work in flight leaves peers idle: throughput falls short of the same capacity
    starved = sim.run_scenario(replace(config, in_flight=2))
    assert starved["measured_fraction_of_capacity"] < 0.6


def test_stage_costs_slow_the_costly_stage_and_lower_the_ideal():
    flat = replace(SMALL, peers=18, stages=3, start="skewed", minutes=5)
    costly = sim.run_scenario(replace(flat, stage_costs=(1.0, 1.0, 2.0)))
    even = sim.run_scenario(flat)
    # the same peers: the ideal is at most sum(speeds)/sum(costs), 3/4 of what it is with unit costs
    assert costly["steady_state_ideal"] <= 0.76 * even["steady_state_ideal"]
    assert costly["steady_state_fraction_of_ideal"] >= 0.85
    # calls on the costly stage take twice as long: throughput stays within the weighted capacity. (The
    # assignment reached here is the exact ideal, with a peer of speed 2 on the costly stage: its 16 s
    # calls time out under load now and then, so the trainers get 0.76 of that capacity; seeds 1 to 3: 0.92
    # to 0.96.)
    assert 0.72 <= costly["measured_fraction_of_capacity"] <= 1.02


def write_trace(path: Path) -> Path:
    lines = [f"0,add,node{i}" for i in range(4)]
    lines += ["60000,remove,node0", "90000,add,node4", "150000,remove,node1", "150000,remove,node2"]
    lines += ["200000,add,node5", "200000,add,node6", "260000,remove,node4", "300000,add,node7"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_churn_runs_and_is_counted(tmp_path):
    trace = str(write_trace(tmp_path / "trace.csv"))
    config = replace(SMALL, peers=32, start="auto", trace=trace, minutes=5, trace_minutes=4)
    report = sim.run_scenario(config)
    # four nodes at the peak stand for 32 peers: the trace's 4 3 4 2 4 3 4 live nodes, 8 peers each
    assert report["peak_live_peers"] == 32
    assert report["joins"] == 8 + 16 + 8
    assert report["removals"] == 8 + 16 + 8
    assert report["samples_completed"] > 0
    assert report["stage_emptied_by_move"] == 0
    assert report["failed_calls"]["connection_errors"] > 0  # calls in flight on preempted peers fail


def test_peers_of_a_node_preempted_while_booting_never_join(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node0\n0,add,node1\n60000,add,node2\n70000,remove,node2\n200000,remove,node1\n")
    config = replace(SMALL, peers=30, stages=3, start="auto", trace=str(trace), minutes=4, trace_minutes=200 / 60)
    together = sim.run_scenario(config)
    spread = sim.run_scenario(replace(config, join_spread=20.0))
    # node2's 10 peers start at once, or over 20 s of which only the first 10 pass before it is preempted
    assert together["joins"] == 10 and together["removals"] == 20
    assert 0 < spread["joins"] < 10 and spread["removals"] == 10 + spread["joins"]


@pytest.mark.skipif(not SPOT_TRACE.exists(), reason="the shared spot traces are not checked out")
def test_real_spot_trace_replays_without_error():
    config = replace(SMALL, peers=64, stages=4, start="auto", trace=str(SPOT_TRACE), minutes=4, rebalance_period=20)
    report = sim.run_scenario(config)
    assert report["joins"] > 100 and report["removals"] > 100
    assert report["peak_live_peers"] <= 64 + 2
    assert report["samples_completed"] > 0
    assert report["stage_emptied_by_move"] == 0


def test_command_line_prints_one_json_object_with_every_margin_and_the_baseline():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--peers", "12", "--stages", "3", "--minutes", "2", "--microbatch", "8"]
        + ["--margins", "0.05,0.2", "--rebalance-period", "10", "--start", "all-in-one", "--margin", "0.1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["by_margin"]) == {"0.1", "0.05", "0.2"}
    assert report["no_rebalance"]["moves"] == 0 and report["no_rebalance"]["rebalance"] is False
    assert report["by_margin"]["0.1"]["moves"] == report["moves"]
    for key in ("steady_state_fraction_of_ideal", "time_to_90pct_s", "moves_per_peer_hour", "empty_stage_seconds"):
        assert key in report
    assert report["total_wall_seconds"] > 0
    assert "scenario: rebalancing off" in out.stderr


def test_command_line_refuses_nonsense():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--stages", "3", "--stage-costs", "1,2", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--stage-costs" in out.stderr


def test_dropping_calls_whose_caller_gave_up_keeps_an_overloaded_swarm_productive():
    """Far more work in flight than the bottleneck clears within a deadline: calls time out in queues.

    A peer that still computes them fills its queue with work nobody waits for while the retries
    queue up behind it; one that drops them (as the real runtime does) spends its time on live calls.
    """
    overloaded = replace(SMALL, peers=120, stages=8, minutes=6, microbatch=32, in_flight=240, rebalance_period=60)
    dropping = sim.run_scenario(overloaded)
    computing = sim.run_scenario(replace(overloaded, skip_abandoned=False))
    assert dropping["abandoned_calls_skipped"] > 100
    assert computing["abandoned_calls_skipped"] == 0
    assert computing["abandoned_calls_computed"] > 3 * dropping["abandoned_calls_computed"]
    # seeds 0 to 2 gave 0.80 to 0.87. Since a call's deadline counts the calls queued before it at its
    # peer, few calls outlive theirs, and computing those costs little (0.80 to 0.82): dropping them
    # must not cost anything either
    assert dropping["measured_fraction_of_capacity"] >= 0.75
    assert dropping["measured_fraction_of_capacity"] >= computing["measured_fraction_of_capacity"] - 0.02


@pytest.mark.parametrize("seed", [0, 2])
def test_a_whole_plan_is_carried_out_within_two_periods_without_oscillation(seed):
    """From a skewed start every peer computes the same whole plan and the movers take it in one period."""
    config = replace(SMALL, peers=200, stages=8, minutes=6, microbatch=32, rebalance_period=60.0, seed=seed)
    report = sim.run_scenario(config)
    assert report["time_to_90pct_s"] is not None and report["time_to_90pct_s"] <= 2 * 60
    assert report["steady_state_fraction_of_ideal"] >= 0.97
    assert report["oscillations"] == 0
    assert report["stage_emptied_by_move"] == 0 and report["stage_emptied_by_stale_move"] == 0
    # seeds 0 and 2 took 80 and 80 s, with 88 and 91 moves where the first plans had 85 and 89: nobody sent
    # twice for one gap, nothing undone
    assert report["moves"] <= 110


# noisy speeds (+-20% on every announcement, 20% on every timing) and records that lapse though their peers
# live, with the real peer's rebalance period
NOISY = replace(
    SMALL,
    peers=60,
    minutes=20,
    rebalance_period=60.0,
    announce_noise=0.2,
    throughput_noise=0.2,
    lapse_rate=0.02,
    stage_lapse_rate=0.01,
)
OLD_RULE = {"deviations": 0.0, "hold": 0.0, "cooldown": 0.0}


@pytest.mark.parametrize("seed", [0, 1])
def test_under_noise_and_lapses_the_old_rule_oscillates_and_the_guarded_one_does_not(seed):
    guarded = sim.run_scenario(replace(NOISY, seed=seed))
    old = sim.run_scenario(replace(NOISY, seed=seed, **OLD_RULE))
    # seeds 0 and 1: the old rule moved 56 and 55 peers, 10 and 9 of them back within 15 minutes, and held
    # 0.81 and 0.86 of the ideal; the guarded rule 19 and 20 moves, none back, 0.99 and 0.91 (15 peers a stage:
    # a peer is a large step, and the rule stops where the rest is within the noise)
    assert old["oscillations"] >= 3
    assert guarded["oscillations"] == 0 and guarded["moves_back"] == 0
    assert guarded["moves"] < old["moves"]
    assert guarded["steady_state_fraction_of_ideal"] >= 0.9
    assert guarded["steady_state_fraction_of_ideal"] > old["steady_state_fraction_of_ideal"] + 0.04
    assert guarded["stage_emptied_by_move"] == 0


def test_a_stage_whose_records_lapsed_draws_no_peer():
    """A swarm near balance whose stages' records lapse now and then: the lapses must move nobody."""
    config = replace(SMALL, peers=24, start="auto", minutes=10, stage_lapse_rate=0.03, throughput_noise=0.0)
    guarded = sim.run_scenario(config)
    old = sim.run_scenario(replace(config, **OLD_RULE))
    assert guarded["record_lapses"]["stage"] > 10
    # the old rule fills each stage that looks empty ("from 0.0") and undoes it when its records are back:
    # 141 moves, 82 of them back, 0.50 of the ideal; the guarded rule 17 moves (3 without the lapses), none
    # back, 0.98 (at a margin of 0.5: 13 and 2)
    assert old["moves"] >= 50 and old["moves_back"] >= 20
    assert guarded["moves"] <= 20 and guarded["moves_back"] == 0
    assert guarded["steady_state_fraction_of_ideal"] >= 0.9 > old["steady_state_fraction_of_ideal"]


def test_no_peer_returns_within_its_cool_down():
    """Without the noise and lapse guards, plans send peers back; the cool-down alone holds them."""
    unguarded = replace(NOISY, rebalance_period=10.0, deviations=0.0, hold=0.0)
    without = sim.run_scenario(replace(unguarded, cooldown=0.0))
    held = sim.run_scenario(unguarded)
    assert without["oscillations"] > 5  # back within 15 minutes
    assert held["returns_within_cooldown"] == 0 and held["moves"] > 0


def test_averaging_costs_what_a_reduce_scatter_round_takes():
    from simulation.averaging import Link, round_seconds

    gradient = 100e6  # bytes
    links = [Link(100.0, 0.05)] * 16
    # 16 mates over 100 Mbit/s and 50 ms: 4 latencies, 2 * 15/16 gradients on the wire, the 15 slices summed
    assert round_seconds(gradient, links) == pytest.approx(4 * 0.05 + 2 * 15 / 16 * 8.0 + 15 / 16 * gradient / 2e9)
    assert round_seconds(gradient, links[:1]) == 0.0
    # the slowest mate sets the pace
    assert round_seconds(gradient, [*links[:15], Link(10.0, 0.2)]) > 9 * round_seconds(gradient, links)
    # bytes per peer barely grow with the mates: 2 (n-1)/n gradients
    assert round_seconds(gradient, links) < 2 * round_seconds(gradient, links[:2])

    base = replace(SMALL, peers=40, start="auto", minutes=6, stage_params=5e6, link_mbit_min=100, link_mbit_max=1000)
    free = sim.run_scenario(base)
    # rounds that hold the mates (as the round before serving through it did)
    small_steps = sim.run_scenario(replace(base, target_batch_size=256, serve_during_rounds=False))
    large_steps = sim.run_scenario(replace(base, target_batch_size=2048, serve_during_rounds=False))
    assert "averaging" not in free
    for report in (small_steps, large_steps):
        averaging = report["averaging"]
        assert averaging["steady_rounds"] > 0 and averaging["mean_mates"] >= 2
        assert averaging["mean_mb_per_peer_per_round"] < 2 * 20.0  # under two 20 MB gradients
    # averaging takes a share of every step, so less is trained; larger steps average less often
    assert small_steps["averaging"]["averaging_share"] > large_steps["averaging"]["averaging_share"]
    assert small_steps["measured_fraction_of_ideal"] < large_steps["measured_fraction_of_ideal"]
    assert large_steps["measured_fraction_of_ideal"] < free["measured_fraction_of_ideal"]
    # mates that serve on through their round are held only where a round outlasts a step
    through = sim.run_scenario(replace(base, target_batch_size=256, serve_during_rounds=True))
    assert through["averaging"]["held_share"] < small_steps["averaging"]["held_share"]
    assert through["measured_fraction_of_ideal"] > small_steps["measured_fraction_of_ideal"]


def test_command_line_models_noise_lapses_and_averaging():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--peers", "16", "--stages", "2", "--minutes", "2", "--margins", ""]
        + ["--no-baseline", "--quiet", "--announce-noise", "0.2", "--lapse-rate", "0.05", "--old-rule"]
        + ["--target-batch-size", "256", "--stage-params", "1e6", "--link-mbit", "50,500", "--latency-ms", "10,50"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["config"]["deviations"] == 0.0 and report["config"]["cooldown_seconds"] == 0.0
    assert report["config"]["announce_noise"] == 0.2 and report["config"]["link_mbit_max"] == 500.0
    assert report["record_lapses"]["peer"] > 0 and report["averaging"]["rounds"] > 0
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--link-mbit", "500,50", "--quiet"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "--link-mbit" in refused.stderr
