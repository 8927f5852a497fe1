"""--compile: a stage whose blocks torch.compile compiled computes what the plain stage does (to float32
rounding: compiled kernels may order sums differently), forward and backward, and trains."""

from __future__ import annotations

import pytest
import torch

from swarm.config import ConfigError, PeerConfig
from swarm.models import build_stage, compile_blocks, get_model_spec


@pytest.mark.timeout(300)
def test_compiled_blocks_compute_and_train_as_the_plain_stage():
    spec = get_model_spec("gpt-micro")
    plain, compiled = build_stage(spec, 1, 4, 0), compile_blocks(build_stage(spec, 1, 4, 0))
    x = torch.randn(4, spec.seq_len, spec.d_model, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    for module in (plain, compiled):
        module(x).backward(grad)
    assert torch.allclose(plain(x), compiled(x), atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_compile_and_offload_are_refused_together():
    with pytest.raises(ConfigError, match="--compile and --offload"):
        PeerConfig(compile=True, offload=True).check()
