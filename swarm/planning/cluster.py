"""What a plan is made for: the model's costs per layer, the peers, the trainers and the links between them.

Everything here is plain data, read from a cluster file (JSON or YAML) or built by the benchmarks.
Units are SI: flops, bytes, seconds. Speeds are what peers measure (a peer's samples/s on its stage,
times the stage's flops per sample, is its flops/s); bandwidths and round trips are what trainers
measure of their links (`swarm.compression.link_choice.LinkEstimator`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from swarm.compression.link_choice import CodecProfile
from swarm.models.registry import ModelSpec, get_model_spec

FLOAT_BYTES = 4  # boundary tensors travel as float32 before their codec
TOKEN_BYTES = 8  # token ids (int64)
STATE_BYTES_PER_PARAM = 16  # parameter, gradient and Adam's two moments, float32
# a backward call recomputes its forward with grad enabled (stateless serving), then backpropagates:
# one forward's flops for the forward call, three more for the backward call
FLOPS_PER_FORWARD = 4.0
MEBIBIT = 1e6 / 8  # bytes per second in one Mbit/s

# codecs as profiled on one core of the 2-core CPU machine (`profile_codecs` on activation-like values);
# a cluster file may give its own under "codecs"
DEFAULT_CODECS = (
    CodecProfile("none", 1.0, 3.3e-10, 0.0),
    CodecProfile("fp16", 0.5, 1.1e-9, 2.0e-4),
    CodecProfile("bf16", 0.5, 7.5e-10, 1.7e-3),
    CodecProfile("8bit", 0.266, 4.4e-9, 6.7e-3),
    CodecProfile("4bit", 0.141, 4.0e-9, 0.114),
)


class ClusterError(ValueError):
    """A cluster description that does not parse or does not add up."""


@dataclass(frozen=True)
class ModelCosts:
    """Per sample: what each block, the embedding and the head cost, and what crosses a cut."""

    n_layer: int
    block_flops: float  # forward flops of one block
    first_flops: float  # the embedding, on the first stage
    last_flops: float  # the head and the loss, on the last stage
    boundary_bytes: float  # hidden states at a cut, float32
    input_bytes: float  # token ids into the first stage (and targets into the last)
    block_state_bytes: float  # one block's parameters with their gradient and optimizer state
    first_state_bytes: float
    last_state_bytes: float
    block_activation_bytes: float  # what one block keeps for its backward, per sample

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelCosts:
        """The costs of a registered model: matrix multiplications and attention scores, as `stage_costs`."""
        d, w, s = spec.d_model, spec.learned_width, spec.seq_len
        if spec.family == "llama":
            kv_width = spec.kv_heads * (d // spec.n_head)
            block_params = 2 * d * d + 2 * d * kv_width + 3 * d * spec.ffn_hidden
        else:
            block_params = (3 + spec.mlp_ratio) * d * d + (1 + spec.mlp_ratio) * d * w
        # 2 flops per multiply-add per token, plus the scores and their weighted sum (2 s^2 d)
        block_flops = 2.0 * s * block_params + 4.0 * s * s * d
        head_params = d * spec.vocab_size
        return cls(
            n_layer=spec.n_layer,
            block_flops=block_flops,
            first_flops=2.0 * s * w,
            last_flops=2.0 * s * head_params,
            boundary_bytes=float(s * spec.boundary_width * FLOAT_BYTES),
            input_bytes=float(s * TOKEN_BYTES),
            block_state_bytes=float(block_params * STATE_BYTES_PER_PARAM),
            first_state_bytes=float((spec.vocab_size + s) * w * STATE_BYTES_PER_PARAM),
            last_state_bytes=float(head_params * STATE_BYTES_PER_PARAM),
            # the activations a block saves in float32: 34 values per token and width, 5 per score
            block_activation_bytes=float(FLOAT_BYTES * (34 * s * d + 5 * spec.n_head * s * s)),
        )

    def stage_flops(self, blocks: int, first: bool, last: bool) -> float:
        """Flops per sample of one forward and backward call pair on a stage of `blocks` blocks."""
        forward = blocks * self.block_flops + first * self.first_flops + last * self.last_flops
        return FLOPS_PER_FORWARD * forward

    def stage_state_bytes(self, blocks: int, first: bool, last: bool) -> float:
        return blocks * self.block_state_bytes + first * self.first_state_bytes + last * self.last_state_bytes

    def stage_memory(self, blocks: int, first: bool, last: bool, microbatch: int) -> float:
        """Bytes a peer needs for a stage: its state, and a microbatch's activations through a backward."""
        return self.stage_state_bytes(blocks, first, last) + microbatch * blocks * self.block_activation_bytes


@dataclass(frozen=True)
class PlanPeer:
    """A device that may host a stage."""

    name: str
    flops: float  # sustained flops/s on this model
    memory: float  # bytes of device memory
    bandwidth: float  # bytes/s of its network link, each way
    region: str = "default"


