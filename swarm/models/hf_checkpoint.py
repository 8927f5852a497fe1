"""A published Hugging Face Llama checkpoint, from a local folder, as a spec and as the weights of one stage.

The folder holds what `save_pretrained` writes: config.json, and the weights in model.safetensors or in
shards named by model.safetensors.index.json. A peer reads only the tensors of its own stage: the
embedding on stage 0, `model.layers.N.*` on the stage that holds block N, the final norm and the head on
the last stage (the embedding again there where the checkpoint ties the head to it: see swarm.models.llama).
Tensors stored in bfloat16 or float16 are widened to the stage's float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from swarm.models.gpt import partition_layers
from swarm.models.llama import LlamaStage
from swarm.models.registry import ModelSpec

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Samples the swarm trains on are at most this many tokens, however long a context the checkpoint allows
# (Llama 3's 131072 would not fit a microbatch on any one volunteer's device).
MAX_SEQ_LEN = 2048
MODEL_PREFIX = "hf:"
MAX_NAME = 128  # as a stage record allows


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used: a missing or unreadable file, another architecture, a bad tensor."""


def model_name(folder: str | Path) -> str:
    """The name under which a swarm trains the checkpoint's model unless told another: hf:FOLDER_NAME."""
    return (MODEL_PREFIX + Path(folder).resolve().name)[:MAX_NAME]


def read_config(folder: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, as a dict."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise CheckpointError(f"{folder} is not a folder; give the folder that holds the checkpoint's {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: a Hugging Face checkpoint folder holds its {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds no JSON object")
    return config


def _rope(config: dict[str, Any], path: Path) -> tuple[float, tuple[float, float, float, int] | None]:
    """rope_theta and Llama 3's rope scaling, from a config of transformers 5 (`rope_parameters`) or 4."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{path}: a partial rotary embedding (partial_rotary_factor) is not supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope type {kind!r} is not supported (only the plain one and llama3)")
    try:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        factor, low, high, original = (params[key] for key in keys)
    except KeyError as e:
        raise CheckpointError(f"{path}: the llama3 rope scaling lacks {e}") from None
    return theta, (float(factor), float(low), float(high), int(original))


def spec_from_config(config: dict[str, Any], folder: str | Path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a Llama checkpoint's config.json (already read from `folder`), called `name` (default:
    model_name(folder))."""
    path = Path(folder) / CONFIG_FILE
    if config.get("model_type") != "llama":
        raise CheckpointError(
            f"{path}: model_type is {config.get('model_type')!r}; only Llama-style checkpoints (model_type llama) load"
        )
    for key, wanted in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, wanted) != wanted:
            raise CheckpointError(f"{path}: {key} {config[key]!r} is not supported (only {wanted!r})")
    try:
        d_model, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
        sizes = {
            "vocab_size": int(config["vocab_size"]),
            "n_layer": int(config["num_hidden_layers"]),
            "ffn_hidden": int(config["intermediate_size"]),
            "n_kv_head": int(config.get("num_key_value_heads") or n_head),
        }
    except KeyError as e:
        raise CheckpointError(f"{path} lacks {e}, which a Llama config names") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: a size is not a whole number ({e})") from None
    if config.get("head_dim") not in (None, d_model // max(n_head, 1)):
        raise CheckpointError(f"{path}: head_dim {config['head_dim']} is not hidden_size / num_attention_heads")
    theta, scaling = _rope(config, path)
    try:
        return ModelSpec(
            name or model_name(folder),
            seq_len=min(int(config.get("max_position_embeddings", MAX_SEQ_LEN)), MAX_SEQ_LEN),
            d_model=d_model,
            n_head=n_head,
            family="llama",
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            **sizes,
        )
    except (ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{path} describes no model this swarm can build: {e}") from None


def read_spec(folder: str | Path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of the Llama checkpoint in `folder` (only its config.json is read), called `name` (default:
    model_name(folder))."""
    return spec_from_config(read_config(folder), folder, name)


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Where each tensor of the checkpoint is stored: its name -> the safetensors file that holds it."""
    folder = Path(folder)
    index, single = folder / INDEX_FILE, folder / WEIGHTS_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} holds no weight_map of tensor names to files ({e!r})") from None
    if single.is_file():
        with _open(single) as handle:
            return dict.fromkeys(handle.keys(), single)
    other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    hint = f" (it holds {', '.join(other)}: save the model again with safe_serialization)" if other else ""
    raise CheckpointError(f"{folder} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path} cannot be read as safetensors: {e}") from None


def stage_tensor_names(spec: ModelSpec, stage: int, num_stages: int, tied: bool) -> dict[str, str]:
    """The checkpoint's name of each of a stage's parameters: the stage's name -> the checkpoint's."""
    names = {}
    if stage == 0:
        names["embed_tokens.weight"] = "model.embed_tokens.weight"
    parts = (
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
    for i, layer in enumerate(partition_layers(spec.n_layer, num_stages, spec.stage_blocks)[stage]):
        names.update({f"blocks.{i}.{part}": f"model.layers.{layer}.{part}" for part in parts})
    if stage == num_stages - 1:
        names["norm.weight"] = "model.norm.weight"
        names["lm_head.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return names


def load_stage(folder: str | Path, stage: int, num_stages: int, spec: ModelSpec | None = None) -> LlamaStage:
    """Stage `stage` of `num_stages` of the checkpoint in `folder`, with its weights (and no others) read in.

    `spec`, if given (a peer's, from its settings), must be the checkpoint's own, whatever its name.
    """
    config = read_config(folder)
    own = spec_from_config(config, folder, spec.name if spec is not None else None)
    if spec is not None and spec != own:
        raise CheckpointError(f"{Path(folder) / CONFIG_FILE} describes {own}, not the model {spec}")
    module = LlamaStage(own, stage, num_stages)
    files = weight_files(folder)
    tied = bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in files
    names = stage_tensor_names(own, stage, num_stages, tied)
    missing = sorted(theirs for theirs in names.values() if theirs not in files)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{folder} lacks tensors that stage {stage} of {num_stages} needs: {shown}")
    params = dict(module.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append(ours)
    with torch.no_grad():
        for path, ours_in_file in by_file.items():
            with _open(path) as handle:
                for ours in ours_in_file:
                    _copy_tensor(handle, names[ours], path, params[ours])
    return module


def _copy_tensor(handle: Any, name: str, path: Path, param: torch.nn.Parameter) -> None:
    try:
        tensor = handle.get_tensor(name)
    except (SafetensorError, KeyError) as e:
        raise CheckpointError(f"{path}: tensor {name} cannot be read ({e})") from None
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(
            f"{path}: tensor {name} is {list(tensor.shape)}, but config.json's model needs {list(param.shape)}"
        )
    if not tensor.is_floating_point():
        raise CheckpointError(f"{path}: tensor {name} holds {tensor.dtype}, not floating-point weights")
    param.copy_(tensor)
