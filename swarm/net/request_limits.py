"""How large a stage call a peer accepts: from its stage's boundary size and the largest microbatch it takes.

A backward is a stage's largest call: it carries the stage's input again (hidden states, or the token
ids on the first stage), the token ids where later stages take them, and the output gradient (the
targets on the last stage). A peer that accepts microbatches of up to N samples therefore accepts
messages of N backwards' worth of bytes, plus a little for frames and headers, and no more: a fixed
limit refuses GPU-sized microbatches of large models and lets through absurd ones of small models.

Boundary tensors are counted at 4 bytes an element (float32, the widest on the wire: a narrower
compute dtype only leaves room), token ids at 8 (int64, as they are sent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from swarm.models.precision import flag_value
from swarm.models.stage_io import expected_inputs
from swarm.net.wire import CHUNK_BYTES, Announced, Part, WireError, WireLimits, announced_tensors
from swarm.proto import ErrorCode

BOUNDARY_ELEMENT_BYTES = 4  # float32: the widest dtype a boundary tensor goes over the wire in
TOKEN_BYTES = 8  # int64 token ids and targets
HEADROOM_BYTES = 2**20  # frames, tensor headers and the request's own fields: far less than this
HEADROOM_SHARE = 1 / 64  # and per byte of tensors (a part of CHUNK_BYTES costs some tens of bytes)
# what a codec may add to a tensor's raw bytes (block scales, a codebook, a header): far below this
CODEC_SLACK_BYTES = 64 * 1024
CODEC_SLACK_SHARE = 1 / 16
FIELDS_PER_PART = 8  # protobuf fields a tensor part takes in a frame (its tag, shape, dtype, codec, count, buffer)


@dataclass(frozen=True)
class CallTensors:
    """What one backward to a stage carries, per sample: [seq_len, width] boundary tensors and [seq_len] id tensors."""

    boundary: int  # hidden input and output gradient, each [seq_len, width] per sample
    ids: int  # token ids and targets, each [seq_len] per sample

    @classmethod
    def backward_of(cls, is_first: bool, is_last: bool, takes_tokens: bool) -> CallTensors:
        """The tensors of a backward to a stage: its input, the token ids it takes besides, the output's gradient."""
        boundary = (not is_first) + (not is_last)  # the hidden input; the gradient of the hidden output
        ids = is_first + takes_tokens + is_last  # the first stage's input; the ids besides; the last's targets
        return cls(int(boundary), int(ids))


def call_bytes(tensors: CallTensors, width: int, seq_len: int, samples: int, element_bytes: int) -> tuple[int, int]:
    """(bytes of all the call's tensors, bytes of its largest tensor) for a call of `samples` samples."""
    boundary = samples * seq_len * width * element_bytes
    ids = samples * seq_len * TOKEN_BYTES
    largest = max(boundary if tensors.boundary else 0, ids if tensors.ids else 0)
    return tensors.boundary * boundary + tensors.ids * ids, largest


def with_headroom(payload: int) -> int:
    """A message's bytes for `payload` bytes of tensors: frames, part headers and the request's fields added."""
    return payload + HEADROOM_BYTES + math.ceil(payload * HEADROOM_SHARE)


def request_limits(
    tensors: CallTensors,
    width: int,
    seq_len: int,
    max_microbatch: int,
    element_bytes: int = BOUNDARY_ELEMENT_BYTES,
    max_message_bytes: int = 0,
    source: str = "",
) -> WireLimits:
    """The limits of a peer whose stage's backward carries `tensors` and that accepts up to `max_microbatch`
    samples a call; `max_message_bytes` (0: none), if given, replaces what follows from them. `source` says
    where the limits come from and what to change, for the refusal of a message over them."""
    payload, largest = call_bytes(tensors, width, seq_len, max_microbatch, element_bytes)
    message = max_message_bytes or with_headroom(payload)
    tensor = max_message_bytes or largest
    # parts of at most CHUNK_BYTES, a few more for the small tensors; never below the fixed defaults
    parts = max(WireLimits.max_parts, math.ceil(message / CHUNK_BYTES) + 4 * (tensors.boundary + tensors.ids))
    fields = max(WireLimits.max_fields, FIELDS_PER_PART * parts)
    return WireLimits(
        max_message_bytes=message, max_tensor_bytes=tensor, max_parts=parts, max_fields=fields, source=source
    )


