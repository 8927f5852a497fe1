"""Tensor codecs for the wire: each turns a tensor into bytes and back, keeping shape and dtype."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

# dtypes that may cross the wire, by the name a Tensor message carries.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class CodecError(ValueError):
    """A payload that cannot be decoded: corrupt, truncated, or naming an unknown codec or dtype."""


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a wire name stands for; a clear error for an unknown one."""
    try:
        return DTYPES[name]
    except KeyError:
        raise CodecError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; a clear error for one the wire does not carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} cannot be sent; supported: {sorted(DTYPES)}") from None


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor in its own dtype (one copy)."""
    flat = tensor.detach().reshape(-1).cpu()
    if flat.numel() and flat.stride(0) != 1:
        # .contiguous() keeps a one-element view's stride, which .view(uint8) refuses
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor as a view of its own memory (no copy; a device tensor is copied to
    the host once). The view keeps the memory alive; the tensor must not change until it is sent."""
    flat = tensor.detach().reshape(-1).cpu()
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def tensor_from_bytes(
    buffer: bytes | bytearray | memoryview, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of the given shape and dtype whose raw bytes are `buffer`; refuses a wrong length."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(buffer) != numel * itemsize:
        raise CodecError(
            f"payload of {len(buffer)} bytes does not hold a {dtype_name(dtype)} tensor of shape {list(shape)} "
            f"({numel * itemsize} bytes): corrupt or truncated"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer needs a writable buffer to hand out a writable tensor (one the caller made
    # for this tensor alone, as `swarm.net.wire.decode_tensors` does, is wrapped as it is)
    raw = torch.frombuffer(buffer if isinstance(buffer, bytearray) else bytearray(buffer), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


class Codec:
    """Encodes tensors for the wire. Subclasses set `name` and override `encode` and `decode`."""

    name: ClassVar[str] = ""
    #: whether the codec changes values (a lossy codec applies only to floating-point tensors)
    lossy: ClassVar[bool] = False

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether this codec encodes tensors of `dtype`; others travel uncompressed."""
        return not self.lossy or dtype.is_floating_point

    def encode(self, tensor: torch.Tensor) -> bytes:
        raise NotImplementedError

    def decode(self, buffer: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class NoCompression(Codec):
    """Raw bytes in the tensor's own dtype."""

    name = "none"

    def encode(self, tensor: torch.Tensor) -> memoryview:
        # no copy: the bytes go from the tensor's memory to the socket (or shared memory) once
        return tensor_bytes_view(tensor)

    def decode(self, buffer: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return tensor_from_bytes(buffer, shape, dtype)


class CastCompression(Codec):
    """Sends floating-point tensors in a narrower float dtype and casts back on arrival."""

    lossy = True
    wire_dtype: ClassVar[torch.dtype]

    def encode(self, tensor: torch.Tensor) -> bytes:
        return tensor_to_bytes(tensor.detach().to(self.wire_dtype))

    def decode(self, buffer: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return tensor_from_bytes(buffer, shape, self.wire_dtype).to(dtype)


class Float16Compression(CastCompression):
    """IEEE half precision: 2 bytes a value, about 3 decimal digits, range up to 65504."""

    name = "fp16"
    wire_dtype = torch.float16

    def encode(self, tensor: torch.Tensor) -> bytes:
        # clamp so that large activations saturate instead of turning into inf
        finfo = torch.finfo(torch.float16)
        # clamp in float32: in bfloat16 the bound 65504 itself rounds up to 65536, past float16's range
        return tensor_to_bytes(tensor.detach().float().clamp(finfo.min, finfo.max).to(torch.float16))


class BFloat16Compression(CastCompression):
    """bfloat16: 2 bytes a value, float32's range, about 2 decimal digits."""

    name = "bf16"
    wire_dtype = torch.bfloat16
