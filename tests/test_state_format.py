"""A stage's state format: checkpoints other tools open, the wire's unchanged order, clear errors on bad files."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer
from swarm.peer.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, restore, save_checkpoint
from swarm.peer.stage_state import StageStateError, state_tensors
from swarm.peer.standby_copy import Standby
from swarm.peer.state_file import read_state_file, write_state_file, write_tensor_list


def stepped_stage(stage: int = 1, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A gpt-tiny stage of 3 whose AdamW has stepped twice, so every kind of state is there."""
    module = build_stage(get_model_spec("gpt-tiny"), stage, 3, seed=seed)
    optimizer = build_optimizer(module, OptimizerSettings())
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for param in module.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        apply_accumulated_step(module, optimizer, 4)
    return module, optimizer


def fresh_stage(stage: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module = build_stage(get_model_spec("gpt-tiny"), stage, 3, seed=7)  # another seed: every value must come in
    return module, build_optimizer(module, OptimizerSettings())


def assert_same_state(
    a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]
):
    (left, has_left), (right, has_right) = state_tensors(*a), state_tensors(*b)
    assert has_left and has_right and len(left) == len(right)
    for index, (x, y) in enumerate(zip(left, right)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"state tensor {index} differs"


READER = """
import json, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

with safe_open(sys.argv[1], framework="numpy") as file:
    metadata = file.metadata()
arrays = load_file(sys.argv[1])
assert not any(name == "swarm" or name.startswith("swarm.") for name in sys.modules), "swarm was imported"
np.savez(sys.argv[2], **arrays)
print(json.dumps(metadata))
"""


def test_checkpoint_opens_with_safetensors_alone(tmp_path):
    module, optimizer = stepped_stage()
    path = save_checkpoint(tmp_path / "checkpoints", "gpt-tiny", module, optimizer, step=2, samples_stepped=8)
    assert path.name == "gpt-tiny-stage1-of-3.safetensors"
    out = tmp_path / "arrays.npz"
    reader = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READER), str(path), str(out)], capture_output=True, text=True, timeout=60
    )
    assert reader.returncode == 0, reader.stderr
    metadata = json.loads(reader.stdout)
    assert (metadata["model"], metadata["stage"], metadata["num_stages"], metadata["step"]) == (
        "gpt-tiny",
        "1",
        "3",
        "2",
    )
    arrays = np.load(out)
    for name, param in module.named_parameters():
        assert np.array_equal(arrays[f"param.{name}"], param.detach().numpy()), name
        state = optimizer.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(arrays[f"{key}.{name}"], state[key].numpy()), f"{key}.{name}"
        assert float(arrays[f"step.{name}"]) == float(state["step"]) == 2.0
    assert len(arrays.files) == 4 * len(list(module.parameters()))


def test_checkpoint_resumes_exactly(tmp_path):
    stepped = stepped_stage()
    save_checkpoint(tmp_path, "gpt-tiny", *stepped, step=2, samples_stepped=8)
    checkpoint = load_checkpoint(tmp_path, "gpt-tiny", 1, 3)
    assert (checkpoint.step, checkpoint.samples_stepped) == (2, 8)
    resumed = fresh_stage()
    restore(checkpoint, *resumed)
    assert_same_state(stepped, resumed)
    assert resumed[1].state_dict()["param_groups"] == stepped[1].state_dict()["param_groups"]
    assert resumed[1].param_groups[0]["betas"] == stepped[1].param_groups[0]["betas"]


def test_wire_order_is_unchanged():
    """Parameters in module order, then every exp_avg, every exp_avg_sq, every step count, as old peers expect."""
    module, optimizer = stepped_stage()
    params = list(module.parameters())
    states = [optimizer.state[p] for p in params]
    expected = [p.detach() for p in params]
    expected += [s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states]
    expected += [torch.as_tensor(s["step"], dtype=torch.float32) for s in states]
    tensors, has_optimizer_state = state_tensors(module, optimizer)
    assert has_optimizer_state and len(tensors) == len(expected)
    for index, (got, want) in enumerate(zip(tensors, expected)):
        assert got.dtype == want.dtype and torch.equal(got, want), f"wire tensor {index}"
        assert got.data_ptr() != want.data_ptr()  # copies: the runtime goes on stepping while they travel
    fresh = build_stage(get_model_spec("gpt-tiny"), 1, 3, seed=0)
    tensors, has_optimizer_state = state_tensors(fresh, build_optimizer(fresh, OptimizerSettings()))
    assert not has_optimizer_state and len(tensors) == len(list(fresh.parameters()))  # before the first step


