"""A peer SIGKILLed mid-training: its backwards move to a stage-mate and its lost gradients are resent."""

from __future__ import annotations

import json
import signal
import time

import pytest
from conftest import (
    assert_matches_reference,
    peer_flags,
    reference_run,
    reordering_noise,
    trainer_flags,
    wait_for_records,
)
from swarm.peer.checkpoint import load_checkpoint

from swarm.stage_records import SERVING


@pytest.mark.timeout(300)
def test_killed_peer_loses_no_microbatch(local_swarm, tmp_path):
    steps, micro, kill_at = 8, 1, 3
    local_swarm.start_bootstrap()
    names = {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]}
    for stage, peers in names.items():
        for name in peers:
            local_swarm.start_peer(name, stage, peer_flags(tmp_path / name))
    counts = [lambda r, s=s: sum(p.state == SERVING for p in r[s]) for s in range(3)]
    wait_for_records(local_swarm.initial_peers, lambda r: [count(r) for count in counts] == [1, 2, 1])
    summary_file = tmp_path / "summary.json"
    # one sample per microbatch, many in flight, 100 ms each way: a kill lands between forwards and backwards
    flags = [*trainer_flags(steps, summary_file, micro, in_flight=8), "--emulate-latency-ms", "100"]
    trainer = local_swarm.start_trainer("trainer", flags)
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= kill_at for p in r[1]), timeout=150)
    time.sleep(1.5)  # into the next step (about 3 s long), while the peer holds gradients it has not averaged
    local_swarm.stop("peer1a", signal.SIGKILL)

    assert trainer.wait(240) == 0, local_swarm.log_path("trainer").read_text()
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps
    assert summary["backwards_moved"] > 0, "no backward had to move to the surviving stage-mate"
    assert summary["samples_resent"] > 0, "the dead peer held no gradients: the kill came at a step boundary"
    for name in ("peer0", "peer1b", "peer2"):
        assert local_swarm.stop(name) == 0
    # what the dead peer had applied was sent again: the stage ends as the one-process run does
    checkpoint = load_checkpoint(tmp_path / "peer1b", "gpt-tiny", 1, 3)
    assert checkpoint.step == steps and checkpoint.samples_stepped == steps * 24
    noise = reordering_noise(steps, 1, micro)
    assert_matches_reference(reference_run(steps, micro).stages[1], checkpoint.parameters, "stage 1", noise)
