"""The planner: its model on cases worked by hand, its plans against brute force, its file and command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from simulation.pipeline_flow import simulate_plan
from swarm.cli import main
from swarm.config import PeerConfig, TrainerConfig
from swarm.config.options import ConfigError, load_config
from swarm.models.registry import get_model_spec
from swarm.planning.cluster import (
    MEBIBIT,
    Cluster,
    ClusterError,
    ModelCosts,
    Network,
    PlanPeer,
    PlanTrainer,
    cluster_from_dict,
    read_cluster,
)
from swarm.planning.exhaustive import best_plan
from swarm.planning.pipeline_model import LinkView, Plan, predict
from swarm.planning.planner import PipelinePlan, plan_pipeline, replan_gain

GIB = 2**30
EXAMPLE = Path(__file__).parent.parent / "examples" / "cluster.yaml"
# wide enough that no single consumer card holds the model: plans must cut it
WIDE = ModelCosts.from_spec(get_model_spec("gpt-xl", d_model=4096, n_layer=8))
CARDS = ((150e12, 40 * GIB, 10_000), (60e12, 24 * GIB, 1_000), (25e12, 16 * GIB, 1_000), (12e12, 12 * GIB, 300))


def random_cluster(seed: int, peers: int = 4, mbit: float = 100.0, round_trip: float = 0.02) -> Cluster:
    rng = random.Random(seed)
    members = []
    for i in range(peers):
        flops, memory, link = rng.choice(CARDS)
        members.append(PlanPeer(f"p{i}", flops, memory, link * MEBIBIT, f"r{rng.randrange(3)}"))
    pairs = [("r0", "r1"), ("r0", "r2"), ("r1", "r2")]
    network = Network({p: round_trip for p in pairs}, {p: mbit * MEBIBIT for p in pairs})
    return Cluster(WIDE, tuple(members), (PlanTrainer("t", 10_000 * MEBIBIT, "r0"),), network)


def test_one_compute_bound_peer_runs_at_its_flops_plus_the_call_overhead():
    model = ModelCosts.from_spec(get_model_spec("gpt-small"))
    peer = PlanPeer("p", 1e12, 80 * GIB, 1e12)
    cluster = Cluster(model, (peer,), (PlanTrainer("t", 1e12),), call_overhead=0.003, target_batch_size=1 << 20)
    prediction = predict(Plan((model.n_layer,), (0,), 4), LinkView(cluster))
    codec_seconds = (3 * model.input_bytes + 2 * 4.0) * 3.3e-10  # "none" on a fast link
    flops = model.stage_flops(model.n_layer, True, True)
    expected = 4 / (4 * (flops / 1e12 + codec_seconds) + 2 * 0.003)
    assert prediction.samples_per_s == pytest.approx(expected, rel=0.02)
    assert prediction.limit == "stage 0" and prediction.idle == ()


def test_a_narrow_trainer_link_bounds_the_plan_and_is_named():
    model = ModelCosts.from_spec(get_model_spec("gpt-small"))
    peers = tuple(PlanPeer(f"p{i}", 1e15, 80 * GIB, 1e12) for i in range(2))
    cluster = Cluster(model, peers, (PlanTrainer("t", 1 * MEBIBIT),), max_codec_error=0.0)  # 1 Mbit/s, no codec
    prediction = predict(Plan((6, 6), (0, 1), 8), LinkView(cluster))
    per_sample = (2 * model.input_bytes + model.boundary_bytes) + (2 * (model.boundary_bytes + model.input_bytes) + 4)
    assert prediction.limit == "trainer links"
    assert prediction.samples_per_s == pytest.approx(MEBIBIT / per_sample, rel=1e-6)


def test_a_peer_whose_memory_does_not_hold_its_stage_is_idle():
    cluster = random_cluster(0)
    small = PlanPeer("small", 1e14, 1 * GIB, 1e9)
    cluster = Cluster(WIDE, (*cluster.peers, small), cluster.trainers, cluster.network)
    prediction = predict(Plan((8,), (0,) * len(cluster.peers), 1), LinkView(cluster))
    assert "small" in prediction.idle


@pytest.mark.parametrize("seed", range(6))
def test_the_planner_matches_brute_force_on_small_clusters(seed):
    cluster = random_cluster(seed, mbit=[10, 100, 1000][seed % 3], round_trip=[0.001, 0.2][seed % 2])
    view = LinkView(cluster)
    planned = plan_pipeline(cluster, view)
    _, best = best_plan(cluster, view, max_stages=4)
    assert best.samples_per_s > 0
    assert planned.prediction.samples_per_s >= 0.95 * best.samples_per_s, (planned, best)


def test_cards_of_unequal_memory_get_uneven_cuts_the_big_card_the_bigger_stage():
    # the model fits the 40 GB card whole one sample at a time and no 16 GB card: cut so that all four work
    peers = (PlanPeer("big", 150e12, 40 * GIB, 1250e6),) + tuple(
        PlanPeer(f"t4-{i}", 25e12, 16 * GIB, 125e6) for i in range(3)
    )
    cluster = Cluster(WIDE, peers, (PlanTrainer("t", 1250e6),), microbatch_sizes=(1, 2, 4))
    planned = plan_pipeline(cluster)
    blocks, stages = planned.plan.blocks, planned.plan.stages
    assert len(set(blocks)) > 1 and not planned.prediction.idle, planned
    assert blocks[stages[0]] == max(blocks) and all(s != stages[0] for s in stages[1:])
    _, best = best_plan(cluster)
    assert planned.prediction.samples_per_s == pytest.approx(best.samples_per_s)


def test_a_large_swarm_gets_a_whole_plan():
    rng = random.Random(3)
    peers = tuple(PlanPeer(f"p{i}", *rng.choice(CARDS)[:2], 1e9, f"r{rng.randrange(8)}") for i in range(1000))
    cluster = Cluster(WIDE, peers, tuple(PlanTrainer(f"t{j}", 1250e6, f"r{j}") for j in range(4)))
    planned = plan_pipeline(cluster)
    plan = planned.plan
    assert sum(plan.blocks) == WIDE.n_layer and min(plan.blocks) >= 1
    assert set(range(plan.num_stages)) <= set(plan.stages) and planned.prediction.samples_per_s > 0
    assert len(planned.prediction.windows) == 4


def test_a_drift_in_measured_speeds_makes_a_new_plan_worth_taking():
    peers = (PlanPeer("big", 150e12, 40 * GIB, 1250e6),) + tuple(
        PlanPeer(f"t4-{i}", 25e12, 16 * GIB, 125e6) for i in range(3)
    )
    cluster = Cluster(WIDE, peers, (PlanTrainer("t", 1250e6),), microbatch_sizes=(1, 2, 4))
    planned = plan_pipeline(cluster)
    gain, _ = replan_gain(planned.plan, cluster)
    assert gain == pytest.approx(1.0)
    # the big card, which the plan gives the bigger stage, is measured at half its speed (throttled, shared)
    slower = Cluster(
        WIDE, (PlanPeer("big", 75e12, 40 * GIB, 1250e6), *peers[1:]), cluster.trainers, microbatch_sizes=(1, 2, 4)
    )
    gain, fresh = replan_gain(planned.plan, slower)
    assert gain > 1.1 and fresh.plan.blocks != planned.plan.blocks


def test_the_example_cluster_file_reads_and_bad_ones_say_what_is_wrong(tmp_path):
    cluster = read_cluster(EXAMPLE)
    assert len(cluster.peers) == 32 and len(cluster.trainers) == 3
    with pytest.raises(ClusterError, match="'tflops'"):
        cluster_from_dict(
            {"model": "gpt-tiny", "peers": [{"memory_gb": 1, "bandwidth_mbit": 1}], "trainers": [{"bandwidth_mbit": 1}]}
        )
    with pytest.raises(ClusterError, match="unknown model"):
        cluster_from_dict({"model": "gpt-huge", "peers": [], "trainers": []})
    with pytest.raises(ClusterError, match="'peers' must be a list"):
        cluster_from_dict({"model": "gpt-tiny", "trainers": []})
    with pytest.raises(ClusterError, match="positive"):
        cluster_from_dict(
            {
                "model": "gpt-tiny",
                "peers": [{"tflops": 0, "memory_gb": 1, "bandwidth_mbit": 1}],
                "trainers": [{"bandwidth_mbit": 1}],
            }
        )
    broken = tmp_path / "broken.yaml"
    broken.write_text("peers: [unclosed\n")
    with pytest.raises(ClusterError, match="does not parse"):
        read_cluster(broken)


def test_swarm_plan_writes_a_plan_file_and_keeps_a_current_plan_that_is_still_best(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(EXAMPLE), "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert sum(plan["blocks_per_stage"]) == 24 and plan["predicted_samples_per_s"] > 0
    assert set(plan["max_in_flight"]) == {"lab-trainer", "east-trainer", "west-trainer"}
    again = tmp_path / "again.json"
    assert main(["plan", "--cluster", str(EXAMPLE), "--current", str(out), "--out", str(again)]) == 1
    assert not again.exists() and "the plan in use stands" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**plan, "blocks_per_stage": [1, 2]}))
    assert main(["plan", "--cluster", str(EXAMPLE), "--current", str(bad)]) == 2
    assert "must be positive and add up to 24" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the cluster file" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(EXAMPLE), "--out", str(tmp_path / "no" / "such" / "plan.json")]) == 2
    assert "cannot write the plan file" in capsys.readouterr().err


def tiny_plan_file(path: Path, blocks: tuple[int, ...], microbatch: int = 5) -> Path:
    """A plan file as `swarm plan` writes it, for gpt-tiny's peers peer0..peer2 (one per stage) and an idle one."""
    model = ModelCosts.from_spec(get_model_spec("gpt-tiny"))
    peers = tuple(PlanPeer(f"peer{i}", 1e12, 8 * GIB, 1e9) for i in range(4))
    cluster = Cluster(model, peers, (PlanTrainer("trainer", 1e9),), max_in_flight=3)
    plan = Plan(blocks, tuple(range(len(blocks))) + (-1,) * (4 - len(blocks)), microbatch)
    view = LinkView(cluster)
    path.write_text(json.dumps(PipelinePlan(plan, predict(plan, view), view.codecs_by_region()).to_dict(cluster)))
    return path


