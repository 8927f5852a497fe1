"""Checkpoints: a whole swarm stopped and started again goes on where it was; a torn write loses nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    assert_matches_reference,
    peer_flags,
    reference_run,
    run_as_stage_members,
    trainer_flags,
    wait_for_records,
)

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.net.wire import WireLimits
from swarm.peer.checkpoint import CheckpointError, load_checkpoint, restore, save_checkpoint
from swarm.peer.stage_state import load_state_tensors
from swarm.peer.state_transfer import request_state
from swarm.records.stage_records import SERVING


def all_serving(records: dict) -> bool:
    return all(any(r.state == SERVING for r in records[stage]) for stage in range(3))


def served_state(initial_peers: list[str], peer_id: str, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
    """A peer's live state, fetched over the wire and loaded into a fresh stage."""
    given = run_as_stage_members(  # only a stage-mate is given a state
        initial_peers, stage, 1, lambda p2p: request_state(p2p, peer_id, "gpt-tiny", stage, WireLimits())
    )
    module = build_stage(get_model_spec("gpt-tiny"), stage, 3, seed=0)  # another seed: every value must come in
    load_state_tensors(module, build_optimizer(module, OptimizerSettings()), given.tensors, given.has_optimizer_state)
    return given.step, module.state_dict()


@pytest.mark.timeout(300)
def test_swarm_restarted_from_checkpoints_continues(local_swarm, tmp_path):
    first, second = 3, 2
    checkpoints = tmp_path / "checkpoints"
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(checkpoints))
    trainer = local_swarm.start_trainer("trainer", trainer_flags(first, tmp_path / "first.json"))
    assert trainer.wait(180) == 0, local_swarm.log_path("trainer").read_text()
    local_swarm.stop_all()  # every process, the bootstrap node included
    saved = {stage: load_checkpoint(checkpoints, "gpt-tiny", stage, 3) for stage in range(3)}
    assert all(checkpoint.step == first for checkpoint in saved.values())

    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(checkpoints))
    records = wait_for_records(local_swarm.initial_peers, all_serving)
    for stage in range(3):
        (record,) = records[stage]
        step, parameters = served_state(local_swarm.initial_peers, record.peer_id, stage)
        assert step == first and record.step == first
        for name, tensor in saved[stage].parameters.items():
            assert torch.equal(parameters[name], tensor), f"stage {stage}: {name} differs from the checkpoint"

    summary_file = tmp_path / "second.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(second, summary_file))
    assert trainer.wait(180) == 0, local_swarm.log_path("trainer").read_text()
    assert json.loads(summary_file.read_text())["first_step"] == first
    for stage in range(3):
        assert local_swarm.stop(f"peer{stage}") == 0
    # the two runs together are the same training as one of first + second steps
    reference = reference_run(first + second)
    for stage, module in enumerate(reference.stages):
        checkpoint = load_checkpoint(checkpoints, "gpt-tiny", stage, 3)
        assert checkpoint.step == first + second
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}")


WRITER = """
import sys, torch
from torch import nn
from swarm.peer.checkpoint import save_checkpoint

class Big(nn.Module):  # big enough that a write takes a while
    stage, num_stages = 0, 1
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2048, 4096))

module = Big()
optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
step = 0
while True:
    step += 1
    with torch.no_grad():
        module.weight.fill_(step)
    print("start", step, flush=True)
    save_checkpoint(sys.argv[1], "big", module, optimizer, step)
    print("done", step, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1])
def test_checkpoint_write_killed_midway_leaves_the_previous_one(tmp_path, delay):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        lines = [writer.stdout.readline().strip() for _ in range(3)]
        assert lines == ["start 1", "done 1", "start 2"]  # one checkpoint complete, the next being written
        time.sleep(delay)
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait(10)
    checkpoint = load_checkpoint(tmp_path, "big", 0, 1)
    # the last write that completed before the kill (a fast disk may finish several within the delay)
    assert checkpoint is not None and checkpoint.step >= 1
    # the file holds one whole write: every value is that write's step
    assert torch.all(checkpoint.parameters["weight"] == checkpoint.step)
    # the next save clears what the killed write left behind
    module = build_stage(get_model_spec("gpt-tiny"), 0, 1, seed=0)
    save_checkpoint(tmp_path, "big", module, build_optimizer(module, OptimizerSettings()), 0)
    assert not list(tmp_path.glob("*.tmp"))


def test_checkpoint_of_another_vocabulary_is_one_clear_error(tmp_path):
    spec = get_model_spec("gpt-tiny")
    module = build_stage(spec, 0, 2, seed=0)
    save_checkpoint(tmp_path, "gpt-tiny", module, build_optimizer(module, OptimizerSettings()), 3)
    checkpoint = load_checkpoint(tmp_path, "gpt-tiny", 0, 2)
    wider = build_stage(dataclasses.replace(spec, vocab_size=spec.vocab_size + 100), 0, 2, seed=0)
    with pytest.raises(CheckpointError, match="--vocab-size") as error:
        restore(checkpoint, wider, build_optimizer(wider, OptimizerSettings()))
    assert "\n" not in str(error.value)
