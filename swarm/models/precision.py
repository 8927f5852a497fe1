"""The swarm's compute dtype (`--dtype`): what a stage computes in and what its boundary tensors travel in.

Parameters and optimizer state stay float32 (the master copy); a stage's forward runs under
`torch.autocast` in the compute dtype, and the hidden states and their gradients that cross a stage
boundary are cast to it, so bfloat16 halves the bytes on the wire. Parameter gradients stay float32:
autocast casts float32 parameters for its kernels, and the cast's backward returns float32.

float32 turns autocast off altogether, so a float32 swarm computes exactly what it computed before
the setting existed. float16 is refused: its gradients underflow without loss scaling, which every
stage of the pipeline would have to agree on step by step; bfloat16 has float32's range and needs none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: the values of --dtype
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
#: the compute dtype each explicit value stands for
COMPUTE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BOUNDARY_DTYPES = (torch.float32, torch.bfloat16)  # what boundary tensors may travel in (fp16 is refused)
FP16_REFUSAL = (
    "--dtype fp16 needs loss scaling for its gradients, which the swarm does not do (they underflow float16 "
    "between stages): use --dtype bf16, as fast on GPUs that have it and with float32's range, or fp32"
)


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """The explicit --dtype that `name` means on `device`: auto is bf16 on a CUDA device that computes it in
    hardware, fp32 anywhere else (a CPU's bfloat16 autocast runs, but is no faster than its float32)."""
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and _native_bf16(device):
        return "bf16"
    return "fp32"


def _native_bf16(device: torch.device) -> bool:
    """Whether a CUDA device computes bfloat16 in hardware (compute capability 8.0, Ampere, or later): older
    ones (a T4, a V100) only emulate it, slower than their float16 and no faster than float32."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 0)


def compute_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype a stage on `device` computes in and sends its boundary tensors in, for --dtype `name`."""
    return COMPUTE_DTYPES[resolve_dtype(name, device)]


def flag_value(dtype: torch.dtype) -> str:
    """The --dtype value of a compute dtype (bf16 for torch.bfloat16), for messages."""
    return next((name for name, known in COMPUTE_DTYPES.items() if known == dtype), str(dtype))


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Autocast to `dtype` on `device`'s kind; nothing at all for float32 (exactly the plain computation)."""
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def expected_dtype(name: str, announced: str | None) -> torch.dtype | None:
    """The boundary dtype a process without a device of its own (a trainer) expects for --dtype `name`: the
    one it names, or for auto the one the swarm's peers announce (`announced`); None while they announce
    none, for a caller that then takes float32 or bfloat16 as the peers send it."""
    if name != "auto":
        return COMPUTE_DTYPES[name]
    return COMPUTE_DTYPES.get(announced or "")
