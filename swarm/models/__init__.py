"""Model specs and their partition into pipeline stages."""

from swarm.models.gpt import GPTStage, build_stage, partition_layers
from swarm.models.registry import BYTE_VOCAB_SIZE, EOD_TOKEN, MODELS, ModelSpec, get_model_spec

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOD_TOKEN",
    "MODELS",
    "GPTStage",
    "ModelSpec",
    "build_stage",
    "get_model_spec",
    "partition_layers",
]