def reply_limits(width: int, seq_len: int, samples: int, element_bytes: int = BOUNDARY_ELEMENT_BYTES) -> WireLimits:
    """What a caller reads in the reply to a call of `samples` samples: one boundary tensor (a forward's output,
    or a backward's input gradient), with the same headroom."""
    return request_limits(CallTensors(boundary=1, ids=0), width, seq_len, samples, element_bytes)


def largest_fitting_microbatch(
    tensors: CallTensors, width: int, seq_len: int, max_message_bytes: int, element_bytes: int = BOUNDARY_ELEMENT_BYTES
) -> int:
    """The most samples a backward may carry within `max_message_bytes` (0 if not even one fits)."""
    per_sample, _ = call_bytes(tensors, width, seq_len, 1, element_bytes)
    if per_sample <= 0:
        return 0
    samples = max(0, int((max_message_bytes - HEADROOM_BYTES) / (per_sample * (1 + HEADROOM_SHARE))))
    while samples > 0 and with_headroom(samples * per_sample) > max_message_bytes:  # rounding of the share
        samples -= 1
    return samples


class BoundarySpec(Protocol):
    """What the limits need of a model's spec (`swarm.models.ModelSpec`)."""

    seq_len: int

    @property
    def boundary_width(self) -> int: ...


class StageShape(Protocol):
    """What the limits need of a stage module (`swarm.models.GPTStage`)."""

    spec: BoundarySpec
    stage: int
    is_first: bool
    is_last: bool
    takes_tokens: bool


@dataclass(frozen=True)
class StageLimits:
    """What a peer accepts of its stage's calls: the wire limits, the most samples in one call, and the largest
    microbatch it announces (the most samples whose backward fits both)."""

    wire: WireLimits
    max_call_samples: int  # refused above this with TOO_LARGE, whatever the bytes
    max_microbatch: int  # announced: a trainer splits larger microbatches into parts of at most this


def stage_limits(
    stage: StageShape, max_microbatch: int, max_request_bytes: int = 0, element_bytes: int = BOUNDARY_ELEMENT_BYTES
) -> StageLimits:
    """A peer's limits for `stage`: from the stage's boundary size and --max-microbatch, or where
    --max-request-mb is given (`max_request_bytes`), from that, announcing the microbatch whose backward fits."""
    spec = stage.spec
    tensors = CallTensors.backward_of(stage.is_first, stage.is_last, stage.takes_tokens)
    width, seq_len = spec.boundary_width, spec.seq_len
    advice = "send smaller microbatches (the trainer's --microbatch-size)"
    if max_request_bytes:
        fitting = largest_fitting_microbatch(tensors, width, seq_len, max_request_bytes, element_bytes)
        announced = max(1, min(max_microbatch, fitting))
        source = (
            f"this peer's --max-request-mb {max_request_bytes / 2**20:g} holds a backward of stage {stage.stage} "
            f"of {fitting} samples: {advice}, or start this peer with a larger --max-request-mb (0: from the model "
            "and --max-microbatch)"
        )
    else:
        announced = max_microbatch
        shapes = _describe(tensors, max_microbatch, seq_len, width, element_bytes)
        source = (
            f"the limit holds a backward of stage {stage.stage} of this peer's --max-microbatch {max_microbatch} "
            f"samples ({shapes}): {advice}, or start this peer with a larger --max-microbatch"
        )
    wire = request_limits(tensors, width, seq_len, max_microbatch, element_bytes, max_request_bytes, source)
    return StageLimits(wire, max_microbatch, announced)


