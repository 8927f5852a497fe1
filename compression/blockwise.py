"""Blockwise quantization codecs: 8 or 4 bits a value plus one float32 scale per block of 64 values.

A tensor is flattened and cut into blocks of `block_size` values (the last block padded with zeros). Each
block is divided by its largest finite magnitude (absmax), which maps it onto [-1, 1], and every value is
replaced by the index of the nearest level of a fixed, non-uniform codebook on [-1, 1]. Decoding looks the
levels up again and multiplies by the block's scale. Everything is vectorized torch, on CPU or GPU alike;
on CPU large tensors go through in chunks of 2**17 values to keep the temporaries in cache. Decoding always
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

import numpy
import torch

from swarm.compression.codecs import Codec, CodecError

HEADER = struct.Struct("<4sBBHQ")
VERSION = 1
DEFAULT_BLOCK_SIZE = 64
#: values quantized at a time on CPU: large tensors in one go spend most of their time in page faults on
#: fresh temporaries and in memory traffic; chunks of 512 KiB of float32 keep the temporaries (about 2 MiB) in
#: a core's cache, and larger ones were slower on these machines (measured: 2**16 to 2**18)
CPU_CHUNK_VALUES = 2**17
#: exponent of the signed power codebook. Measured (relative L2 error, blocks of 64): a uniform grid (1.0)
#: wins only on plain gaussian data, and by about 1%; 1.75 cuts the error by a third (student-t, 3 degrees
#: of freedom) to two thirds (gaussian with rare 50x outliers, heavy-tailed gradients), because such blocks
#: hold one large value and many small ones that a uniform grid rounds coarsely. 2 and above start to cost
#: on gaussian data (+8% at 2.0); 1.75 is also among the best exponents at 4 bits.
CODEBOOK_EXPONENT = 1.75
#: below this (2**-100) a block's scale divided by the table's half would leave float32's normal range
TINY_SCALE = 2.0**-100


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
    so narrow that any two neighbouring cells hold at most one midpoint; one table (built with bucketize)
    holds the code at each cell's left edge, another the midpoint after that code, and one comparison
    finishes the job. That is two gathers by the same index and a few elementwise passes.

    It works on values scaled by `half` (cells / 2, a power of two), so that the cell index is one add
    and a truncation. A power of two scales exactly: comparing scaled values with scaled midpoints gives
    the same answers as comparing the values themselves.
    """

    def __init__(self, bits: int, device: torch.device) -> None:
        mids = midpoints(bits)
        min_gap = float((mids[1:] - mids[:-1]).min())
        # two neighbouring cells (width 2 / cells) must be narrower than the smallest gap between midpoints
        self.cells = 2 ** math.ceil(math.log2(4 / min_gap))
        self.half = self.cells // 2
        edges = torch.linspace(-1.0, 1.0, self.cells + 1, dtype=torch.float64)[:-1].to(torch.float32)
        first_code = torch.bucketize(edges, mids)
        self.first_code = first_code.to(torch.uint8).to(device)
        # +inf after the last midpoint: the top code never moves up
        next_midpoint = torch.cat([mids, torch.tensor([math.inf])])
        self.threshold = (next_midpoint[first_code] * self.half).to(device)

    def codes_into(self, scaled: torch.Tensor, codes: torch.Tensor, work: _Workspace) -> None:
        """Writes into uint8 `codes` those of the nearest levels to `scaled` / half; `scaled` holds values
        in [-half, half], flat like `codes`."""
        # the cell index, computed a hundredth of a cell low so that float rounding can only err downwards
        # (by at most one cell, after which the value still lies within two cells of the cell's left edge,
        # so within one midpoint of its code); truncation then floors, and half lands in the last cell
        torch.add(scaled, self.half - 0.01, out=work.floats)
        work.cells.copy_(work.floats)
        torch.index_select(self.first_code, 0, work.cells, out=codes)
        torch.index_select(self.threshold, 0, work.cells, out=work.floats)
        if scaled.device.type == "cpu":  # torch 2.13's CPU comparison into bool is about 3x slower than numpy's
            numpy.greater(scaled.numpy(), work.floats.numpy(), out=work.above.numpy())
        else:
            torch.gt(scaled, work.floats, out=work.above)
        codes.add_(work.above)

    def __call__(self, normalized: torch.Tensor) -> torch.Tensor:
        """uint8 codes of the nearest levels to `normalized`, whose values must lie in [-1, 1]."""
        flat = normalized.reshape(-1) * self.half
        codes = torch.empty(flat.shape, dtype=torch.uint8, device=flat.device)
        work = _Workspace(flat.numel(), flat.device)
        work.scaled.copy_(flat)
        self.codes_into(work.scaled, codes, work)
        return codes.view(normalized.shape)


