"""A swarm with no compression trains to the same parameters as one process with the same batch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_matches_reference, peer_flags, reference_run, reordering_noise, trainer_flags

from swarm.peer.checkpoint import load_checkpoint

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
