"""Llama-style stages: the same logits as Hugging Face's own model when loaded from its checkpoint, split any
way; the same model whole or cut; training; clear errors for a broken checkpoint folder; a swarm fine-tuning one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarm.config import ConfigError, PeerConfig, TrainerConfig, load_config
from swarm.models import LlamaStage, build_stage, get_model_spec, initial_stage, partition_layers
from swarm.models.hf_checkpoint import CheckpointError, load_stage, read_spec
from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer

try:
    import transformers
except ImportError:  # the hf extra is not installed: the tests that write a checkpoint skip
    transformers = None
needs_transformers = pytest.mark.skipif(
    transformers is None, reason="writing a Hugging Face checkpoint needs transformers: pip install -e '.[hf]'"
)

VOCAB = 300  # above the 257 byte ids, so a byte corpus also fits


def write_checkpoint(folder: Path, tied: bool = False, llama3_rope: bool = False, shard: bool = False) -> Path:
    """A tiny random LlamaForCausalLM saved with save_pretrained: 3 layers, grouped-query attention (4 heads
    sharing 2 key/value heads); norms drawn away from one, so a misplaced one shows."""
    rope = {"rope_type": "default", "rope_theta": 5000.0}
    if llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        initializer_range=0.1,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "1GB")
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def staged_logits(stages: list[LlamaStage], tokens: torch.Tensor) -> torch.Tensor:
    hidden = tokens
    with torch.no_grad():
        for stage in stages:
            hidden = stage(hidden)
        return stages[-1].logits(hidden)


@needs_transformers
@pytest.mark.parametrize(
    "variant",
    [{}, {"tied": True, "llama3_rope": True, "shard": True}],
    ids=["plain", "tied-llama3-sharded"],
)
def test_checkpoint_split_any_way_gives_transformers_logits(tmp_path, variant):
    folder = write_checkpoint(tmp_path / "tiny-llama", **variant)
    if variant.get("shard"):
        assert (folder / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(folder, tokens)
    spec = read_spec(folder)
    assert (spec.family, spec.n_layer, spec.n_head, spec.n_kv_head, spec.vocab_size) == ("llama", 3, 4, 2, VOCAB)
    for num_stages in (1, 2, 3):
        stages = [load_stage(folder, k, num_stages) for k in range(num_stages)]
        torch.testing.assert_close(staged_logits(stages, tokens), expected, rtol=1e-5, atol=1e-5)


@needs_transformers
def test_stage_reads_only_its_tensors(tmp_path, monkeypatch):
    folder = write_checkpoint(tmp_path / "tiny-llama", shard=True)
    read = []
    import swarm.models.hf_checkpoint as hf_checkpoint

    original = hf_checkpoint._copy_tensor
    monkeypatch.setattr(hf_checkpoint, "_copy_tensor", lambda h, name, *a: read.append(name) or original(h, name, *a))
    load_stage(folder, 1, 3)
    assert read and all(name.startswith("model.layers.1.") for name in read), read


def split_state(whole: LlamaStage, stage: int, num_stages: int) -> dict[str, torch.Tensor]:
    """The parameters of `stage` of `num_stages`, taken from the one-stage model `whole`."""
    first = partition_layers(whole.spec.n_layer, num_stages)[stage].start
    state = {}
    for name, tensor in whole.state_dict().items():
        if name.startswith("blocks."):
            index, rest = name.removeprefix("blocks.").split(".", 1)
            name = f"blocks.{int(index) - first}.{rest}"
        state[name] = tensor
    module = LlamaStage(whole.spec, stage, num_stages)
    return {name: state[name] for name in module.state_dict()}


def test_whole_model_equals_its_stages_composed():
    spec = get_model_spec("llama-tiny")
    whole = build_stage(spec, 0, 1, seed=5)
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_len), generator=torch.Generator().manual_seed(2))
    targets = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        expected_loss, expected_hidden = whole(tokens, targets), whole(tokens)
    for num_stages in (2, 3, 6):
        stages = []
        for k in range(num_stages):
            stage = LlamaStage(spec, k, num_stages)
            stage.load_state_dict(split_state(whole, k, num_stages))
            stages.append(stage)
        hidden = tokens
        with torch.no_grad():
            for stage in stages[:-1]:
                hidden = stage(hidden)
            assert torch.equal(stages[-1](hidden), expected_hidden)
            assert torch.equal(stages[-1](hidden, targets), expected_loss)
            # the three parts a runtime may run apart compose to forward
            hidden_in, context = stages[-1].enter(hidden)
            for block in stages[-1].blocks:
                hidden_in = block(hidden_in, context)
            assert torch.equal(stages[-1].leave(hidden_in, targets, context), expected_loss)


@needs_transformers
def test_loaded_checkpoint_equals_itself_split(tmp_path):
    folder = write_checkpoint(tmp_path / "tiny-llama", tied=True)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    whole = staged_logits([load_stage(folder, 0, 1)], tokens)
    for num_stages in (2, 3):
        assert torch.equal(staged_logits([load_stage(folder, k, num_stages) for k in range(num_stages)], tokens), whole)


def test_build_is_deterministic_and_the_stage_has_the_gpt_shape():
    spec = get_model_spec("llama-tiny")
    a, b = build_stage(spec, 1, 3, seed=2), build_stage(spec, 1, 3, seed=2)
    assert isinstance(a, LlamaStage) and a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.blocks[0].mlp.up_proj.weight, build_stage(spec, 1, 3, seed=3).blocks[0].mlp.up_proj.weight)
    assert (a.stage, a.num_stages, a.is_first, a.is_last) == (1, 3, False, False)
    assert (a.takes_tokens, a.num_inputs) == (False, 1)
    whole = sum(p.numel() for k in range(3) for p in build_stage(spec, k, 3).parameters())
    assert whole == spec.num_parameters(3) == spec.num_parameters()
    assert "inv_freq" not in a.state_dict()  # follows from the spec, like GPTStage's fixed embeddings


def test_llama_stages_train():
    spec = get_model_spec("llama-tiny")
    stages = [build_stage(spec, k, 2, seed=0) for k in range(2)]
    optimizers = [build_optimizer(stage, OptimizerSettings(lr=3e-3)) for stage in stages]
    tokens = torch.randint(0, 64, (8, spec.seq_len + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        per_sample = stages[1](stages[0](tokens[:, :-1]), tokens[:, 1:])
        assert per_sample.shape == (8,)
        per_sample.sum().backward()
        losses.append(float(per_sample.detach().mean()))
        for stage, optimizer in zip(stages, optimizers):
            apply_accumulated_step(stage, optimizer, 8)
    assert losses[-1] < losses[0] - 0.3, losses


def test_spec_checks():
    spec = get_model_spec("llama-tiny")
    assert spec.kv_heads == 2 and get_model_spec("gpt-tiny").family == "gpt"
    for bad in ({"n_kv_head": 3}, {"ffn_hidden": 0}, {"bottleneck": 16}, {"family": "rwkv"}):
        with pytest.raises(ValueError):
            get_model_spec("llama-tiny", **bad)
    with pytest.raises(ValueError, match="llama family"):
        get_model_spec("gpt-tiny", n_kv_head=2)
    assert get_model_spec("llama-1.1b").num_parameters() == 1_100_048_384  # TinyLlama-1.1B's count


def rewrite_weights(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


@needs_transformers
def test_broken_folders_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="is not a folder"):
        read_spec(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_spec(tmp_path / "empty")
    folder = write_checkpoint(tmp_path / "tiny-llama")
    config = json.loads((folder / "config.json").read_text())

    def with_config(**changes) -> Path:
        other = tmp_path / f"changed-{len(list(tmp_path.iterdir()))}"
        other.mkdir()
        (other / "config.json").write_text(json.dumps({**config, **changes}))
        return other

    with pytest.raises(CheckpointError, match="model_type is 'gpt2'"):
        read_spec(with_config(model_type="gpt2"))
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        read_spec(with_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        read_spec(with_config(hidden_act="gelu"))
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        read_spec(tmp_path / "garbled")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_stage(with_config(), 0, 1)

    rewrite_weights(folder, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    load_stage(folder, 0, 2)  # stage 0 of 2 holds layers 0 and 1: it needs nothing that is missing
    with pytest.raises(CheckpointError, match=r"lacks tensors that stage 1 of 2 needs: model.layers.2.mlp.up_proj"):
        load_stage(folder, 1, 2)
    rewrite_weights(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(72, 31)}))
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.up_proj.weight is \[72, 31\], but .* \[72, 32\]"):
        load_stage(folder, 1, 2)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        load_stage(folder, 1, 2)


@needs_transformers
def test_settings_take_the_checkpoints_model(tmp_path):
    folder = write_checkpoint(tmp_path / "tiny-llama")
    peer = load_config(PeerConfig, {"hf_checkpoint": str(folder), "num_stages": 2})
    assert peer.model == "hf:tiny-llama" and peer.model_spec() == read_spec(folder)
    stage = initial_stage(peer.model_spec(), 1, 2, 0, peer.hf_checkpoint)
    assert torch.equal(stage.lm_head.weight, load_file(folder / "model.safetensors")["lm_head.weight"])
    named = load_config(PeerConfig, {"hf_checkpoint": str(folder), "model": "hf:our-run", "num_stages": 2})
    assert named.model == named.model_spec().name == "hf:our-run"  # where folders' names differ between machines
    initial_stage(named.model_spec(), 0, 2, 0, named.hf_checkpoint)
    with pytest.raises(ConfigError, match="checkpoint's model knows 300 ids"):
        load_config(PeerConfig, {"hf_checkpoint": str(folder), "vocab_size": 257})
    with pytest.raises(ConfigError, match="--num-stages must be within 1..3"):
        load_config(PeerConfig, {"hf_checkpoint": str(folder), "num_stages": 4})
    with pytest.raises(ConfigError, match="not on bytes: give --tokenizer"):
        load_config(TrainerConfig, {"hf_checkpoint": str(folder)})
    with pytest.raises(ConfigError, match="--hf-checkpoint: .*config.json is missing"):
        load_config(PeerConfig, {"hf_checkpoint": str(tmp_path)})
    with pytest.raises(ConfigError, match="give its folder with --hf-checkpoint"):
        load_config(PeerConfig, {"model": "hf:tiny-llama"})


def write_tokenizer(folder: Path, text_file: str) -> None:
    """A byte-level BPE tokenizer of fewer than VOCAB ids, trained on `text_file`, as the folder's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 20, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([text_file], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))


