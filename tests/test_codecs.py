"""Codecs: exact round trips where lossless, stated error bounds where lossy, and refusal of bad payloads."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from swarm.compression import CODECS, DTYPES, PACKED_INTEGERS, CodecError, blockwise, get_codec
from swarm.compression.blockwise import (
    HEADER,
    Blockwise4bitCompression,
    Blockwise8bitCompression,
    BlockwiseQuantization,
    _nearest_level_table,
    midpoints,
    nearest_codes_bucketize,
    signed_power_codebook,
)
from swarm.net.wire import CHUNK_BYTES, Part, WireError, WireLimits, decode_tensors, encode_tensor
from swarm.proto import Tensor

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BLOCKWISE = ["8bit", "4bit"]
PLAIN = ["none", "fp16", "bf16"]
BLOCK = 64

# Error bounds, measured with the seeds below and given some margin.
# Relative L2 error ||x - decode(encode(x))|| / ||x|| on 2**16 standard gaussian float32 values:
GAUSSIAN_REL_ERROR = {"none": 0.0, "fp16": 3e-4, "bf16": 3e-3, "8bit": 0.0070, "4bit": 0.115}
# measured: fp16 2.1e-4, bf16 1.7e-3, 8bit 0.0060, 4bit 0.102
# On heavy-tailed data the non-uniform codebook must beat plain uniform absmax quantization with as many
# levels (round(x / absmax * 127), the usual int8 scheme) by at least this factor in relative L2 error:
HEAVY_TAIL_GAIN_8BIT = {"student_t3": 1.3, "outliers": 2.0, "layernorm_outlier_channels": 1.6}
# measured gains (8bit 0.0069, 0.0049, 0.0053 against 0.0111, 0.0153, 0.0127): 1.6, 3.1 and 2.4
HEAVY_TAIL_GAIN_4BIT = {"student_t3": 1.3, "outliers": 1.3, "layernorm_outlier_channels": 1.2}
# measured gains (4bit 0.115, 0.080, 0.088 against round(x / absmax * 7)'s 0.186, 0.125, 0.130): 1.6, 1.6, 1.5


def max_level_gap(bits: int) -> float:
    levels = signed_power_codebook(bits)
    return float((levels[1:] - levels[:-1]).max())


def block_absmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """For each value of flattened x, the largest finite magnitude in its block (as float64)."""
    flat = x.detach().reshape(-1).to(torch.float64)
    padded = torch.zeros(-(-flat.numel() // block) * block, dtype=torch.float64)
    padded[: flat.numel()] = torch.where(torch.isfinite(flat), flat.abs(), 0.0)
    return padded.view(-1, block).amax(1).repeat_interleave(block)[: flat.numel()]


def roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(x), tuple(x.shape), x.dtype)


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x - y).norm() / x.norm())


def uniform_absmax(x: torch.Tensor, steps: int, block: int = BLOCK) -> torch.Tensor:
    """Baseline: blockwise absmax with a uniform grid of 2 * steps + 1 levels."""
    blocks = x.reshape(-1, block)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30)
    return ((blocks / scale * steps).round() / steps * scale).reshape(x.shape)


def heavy_tailed(kind: str, generator: torch.Generator) -> torch.Tensor:
    n = 2**16
    if kind == "student_t3":
        # student-t with 3 degrees of freedom, built from gaussians: z / sqrt(chi2_3 / 3)
        z = torch.randn(n, generator=generator)
        chi2 = torch.randn(n, 3, generator=generator).pow(2).sum(1)
        return z / (chi2 / 3).sqrt()
    if kind == "outliers":
        x = torch.randn(n, generator=generator)
        picks = torch.randint(0, n, (n // 1000,), generator=generator)
        x[picks] *= 50
        return x
    if kind == "layernorm_outlier_channels":
        hidden = torch.nn.functional.layer_norm(torch.randn(64, 1024, generator=generator), (1024,))
        hidden[:, :4] *= 30  # a few channels much larger than the rest, as in trained transformers
        return hidden.reshape(-1)
    raise ValueError(kind)


SHAPES = [(0,), (3, 0, 2), (), (1,), (63,), (64,), (65,), (1000,), (2, 3, 5)]


def make_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)


def assert_within_bound(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """Each value's error is within what the codec promises for it."""
    assert y.shape == x.shape and y.dtype == x.dtype
    if name == "none":
        assert torch.equal(y, x)
        return
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    # the decoded value is rounded to the tensor's dtype: relative eps, or a subnormal's spacing near 0
    finfo = torch.finfo(x.dtype)
    output_rounding, tiny = finfo.eps, finfo.eps * finfo.smallest_normal
    if name in ("fp16", "bf16"):
        wire = torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16)
        xd = xd.clamp(-wire.max, wire.max)  # fp16 saturates by design
        bound = (wire.eps + output_rounding) * xd.abs() + wire.eps * wire.smallest_normal + tiny
    else:
        # nearest of the levels: at most half the widest gap between levels, times the block's scale
        bits = 8 if name == "8bit" else 4
        bound = (max_level_gap(bits) / 2 + 2 * output_rounding) * block_absmax(x) + tiny
    assert bool(((xd - yd).abs() <= bound).all()), f"{name}: error {float((xd - yd).abs().max())} over bound"


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_keeps_shape_and_dtype(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = make_input(shape, dtype)
    assert_within_bound(name, x, roundtrip(name, x))


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_non_contiguous_input_encodes_like_its_contiguous_copy(name: str, dtype: torch.dtype) -> None:
    x = make_input((4, 5, 7), dtype).transpose(0, 2)  # shape (7, 5, 4), not contiguous
    assert not x.is_contiguous()
    codec = get_codec(name)
    assert codec.encode(x) == codec.encode(x.contiguous())
    assert_within_bound(name, x, roundtrip(name, x))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_one_strided_value(name: str) -> None:
    """A one-element view with a stride other than 1 (here 2), as `batch[:1, 0]` gives."""
    x = torch.randn(1, 2, generator=torch.Generator().manual_seed(14))[:, 0]
    assert x.stride() == (2,)
    assert_within_bound(name, x, roundtrip(name, x))


def test_fp16_saturates_bfloat16() -> None:
    x = torch.tensor([1e5, -1e5, 7e4, 1.0], dtype=torch.bfloat16)
    y = roundtrip("fp16", x)
    assert bool(torch.isfinite(y).all()), y


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_none_is_exact_for_every_dtype(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        x = torch.randint(0, 2, (3, 17), generator=generator).bool()
    elif dtype.is_floating_point:
        x = torch.randn(3, 17, generator=generator).to(dtype)
    else:
        x = torch.randint(0, 100, (3, 17), generator=generator).to(dtype)
    for sample in (x, x.t(), x[:0], x[0, 0]):
        y = roundtrip("none", sample)
        assert y.dtype == dtype and y.shape == sample.shape and torch.equal(y, sample)


def test_registry_holds_the_blockwise_codecs() -> None:
    assert isinstance(CODECS["8bit"], Blockwise8bitCompression)
    assert isinstance(CODECS["4bit"], Blockwise4bitCompression)
    for codec in CODECS.values():
        assert get_codec(codec.name) is codec
        # lossy codecs leave integer and bool tensors to the wire, which packs wide integers
        assert codec.applies_to(torch.float32) and codec.applies_to(torch.bfloat16)
        assert codec.applies_to(torch.int64) == (not codec.lossy)
        assert codec.applies_to(torch.bool) == (not codec.lossy)
    assert CODECS["8bit"].lossy and CODECS["4bit"].lossy


@pytest.mark.parametrize("name", BLOCKWISE)
def test_lossy_blockwise_refuses_to_encode_integers(name: str) -> None:
    with pytest.raises(TypeError):
        get_codec(name).encode(torch.arange(10))


@pytest.mark.parametrize("name", sorted(GAUSSIAN_REL_ERROR))
def test_gaussian_error_bound(name: str) -> None:
    x = torch.randn(2**16, generator=torch.Generator().manual_seed(2))
    error = rel_error(x, roundtrip(name, x))
    assert error <= GAUSSIAN_REL_ERROR[name], f"{name}: relative L2 error {error:.5f}"


@pytest.mark.parametrize("kind", sorted(HEAVY_TAIL_GAIN_8BIT))
@pytest.mark.parametrize("name", BLOCKWISE)
def test_codebook_beats_uniform_grid_on_heavy_tails(name: str, kind: str) -> None:
    x = heavy_tailed(kind, torch.Generator().manual_seed(3))
    steps, gains = (127, HEAVY_TAIL_GAIN_8BIT) if name == "8bit" else (7, HEAVY_TAIL_GAIN_4BIT)
    ours, uniform = rel_error(x, roundtrip(name, x)), rel_error(x, uniform_absmax(x, steps))
    assert ours * gains[kind] <= uniform, f"{name} on {kind}: {ours:.5f} vs uniform {uniform:.5f}"


@pytest.mark.parametrize("bits", [8, 4])
def test_codebook_shape(bits: int) -> None:
    levels = signed_power_codebook(bits)
    assert levels.dtype == torch.float32 and levels.numel() == 2**bits
    assert bool((levels[1:] > levels[:-1]).all())
    assert levels[0] == -1 and levels[-1] == 1 and bool((levels == 0).any())
    # finer near zero than near the ends: what heavy tails need
    gaps = levels[1:] - levels[:-1]
    assert gaps[len(gaps) // 2] < gaps[0] / 4 and gaps[len(gaps) // 2] < gaps[-1] / 4


@pytest.mark.parametrize("bits", [8, 4])
def test_table_search_matches_bucketize_and_is_nearest(bits: int) -> None:
    mids = midpoints(bits)
    table = _nearest_level_table(bits, torch.device("cpu"))
    edges = torch.linspace(-1, 1, table.cells + 1)
    # the hard cases: each midpoint and cell edge and the floats just around them, plus random values
    hard = torch.cat([mids, edges, torch.tensor([-1.0, 0.0, 1.0, -0.0])])
    around = torch.cat([hard, torch.nextafter(hard, torch.tensor(2.0)), torch.nextafter(hard, torch.tensor(-2.0))])
    values = torch.cat([around, torch.rand(100_000, generator=torch.Generator().manual_seed(4)) * 2 - 1])
    values = values.clamp(-1, 1)
    codes = table(values)
    assert torch.equal(codes, nearest_codes_bucketize(values, bits))
    # and that is a nearest level: levels are sorted, so no farther than either neighbouring level
    levels = signed_power_codebook(bits).double()
    padded = torch.cat([torch.tensor([-math.inf]), levels, torch.tensor([math.inf])])
    v, index = values.double(), codes.long() + 1
    # (up to 1e-7: the midpoints are float32, so a value at a rounded midpoint may take either side)
    chosen = (v - padded[index]).abs() - 1e-7
    assert bool((chosen <= (v - padded[index - 1]).abs()).all())
    assert bool((chosen <= (v - padded[index + 1]).abs()).all())


def reference_blockwise(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """The codec's result by the plain, unchunked recipe: absmax scales, bucketize on the midpoints."""
    flat = x.reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    scales = padded.abs().amax(1, keepdim=True)
    codes = nearest_codes_bucketize(padded / torch.where(scales > 0, scales, 1.0), bits)
    values = signed_power_codebook(bits)[codes.long()] * scales
    return values.view(-1)[: flat.numel()].to(x.dtype).view(x.shape)


@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize("chunk_values", [None, 64, 192])
def test_chunked_codec_equals_reference(name: str, chunk_values: int | None, monkeypatch) -> None:
    """Quantizing chunk by chunk gives exactly the plain recipe, ragged last chunk and block included."""
    if chunk_values is not None:
        monkeypatch.setattr(blockwise, "CPU_CHUNK_VALUES", chunk_values)
    # more than two chunks, the last one ragged and ending in a partial block (numel % 64 == 36 or 40)
    numel = 2 * blockwise.CPU_CHUNK_VALUES + 100 if chunk_values is None else 1000
    x = torch.randn(numel, generator=torch.Generator().manual_seed(15))
    x[::997] *= 50
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).view(-1, 4)
        assert torch.equal(roundtrip(name, xd), reference_blockwise(xd, 8 if name == "8bit" else 4))


@pytest.mark.parametrize("name", BLOCKWISE)
def test_blocks_of_every_magnitude_and_with_zeros_equal_the_reference(name: str) -> None:
    """Blocks whose scale lies near or below float32's normal range (where dividing by scale / half would
    not be exact), all-zero blocks and ordinary ones, mixed in one chunk, give the plain recipe's values."""
    generator = torch.Generator().manual_seed(21)
    magnitudes = [1.0, 1e-30, 1e-36, 1e-38, 1e-40, 1e-44, 0.0, 1e37]
    x = torch.cat([torch.randn(64 * 3, generator=generator) * m for m in magnitudes])
    assert torch.equal(roundtrip(name, x), reference_blockwise(x, 8 if name == "8bit" else 4))
    assert torch.equal(roundtrip(name, x[:-64]), reference_blockwise(x[:-64], 8 if name == "8bit" else 4))


@pytest.mark.parametrize("name", BLOCKWISE)
def test_block_absmax_is_exact_and_zero_stays_zero(name: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    x[100:228] = 0  # two whole blocks of zeros
    y = roundtrip(name, x)
    blocks_x = torch.nn.functional.pad(x, (0, 24)).view(-1, BLOCK)
    blocks_y = torch.nn.functional.pad(y, (0, 24)).view(-1, BLOCK)
    peak = blocks_x.abs().argmax(1, keepdim=True)
    assert torch.equal(blocks_y.gather(1, peak), blocks_x.gather(1, peak))  # +-1 are levels: exact
    assert bool((y[x == 0] == 0).all())
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_non_finite_values(name: str, dtype: torch.dtype) -> None:
    """Documented: NaN -> 0; +-inf -> +-(largest finite magnitude in the block); 0 in an all-non-finite block."""
    nan, inf = math.nan, math.inf
    x = torch.zeros(4 * BLOCK, dtype=dtype)
    x[0:4] = torch.tensor([nan, inf, -inf, 0.5], dtype=dtype)
    x[4] = -2.0  # block 0: largest finite magnitude 2
    x[BLOCK : 2 * BLOCK] = inf  # block 1: nothing finite
    x[2 * BLOCK] = nan  # block 2: NaN and zeros
    x[3 * BLOCK : 3 * BLOCK + 2] = torch.tensor([1.0, 3.0], dtype=dtype)  # block 3: finite, untouched
    y = roundtrip(name, x)
    assert y.dtype == dtype and bool(torch.isfinite(y).all())
    assert y[0] == 0 and y[1] == 2 and y[2] == -2 and y[4] == -2
    assert bool((y[BLOCK : 3 * BLOCK] == 0).all())
    assert y[3 * BLOCK + 1] == 3
    assert abs(float(y[3]) - 0.5) <= (max_level_gap(8 if name == "8bit" else 4) / 2) * 2 + 1e-3


@pytest.mark.parametrize("name", BLOCKWISE)
def test_extreme_magnitudes(name: str) -> None:
    # float64 beyond float32's range counts as infinite; float16's largest value stays finite
    x = torch.tensor([1e300, -1.0, 2.0] + [0.0] * 61 + [1e-300, 1e-30], dtype=torch.float64)
    y = roundtrip(name, x)
    assert y[0] == 2 and y[2] == 2 and y[-2] == 0
    assert abs(float(y[-1]) - 1e-30) <= 1e-36  # a tiny block keeps full relative precision (float32 scale)
    h = torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16)
    assert torch.equal(roundtrip(name, h)[:2], h[:2])
    # gradients far below float16's range keep their relative precision
    g = torch.randn(4096, generator=torch.Generator().manual_seed(6)) * 1e-9
    assert rel_error(g, roundtrip(name, g)) <= GAUSSIAN_REL_ERROR[name] * 1.1


@pytest.mark.parametrize("name", BLOCKWISE)
def test_payload_size_and_header(name: str) -> None:
    bits = 8 if name == "8bit" else 4
    for numel in (0, 1, 63, 64, 65, 1000):
        payload = get_codec(name).encode(torch.ones(numel))
        blocks = -(-numel // BLOCK)
        assert len(payload) == HEADER.size + 4 * blocks + blocks * BLOCK * bits // 8
        magic, version, reserved, block, count = HEADER.unpack_from(payload)
        assert (magic, version, reserved, block, count) == (get_codec(name).magic, 1, 0, BLOCK, numel)


@pytest.mark.parametrize("cls", [Blockwise8bitCompression, Blockwise4bitCompression])
def test_payload_carries_its_block_size(cls: type[BlockwiseQuantization]) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    payload = cls(block_size=32).encode(x)
    y = get_codec(cls.name).decode(payload, (1000,), torch.float32)
    assert_within_bound(cls.name, x, y)  # blocks of 32 are within the bound for blocks of 64
    with pytest.raises(ValueError):
        cls(block_size=0)


def corrupt_payloads(name: str) -> dict[str, tuple[bytes, tuple[int, ...], torch.dtype]]:
    """Bad payloads with the shape and dtype they claim to be, each of which decode must refuse."""
    shape = (3, 50)
    good = get_codec(name).encode(torch.randn(shape, generator=torch.Generator().manual_seed(8)))
    magic, version, reserved, block, count = HEADER.unpack_from(good)
    body = good[HEADER.size :]
    blocks = -(-count // block)

    def header(**fields: int | bytes) -> bytes:
        values = {"magic": magic, "version": version, "reserved": reserved, "block": block, "count": count}
        values.update(fields)
        return HEADER.pack(*values.values())

    def with_scale(value: float) -> bytes:
        return good[: HEADER.size] + struct.pack("<f", value) + good[HEADER.size + 4 :]

    other = "4bit" if name == "8bit" else "8bit"
    cases = {
        "empty": (b"", shape, torch.float32),
        "header only": (good[: HEADER.size], shape, torch.float32),
        "half a header": (good[: HEADER.size // 2], shape, torch.float32),
        "truncated by one": (good[:-1], shape, torch.float32),
        "truncated scales": (good[: HEADER.size + 4 * blocks - 1], shape, torch.float32),
        "extended by one": (good + b"\0", shape, torch.float32),
        "wrong magic": (b"XXXX" + good[4:], shape, torch.float32),
        "other codec's payload": (get_codec(other).encode(torch.ones(shape)), shape, torch.float32),
        "future version": (header(version=2) + body, shape, torch.float32),
        "unknown flags": (header(reserved=1) + body, shape, torch.float32),
        "block size 0": (header(block=0) + body, shape, torch.float32),
        "more values than the shape": (header(count=count + 1) + body, shape, torch.float32),
        "more values, body to match": (header(count=count * 2) + body + body, shape, torch.float32),
        "huge count": (header(count=2**64 - 1) + body, shape, torch.float32),
        "fewer values than the shape": (good, (3, 51), torch.float32),
        "NaN scale": (with_scale(math.nan), shape, torch.float32),
        "inf scale": (with_scale(math.inf), shape, torch.float32),
        "negative scale": (with_scale(-1.0), shape, torch.float32),
        "scale beyond float16": (with_scale(1e6), shape, torch.float16),
        "integer dtype": (good, shape, torch.int64),
        "bool dtype": (good, shape, torch.bool),
        "negative shape": (good, (-3, -50), torch.float32),
    }
    if name == "4bit":
        cases["odd block size"] = (header(block=63) + body, shape, torch.float32)
    generator = torch.Generator().manual_seed(9)
    for size in (0, 3, 15, 16, 17, 100, len(good)):
        noise = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        cases[f"random {size} bytes"] = (noise, shape, torch.float32)
    return cases


@pytest.mark.parametrize("name", BLOCKWISE)
def test_corrupt_payloads_are_refused(name: str) -> None:
    codec = get_codec(name)
    for case, (payload, shape, dtype) in corrupt_payloads(name).items():
        with pytest.raises(CodecError):
            codec.decode(payload, shape, dtype)
            pytest.fail(f"{name} decoded the corrupt payload {case!r}")


@pytest.mark.parametrize("name", PLAIN)
def test_plain_codecs_refuse_wrong_lengths(name: str) -> None:
    codec = get_codec(name)
    good = bytes(codec.encode(torch.randn(3, 5)))
    for payload in (b"", good[:-1], good + b"\0"):
        with pytest.raises(CodecError):
            codec.decode(payload, (3, 5), torch.float32)


@pytest.mark.parametrize("name", BLOCKWISE)
def test_flipped_bytes_decode_or_raise_codec_error(name: str) -> None:
    """Any byte of a valid payload may be damaged: the result is a CodecError or a finite tensor."""
    codec = get_codec(name)
    good = bytearray(codec.encode(torch.randn(200, generator=torch.Generator().manual_seed(10))))
    generator = torch.Generator().manual_seed(11)
    for _ in range(300):
        bad = bytearray(good)
        for position in torch.randint(0, len(bad), (3,), generator=generator).tolist():
            bad[position] = int(torch.randint(0, 256, (), generator=generator))
        try:
            y = codec.decode(bytes(bad), (200,), torch.float16)
        except CodecError:
            continue
        assert y.shape == (200,) and y.dtype == torch.float16 and bool(torch.isfinite(y).all())


def test_random_shapes_dtypes_and_codecs() -> None:
    """Many random small tensors, fixed seed: every codec keeps shape and dtype and its error bound."""
    generator = torch.Generator().manual_seed(12)
    names = sorted(CODECS)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (), generator=generator))

    for _ in range(400):
        shape = [pick(9) for _ in range(pick(5))]
        if shape and not pick(3):
            shape[pick(len(shape))] = pick(300)  # one long dimension: several blocks, a ragged last one
        dtype = FLOAT_DTYPES[pick(len(FLOAT_DTYPES))]
        scale = 10.0 ** (pick(10 if dtype == torch.float16 else 13) - 6)  # float16 overflows beyond 1e4
        x = torch.randn([*shape, 2], generator=generator, dtype=torch.float64).mul(scale).to(dtype)
        name = names[pick(len(names))]
        # non-contiguous or contiguous
        x = x[..., 0] if pick(2) else x[..., 0].clone(memory_format=torch.contiguous_format)
        assert_within_bound(name, x, roundtrip(name, x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CODECS))
def test_cuda_encoding_matches_cpu(name: str) -> None:
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(13))
    for dtype in FLOAT_DTYPES:
        xd = x.to(dtype)
        assert get_codec(name).encode(xd.cuda().t()) == get_codec(name).encode(xd.t())


@pytest.mark.parametrize("name", BLOCKWISE)
def test_through_the_wire_parts(name: str) -> None:
    """Split into wire parts and reassembled: floats within the bound, integers exact (packed), and a
    corrupt payload a WireError rather than a crash."""
    tokens = torch.randint(0, 50_000, (4, 33))
    hidden = torch.randn(4, 33, 3 * CHUNK_BYTES // 33, generator=torch.Generator().manual_seed(16))  # parts
    parts = [p for t in (tokens, hidden.bfloat16()) for p in encode_tensor(t, get_codec(name))]
    assert [p.head.codec for p in parts if p.head.shape] == ["packed-int", name]
    assert sum(1 for p in parts if not p.head.shape) >= 1  # the quantized hidden states still span parts
    tokens_out, hidden_out = decode_tensors(parts, WireLimits())
    assert torch.equal(tokens_out, tokens)
    assert_within_bound(name, hidden.bfloat16(), hidden_out)
    bad = Part(Tensor(shape=[4, 33], dtype="float32", codec=name, num_parts=1), parts[1].buffer[:-1])
    with pytest.raises(WireError):
        decode_tensors([bad], WireLimits())


PACKING_CASES = [(0, 255, torch.uint8), (-128, 127, torch.int8), (0, 256, torch.int16), (-32768, 32767, torch.int16)]


@pytest.mark.parametrize(
    ("low", "high", "packed", "dtype"),
    [(*case, dtype) for case in PACKING_CASES for dtype in (torch.int64, torch.int32, torch.int16)]
    + [
        (0, 50_000, torch.int32, torch.int64),
        (0, 50_000, torch.int32, torch.int32),
        (-(2**40), 7, torch.int64, torch.int64),
    ],
)
def test_packed_integers_are_exact_in_the_narrowest_type(
    low: int, high: int, packed: torch.dtype, dtype: torch.dtype
) -> None:
    x = torch.randint(low, high + 1, (7, 13), generator=torch.Generator().manual_seed(20), dtype=torch.int64)
    x[0, 0], x[0, 1] = low, high
    x = x.to(dtype)
    codec = PACKED_INTEGERS
    payload = codec.encode(x.t())  # strided input too
    assert len(payload) == 1 + x.numel() * packed.itemsize
    y = codec.decode(payload, (13, 7), dtype)
    assert y.dtype == dtype and torch.equal(y, x.t())
    assert codec.decode(codec.encode(x[:0]), (0, 13), dtype).shape == (0, 13)


def test_packed_integers_are_what_compressing_codecs_send_integers_with() -> None:
    ids = torch.randint(0, 256, (32, 64))
    for name in sorted(CODECS):
        (head,) = encode_tensor(ids, get_codec(name))
        assert head.head.codec == ("packed-int" if get_codec(name).lossy else "none")
        assert len(head.buffer) == (1 + ids.numel() if get_codec(name).lossy else 8 * ids.numel())
        (flags,) = encode_tensor(ids > 9, get_codec(name))  # narrow already: as it is
        assert flags.head.codec == "none"
        assert torch.equal(decode_tensors([head], WireLimits())[0], ids)
    assert "packed-int" not in CODECS  # not a --compression choice
    assert get_codec("packed-int") is PACKED_INTEGERS


def test_corrupt_packed_integers_are_refused() -> None:
    good = PACKED_INTEGERS.encode(torch.arange(300, dtype=torch.int64))  # int16
    cases = {
        "empty": (b"", (300,), torch.int64),
        "unknown type byte": (bytes([9]) + good[1:], (300,), torch.int64),
        "short": (good[:-1], (300,), torch.int64),
        "long": (good + b"\0", (300,), torch.int64),
        "wider than its dtype": (PACKED_INTEGERS.encode(torch.tensor([2**40])), (1,), torch.int32),
        "into a float": (good, (300,), torch.float32),
    }
    for case, (payload, shape, dtype) in cases.items():
        with pytest.raises(CodecError):
            PACKED_INTEGERS.decode(payload, shape, dtype)
            pytest.fail(f"decoded the corrupt payload: {case}")
    with pytest.raises(CodecError):
        PACKED_INTEGERS.encode(torch.randn(3))
