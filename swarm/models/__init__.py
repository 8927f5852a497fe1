"""Model specs and their partition into pipeline stages."""

from swarm.models.gpt import GPTStage, partition_layers
from swarm.models.llama import LlamaStage
from swarm.models.registry import BYTE_VOCAB_SIZE, EOD_TOKEN, MODELS, ModelSpec, get_model_spec
from swarm.models.stage import Stage, build_stage, compile_blocks, initial_stage

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOD_TOKEN",
    "MODELS",
    "GPTStage",
    "LlamaStage",
    "ModelSpec",
    "Stage",
    "build_stage",
    "compile_blocks",
    "get_model_spec",
    "initial_stage",
    "partition_layers",
]