def _describe(tensors: CallTensors, samples: int, seq_len: int, width: int, element_bytes: int) -> str:
    """The tensors of a backward in words, e.g. `2 x float32[8, 512, 768] and 1 x int64[8, 512]`."""
    dtype = "float32" if element_bytes == 4 else f"{8 * element_bytes}-bit"
    described = [f"{tensors.boundary} x {dtype}[{samples}, {seq_len}, {width}]"] if tensors.boundary else []
    described += [f"{tensors.ids} x int64[{samples}, {seq_len}]"] if tensors.ids else []
    return " and ".join(described)


def call_too_large(samples: int, max_call_samples: int) -> str:
    """The refusal of a call of `samples` samples, over the `max_call_samples` this peer accepts in one call."""
    return (
        f"a call of {samples} samples is over this peer's limit of {max_call_samples} samples per call "
        f"(its --max-microbatch, or --max-batch-samples where that is 0): send microbatches of at most "
        f"{max_call_samples} samples (the trainer's --microbatch-size), or start this peer with a larger "
        "--max-microbatch"
    )


def undecoded_problem(
    stage: StageShape, backward: bool, parts: list[Part], max_batch: int, dtype: torch.dtype = torch.float32
) -> tuple[int, str] | None:
    """What is wrong with a stage call's tensors as their headers announce them, before any is decoded: their
    count, shapes and dtypes against the stage's boundary, and their bytes against what such a tensor takes
    (`CODEC_SLACK_*` above its raw size); (error code, message) or None. A peer calls it on the parts it read,
    so that a request is never decoded (nor decompressed) into more than the model's shapes hold."""
    try:
        announced = announced_tensors(parts)
    except WireError as e:
        return e.code, str(e)
    names = expected_inputs(stage, backward)
    if len(announced) != len(names):
        kind = "backward" if backward else "forward"
        return ErrorCode.BAD_REQUEST, (
            f"{kind} of stage {stage.stage} takes {len(names)} tensors ({', '.join(names)}), got {len(announced)}"
        )
    first = announced[0]
    if len(first.shape) < 2:
        return ErrorCode.BAD_REQUEST, f"{names[0]} must be [batch, seq, ...], got {_announced(first)}"
    batch, seq = first.shape[:2]
    if batch > max_batch:
        return ErrorCode.TOO_LARGE, call_too_large(batch, max_batch)
    if batch < 1:
        return ErrorCode.BAD_REQUEST, f"batch size {batch} is outside 1..{max_batch} for this peer"
    if not 1 <= seq <= stage.spec.seq_len:
        return ErrorCode.BAD_REQUEST, f"sequence length {seq} is outside 1..{stage.spec.seq_len} of this model"
    for name, tensor in zip(names, announced):
        if name in ("tokens", "targets"):
            want, want_dtype = (batch, seq), torch.int64
        else:
            want, want_dtype = (batch, seq, stage.spec.boundary_width), dtype
        if tensor.shape != want or tensor.dtype != want_dtype:
            hint = ""
            if tensor.dtype != want_dtype and tensor.dtype.is_floating_point and want_dtype.is_floating_point:
                hint = f": this stage computes in --dtype {flag_value(dtype)}, and every peer and trainer of a swarm"
                hint += " must agree"
            return (
                ErrorCode.BAD_REQUEST,
                f"{name} must be {_dtype(want_dtype)}{list(want)}, got {_announced(tensor)}{hint}",
            )
        raw = math.prod(want) * torch.empty((), dtype=want_dtype).element_size()
        if tensor.wire_bytes > raw + CODEC_SLACK_BYTES + raw * CODEC_SLACK_SHARE:
            return ErrorCode.BAD_REQUEST, (
                f"{name} {_announced(tensor)} comes in {tensor.wire_bytes} bytes of codec {tensor.codec}, more than "
                f"such a tensor takes ({raw} bytes raw)"
            )
    return None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _announced(tensor: Announced) -> str:
    return f"{_dtype(tensor.dtype)}{list(tensor.shape)}"
