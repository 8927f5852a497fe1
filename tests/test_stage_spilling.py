"""Stage spilling (--offload): a stage whose blocks live in host memory trains exactly as one in memory.

Every comparison is torch.equal: the spilled stage runs the same operations on the same device in the same
order (a group recomputed from its saved input repeats its forward bit for bit, and a parameter used once gets
the same gradient from its group's backward as from the whole stage's), so nothing may differ at all.
"""

from __future__ import annotations

import gc
import json
import weakref
from dataclasses import replace

import pytest
import torch
from conftest import assert_matches_reference, peer_flags, reference_run, trainer_flags

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer
from swarm.peer.checkpoint import load_checkpoint, restore, save_checkpoint
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_spilling import DeviceCopier, block_bytes, default_group_size
from swarm.peer.stage_state import load_state_tensors, state_tensors

MODELS = ["gpt-tiny", "gpt-tiny-bottleneck", "gpt-tiny-subspace", "llama-tiny"]
STAGES = 3
BATCH, SEQ = 3, 16


def nine_layers(model: str):
    """The model with 9 blocks: 3 a stage, so a stage streams 3 groups of 1 (or 2 groups, 2 and 1)."""
    return replace(get_model_spec(model), n_layer=9)


def make_runtime(
    spec, stage: int, offload: bool, group: int = 0, target: int = 1000, device: str = "cpu", **kwargs
) -> StageRuntime:
    """A runtime of one stage, built alike every time (the seed), spilling its blocks if `offload`."""
    module = build_stage(spec, stage, STAGES, seed=7)
    optimizer = build_optimizer(module, OptimizerSettings(lr=1e-2))
    return StageRuntime(module, optimizer, target, device=device, offload=offload, offload_group=group, **kwargs)


def runtime_pair(spec, stage: int, group: int, target: int = 1000, **kwargs) -> tuple[StageRuntime, StageRuntime]:
    """Two runtimes of one stage, alike but for --offload; the second one spills its blocks."""
    return tuple(make_runtime(spec, stage, offload, group, target, **kwargs) for offload in (False, True))


