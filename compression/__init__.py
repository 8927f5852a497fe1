"""Tensor codecs for the wire and their registry."""

from swarm.compression.blockwise import Blockwise4bitCompression, Blockwise8bitCompression
from swarm.compression.codecs import (
    DTYPES,
    BFloat16Compression,
    Codec,
    CodecError,
    Float16Compression,
    NoCompression,
    dtype_from_name,
    dtype_name,
)
from swarm.compression.integers import PackedIntegers

CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        NoCompression(),
        Float16Compression(),
        BFloat16Compression(),
        Blockwise8bitCompression(),
        Blockwise4bitCompression(),
    )
}
#: the codec a compressing codec sends integer tensors with; only the wire picks it, so it is not in CODECS
PACKED_INTEGERS = PackedIntegers()
#: every codec a Tensor message may name
WIRE_CODECS: dict[str, Codec] = {**CODECS, PACKED_INTEGERS.name: PACKED_INTEGERS}


def get_codec(name: str) -> Codec:
    """The codec a Tensor message names (one of CODECS, or the wire's integer packing); a clear error for an
    unknown one."""
    try:
        return WIRE_CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known codecs: {sorted(CODECS)}") from None


__all__ = [
    "CODECS",
    "PACKED_INTEGERS",
    "DTYPES",
    "Codec",
    "CodecError",
    "dtype_from_name",
    "dtype_name",
    "get_codec",
]
