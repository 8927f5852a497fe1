"""Lossless packing of integer tensors into the narrowest integer type that holds their values.

Token ids and targets are int64 in memory, but a byte-level vocabulary fits in one byte a value. With a
compressing codec, the int64 ids a trainer sends three times per sample (stage 0's forward and backward,
the last stage's targets) were a tenth of its bytes. Packed, they cost an eighth of that.

Payload layout: one byte naming the packed type (an index into PACKED_DTYPES), then the values in that
type, little-endian. Decoding widens them back to the dtype the Tensor message names.
"""

from __future__ import annotations

import torch

from swarm.compression.codecs import Codec, CodecError, dtype_name, tensor_from_bytes, tensor_to_bytes

#: narrowest first; an index into this tuple is the payload's first byte
PACKED_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
#: the integer dtypes this codec carries; narrower ones have nothing to gain
PACKABLE_DTYPES: frozenset[torch.dtype] = frozenset({torch.int16, torch.int32, torch.int64})


def narrowest_dtype(low: int, high: int) -> torch.dtype:
    """The first of PACKED_DTYPES whose range holds both `low` and `high`."""
    for dtype in PACKED_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    raise CodecError(f"values {low}..{high} fit no integer type")  # unreachable for int64 input


class PackedIntegers(Codec):
    """Integers in the narrowest type that holds them; exact. Not a choice of `--compression`: a
    compressing codec sends integer tensors this way (see `swarm.net.wire.encode_tensor`)."""

    name = "packed-int"

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype in PACKABLE_DTYPES

    def encode(self, tensor: torch.Tensor) -> bytes:
        if tensor.dtype not in PACKABLE_DTYPES:
            raise CodecError(f"{self.name} packs {sorted(map(dtype_name, PACKABLE_DTYPES))}, not {tensor.dtype}")
        if tensor.numel():
            low, high = torch.aminmax(tensor.detach())
            packed = narrowest_dtype(int(low), int(high))
        else:
            packed = torch.uint8
        return bytes([PACKED_DTYPES.index(packed)]) + tensor_to_bytes(tensor.detach().to(packed))

    def decode(self, buffer: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype not in PACKABLE_DTYPES:
            raise CodecError(f"{self.name} cannot decode into {dtype_name(dtype)}")
        if not buffer:
            raise CodecError(f"{self.name} payload is empty: it lacks its type byte")
        if buffer[0] >= len(PACKED_DTYPES):
            raise CodecError(
                f"{self.name} payload names packed type {buffer[0]}, not one of 0..{len(PACKED_DTYPES) - 1}"
            )
        packed = PACKED_DTYPES[buffer[0]]
        if packed.itemsize > dtype.itemsize:
            raise CodecError(f"{self.name} payload packs {dtype_name(packed)}, wider than its {dtype_name(dtype)}")
        return tensor_from_bytes(memoryview(buffer)[1:], shape, packed).to(dtype)
