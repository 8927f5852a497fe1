"""Blockwise quantization codecs: 8 or 4 bits a value plus one float32 scale per block of 64 values.

A tensor is flattened and cut into blocks of `block_size` values (the last block padded with zeros). Each
block is divided by its largest finite magnitude (absmax), which maps it onto [-1, 1], and every value is
replaced by the index of the nearest level of a fixed, non-uniform codebook on [-1, 1]. Decoding looks the
levels up again and multiplies by the block's scale. Everything is vectorized torch, on CPU or GPU alike;
on CPU large tensors go through in chunks of 2**18 values to keep the temporaries in cache. Decoding always
produces a CPU tensor.

Payload layout (all little-endian)::

    header   16 bytes  magic (4, b"BWQ8" or b"BWQ4"), version (u8), reserved (u8, 0),
                       block size (u16), number of values (u64)
    scales   4 bytes a block, float32
    codes    8bit: one byte a value; 4bit: two values a byte, the first in the high nibble

Scales are float32 rather than float16: gradients are often far below float16's normal range (6e-5) and
would lose precision or flush to zero there, activations may exceed 65504, and a bfloat16 scale would add a
per-block error of up to 0.4%, comparable to the 8-bit quantization error itself. The cost is 4 bytes per
64 values (1/16 of the 8-bit codes, 1/8 of the 4-bit ones).

Non-finite inputs, a defined behaviour rather than garbage: NaN is sent as 0; +inf and -inf saturate to
plus or minus the largest finite magnitude in their block; in a block with no finite nonzero value, they
decode to 0. Values are quantized in float32, so float64 inputs beyond float32's range count as infinite.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from typing import ClassVar

import torch
from swarm.compression.codecs import Codec, CodecError

HEADER = struct.Struct("<4sBBHQ")
VERSION = 1
DEFAULT_BLOCK_SIZE = 64
#: values quantized at a time on CPU: large tensors in one go spend most of their time in page faults on
#: fresh temporaries and in memory traffic; chunks of 1 MiB of float32 keep them in cache
CPU_CHUNK_VALUES = 2**18
#: exponent of the signed power codebook. Measured (relative L2 error, blocks of 64): a uniform grid (1.0)
#: wins only on plain gaussian data, and by about 1%; 1.75 cuts the error by a third (student-t, 3 degrees
#: of freedom) to two thirds (gaussian with rare 50x outliers, heavy-tailed gradients), because such blocks
#: hold one large value and many small ones that a uniform grid rounds coarsely. 2 and above start to cost
#: on gaussian data (+8% at 2.0); 1.75 is also among the best exponents at 4 bits.
CODEBOOK_EXPONENT = 1.75


def signed_power_codebook(bits: int, exponent: float = CODEBOOK_EXPONENT) -> torch.Tensor:
    """The 2**bits sorted float32 levels on [-1, 1]: sign(u) * |u|**exponent over an even grid of u.

    The grid holds 0 exactly (so zero blocks and zero padding stay zero) and both -1 and +1 (the value that
    set the block's scale is exact). With an even number of levels one side must get one more level than
    the other: the positive side gets 2**(bits-1) levels, the negative side one fewer.
    """
    half = 2 ** (bits - 1)
    positive = (torch.arange(1, half + 1, dtype=torch.float64) / half) ** exponent
    negative = -((torch.arange(1, half, dtype=torch.float64) / (half - 1)) ** exponent)
    levels = torch.cat([negative.flip(0), torch.zeros(1, dtype=torch.float64), positive])
    return levels.to(torch.float32)


def midpoints(bits: int) -> torch.Tensor:
    """The 2**bits - 1 float32 boundaries halfway between neighbouring levels, sorted."""
    levels = signed_power_codebook(bits).to(torch.float64)
    return ((levels[1:] + levels[:-1]) / 2).to(torch.float32)


def nearest_codes_bucketize(normalized: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference nearest-level search: int32 codes of `normalized` (values in [-1, 1]) by binary search."""
    return torch.bucketize(normalized, midpoints(bits).to(normalized.device), out_int32=True)


class _NearestLevelTable:
    """Nearest-level search by table lookup, giving exactly the codes of `nearest_codes_bucketize`.

    torch.bucketize runs a branchy binary search per value: about 30-100 MB/s of float32 on one CPU core
    for 255 midpoints, the bottleneck of the whole codec. Instead, [-1, 1] is cut into `cells` equal cells
    so narrow that any two neighbouring cells hold at most one midpoint; a table (built with bucketize)
    holds the code at each cell's left edge, and one comparison with the next midpoint finishes the job.
    That is two gathers from small tables and a few elementwise passes, about ten times faster.
    """

    def __init__(self, bits: int, device: torch.device) -> None:
        mids = midpoints(bits)
        min_gap = float((mids[1:] - mids[:-1]).min())
        # two neighbouring cells (width 2 / cells) must be narrower than the smallest gap between midpoints
        self.cells = 2 ** math.ceil(math.log2(4 / min_gap))
        edges = torch.linspace(-1.0, 1.0, self.cells + 1, dtype=torch.float64)[:-1].to(torch.float32)
        self.first_code = torch.bucketize(edges, mids, out_int32=True).to(device)
        # +inf after the last midpoint: the top code never moves up
        self.next_midpoint = torch.cat([mids, torch.tensor([math.inf])]).to(device)

    def __call__(self, normalized: torch.Tensor) -> torch.Tensor:
        """int32 codes of the nearest levels to `normalized`, whose values must lie in [-1, 1]."""
        half = self.cells / 2
        # the cell index, computed a hundredth of a cell low so that float rounding can only err downwards
        # (by at most one cell, after which the value still lies within two cells of the cell's left edge,
        # so within one midpoint of its code); truncation then floors, and 1.0 lands in the last cell
        cell = normalized.mul(half).add_(half - 0.01).to(torch.int32)
        codes = self.first_code.index_select(0, cell.view(-1)).view(cell.shape)
        codes += normalized > self.next_midpoint.index_select(0, codes.view(-1)).view(codes.shape)
        return codes


@functools.cache
def _nearest_level_table(bits: int, device: torch.device) -> _NearestLevelTable:
    return _NearestLevelTable(bits, device)


def _chunk_blocks(device: torch.device, block_size: int) -> int:
    """Blocks a chunk: on CPU, few enough that each temporary (about ten) stays in cache; on GPU, all."""
    return max(1, CPU_CHUNK_VALUES // block_size) if device.type == "cpu" else 2**62


@functools.cache
def _decode_table(bits: int) -> torch.Tensor:
    """Levels for each code byte: 256 values for 8 bits; for 4 bits, 256 rows of the byte's two levels."""
    levels = signed_power_codebook(bits)
    if bits == 8:
        return levels
    byte = torch.arange(256)
    # one lookup per byte both unpacks the two nibbles and finds their levels
    return torch.stack([levels[byte >> 4], levels[byte & 15]], dim=1).contiguous()


class BlockwiseQuantization(Codec):
    """Absmax blockwise quantization onto a non-uniform codebook; subclasses set the bits and magic."""

    lossy = True
    bits: ClassVar[int]
    magic: ClassVar[bytes]

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if not 1 <= block_size <= 0xFFFF or (self.bits == 4 and block_size % 2):
            raise ValueError(f"block_size must be in [1, 65535] (and even for 4 bits), got {block_size}")
        self.block_size = block_size

    def _code_bytes(self, num_blocks: int, block_size: int) -> int:
        return num_blocks * block_size * self.bits // 8

    def encode(self, tensor: torch.Tensor) -> bytes:
        """The payload for a floating-point tensor on any device; see the module docstring for the layout."""
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"codec {self.name!r} encodes floating-point tensors only, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)  # copies a non-contiguous input, in its own dtype
        numel, block_size = flat.numel(), self.block_size
        num_blocks = -(-numel // block_size)
        scale_bytes, code_bytes = 4 * num_blocks, self._code_bytes(num_blocks, block_size)
        out = torch.empty(HEADER.size + scale_bytes + code_bytes, dtype=torch.uint8)
        out[: HEADER.size] = torch.frombuffer(
            bytearray(HEADER.pack(self.magic, VERSION, 0, block_size, numel)), dtype=torch.uint8
        )
        out_scales = out[HEADER.size : HEADER.size + scale_bytes].view(torch.float32)
        out_codes = out[HEADER.size + scale_bytes :]
        step = _chunk_blocks(flat.device, block_size) * block_size
        for begin in range(0, numel, step):
            count = min(step, numel - begin)
            blocks = -(-count // block_size)
            chunk = torch.empty(blocks * block_size, dtype=torch.float32, device=flat.device)
            chunk[:count].copy_(flat[begin : begin + count])  # float32, whatever the input dtype
            chunk[count:].zero_()
            scales, codes = self._quantize(chunk.view(blocks, block_size))
            first = begin // block_size
            out_scales[first : first + blocks].copy_(scales)
            # int32 or uint8 -> uint8, and device -> host
            out_codes[self._code_bytes(first, block_size) :][: codes.numel()].copy_(codes)
        return out.numpy().tobytes()

    def _quantize(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and flat codes (int32; for 4 bits packed uint8) of float32 `blocks`, which it overwrites."""
        # abs().amax() beats the temporary-free aminmax() several times over on CPU
        scales = blocks.abs().amax(dim=1)
        finite = bool(torch.isfinite(scales).all())
        if not finite:
            # rare: NaN or inf somewhere; scale by the largest finite magnitude, and send NaN as 0
            scales = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=1)
            blocks.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
        # an all-zero block keeps scale 0 but is divided by 1: no 0/0. Finite values now lie in [-1, 1]
        # (|x| <= scale, and division rounds monotonically); infinities are clamped to +-1, times scale 0
        # if their block has no finite nonzero value.
        blocks.div_(torch.where(scales > 0, scales, 1.0).unsqueeze(1))
        if not finite:
            blocks.clamp_(-1.0, 1.0)
        codes = _nearest_level_table(self.bits, blocks.device)(blocks).view(-1)
        if self.bits == 4:
            pairs = codes.to(torch.uint8).view(-1, 2)  # block sizes are even: no pair straddles a block
            codes = torch.add(pairs[:, 1], pairs[:, 0], alpha=16)  # first code in the high nibble
        return scales, codes

    def decode(self, buffer: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The CPU tensor of `shape` and `dtype` in `buffer`; CodecError for any inconsistent payload."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CodecError(f"codec {self.name!r} carries floating-point tensors only, not {dtype}")
        try:
            shape = tuple(operator.index(size) for size in shape)
        except TypeError:
            raise CodecError(f"invalid shape {shape!r}") from None
        if any(size < 0 for size in shape):
            raise CodecError(f"invalid shape {list(shape)}")
        numel = math.prod(shape)
        if len(buffer) < HEADER.size:
            raise CodecError(f"{self.name} payload of {len(buffer)} bytes has no full header: truncated")
        magic, version, reserved, block_size, claimed = HEADER.unpack_from(buffer)
        if magic != self.magic:
            raise CodecError(f"payload starts with {magic!r}, not {self.magic!r} ({self.name}): corrupt")
        if version != VERSION or reserved != 0:
            raise CodecError(f"unsupported {self.name} payload version {version} (flags {reserved})")
        if block_size == 0 or (self.bits == 4 and block_size % 2):
            raise CodecError(f"{self.name} payload has an invalid block size {block_size}: corrupt")
        if claimed != numel:
            raise CodecError(f"{self.name} payload holds {claimed} values, shape {list(shape)} has {numel}")
        num_blocks = -(-numel // block_size)
        scale_bytes = 4 * num_blocks
        expected = HEADER.size + scale_bytes + self._code_bytes(num_blocks, block_size)
        if len(buffer) != expected:
            raise CodecError(
                f"{self.name} payload of {len(buffer)} bytes for {numel} values in blocks of {block_size} "
                f"should have {expected} bytes: corrupt or truncated"
            )
        result = torch.empty(numel, dtype=dtype)
        if numel == 0:
            return result.view(shape)

        # the one copy of the (small) payload: torch cannot wrap read-only bytes without warning
        body = bytearray(memoryview(buffer)[HEADER.size :])
        scales = torch.frombuffer(body, dtype=torch.float32, count=num_blocks)
        # an encoder never sends a negative, NaN or inf scale, nor one the target dtype cannot hold
        if not bool(((scales >= 0) & (scales <= torch.finfo(dtype).max)).all()):
            raise CodecError(f"{self.name} payload has a negative, non-finite or out-of-range scale: corrupt")
        codes = torch.frombuffer(body, dtype=torch.uint8, offset=scale_bytes)
        table = _decode_table(self.bits)
        step = _chunk_blocks(result.device, block_size)
        for first in range(0, num_blocks, step):
            blocks = min(step, num_blocks - first)
            chunk_codes = codes[self._code_bytes(first, block_size) :][: self._code_bytes(blocks, block_size)]
            # index_select: several times faster than advanced indexing on CPU
            values = table.index_select(0, chunk_codes.int()).view(blocks, block_size)
            values.mul_(scales[first : first + blocks].unsqueeze(1))
            begin = first * block_size
            count = min(blocks * block_size, numel - begin)
            result[begin : begin + count].copy_(values.view(-1)[:count])  # to the requested dtype
        return result.view(shape)


class Blockwise8bitCompression(BlockwiseQuantization):
    """One byte a value plus a float32 scale per 64 values: about 26.6% of float32's bytes."""

    name = "8bit"
    bits = 8
    magic = b"BWQ8"


class Blockwise4bitCompression(BlockwiseQuantization):
    """Half a byte a value plus a float32 scale per 64 values: about 14.1% of float32's bytes."""

    name = "4bit"
    bits = 4
    magic = b"BWQ4"