def request(spec, stage: int, seed: int, batch: int = BATCH, device: str = "cpu") -> list[torch.Tensor]:
    """A backward request's tensors: the stage's inputs, then its output gradient (or targets on the last)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (batch, SEQ), generator=g)
    first = tokens if stage == 0 else torch.randn(batch, SEQ, spec.boundary_width, generator=g)
    inputs = [first, tokens] if spec.later_stages_take_tokens and stage > 0 else [first]
    if stage == STAGES - 1:
        extra = torch.randint(0, spec.vocab_size, (batch, SEQ), generator=g)
    else:
        extra = torch.randn(batch, SEQ, spec.boundary_width, generator=g)
    return [t.to(device) for t in (*inputs, extra)]


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.device == b.device or b.device.type == "cpu", what
        assert torch.equal(a, b.to(a.device)), f"{what}: differs by {(a - b.to(a.device)).abs().max()}"


def assert_same_parameters(memory: StageRuntime, spilled: StageRuntime, grads: bool = True) -> None:
    for (name, p), q in zip(memory.module.named_parameters(), spilled.module.parameters()):
        assert_same(p.detach(), q.detach(), name)
        if grads:
            assert_same(p.grad, q.grad, f"{name}.grad")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("group", [1, 2])
def test_spilled_stage_computes_what_the_stage_in_memory_does(model, stage, group):
    spec = nine_layers(model)
    memory, spilled = runtime_pair(spec, stage, group)
    assert len(spilled.spilling.groups) == (3 if group == 1 else 2)
    assert all(p.device.type == "cpu" for p in spilled.spilling.spilled)
    for step in range(3):
        for micro in range(2):  # two microbatches accumulate before each step
            tensors = request(spec, stage, seed=10 * step + micro)
            split = memory.module.num_inputs
            with torch.inference_mode():
                assert_same(memory._stage_forward(tensors[:split]), spilled._stage_forward(tensors[:split]), "output")
            for accumulate in (True, False):  # a backward a stage-mate holds: its input gradient only
                ours, theirs = memory._backward(tensors, accumulate), spilled._backward(tensors, accumulate)
                assert_same(ours[0], theirs[0], f"input gradient (accumulate={accumulate})")
                assert_same(ours[1], theirs[1], "losses")
                assert_same_parameters(memory, spilled)
        apply_accumulated_step(memory.module, memory.optimizer, 2 * BATCH)
        spilled.spilling.step(spilled.optimizer, 2 * BATCH)
        assert_same_parameters(memory, spilled)
        assert all(p.grad is None for p in spilled.module.parameters())
    for p, q in zip(memory.module.parameters(), spilled.module.parameters()):  # the optimizer state too
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_same(memory.optimizer.state[p][key], spilled.optimizer.state[q][key], key)


@pytest.mark.parametrize("model", ["gpt-tiny-subspace", "llama-tiny"])
def test_spilling_is_exact_under_bfloat16_autocast_too(model):
    # the groups recomputed in the backward run under the autocast their forward ran under
    spec = nine_layers(model)
    for stage in range(STAGES):
        memory, spilled = runtime_pair(spec, stage, group=1, dtype=torch.bfloat16)
        for seed in range(2):
            tensors = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in request(spec, stage, seed)]
            split = memory.module.num_inputs
            with torch.inference_mode():
                assert_same(memory._stage_forward(tensors[:split]), spilled._stage_forward(tensors[:split]), "output")
            ours, theirs = memory._backward(tensors), spilled._backward(tensors)
            assert_same(ours[0], theirs[0], "input gradient")
            assert_same(ours[1], theirs[1], "losses")
            assert_same_parameters(memory, spilled)


@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-tiny-subspace"])
def test_an_offloaded_runtime_trains_like_one_in_memory(model):
    spec = nine_layers(model)
    for stage in (0, 2):
        # batches of two requests (4 samples): two batches a step, three steps
        # by samples alone: on a loaded machine a limit by seconds of work mixed batches of 2 and 4 samples, and a
        # batch crossing the step boundary (4 + 2 + 4) left the run a step short
        batching = {"max_batch_samples": 4, "max_batch_seconds": 0}
        memory, spilled = runtime_pair(spec, stage, group=1, target=8, **batching)
        # the first pass of a fresh process may round differently from every later one (on an AVX-512 host,
        # gpt-tiny-subspace's first runtime, in memory or spilled, ended elsewhere than the second): a pass
        # of a third runtime first, so that the two compared run alike
        warm_up = make_runtime(spec, stage, False, 1, 8, **batching)
        replies = {}
        for runtime in (warm_up, memory, spilled):
            # queued before the worker starts, so that it merges them into batches (one pass of loads each)
            futures = [runtime.submit(True, request(spec, stage, seed, batch=2)) for seed in range(12)]
            runtime.start()
            replies[id(runtime)] = [f.result(60) for f in futures]
            runtime.shutdown()
        assert memory.step == spilled.step == 3
        assert memory.fingerprint == spilled.fingerprint
        for ours, theirs in zip(replies[id(memory)], replies[id(spilled)]):
            assert ours.step == theirs.step
            for a, b in zip(ours.tensors, theirs.tensors):
                assert_same(a, b, "reply")
            assert_same(ours.losses, theirs.losses, "losses")
        assert_same_parameters(memory, spilled)


def test_state_and_checkpoints_of_an_offloaded_stage(tmp_path):
    spec = nine_layers("gpt-tiny")
    memory, spilled = runtime_pair(spec, 1, group=1, target=6)
    for runtime in (memory, spilled):
        runtime.start()
        for seed in range(4):
            runtime.submit(True, request(spec, 1, seed)).result(60)
        runtime.shutdown()
    assert spilled.step == 2 and spilled.fingerprint == memory.fingerprint
    tensors, has_optimizer_state = state_tensors(spilled.module, spilled.optimizer)
    assert has_optimizer_state
    assert all(torch.equal(a, b) for a, b in zip(tensors, state_tensors(memory.module, memory.optimizer)[0]))
    # a joining offloaded peer takes the state, and a restarted one its checkpoint: both train on alike
    joined, resumed = make_runtime(spec, 1, True, group=2, target=6), make_runtime(spec, 1, True, group=1, target=6)
    load_state_tensors(joined.module, joined.optimizer, tensors, has_optimizer_state)
    save_checkpoint(tmp_path, "nine", spilled.module, spilled.optimizer, spilled.step)
    restore(load_checkpoint(tmp_path, "nine", 1, STAGES), resumed.module, resumed.optimizer)
    for runtime in (memory, joined, resumed):  # one more step each, on this thread
        for seed in (10, 11):
            runtime._backward(request(spec, 1, seed))
        runtime.samples_accumulated = 2 * BATCH
        runtime._average_and_step(runtime.step)
        runtime.settle_fingerprint()  # hashed off the runtime thread: known once settled
    assert memory.fingerprint == joined.fingerprint == resumed.fingerprint


class DeviceModel(DeviceCopier):
    """A CPU copier that models a GPU's memory: a loaded list holds device memory until it is dropped and the
    host has waited for an event recorded after that (the device may still be working on it before)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.loaded: list[weakref.ref] = []  # the first tensor of each list loaded, in load order
        self.done: set[int] = set()  # lists the device is known to be done with
        self.most = 0  # the most lists ever held on the device at once

    def load(self, tensors: list[torch.Tensor]):
        loading = super().load(tensors)
        self.loaded.append(weakref.ref(loading.tensors[0]))
        self.most = max(self.most, len(self.loaded) - len(self.done))
        return loading

    def event(self) -> frozenset[int]:
        # all the work on a list dropped by now is enqueued: the device is done with it once past this event
        return frozenset(index for index, ref in enumerate(self.loaded) if ref() is None)

    def synchronize(self, event: frozenset[int] | None) -> None:
        self.done |= event or set()


