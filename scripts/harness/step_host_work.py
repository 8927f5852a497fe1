"""The host's share of a stage's step, timed on this machine: what a peer does with the summed gradient between
the last backward and the optimizer, for a stage of a given model.

`alone`: a peer with no stage-mates (the gradient leaves the parameters as one vector, its norm is taken, and it
comes back); `with_slice_math`: the same plus what a round with mates adds over the slice this peer owns (the
squared norms in float64, the weighted sum and the joining of the slices), taken here over the whole gradient,
as a lone peer's round did before it skipped them. Minimum of `repeats` runs of each, interleaved.
"""

from __future__ import annotations

import time

import torch

from swarm.models import build_stage, get_model_spec
from swarm.peer.gradient_buffers import flat_gradient, set_gradients
from swarm.peer.round_slices import reduce_slice, squared_norms


def step_host_work(model: str, stage: int = 1, num_stages: int = 4, repeats: int = 3) -> dict:
    """Seconds of host work per step for stage `stage` of `num_stages` of `model`, alone and with the slice math."""
    module = build_stage(get_model_spec(model), stage, num_stages, 0)
    for param in module.parameters():
        param.grad = torch.randn_like(param)

    def alone() -> None:
        flat = flat_gradient(module)
        float(flat.norm())
        set_gradients(module, flat)

    def with_slice_math() -> None:
        flat = flat_gradient(module)
        float(flat.norm())
        squared_norms([flat])
        set_gradients(module, torch.cat([reduce_slice([flat], [1.0])]))

    times: dict[str, list[float]] = {"alone": [], "with_slice_math": []}
    for _ in range(repeats):
        for name, work in (("alone", alone), ("with_slice_math", with_slice_math)):
            start = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - start)
    return {
        "model": model,
        "stage": stage,
        "parameters_m": round(sum(p.numel() for p in module.parameters()) / 1e6, 1),
        "threads": torch.get_num_threads(),
        **{f"{name}_s": round(min(measured), 3) for name, measured in times.items()},
    }