def test_peers_and_trainers_take_their_settings_from_a_plan_file(tmp_path):
    plan = str(tiny_plan_file(tmp_path / "plan.json", (3, 1, 2)))
    peer = load_config(PeerConfig, {"plan": plan, "plan_name": "peer2", "stage": "0"}, environ={})
    assert (peer.num_stages, peer.stage_blocks, peer.stage) == (3, [3, 1, 2], "2")  # the plan's stand over flags
    assert peer.model_spec().stage_blocks == (3, 1, 2)
    trainer = load_config(TrainerConfig, {"plan": plan, "plan_name": "trainer"}, environ={})
    assert (trainer.num_stages, trainer.stage_blocks, trainer.microbatch_size) == (3, [3, 1, 2], 5)
    assert 1 <= trainer.max_in_flight <= 3
    # a plan whose cut is the even one sets none: such peers announce the same cut as peers started without it
    even = str(tiny_plan_file(tmp_path / "even.json", (2, 2, 2)))
    assert load_config(PeerConfig, {"plan": even, "plan_name": "peer0"}, environ={}).stage_blocks == []


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"plan_name": "peer3"}, "no stage for it in"),  # the plan leaves peer3 idle
        ({"plan_name": "nobody"}, "no stage for it in"),
        ({"plan_name": "peer0", "model": "llama-tiny"}, None),  # another model of 6 blocks: the cut still fits
        ({"plan_name": "peer0", "model": "gpt-micro"}, "is not of this model's 8 blocks"),
    ],
)
def test_a_plan_that_does_not_fit_the_process_is_a_clear_error(tmp_path, settings, message):
    plan = str(tiny_plan_file(tmp_path / "plan.json", (3, 1, 2)))
    if message is None:
        assert load_config(PeerConfig, {"plan": plan, **settings}, environ={}).stage == "0"
        return
    with pytest.raises(ConfigError, match=message):
        load_config(PeerConfig, {"plan": plan, **settings}, environ={})


