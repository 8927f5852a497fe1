"""The subspace model: blocks write a narrow part of the residual stream, sent exactly (in-process only)."""

from __future__ import annotations

import pytest
import torch

from swarm.models import build_stage, get_model_spec
from swarm.models.stage_io import StageInputError, check_stage_inputs

SPEC = get_model_spec("gpt-tiny-subspace")
NUM_STAGES = 3
BATCH, SEQ = 2, 16


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def test_preset_is_gpt_tiny_sending_a_fifth_of_the_width():
    tiny = get_model_spec("gpt-tiny")
    assert SPEC.subspace == 24 and SPEC.boundary_width == 24 and SPEC.bottleneck == 0
    assert (SPEC.d_model, SPEC.n_layer, SPEC.seq_len) == (tiny.d_model, tiny.n_layer, tiny.seq_len)
    with pytest.raises(ValueError, match="subspace must be"):
        get_model_spec("gpt-tiny", subspace=128)
    with pytest.raises(ValueError, match="do not combine"):
        get_model_spec("gpt-tiny-bottleneck", subspace=16)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_num_parameters_counts_the_narrow_projections(num_stages: int):
    built = sum(p.numel() for k in range(num_stages) for p in build_stage(SPEC, k, num_stages).parameters())
    assert SPEC.num_parameters(num_stages) == built


def test_the_boundary_loses_nothing():
    """Three stages passing 24 coordinates and the token ids compute what one stage holding every block does."""
    stages = [build_stage(SPEC, k, NUM_STAGES, seed=3) for k in range(NUM_STAGES)]
    whole = build_stage(SPEC, 0, 1, seed=3)
    parameters = {}
    offset = 0
    for stage in stages:
        for name, value in stage.state_dict().items():
            if name.startswith("blocks."):
                index, rest = name.removeprefix("blocks.").split(".", 1)
                name = f"blocks.{int(index) + offset}.{rest}"
            parameters[name] = value
        offset += len(stage.blocks)
    whole.load_state_dict(parameters)  # strict: the fixed embedding is not part of the state

    ids, targets = tokens(), tokens(1)
    hidden = ids
    for stage in stages[:-1]:
        hidden = stage(hidden, tokens=ids)
        assert hidden.shape == (BATCH, SEQ, SPEC.boundary_width)
    torch.testing.assert_close(stages[-1](hidden, targets, tokens=ids), whole(ids, targets), rtol=1e-5, atol=1e-6)


def test_a_later_stage_needs_the_token_ids():
    middle, last = build_stage(SPEC, 1, NUM_STAGES), build_stage(SPEC, 2, NUM_STAGES)
    hidden, ids = torch.randn(BATCH, SEQ, SPEC.boundary_width), tokens()
    assert check_stage_inputs(middle, False, [hidden, ids], max_batch=8) == BATCH
    assert check_stage_inputs(middle, True, [hidden, ids, hidden.clone()], max_batch=8) == BATCH
    assert check_stage_inputs(last, True, [hidden, ids, tokens(1)], max_batch=8) == BATCH
    with pytest.raises(StageInputError, match=r"takes 2 tensors \(hidden, tokens\), got 1"):
        check_stage_inputs(middle, False, [hidden], max_batch=8)
    with pytest.raises(StageInputError, match=r"tokens must be int64\[2, 16\]"):
        check_stage_inputs(middle, False, [hidden, ids.float()], max_batch=8)
    with pytest.raises(StageInputError, match="ids outside"):
        check_stage_inputs(middle, False, [hidden, ids + SPEC.vocab_size], max_batch=8)
    with pytest.raises(ValueError, match="takes the token ids"):
        middle(hidden)
    assert build_stage(SPEC, 0, NUM_STAGES).num_inputs == 1 and middle.num_inputs == last.num_inputs == 2


def test_the_fixed_embedding_depends_on_the_spec_alone():
    """A newcomer downloads only parameters: what is not among them must not depend on its --seed."""
    a, b = build_stage(SPEC, 1, NUM_STAGES, seed=1), build_stage(SPEC, 1, NUM_STAGES, seed=2)
    assert torch.equal(a.tok_fixed, b.tok_fixed) and torch.equal(a.pos_fixed, b.pos_fixed)
    assert a.tok_fixed.shape == (SPEC.vocab_size, SPEC.d_model - SPEC.subspace)
    assert "tok_fixed" not in a.state_dict() and "tok_fixed" not in dict(a.named_parameters())
    assert not torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
