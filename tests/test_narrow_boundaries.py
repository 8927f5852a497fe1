"""What both models with narrow stage boundaries (a learned bottleneck, a subspace) must do (in-process only)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SMALL_CORPUS

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.models.stage_io import check_stage_inputs
from swarm.peer.runtime import StageRuntime
from swarm.trainer.data import ByteCorpus
from swarm.trainer.reference import train_reference

MODELS = ["gpt-tiny-bottleneck", "gpt-tiny-subspace"]
NUM_STAGES = 3
BATCH, SEQ = 2, 16


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 257, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model", MODELS)
def test_split_backward_over_the_wire_matches_one_process_autograd(model: str):
    """Stage by stage as peers run it, via StageRuntime: narrow activations forward (with the token ids where
    a stage takes them), narrow gradients back; every parameter's gradient is one process's."""
    spec = get_model_spec(model)
    stages = [build_stage(spec, k, NUM_STAGES, seed=5) for k in range(NUM_STAGES)]
    ids, targets = tokens(0), tokens(1)
    hidden = ids
    for stage in stages[:-1]:
        hidden = stage(hidden, tokens=ids)
    stages[-1](hidden, targets, tokens=ids).sum().backward()
    expected = [{name: p.grad.clone() for name, p in stage.named_parameters()} for stage in stages]

    runtimes = []
    for k in range(NUM_STAGES):
        module = build_stage(spec, k, NUM_STAGES, seed=5)
        runtimes.append(StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=100))
        runtimes[-1].start()
    try:
        inputs = [[ids]]
        for runtime in runtimes[:-1]:
            # clone: a copy as the wire makes (the runtime answers forwards with inference tensors)
            output = runtime.submit(False, inputs[-1]).result(30).tensors[0].clone()
            inputs.append([output, ids] if runtimes[len(inputs)].module.takes_tokens else [output])
        grad = runtimes[-1].submit(True, [*inputs[-1], targets]).result(30).tensors[0]
        for runtime, stage_inputs in zip(reversed(runtimes[:-1]), reversed(inputs[:-1])):
            assert grad.shape == (BATCH, SEQ, spec.boundary_width)
            check_stage_inputs(runtime.module, True, [*stage_inputs, grad], max_batch=8)
            result = runtime.submit(True, [*stage_inputs, grad]).result(30)
            grad = result.tensors[0] if result.tensors else None
        assert grad is None  # the first stage's inputs are token ids
        for runtime, grads in zip(runtimes, expected):
            for name, param in runtime.module.named_parameters():
                torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        for runtime in runtimes:
            runtime.shutdown()


@pytest.mark.parametrize("model", MODELS)
def test_reference_training_lowers_the_loss(model: str):
    run = train_reference(
        get_model_spec(model),
        NUM_STAGES,
        ByteCorpus(SMALL_CORPUS),
        steps=8,
        target_batch_size=8,
        microbatch_size=4,
        settings=OptimizerSettings(lr=3e-3),
        seed=7,
    )
    assert all(math.isfinite(loss) for loss in run.losses)
    assert sum(run.losses[-3:]) / 3 < run.losses[0] - 0.5, run.losses