class _Workspace:
    """Temporaries of one chunk, allocated once per call and reused chunk after chunk."""

    def __init__(self, values: int, device: torch.device) -> None:
        self.scaled = torch.empty(values, dtype=torch.float32, device=device)
        self.floats = torch.empty(values, dtype=torch.float32, device=device)
        self.cells = torch.empty(values, dtype=torch.int32, device=device)
        self.above = torch.empty(values, dtype=torch.bool, device=device)
        self.codes = torch.empty(values, dtype=torch.uint8, device=device)  # off the CPU: copied to the host after

    def take(self, values: int) -> _Workspace:
        """Views of the first `values` of each temporary (a chunk shorter than the first)."""
        view = object.__new__(_Workspace)
        for name, tensor in vars(self).items():
            setattr(view, name, tensor[:values])
        return view


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
        step = max(1, min(_chunk_blocks(flat.device, block_size), num_blocks)) * block_size
        work = _Workspace(step, flat.device)
        padded: torch.Tensor | None = None
        # on CPU scales and 8-bit codes go straight into the payload; otherwise through buffers (on a GPU,
        # copied to the host after; 4-bit codes, packed first)
        on_host = flat.device.type == "cpu"
        direct = on_host and self.bits == 8
        scale_buffer = None if on_host else torch.empty(step // block_size, dtype=torch.float32, device=flat.device)
        for begin in range(0, numel, step):
            count = min(step, numel - begin)
            blocks = -(-count // block_size)
            chunk = flat[begin : begin + count]
            if count % block_size or chunk.dtype != torch.float32:
                # padded with zeros to whole blocks, in float32 whatever the input dtype
                if padded is None:
                    padded = torch.empty(step, dtype=torch.float32, device=flat.device)
                chunk = padded[: blocks * block_size]
                chunk[:count].copy_(flat[begin : begin + count])
                chunk[count:].zero_()
            first = begin // block_size
            target = out_codes[self._code_bytes(first, block_size) :][: self._code_bytes(blocks, block_size)]
            codes = target if direct else work.codes[: blocks * block_size]
            scales = out_scales[first : first + blocks]
            device_scales = scales if scale_buffer is None else scale_buffer[:blocks]
            packed = self._quantize(chunk.view(blocks, block_size), device_scales, codes, work)
            if not on_host:
                scales.copy_(device_scales)
            if not direct:
                target.copy_(packed)
        return out.numpy().tobytes()

    def _quantize(
        self, blocks: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, work: _Workspace
    ) -> torch.Tensor:
        """Writes the scales of float32 `blocks` (read only) into `scales` and their codes into uint8
        `codes`, one a value; returns the code bytes: `codes` itself, or for 4 bits their packed pairs."""
        table = _nearest_level_table(self.bits, blocks.device)
        if blocks.numel() != work.scaled.numel():
            work = work.take(blocks.numel())
        # abs() into a reused buffer, then amax(): on CPU several times faster than the temporary-free aminmax()
        torch.amax(torch.abs(blocks, out=work.floats.view(blocks.shape)), dim=1, out=scales)
        low, high = torch.stack(torch.aminmax(scales)).tolist()  # one wait on a GPU, not two
        finite = math.isfinite(high)
        if not finite:
            # rare: NaN or inf somewhere; scale by the largest finite magnitude, and send NaN as 0
            scales.copy_(torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=1))
            blocks = blocks.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)
            low = float(scales.min())
        # Finite values now lie in [-half, half] (|x| <= scale, and division rounds monotonically); infinities
        # are clamped to +-half, times scale 0 if their block has no finite nonzero value. Dividing by
        # scale / half gives exactly the value over its scale times half, as long as scale / half is exact:
        # not so below float32's normal range, where the two steps are taken one after the other. An
        # all-zero block keeps scale 0 but is divided by 1: no 0/0.
        scaled = work.scaled.view(blocks.shape)
        if low >= TINY_SCALE:
            torch.div(blocks, (scales / table.half).unsqueeze(1), out=scaled)
        else:
            torch.div(blocks, torch.where(scales > 0, scales, 1.0).unsqueeze(1), out=scaled).mul_(table.half)
        if not finite:
            scaled.clamp_(-table.half, table.half)
        table.codes_into(work.scaled, codes, work)
        if self.bits == 8:
            return codes
        pairs = codes.view(-1, 2)  # block sizes are even: no pair straddles a block
        packed = work.above.view(torch.uint8)[: pairs.shape[0]]  # free again once the codes are found
        return torch.add(pairs[:, 1], pairs[:, 0], alpha=16, out=packed)  # first code in the high nibble

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
        indices = torch.empty(self._code_bytes(min(step, num_blocks), block_size), dtype=torch.int32)
        staging: torch.Tensor | None = None  # float32 values of a chunk that cannot go straight into the result
        for first in range(0, num_blocks, step):
            blocks = min(step, num_blocks - first)
            code_bytes = self._code_bytes(blocks, block_size)
            chunk_indices = indices[:code_bytes]
            chunk_indices.copy_(codes[self._code_bytes(first, block_size) :][:code_bytes])
            begin = first * block_size
            count = min(blocks * block_size, numel - begin)
            direct = dtype == torch.float32 and count == blocks * block_size
            if direct:
                values = result[begin : begin + count]
            else:
                if staging is None:
                    staging = torch.empty(min(step, num_blocks) * block_size, dtype=torch.float32)
                values = staging[: blocks * block_size]
            # index_select: several times faster than advanced indexing on CPU
            torch.index_select(table, 0, chunk_indices, out=values.view(code_bytes, -1).squeeze(1))
            values.view(blocks, block_size).mul_(scales[first : first + blocks].unsqueeze(1))
            if not direct:
                result[begin : begin + count].copy_(values[:count])  # to the requested dtype
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
