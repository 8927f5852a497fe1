"""Our codecs as hivemind compression strategies, for hivemind's averagers and optimizers.

    from swarm.compression.hivemind_adapter import HivemindCodecAdapter
    DecentralizedAverager(tensors, dht, compression=HivemindCodecAdapter("8bit"), ...)
    hivemind.Optimizer(..., grad_compression=HivemindCodecAdapter("8bit"), state_averaging_compression=...)

How hivemind 1.1.12 dispatches. A sender calls its own strategy's `compress`, which stamps a
`runtime_pb2.CompressionType` into the message. Every receiver ignores the sender's strategy: it calls
`deserialize_torch_tensor`, which decodes with `_BASE_COMPRESSION_TYPES[CompressionType.Name(msg.compression)]`,
a module-level table with one instance per enum value. All-reduce also compresses through that table: a reducer
sends each averaged part back as `serialize_torch_tensor(delta, msg.compression)`, so the table entry's `compress`
runs too. So a custom codec works only if every peer's table maps its enum value to that codec, for both
directions. A subclass alone never reaches the receiver. The enum (NONE, MEANSTD_16BIT, FLOAT16, QUANTILE_8BIT,
UNIFORM_8BIT, BLOCKWISE_8BIT) cannot be extended: protobuf carries a value such as 99 across the wire, but
`CompressionType.Name(99)` raises ValueError before the table is looked up.

What this module does. When it is imported (an opt-in: `swarm.compression` does not import it),
`register_with_hivemind` points table entries at our codecs. All five fit into the six existing values:

    none  -> NONE            untouched: our raw bytes are hivemind's NoCompression format, which decodes them
                             bit for bit. Replacing it would break hivemind's default for everything else (its
                             bfloat16 travels as float32 there).
    fp16  -> FLOAT16         replaced: the wire format is unchanged (clamped IEEE half, original dtype name),
                             so stock FLOAT16 messages still decode. Ours also takes bfloat16 tensors.
    8bit  -> BLOCKWISE_8BIT  replaced
    4bit  -> QUANTILE_8BIT   replaced
    bf16  -> UNIFORM_8BIT    replaced

The three 8-bit types are unusable in stock hivemind 1.1.12 with NumPy 2: their `extract` calls `int()` on a
one-element array, which raises TypeError, and BLOCKWISE_8BIT also needs bitsandbytes. So this module gives up
nothing that works here. MEANSTD_16BIT does work, so it is left alone.

Trade-offs:
- This patches a private, process-global table (`_BASE_COMPRESSION_TYPES`). hivemind is pinned at 1.1.12, and
  the module refuses to import if the table is missing. Every process that receives tensors must import this
  module. On Linux, averagers are forked, so they inherit the table. An adapter passed to a spawned process also
  imports the module when it is unpickled.
- A peer running stock hivemind cannot decode our 8bit, 4bit or bf16 messages, and we cannot decode its messages
  of those three types. Under NumPy 2 both sides fail loudly: hivemind's extract raises, and our decoders check
  magic bytes and lengths and raise CodecError. Under NumPy < 2, a stock peer may misread our payloads. The enum
  names on the wire no longer describe the payload: UNIFORM_8BIT messages carry bfloat16.
- Lossy codecs apply only to floating-point tensors. As on our own wire, other tensors travel uncompressed as
  NONE messages.
"""

from __future__ import annotations

import torch
from hivemind.compression import serialization as _hivemind_serialization
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.compression.floating import get_num_bits
from hivemind.proto import runtime_pb2

from swarm.compression.blockwise import Blockwise4bitCompression, Blockwise8bitCompression, BlockwiseQuantization
from swarm.compression.codecs import (
    BFloat16Compression,
    CastCompression,
    Codec,
    Float16Compression,
    NoCompression,
    dtype_from_name,
    dtype_name,
)