def test_a_file_that_is_no_plan_and_a_name_without_a_plan_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="give the file with --plan"):
        load_config(TrainerConfig, {"plan_name": "trainer"}, environ={})
    for content, message in [
        ("{", "is not JSON"),
        ('{"blocks_per_stage": [3, 3]}', "is not a plan file from `swarm plan`"),
        (
            json.dumps({"blocks_per_stage": [6], "stages": {"a": 4}, "microbatch_size": 1, "max_in_flight": {}}),
            "names a stage",
        ),
    ]:
        bad = tmp_path / "bad.json"
        bad.write_text(content)
        with pytest.raises(ConfigError, match=message):
            load_config(PeerConfig, {"plan": str(bad), "plan_name": "a"}, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(PeerConfig, {"plan": str(tmp_path / "missing.json")}, environ={})


def test_a_plan_run_as_events_delivers_what_the_model_predicts():
    # queues on every link and device, random routing by speed: the plan's windows keep the stages busy
    peers = (PlanPeer("big", 150e12, 40 * GIB, 1250e6),) + tuple(
        PlanPeer(f"t4-{i}", 25e12, 16 * GIB, 125e6, "far") for i in range(3)
    )
    cluster = Cluster(WIDE, peers, (PlanTrainer("t", 1250e6),), Network({("default", "far"): 0.1}))
    view = LinkView(cluster)
    planned = plan_pipeline(cluster, view)
    assert planned.plan.num_stages > 1
    predicted = planned.prediction.samples_per_s
    simulated = simulate_plan(planned.plan, view)
    assert 0.9 <= simulated / predicted <= 1.1, (simulated, planned.prediction)
    # one microbatch in flight leaves every stage but one idle at any moment
    assert simulate_plan(planned.plan, view, windows=(1,)) < 0.75 * simulated
