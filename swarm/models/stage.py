"""A pipeline stage of any model family, built from its spec, or from a published checkpoint."""

from __future__ import annotations

from swarm.models.gpt import GPTStage
from swarm.models.gpt import build_stage as build_gpt_stage
from swarm.models.hf_checkpoint import load_stage
from swarm.models.llama import LlamaStage, build_llama_stage
from swarm.models.registry import ModelSpec

# Every family's stage has the same shape: `enter`, `blocks` (each called as block(hidden, context)), `leave`,
# and the attributes spec, stage, num_stages, is_first, is_last, takes_tokens, num_inputs.
Stage = GPTStage | LlamaStage


def build_stage(spec: ModelSpec, stage: int, num_stages: int, seed: int = 0) -> Stage:
    """Builds a stage of `spec`'s family with initial parameters that depend only on (spec, stage, num_stages,
    seed), so every replica of a stage, and a one-process reference, starts identical."""
    if spec.family == "llama":
        return build_llama_stage(spec, stage, num_stages, seed)
    return build_gpt_stage(spec, stage, num_stages, seed)


def initial_stage(spec: ModelSpec, stage: int, num_stages: int, seed: int, hf_checkpoint: str | None) -> Stage:
    """The stage a peer starts from: `hf_checkpoint`'s weights for it if given (a Hugging Face Llama folder,
    whose model `spec` must be), else a fresh one from the seed. Raises CheckpointError if the folder is unusable."""
    if hf_checkpoint is None:
        return build_stage(spec, stage, num_stages, seed)
    return load_stage(hf_checkpoint, stage, num_stages, spec)


def compile_blocks(module: Stage) -> Stage:
    """Compiles each of the stage's blocks with torch.compile (in place; returns the module).

    Blocks, not the whole stage: they are where the time goes, every block of a stage has one shape (one
    compiled graph serves them all), and the stage's ends stay plain Python (its checks, the loss)."""
    for block in module.blocks:
        block.compile()
    return module
