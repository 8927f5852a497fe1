"""Stage-mates over real libp2p: several peers per stage train as one, newcomers take the state."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import (
    assert_matches_reference,
    peer_flags,
    reference_run,
    reordering_noise,
    run_p2p_client,
    trainer_flags,
    wait_for_records,
)
from hivemind.p2p import PeerID

from swarm.net.transport import get_peer_info
from swarm.peer.checkpoint import load_checkpoint
from swarm.records.stage_records import SERVING


def serving(records: dict, stage: int) -> list:
    return [r for r in records[stage] if r.state == SERVING]


def final_parameters(checkpoint_dir, stage: int, steps: int) -> dict[str, torch.Tensor]:
    checkpoint = load_checkpoint(checkpoint_dir, "gpt-tiny", stage, 3)
    assert checkpoint is not None, f"no checkpoint in {checkpoint_dir}"
    assert checkpoint.step == steps, f"{checkpoint_dir} is at step {checkpoint.step}, not {steps}"
    return checkpoint.parameters


def assert_replicas_equal(replicas: list[dict[str, torch.Tensor]], what: str) -> None:
    for other in replicas[1:]:
        for name, tensor in replicas[0].items():
            assert torch.equal(tensor, other[name]), f"{what}: replicas differ in {name}"


@pytest.mark.timeout(300)
def test_two_peers_per_stage_match_one_process(local_swarm, tmp_path):
    steps = 4
    local_swarm.start_bootstrap()
    for stage in range(3):
        for replica in "ab":
            local_swarm.start_peer(f"peer{stage}{replica}", stage, peer_flags(tmp_path / f"ckpt{stage}{replica}"))
    # every peer serving, and long enough for each to have read its mate from the DHT
    wait_for_records(local_swarm.initial_peers, lambda r: all(len(serving(r, s)) == 2 for s in range(3)))
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(steps, summary_file))
    assert trainer.wait(200) == 0, local_swarm.log_path("trainer").read_text()
    for name in [n for n in local_swarm.processes if n.startswith("peer")]:
        assert local_swarm.stop(name) == 0

    reference = reference_run(steps)
    losses = json.loads(summary_file.read_text())["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    for stage, module in enumerate(reference.stages):
        replicas = [final_parameters(tmp_path / f"ckpt{stage}{r}", stage, steps) for r in "ab"]
        assert_replicas_equal(replicas, f"stage {stage}")
        assert_matches_reference(module, replicas[0], f"stage {stage}")


@pytest.mark.timeout(300)
def test_peer_joining_mid_training_takes_its_mates_state(local_swarm, tmp_path):
    # small microbatches, one at a time, over slow links: the newcomer starts mid-run
    steps, join_at, micro = 14, 2, 2
    local_swarm.start_bootstrap()
    names = {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]}
    for stage, peers in names.items():
        for name in peers:
            local_swarm.start_peer(name, stage, peer_flags(tmp_path / name))
    wait_for_records(local_swarm.initial_peers, lambda r: [len(serving(r, s)) for s in range(3)] == [1, 2, 1])
    summary_file = tmp_path / "summary.json"
    # 30 ms each way: steps of a few seconds on any machine, so the newcomer arrives well before the end
    flags = [*trainer_flags(steps, summary_file, micro, in_flight=1), "--emulate-latency-ms", "30"]
    trainer = local_swarm.start_trainer("trainer", flags)
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= join_at for p in serving(r, 1)), timeout=150)
    local_swarm.start_peer("peer1c", 1, peer_flags(tmp_path / "peer1c"))
    assert trainer.wait(240) == 0, local_swarm.log_path("trainer").read_text()

    # before serving, the newcomer loaded exactly the state a mate gave it, mid-training
    joiner_log = local_swarm.log_path("peer1c").read_text()
    loaded = re.search(r"Loaded stage 1 state of step (\d+) \(fingerprint (\w+)\)", joiner_log)
    assert loaded, joiner_log
    joined_step = int(loaded.group(1))
    assert join_at <= joined_step < steps
    given = f"Giving stage 1 state of step {joined_step} (fingerprint {loaded.group(2)})"
    assert any(given in local_swarm.log_path(n).read_text() for n in ("peer1a", "peer1b"))
    assert joiner_log.index(loaded.group(0)) < joiner_log.index("Serving stage 1")

    joiner_id = re.search(r"peer id (\w+)", joiner_log).group(1)
    records = wait_for_records(local_swarm.initial_peers, lambda r: len(serving(r, 1)) == 3)
    infos = {
        r.peer_id: run_p2p_client(
            local_swarm.initial_peers, lambda p2p, r=r: get_peer_info(p2p, PeerID.from_base58(r.peer_id))
        )
        for r in serving(records, 1)
    }
    assert all(info.step == steps for info in infos.values()), infos
    status = subprocess.run(
        [sys.executable, "-m", "swarm", "status", "--initial-peers", *local_swarm.initial_peers],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = [line.split() for line in status.stdout.splitlines()[1:]]
    assert sorted(row[0] for row in rows) == ["0", "1", "1", "1", "2"], status.stdout + status.stderr
    assert all(row[2] == SERVING and row[3] == str(steps) for row in rows), status.stdout
    assert infos[joiner_id].requests_served > 0, "the newcomer got no traffic"
    for name in [n for n in local_swarm.processes if n.startswith("peer")]:
        assert local_swarm.stop(name) == 0

    reference = reference_run(steps, micro)
    replicas = [final_parameters(tmp_path / name, 1, steps) for name in ("peer1a", "peer1b", "peer1c")]
    assert_replicas_equal(replicas, "stage 1")
    noise = reordering_noise(steps, 1, micro)
    assert_matches_reference(reference.stages[1], replicas[0], "stage 1", noise)
