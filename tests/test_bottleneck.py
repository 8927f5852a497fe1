"""The compression-aware model: learned bottleneck projections at stage boundaries (in-process only)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from swarm.models import build_stage, get_model_spec
from swarm.models.stage_io import StageInputError, check_stage_inputs

SPEC = get_model_spec("gpt-tiny-bottleneck")
TINY = get_model_spec("gpt-tiny")
NUM_STAGES = 3
BATCH, SEQ = 2, 16


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def test_preset_is_gpt_tiny_with_a_narrow_boundary():
    assert SPEC.bottleneck == 32 and SPEC.boundary_width == 32
    assert SPEC.d_model == TINY.d_model and SPEC.n_layer == TINY.n_layer and SPEC.seq_len == TINY.seq_len
    assert TINY.bottleneck == 0 and TINY.boundary_width == TINY.d_model
    assert SPEC.d_model // SPEC.boundary_width == 4  # 4x fewer values on the wire
    with pytest.raises(ValueError, match="bottleneck"):
        get_model_spec("gpt-tiny", bottleneck=-1)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_num_parameters_counts_the_projections(num_stages: int):
    built = sum(p.numel() for k in range(num_stages) for p in build_stage(SPEC, k, num_stages).parameters())
    assert SPEC.num_parameters(num_stages) == built
    tiny = sum(p.numel() for k in range(num_stages) for p in build_stage(TINY, k, num_stages).parameters())
    assert TINY.num_parameters(num_stages) == TINY.num_parameters() == tiny


def test_stages_chain_through_the_bottleneck():
    stages = [build_stage(SPEC, k, NUM_STAGES, seed=3) for k in range(NUM_STAGES)]
    assert stages[0].up is None and stages[0].down is not None
    assert stages[1].up is not None and stages[1].down is not None
    assert stages[-1].up is not None and stages[-1].down is None
    hidden = tokens()
    for stage in stages[:-1]:
        check_stage_inputs(stage, False, [hidden], max_batch=8)  # what a peer checks before running it
        hidden = stage(hidden)
        assert hidden.shape == (BATCH, SEQ, SPEC.boundary_width)
    check_stage_inputs(stages[-1], False, [hidden], max_batch=8)
    assert stages[-1](hidden).shape == (BATCH, SEQ, SPEC.d_model)  # no targets: the final hidden state
    losses = stages[-1](hidden, tokens(1))
    assert losses.shape == (BATCH,) and torch.isfinite(losses).all()


def test_a_single_stage_has_no_projections():
    stage = build_stage(SPEC, 0, 1)
    assert stage.up is None and stage.down is None
    reference = build_stage(TINY, 0, 1)
    for (name, a), (_, b) in zip(stage.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_stage_inputs_must_have_the_boundary_width():
    middle, last = build_stage(SPEC, 1, NUM_STAGES), build_stage(SPEC, 2, NUM_STAGES)
    narrow = torch.randn(BATCH, SEQ, SPEC.boundary_width)
    wide = torch.randn(BATCH, SEQ, SPEC.d_model)
    assert check_stage_inputs(middle, False, [narrow], max_batch=8) == BATCH
    assert check_stage_inputs(middle, True, [narrow, narrow.clone()], max_batch=8) == BATCH
    assert check_stage_inputs(last, True, [narrow, tokens()], max_batch=8) == BATCH
    with pytest.raises(StageInputError, match=r"hidden must be float32\[2, 16, 32\]"):
        check_stage_inputs(middle, False, [wide], max_batch=8)
    with pytest.raises(StageInputError, match=r"grad_outputs must be float32\[2, 16, 32\]"):
        check_stage_inputs(middle, True, [narrow, wide], max_batch=8)
    with pytest.raises(StageInputError, match="hidden must be"):
        check_stage_inputs(last, True, [wide, tokens()], max_batch=8)
    # without a bottleneck the full width is still what a stage takes
    tiny_middle = build_stage(TINY, 1, NUM_STAGES)
    assert check_stage_inputs(tiny_middle, True, [wide, wide.clone()], max_batch=8) == BATCH
    with pytest.raises(StageInputError):
        check_stage_inputs(tiny_middle, False, [narrow], max_batch=8)


def test_gradients_flow_through_the_projections():
    stages = [build_stage(SPEC, k, NUM_STAGES, seed=3) for k in range(NUM_STAGES)]
    hidden = tokens()
    for stage in stages[:-1]:
        hidden = stage(hidden)
    stages[-1](hidden, tokens(1)).sum().backward()
    for stage in stages:
        for projection in (stage.up, stage.down):
            if projection is not None:
                for param in projection.parameters():
                    assert param.grad is not None and bool(param.grad.abs().sum() > 0)
    assert bool(stages[0].tok_emb.weight.grad.abs().sum() > 0)  # and on through the bottlenecks to stage 0


# sha256 (first 32 hex digits) of gpt-tiny's stages, seed 7, as built before bottlenecks existed
GPT_TINY_HASHES = {
    (1, 0): "caa203f2387cab39716ea772a651ea7d",
    (3, 0): "cc2bbe773ed8fa0a369c94085f143fa2",
    (3, 1): "5fa053c5ebe1b3d2c03183385709026f",
    (3, 2): "76458ef611b090757846c40896151911",
}


@pytest.mark.parametrize("num_stages, stage", sorted(GPT_TINY_HASHES))
def test_gpt_tiny_parameters_are_unchanged(num_stages: int, stage: int):
    digest = hashlib.sha256()
    for name, tensor in build_stage(TINY, stage, num_stages, seed=7).state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest()[:32] == GPT_TINY_HASHES[num_stages, stage]


def test_bottleneck_keeps_the_shared_parameters_and_ties_the_boundary():
    stages = [build_stage(SPEC, k, NUM_STAGES, seed=7) for k in range(NUM_STAGES)]
    for k, stage in enumerate(stages):
        tiny = build_stage(TINY, k, NUM_STAGES, seed=7).state_dict()
        own = stage.state_dict()
        assert set(own) - set(tiny) <= {"up.weight", "up.bias", "down.weight", "down.bias"}
        for name, value in tiny.items():
            assert torch.equal(own[name], value), name
    for before, after in zip(stages[:-1], stages[1:]):
        assert torch.equal(after.up.weight, before.down.weight.T)  # both sides of a boundary start tied
    # a stage's parameters depend only on (spec, stage, num_stages, seed)
    again = build_stage(SPEC, 1, NUM_STAGES, seed=7).state_dict()
    for name, value in stages[1].state_dict().items():
        assert torch.equal(again[name], value), name
    assert not torch.equal(build_stage(SPEC, 1, NUM_STAGES, seed=8).up.weight, stages[1].up.weight)