@pytest.mark.parametrize("stage", [0, 2])
def test_at_most_two_groups_are_loaded_at_once(stage):
    # the next group loads while one is in use (two at once), never a third: what bounds the device memory,
    # however far the host runs ahead of the device
    spec = nine_layers("gpt-tiny")
    spilled = make_runtime(spec, stage, True, group=1)
    for phase in ("forward", "backward", "step"):
        spilled.spilling.copier = copier = DeviceModel()
        tensors = request(spec, stage, seed=1)
        if phase == "forward":
            with torch.inference_mode():
                spilled._stage_forward(tensors[: spilled.module.num_inputs])
        elif phase == "backward":
            spilled._backward(tensors)
        else:
            spilled.spilling.step(spilled.optimizer, BATCH)
        assert copier.most == 2, (phase, copier.most)


def test_default_groups_fill_a_quarter_of_the_memory():
    spec = nine_layers("gpt-tiny")
    module = build_stage(spec, 1, STAGES)
    per_block = block_bytes(module.blocks[0])
    assert default_group_size(module, torch.device("cpu")) == 3  # on a CPU, nothing is saved by splitting
    assert default_group_size(module, torch.device("cpu"), memory=8 * per_block) == 2
    assert default_group_size(module, torch.device("cpu"), memory=per_block) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stage_four_times_the_memory_cap_trains_on_the_gpu_and_matches():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # a middle stage of 24 blocks of d_model 1024 (50 MB each, 1.2 GB): the cap is a quarter of that, a group
    # one block (two in flight, one's gradients, one's on their way to the host, cuBLAS's workspace: 250 MB)
    spec = replace(get_model_spec("gpt-tiny"), d_model=1024, n_head=8, n_layer=3 * 24, seq_len=SEQ)
    stage, device = 1, torch.device("cuda")
    with sdpa_kernel(SDPBackend.MATH):  # the deterministic attention, so two runs can be compared bit for bit
        memory = make_runtime(spec, stage, False, device="cuda")
        trained = [_train_steps(memory, spec, stage)]
        expected = [p.detach().cpu() for p in memory.module.parameters()]
        blocks = sum(block_bytes(block) for block in memory.module.blocks)
        del memory
        gc.collect()  # a runtime and its queue refer to each other: only a collection frees its device memory
        torch.cuda.empty_cache()
        cap, held = blocks // 4, torch.cuda.memory_allocated(device)  # held: by whatever else lives in this process
        torch.cuda.reset_peak_memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction((held + cap) / total)
        try:
            spilled = make_runtime(spec, stage, True, group=1, device="cuda")
            trained.append(_train_steps(spilled, spec, stage))
            peak = torch.cuda.max_memory_allocated(device) - held
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    assert blocks >= 4 * cap and peak <= cap, (blocks, cap, peak)
    for a, b in zip(*trained):
        assert_same(a, b, "input gradient")
    for a, b in zip(expected, spilled.module.parameters()):
        assert_same(a, b.detach().cpu(), "parameter")


def _train_steps(runtime: StageRuntime, spec, stage: int, steps: int = 2) -> list[torch.Tensor]:
    """Two steps of two microbatches each on this thread; the output gradients each microbatch gave."""
    grads = []
    for step in range(steps):
        for micro in range(2):
            grads.append(runtime._backward(request(spec, stage, 10 * step + micro, device="cuda"))[0].cpu())
        if runtime.spilling is not None:
            runtime.spilling.step(runtime.optimizer, 2 * BATCH)
        else:
            apply_accumulated_step(runtime.module, runtime.optimizer, 2 * BATCH)
    return grads


@pytest.mark.timeout(240)
def test_a_swarm_with_an_offloaded_peer_matches_one_process(local_swarm, tmp_path):
    steps = 3
    checkpoints = tmp_path / "checkpoints"
    local_swarm.start_bootstrap()
    for stage in range(STAGES):
        extra = ("--offload", "--offload-group", "1") if stage == 1 else ()
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(checkpoints, *extra))
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(steps, summary_file))
    assert trainer.wait(180) == 0, (local_swarm.workdir / "trainer.log").read_text()
    for stage in range(STAGES):
        assert local_swarm.stop(f"peer{stage}") == 0
    reference = reference_run(steps)
    losses = json.loads(summary_file.read_text())["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    for stage, module in enumerate(reference.stages):
        checkpoint = load_checkpoint(checkpoints, "gpt-tiny", stage, STAGES)
        assert checkpoint is not None and checkpoint.step == steps
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}")


def test_the_bench_harness_trains_alike_in_memory_and_offloaded():
    from harness.stage_training_speed import stage_training_speed

    spec = nine_layers("gpt-tiny")
    runs = [
        stage_training_speed(spec, "cpu", offload, offload_group=2, microbatch=2, steps=2, seq_len=SEQ)
        for offload in (False, True)
    ]
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"] and runs[0]["losses"] == runs[1]["losses"]
    assert runs[1]["groups"] == [2, 2, 2, 2, 1] and runs[0]["groups"] is None
    assert all(run["samples_per_second"] > 0 and len(run["losses"]) == 2 for run in runs)