@needs_transformers
@pytest.mark.timeout(180)
def test_swarm_fine_tunes_a_checkpoint_as_one_process_does(local_swarm, tmp_path):
    pytest.importorskip("tokenizers", reason="the trainer's --tokenizer needs tokenizers (the hf extra)")
    from conftest import LR, MICRO, SMALL_CORPUS, TARGET, assert_matches_reference

    from swarm.peer.checkpoint import load_checkpoint
    from swarm.trainer.data import load_corpus
    from swarm.trainer.reference import train_reference

    folder = write_checkpoint(tmp_path / "tiny-llama")
    write_tokenizer(folder, SMALL_CORPUS)
    steps, checkpoints, summary_file = 3, tmp_path / "checkpoints", tmp_path / "summary.json"
    model = ["--hf-checkpoint", str(folder), "--num-stages", "2", "--seed", "7"]
    local_swarm.start_bootstrap()
    for stage in range(2):
        flags = [*model, "--target-batch-size", str(TARGET), "--lr", str(LR), "--checkpoint-dir", str(checkpoints)]
        local_swarm.start_peer(f"peer{stage}", stage, [*flags, "--announce-period", "0.5"])
    trainer = local_swarm.start_trainer(
        "trainer",
        [*model, "--tokenizer", str(folder), "--data", SMALL_CORPUS, "--steps", str(steps)]
        + ["--microbatch-size", str(MICRO), "--max-in-flight", "3", "--compression", "none", "--no-progress"]
        + ["--summary-file", str(summary_file)],
    )
    assert trainer.wait(150) == 0, (local_swarm.workdir / "trainer.log").read_text()
    for stage in range(2):
        assert local_swarm.stop(f"peer{stage}") == 0  # a clean exit saves the checkpoint

    corpus = load_corpus(SMALL_CORPUS, tokenizer=str(folder))
    spec = read_spec(folder)
    reference = train_reference(spec, 2, corpus, steps, TARGET, MICRO, OptimizerSettings(lr=LR), 7, str(folder))
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    assert reference.losses[0] < 6.0  # the checkpoint's weights, not a fresh model: ln(300) = 5.7 at random
    for stage, module in enumerate(reference.stages):
        checkpoint = load_checkpoint(checkpoints, "hf:tiny-llama", stage, 2)
        assert checkpoint is not None and checkpoint.step == steps
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}")


def test_the_demo_gives_every_role_the_checkpoint_not_a_vocabulary():
    from swarm.config import DemoConfig
    from swarm.launch.demo import role_flags

    peer_flags, trainer_flags = role_flags(DemoConfig(hf_checkpoint="ckpt/llama"), 257, "summary.json")
    for flags in (peer_flags, trainer_flags):
        assert flags[flags.index("--hf-checkpoint") + 1] == "ckpt/llama" and "--vocab-size" not in flags