@dataclass(frozen=True)
class PlanTrainer:
    """A trainer: every stage call of its microbatches goes out from it and comes back to it."""

    name: str
    bandwidth: float  # bytes/s, each way
    region: str = "default"


@dataclass(frozen=True)
class Network:
    """Round trips and bandwidth caps between regions (symmetric); a pair not named gets the defaults."""

    round_trips: dict[tuple[str, str], float] = field(default_factory=dict)  # seconds
    bandwidths: dict[tuple[str, str], float] = field(default_factory=dict)  # bytes/s per link
    same_region_round_trip: float = 0.001
    other_region_round_trip: float = 0.05

    def round_trip(self, a: str, b: str) -> float:
        default = self.same_region_round_trip if a == b else self.other_region_round_trip
        return self.round_trips.get((a, b), self.round_trips.get((b, a), default))

    def bandwidth(self, a: str, b: str) -> float:
        return self.bandwidths.get((a, b), self.bandwidths.get((b, a), float("inf")))


@dataclass(frozen=True)
class Cluster:
    """Everything a plan depends on."""

    model: ModelCosts
    peers: tuple[PlanPeer, ...]
    trainers: tuple[PlanTrainer, ...]
    network: Network = field(default_factory=Network)
    codecs: tuple[CodecProfile, ...] = DEFAULT_CODECS
    max_codec_error: float = 0.01  # as the trainer's --max-codec-error
    call_overhead: float = 0.002  # seconds a peer spends per call beyond its flops (launch, framing)
    target_batch_size: int = 1024  # samples per optimizer step: how often stage-mates average
    max_in_flight: int = 256  # the most microbatches one trainer may keep in flight
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

    def __post_init__(self) -> None:
        if not self.peers or not self.trainers:
            raise ClusterError("a cluster needs at least one peer and one trainer")
        if len({p.name for p in self.peers}) != len(self.peers):
            raise ClusterError("peer names must be unique")
        for p in self.peers:
            if not (p.flops > 0 and p.memory > 0 and p.bandwidth > 0):
                raise ClusterError(f"peer {p.name}: flops, memory and bandwidth must be positive")
        if any(t.bandwidth <= 0 for t in self.trainers):
            raise ClusterError("a trainer's bandwidth must be positive")
        if not self.microbatch_sizes or min(self.microbatch_sizes) < 1:
            raise ClusterError("microbatch sizes must be positive")
        if self.max_in_flight < 1 or self.target_batch_size < 1:
            raise ClusterError("max_in_flight and target_batch_size must be positive")


def read_cluster(path: str | Path) -> Cluster:
    """Reads a cluster file (JSON, or YAML by its suffix); ClusterError says what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ClusterError(f"cannot read the cluster file {path}: {e.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ClusterError(f"{path} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise ClusterError(f"{path}: expected a mapping at the top")
    return cluster_from_dict(data)


def cluster_from_dict(data: dict[str, Any]) -> Cluster:
    """A cluster from a parsed file: its fields are in docs/operating.md, "Planning a swarm"."""
    try:
        return _cluster(data)
    except ClusterError:
        raise
    except KeyError as e:
        raise ClusterError(f"the cluster file lacks the field {e}") from None
    except (TypeError, ValueError) as e:
        raise ClusterError(f"the cluster file has a bad value: {e}") from None


def _cluster(data: dict[str, Any]) -> Cluster:
    spec = get_model_spec(str(data["model"]))
    peers = []
    for i, entry in enumerate(_list(data, "peers")):
        count = int(entry.get("count", 1))
        for k in range(count):
            name = str(entry.get("name", f"peer{i}"))
            peers.append(
                PlanPeer(
                    f"{name}-{k}" if count > 1 else name,
                    float(entry["tflops"]) * 1e12,
                    float(entry["memory_gb"]) * 2**30,
                    float(entry["bandwidth_mbit"]) * MEBIBIT,
                    str(entry.get("region", "default")),
                )
            )
    trainers = [
        PlanTrainer(
            str(t.get("name", f"trainer{i}")), float(t["bandwidth_mbit"]) * MEBIBIT, str(t.get("region", "default"))
        )
        for i, t in enumerate(_list(data, "trainers"))
    ]
    links = data.get("links", [])
    network = Network(
        round_trips={
            (str(x["a"]), str(x["b"])): float(x["round_trip_ms"]) / 1e3 for x in links if "round_trip_ms" in x
        },
        bandwidths={
            (str(x["a"]), str(x["b"])): float(x["bandwidth_mbit"]) * MEBIBIT for x in links if "bandwidth_mbit" in x
        },
        other_region_round_trip=float(data.get("default_round_trip_ms", 50.0)) / 1e3,
    )
    settings = {k: data[k] for k in ("max_codec_error", "target_batch_size", "max_in_flight") if k in data}
    if "call_overhead_ms" in data:
        settings["call_overhead"] = float(data["call_overhead_ms"]) / 1e3
    return Cluster(ModelCosts.from_spec(spec), tuple(peers), tuple(trainers), network, **settings)


def _list(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ClusterError(f"{key!r} must be a list of mappings")
    return value
