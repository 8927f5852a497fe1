"""A swarm with no compression trains to the same parameters as one process with the same batch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_matches_reference, peer_flags, reference_run, reordering_noise, trainer_flags
from test_planner import tiny_plan_file

from swarm.peer.checkpoint import checkpoint_name, load_checkpoint

STEPS = 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-tiny-bottleneck", "gpt-tiny-subspace"])
def test_swarm_matches_one_process(local_swarm, tmp_path, model):
    checkpoints = tmp_path / "checkpoints"
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(checkpoints, model=model))
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(STEPS, summary_file, model=model))
    assert trainer.wait(180) == 0, (local_swarm.workdir / "trainer.log").read_text()
    for stage in range(3):
        assert local_swarm.stop(f"peer{stage}") == 0  # a clean exit saves the checkpoint

    reference = reference_run(STEPS, model=model)
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == STEPS
    # every stage call went over the direct data plane (the peers announce one on 127.0.0.1)
    assert summary["calls_by_path"].get("direct", 0) > 0 and not summary["calls_by_path"].get("libp2p"), summary
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    for stage, module in enumerate(reference.stages):
        checkpoint = load_checkpoint(checkpoints, model, stage, 3)
        assert checkpoint is not None and checkpoint.step == STEPS
        # the bottleneck's projections amplify rounding: hold it to the drift of a reordered reference
        noise = reordering_noise(STEPS, stage, model=model) if model == "gpt-tiny-bottleneck" else (0.0, 0.0)
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}", noise)


@pytest.mark.timeout(240)
def test_an_uneven_cut_trains_like_one_process_and_a_newcomer_cut_otherwise_is_refused(local_swarm, tmp_path):
    """Peers that take a plan file cutting the model 3,1,2 (`--stage-blocks`, as `swarm plan` may choose) train to
    the one-process reference cut alike; the trainer, given no cut, takes the swarm's. A newcomer with the even cut
    is refused, told the swarm's."""
    cut = (3, 1, 2)
    checkpoints = tmp_path / "checkpoints"
    plan = tiny_plan_file(tmp_path / "plan.json", cut)
    local_swarm.start_bootstrap()
    for stage in range(3):
        flags = peer_flags(checkpoints, "--plan", str(plan), "--plan-name", f"peer{stage}")
        local_swarm.start_peer(f"peer{stage}", stage, flags)
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(STEPS, summary_file))
    assert trainer.wait(180) == 0, (local_swarm.workdir / "trainer.log").read_text()
    newcomer = local_swarm.start_peer("even", 1, peer_flags(tmp_path / "even"))
    assert newcomer.wait(120) != 0
    assert "--stage-blocks 3,1,2 (you gave '')" in local_swarm.log_path("even").read_text()
    assert "Settings from the plan" in local_swarm.log_path("peer1").read_text()
    for stage in range(3):
        assert local_swarm.stop(f"peer{stage}") == 0

    reference = reference_run(STEPS, stage_blocks=cut)
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == STEPS
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    for stage, module in enumerate(reference.stages):
        assert len(module.blocks) == cut[stage]
        checkpoint = load_checkpoint(checkpoints, checkpoint_name("gpt-tiny", cut), stage, 3)
        assert checkpoint is not None and checkpoint.step == STEPS
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}")