def test_old_pt_checkpoint_is_resumed_once(tmp_path, caplog):
    stepped = stepped_stage()
    module, optimizer = stepped
    legacy = tmp_path / "gpt-tiny-stage1-of-3.pt"
    payload = {
        "model": "gpt-tiny",
        "stage": 1,
        "num_stages": 3,
        "step": 2,
        "parameters": {name: t.detach().cpu() for name, t in module.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "samples_stepped": 8,
    }
    torch.save(payload, legacy)  # as the versions before safetensors wrote them
    assert checkpoint_path(tmp_path, "gpt-tiny", 1, 3) == legacy  # so `--stage auto` still finds it
    with caplog.at_level(logging.INFO, logger="swarm.peer.checkpoint"):
        checkpoint = load_checkpoint(tmp_path, "gpt-tiny", 1, 3)
        resumed = fresh_stage()
        restore(checkpoint, *resumed)
        assert_same_state(stepped, resumed)
        assert "older torch format" in caplog.text
        path = save_checkpoint(tmp_path, "gpt-tiny", *resumed, step=2, samples_stepped=8)
        assert "Replaced the older checkpoint" in caplog.text
    assert not legacy.exists() and path.suffix == ".safetensors"
    assert checkpoint_path(tmp_path, "gpt-tiny", 1, 3) == path
    assert load_checkpoint(tmp_path, "gpt-tiny", 1, 3).step == 2


def damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "torn":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00" * 64 + data[64:])
    elif how == "foreign":  # a valid safetensors file that some other tool wrote
        from safetensors.torch import save_file

        save_file({"weight": torch.zeros(2)}, str(path))
    elif how == "no metadata":
        tensors, _ = read_state_file(path)
        write_state_file(path, tensors, {})


@pytest.mark.parametrize("how", ["torn", "empty", "garbage", "foreign", "no metadata"])
def test_bad_checkpoint_is_one_clear_error(tmp_path, how):
    path = save_checkpoint(tmp_path, "gpt-tiny", *stepped_stage(), step=2)
    damage(path, how)
    with pytest.raises(CheckpointError, match="move it away to start fresh") as error:
        load_checkpoint(tmp_path, "gpt-tiny", 1, 3)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_checkpoint_with_misshapen_optimizer_state_is_one_clear_error(tmp_path):
    module, optimizer = stepped_stage()
    path = save_checkpoint(tmp_path, "gpt-tiny", module, optimizer, step=2)
    tensors, metadata = read_state_file(path)
    name = next(name for name, _ in module.named_parameters())
    tensors[f"exp_avg.{name}"] = torch.zeros(3)
    write_state_file(path, tensors, metadata)
    resumed = fresh_stage()
    with pytest.raises(CheckpointError, match="does not fit this model") as error:
        restore(load_checkpoint(tmp_path, "gpt-tiny", 1, 3), *resumed)
    assert "exp_avg" in str(error.value) and "\n" not in str(error.value)


def test_standby_spill_round_trip_and_bad_spill(tmp_path):
    stepped = stepped_stage()
    tensors, has_optimizer_state = state_tensors(*stepped)
    path = tmp_path / "standby" / "standby-gpt-tiny-stage1-of-3.safetensors"
    write_tensor_list(path, tensors)  # as a keeper spills a copy past --standby-memory-mb
    copy = Standby(1, 2, 8, has_optimizer_state, "fingerprint", 0, path=path)
    loaded = copy.load()
    assert len(loaded) == len(tensors) and all(torch.equal(a, b) for a, b in zip(loaded, tensors))
    resumed = fresh_stage()
    copy.apply(*resumed)
    assert_same_state(stepped, resumed)
    assert not list(path.parent.glob("*.tmp"))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(StageStateError, match="--checkpoint-dir") as error:
        copy.load()
    assert "stage 1" in str(error.value) and "\n" not in str(error.value)
