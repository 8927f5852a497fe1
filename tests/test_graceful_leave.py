"""A peer told it will be preempted leaves cleanly mid-training, and the swarm loses nothing by it."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from conftest import (
    assert_matches_reference,
    peer_flags,
    reference_run,
    reordering_noise,
    trainer_flags,
    wait_for_records,
)

from swarm.peer.checkpoint import load_checkpoint
from swarm.records.stage_records import SERVING

LEAVE_BOUND = 30.0  # seconds from notice to exit with the defaults: drain 15 s, withdraw 5 s, hand-over 10 s


@pytest.mark.timeout(300)
def test_preempted_peer_hands_over_and_leaves(local_swarm, tmp_path):
    steps, micro, leave_at = 14, 2, 4
    notice = tmp_path / "interruption-notice"
    local_swarm.start_bootstrap()
    local_swarm.start_peer("peer0", 0, peer_flags(tmp_path / "peer0"))
    local_swarm.start_peer(
        "peer1a",
        1,
        peer_flags(tmp_path / "peer1a", "--preemption-notice", f"file:{notice}", "--preemption-poll", "0.2"),
    )
    local_swarm.start_peer("peer1b", 1, peer_flags(tmp_path / "peer1b"))
    local_swarm.start_peer("peer2", 2, peer_flags(tmp_path / "peer2"))
    serving = [lambda r, s=s: sum(p.state == SERVING for p in r[s]) for s in range(3)]
    wait_for_records(local_swarm.initial_peers, lambda r: [count(r) for count in serving] == [1, 2, 1])
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(steps, summary_file, micro, in_flight=2))
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= leave_at for p in r[1]), timeout=150)

    notice.touch()
    noticed = time.monotonic()
    leaver = local_swarm.processes["peer1a"]
    assert leaver.wait(LEAVE_BOUND + 10) == 0
    assert time.monotonic() - noticed < LEAVE_BOUND
    log = local_swarm.log_path("peer1a").read_text()
    assert "Preemption notice received" in log and re.search(r"Left the swarm [\d.]+s after", log), log

    assert trainer.wait(240) == 0, local_swarm.log_path("trainer").read_text()
    assert json.loads(summary_file.read_text())["steps"] == steps
    for name in ("peer0", "peer1b", "peer2"):
        assert local_swarm.stop(name) == 0
    # nothing the leaver held was lost: the stage ends as the one-process run does
    checkpoint = load_checkpoint(tmp_path / "peer1b", "gpt-tiny", 1, 3)
    assert checkpoint.step == steps
    reference = reference_run(steps, micro)
    assert_matches_reference(reference.stages[1], checkpoint.parameters, "stage 1", reordering_noise(steps, 1, micro))
    assert torch.isfinite(torch.cat([t.flatten() for t in checkpoint.parameters.values()])).all()
