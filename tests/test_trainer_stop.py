"""A trainer asked to stop stops promptly, even in the middle of a step that waits for a missing stage."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
from conftest import peer_flags, trainer_flags, wait_for_records

STOP_BOUND = 15.0  # seconds from SIGTERM to exit; a step stuck on a missing stage must not hold it


@pytest.mark.timeout(240)
def test_sigterm_interrupts_a_step_waiting_for_a_dead_stage(local_swarm, tmp_path):
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    wait_for_records(local_swarm.initial_peers, lambda r: all(r[s] for s in range(3)))
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(1000, summary_file, in_flight=2))
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= 2 for p in r[1]), timeout=150)

    local_swarm.stop("peer1", signal.SIGKILL)  # stage 1 is gone: the step in progress cannot finish
    log = local_swarm.log_path("trainer")
    deadline = time.monotonic() + 60
    while "Stage 1 has no live peer" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "Stage 1 has no live peer" in log.read_text()

    asked = time.monotonic()
    local_swarm.signal("trainer", signal.SIGTERM)
    assert trainer.wait(STOP_BOUND + 10) == 0
    assert time.monotonic() - asked < STOP_BOUND
    assert "was not finished and is not counted" in log.read_text()
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] >= 2 and len(summary["losses"]) == summary["steps"]


@pytest.mark.timeout(240)
def test_a_frozen_stage_stops_training_with_an_error_instead_of_a_hang(local_swarm, tmp_path):
    patience = 15.0
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    wait_for_records(local_swarm.initial_peers, lambda r: all(r[s] for s in range(3)))
    summary_file = tmp_path / "summary.json"
    flags = trainer_flags(1000, summary_file, in_flight=2)
    flags += ["--stage-wait-timeout", str(patience), "--call-timeout-floor", "2", "--call-timeout", "4"]
    trainer = local_swarm.start_trainer("trainer", flags)
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= 2 for p in r[1]), timeout=150)

    # stage 1 hangs without dying: its connections stay open and its record lives on for a while
    local_swarm.signal("peer1", signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        code = trainer.wait(patience + 60)
    finally:
        local_swarm.signal("peer1", signal.SIGCONT)
    assert code != 0
    # retries, re-queues and the wait for a live peer all stay within the patience, plus a deadline or two
    assert time.monotonic() - frozen < patience + 40
    log = local_swarm.log_path("trainer").read_text()
    assert re.search(r"Training stopped: stage 1 (completed no call|has had no live peer) for 15s", log), log[-2000:]
