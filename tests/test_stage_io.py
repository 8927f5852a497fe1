"""What a stage takes and what its replies must hold: counts, shapes, dtypes and bounded values."""

from __future__ import annotations

import pytest
import torch

from swarm.models import build_stage, get_model_spec
from swarm.models.stage_io import (
    MAX_ABS_VALUE,
    StageInputError,
    StageOutputError,
    check_stage_inputs,
    check_stage_outputs,
)

SPEC = get_model_spec("gpt-tiny")
BATCH, SEQ, WIDTH = 2, 16, SPEC.boundary_width


def hidden(value: float | None = None) -> torch.Tensor:
    tensor = torch.randn(BATCH, SEQ, WIDTH)
    if value is not None:
        tensor[1, 3, 5] = value
    return tensor


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38, -2 * MAX_ABS_VALUE])
def test_boundary_values_that_are_not_finite_or_beyond_the_bound_are_refused(value):
    middle = build_stage(SPEC, 1, 3, seed=0)
    with pytest.raises(StageInputError, match="hidden"):
        check_stage_inputs(middle, False, [hidden(value)], max_batch=8)
    with pytest.raises(StageInputError, match="grad_outputs"):
        check_stage_inputs(middle, True, [hidden(), hidden(value)], max_batch=8)
    assert check_stage_inputs(middle, True, [hidden(), hidden(MAX_ABS_VALUE / 2)], max_batch=8) == BATCH


def test_a_reply_must_hold_the_tensors_the_call_asked_for():
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    check_stage_outputs(0, 3, WIDTH, False, [tokens], [hidden()])
    check_stage_outputs(0, 3, WIDTH, True, [tokens, hidden()], [])  # token inputs have no gradient
    check_stage_outputs(2, 3, WIDTH, True, [hidden(), tokens], [hidden()])
    bad = [
        (0, False, [tokens], []),  # no tensor
        (1, False, [hidden()], [hidden(), hidden()]),  # one too many
        (1, False, [hidden()], [torch.randn(BATCH, SEQ, WIDTH + 1)]),  # wrong width
        (1, False, [hidden()], [torch.randn(BATCH + 1, SEQ, WIDTH)]),  # not the batch sent
        (1, True, [hidden(), hidden()], [hidden().double()]),  # wrong dtype
        (1, False, [hidden()], [hidden(float("nan"))]),
        (2, True, [hidden(), tokens], [hidden(1e30)]),
    ]
    for stage, backward, inputs, outputs in bad:
        with pytest.raises(StageOutputError):
            check_stage_outputs(stage, 3, WIDTH, backward, inputs, outputs)
