"""Several runs in one swarm: each trains as it would alone, and a peer started with --run-id auto serves
the run that needs it, moving when another run's stage empties."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import LR, TARGET, assert_matches_reference, peer_flags, reference_run, trainer_flags

from swarm.net.identity import load_identity
from swarm.peer.checkpoint import checkpoint_name, load_checkpoint

STEPS = 3
CUT = (4, 2)


def run_records(initial_peers: list[str], run_id: str, num_stages: int, ready, timeout: float = 120.0) -> dict:
    """Polls one run's stage records until `ready(records)` holds; returns them (AssertionError on timeout)."""
    from swarm.net.dht_node import TetheredDHT
    from swarm.records.stage_records import fetch_stage_records

    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready(records := fetch_stage_records(dht, run_id, num_stages)):
            assert time.monotonic() < deadline, f"run {run_id} did not get ready: {records}"
            time.sleep(0.3)
        return records
    finally:
        dht.shutdown()


def serving(stage: int):
    return lambda records: any(r.state == "serving" for r in records[stage])


@pytest.mark.timeout(300)
def test_two_runs_in_one_swarm_each_train_as_they_would_alone(local_swarm, tmp_path):
    """Runs red (gpt-tiny cut evenly in 2) and blue (gpt-tiny cut 4,2) share one DHT and train at once: each
    run's stages end with its own one-run reference's parameters, and its trainer's losses are the reference's."""
    local_swarm.start_bootstrap()
    runs = {"red": [], "blue": ["--stage-blocks", ",".join(map(str, CUT))]}
    for run_id, extra in runs.items():
        for stage in range(2):
            flags = peer_flags(tmp_path / run_id, "--run-id", run_id, "--num-stages", "2", *extra)
            local_swarm.start_peer(f"{run_id}{stage}", stage, flags)
    trainers = {}
    for run_id in runs:
        flags = [*trainer_flags(STEPS, tmp_path / f"{run_id}.json"), "--run-id", run_id, "--num-stages", "2"]
        trainers[run_id] = local_swarm.start_trainer(f"trainer-{run_id}", flags)
    for run_id, trainer in trainers.items():
        assert trainer.wait(240) == 0, local_swarm.log_path(f"trainer-{run_id}").read_text()[-3000:]
    for run_id in runs:
        for stage in range(2):
            assert local_swarm.stop(f"{run_id}{stage}") == 0

    for run_id, cut in (("red", ()), ("blue", CUT)):
        reference = reference_run(STEPS, stage_blocks=cut, num_stages=2)
        summary = json.loads((tmp_path / f"{run_id}.json").read_text())
        assert summary["steps"] == STEPS
        losses = torch.tensor(summary["losses"])
        torch.testing.assert_close(losses, torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
        for stage, module in enumerate(reference.stages):
            checkpoint = load_checkpoint(tmp_path / run_id, checkpoint_name("gpt-tiny", cut), stage, 2)
            assert checkpoint is not None and checkpoint.step == STEPS
            assert_matches_reference(module, checkpoint.parameters, f"run {run_id}, stage {stage}")


def run_file(path, run_id: str, num_stages: int) -> str:
    settings = {"run_id": run_id, "model": "gpt-tiny", "num_stages": num_stages, "seed": 7, "total_steps": 100}
    path.write_text(json.dumps({**settings, "target_batch_size": TARGET, "lr": LR}))  # JSON is YAML
    return str(path)


@pytest.mark.timeout(480)  # each of its waits allows 120-150 s; the whole took 191 s in a CI rehearsal
def test_an_auto_peer_refills_the_run_with_an_empty_stage_and_moves_when_another_empties(local_swarm, tmp_path):
    """Blue's stage 1 has no peer: a peer started with --run-id auto serves it, and blue trains. When red's stage 2
    empties while blue's stage 1 has another peer, it leaves blue for red's stage 2, and red trains."""
    local_swarm.start_bootstrap()
    fast = ["--announce-period", "0.5", "--target-batch-size", str(TARGET), "--lr", str(LR), "--seed", "7"]
    for stage in range(3):
        local_swarm.start_peer(f"red{stage}", stage, ["--run-id", "red", "--model", "gpt-tiny", *fast])
    local_swarm.start_peer("blue0", 0, ["--run-id", "blue", "--num-stages", "2", *fast])
    run_records(local_swarm.initial_peers, "red", 3, lambda r: all(serving(s)(r) for s in range(3)))
    run_records(local_swarm.initial_peers, "blue", 2, serving(0))
    runs = [run_file(tmp_path / "red.yaml", "red", 3), run_file(tmp_path / "blue.yaml", "blue", 2)]
    auto_flags = ["--run-id", "auto", "--runs", *runs, "--initial-peers", *local_swarm.initial_peers]
    local_swarm.spawn("auto", "peer", [*auto_flags, "--rebalance-period", "3", "--announce-period", "0.5"])
    run_records(local_swarm.initial_peers, "blue", 2, serving(1))
    blue_flags = [*trainer_flags(2, tmp_path / "blue.json"), "--run-id", "blue", "--num-stages", "2"]
    trainer = local_swarm.start_trainer("trainer-blue", blue_flags)
    assert trainer.wait(120) == 0, local_swarm.log_path("trainer-blue").read_text()[-3000:]
    assert "Serving run blue, stage 1: its run has an empty stage" in local_swarm.log_path("auto").read_text()

    # a second peer on blue's stage 1 frees the auto peer (which may leave for red as soon as the newcomer
    # serves, so the two need not be seen serving at once); red's stage 2 then empties
    blue1 = load_identity(str(tmp_path / "blue1.key")).peer_id
    local_swarm.start_peer(
        "blue1", 1, ["--run-id", "blue", "--num-stages", "2", "--identity-path", str(tmp_path / "blue1.key"), *fast]
    )
    run_records(
        local_swarm.initial_peers, "blue", 2, lambda r: any(p.peer_id == blue1 and p.state == "serving" for p in r[1])
    )
    assert local_swarm.stop("red2") == 0
    run_records(local_swarm.initial_peers, "red", 3, serving(2), timeout=150.0)
    trainer = local_swarm.start_trainer("trainer-red", [*trainer_flags(2, tmp_path / "red.json"), "--run-id", "red"])
    assert trainer.wait(120) == 0, local_swarm.log_path("trainer-red").read_text()[-3000:]
    log = local_swarm.log_path("auto").read_text()
    assert "Leaving run blue for run red" in log and "Serving run red, stage 2" in log, log[-3000:]
    assert local_swarm.stop("auto") == 0


def test_run_files_are_checked_before_any_run_is_served(tmp_path):
    """--run-id auto needs --runs and the reverse; each file must name its run and its total steps, and no two
    files the same run; a file's settings stand over the peer's own, its stage is chosen per run."""
    from swarm.config import ConfigError, PeerConfig
    from swarm.config.options import load_config
    from swarm.config.run_files import read_run_files

    red, blue = run_file(tmp_path / "red.yaml", "red", 3), run_file(tmp_path / "blue.yaml", "blue", 2)
    own = load_config(PeerConfig, {"run_id": "auto", "runs": [red, blue], "device": "cpu"}, {})
    runs = read_run_files(own)
    assert [(r.run_id, r.config.num_stages, r.config.run_id, r.total_steps) for r in runs] == [
        ("red", 3, "red", 100),
        ("blue", 2, "blue", 100),
    ]
    for flags, message in (
        ({"run_id": "auto"}, "--run-id auto and --runs go together"),
        ({"runs": [red]}, "--run-id auto and --runs go together"),
        ({"run_id": "auto", "runs": [red], "stage": "1"}, "give no --plan or --stage"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(PeerConfig, flags, {})
    (tmp_path / "no-steps.yaml").write_text("run_id: green\nmodel: gpt-tiny\n")
    (tmp_path / "typo.yaml").write_text("run_id: green\ntotal_steps: 5\nlearning_rate: 0.1\n")
    (tmp_path / "bad-priority.yaml").write_text("run_id: green\ntotal_steps: 5\npriority: -1\n")
    for files, message in (
        ([red, str(tmp_path / "no-steps.yaml")], "must give total_steps"),
        ([red, str(tmp_path / "typo.yaml")], "learning_rate"),
        ([red, str(tmp_path / "bad-priority.yaml")], "priority must be a positive number"),
        ([red, red], "two files name the same run"),
        ([red, str(tmp_path / "missing.yaml")], "cannot read"),
    ):
        config = load_config(PeerConfig, {"run_id": "auto", "runs": files}, {})
        with pytest.raises(ConfigError, match=message):
            read_run_files(config)