#: the hivemind CompressionType name under which each of our codecs travels
HIVEMIND_TYPES: dict[str, str] = {
    NoCompression.name: "NONE",
    Float16Compression.name: "FLOAT16",
    Blockwise8bitCompression.name: "BLOCKWISE_8BIT",
    Blockwise4bitCompression.name: "QUANTILE_8BIT",
    BFloat16Compression.name: "UNIFORM_8BIT",
}
_CODEC_TYPES: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (
        NoCompression,
        Float16Compression,
        BFloat16Compression,
        Blockwise8bitCompression,
        Blockwise4bitCompression,
    )
}
#: types whose stock hivemind entry we keep: our messages of this type are in hivemind's own format
_KEPT_TYPES = frozenset({"NONE"})
_RAW = NoCompression()

_TABLE: dict[str, CompressionBase] | None = getattr(_hivemind_serialization, "_BASE_COMPRESSION_TYPES", None)
if not isinstance(_TABLE, dict):
    raise ImportError(
        "hivemind.compression.serialization._BASE_COMPRESSION_TYPES is missing: this adapter targets hivemind "
        "1.1.12's dispatch table; see swarm.compression.hivemind_adapter"
    )


class HivemindCodecAdapter(CompressionBase):
    """A hivemind compression strategy that encodes with one of our codecs (see the module docstring)."""

    def __init__(self, codec: Codec | str) -> None:
        """`codec`: a codec instance (e.g. with its own block size) or the name of one ("none", "8bit", ...)."""
        if isinstance(codec, str):
            if codec not in _CODEC_TYPES:
                raise ValueError(f"unknown codec {codec!r}; known codecs: {sorted(_CODEC_TYPES)}")
            codec = _CODEC_TYPES[codec]()
        if codec.name not in HIVEMIND_TYPES:
            raise ValueError(f"codec {codec.name!r} has no hivemind compression type; known: {sorted(HIVEMIND_TYPES)}")
        self.codec = codec
        self.compression_type: int = runtime_pb2.CompressionType.Value(HIVEMIND_TYPES[codec.name])

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        """The message for `tensor`. Tensors the codec does not apply to (integers, for a lossy codec) go as NONE."""
        requires_grad = tensor.requires_grad
        tensor = tensor.detach()
        applies = self.codec.applies_to(tensor.dtype)
        codec = self.codec if applies else _RAW
        return runtime_pb2.Tensor(
            compression=self.compression_type if applies else runtime_pb2.CompressionType.NONE,
            buffer=bytes(codec.encode(tensor)),
            size=tuple(tensor.shape),
            dtype=dtype_name(tensor.dtype),
            requires_grad=requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """The tensor in a message of our compression type. Other types go to hivemind's table."""
        if serialized_tensor.compression != self.compression_type:
            return _hivemind_serialization.deserialize_torch_tensor(serialized_tensor)
        tensor = self.codec.decode(
            serialized_tensor.buffer, tuple(serialized_tensor.size), dtype_from_name(serialized_tensor.dtype)
        )
        return tensor.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Bits a value on the wire over bits a value in memory. Headers are ignored."""
        dtype = info.descriptor.dtype
        if not self.codec.applies_to(dtype):
            return 1.0
        if isinstance(self.codec, BlockwiseQuantization):
            wire_bits = self.codec.bits + 32 / self.codec.block_size  # codes plus a float32 scale per block
        elif isinstance(self.codec, CastCompression):
            wire_bits = torch.finfo(self.codec.wire_dtype).bits
        else:
            return 1.0
        return wire_bits / get_num_bits(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.codec.name!r})"


def register_with_hivemind() -> None:
    """Points hivemind's dispatch table at our codecs (see the module docstring). Idempotent. Runs at import."""
    for name, type_name in HIVEMIND_TYPES.items():
        if type_name not in _KEPT_TYPES and not isinstance(_TABLE.get(type_name), HivemindCodecAdapter):
            _TABLE[type_name] = HivemindCodecAdapter(name)


register_with_hivemind()
