"""Peers that answer garbage, in a real swarm: the trainer checks every reply, bans the peer that sent a bad
one and goes on elsewhere; no single peer's refusal or reply can stop training."""

from __future__ import annotations

import json

import pytest
from conftest import trainer_flags
from test_peer_death import trainer_exit_code
from test_step_protocol import start_swarm


@pytest.mark.timeout(300)
def test_a_peer_that_replies_nan_is_banned_and_training_goes_on(local_swarm, tmp_path):
    """peer1b answers every call with NaN tensors (`reply=nan`): each such reply is refused by the
    trainer, the call goes to peer1a, and training finishes with a falling loss."""
    steps = 6
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]},
        {"peer1b": ["--faults", "reply=nan"]},
    )
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(steps, summary_file))
    log = local_swarm.log_path("trainer")
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, log.read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps and summary["last_loss"] < summary["first_loss"], summary
    assert summary["bad_replies"] >= 1 and summary["bans"] >= 1, summary
    assert "bad reply: forward of stage 1 answered values that contain NaN" in log.read_text()
