"""Copies between a CUDA device and the host, off the runtime's critical path.

A stage's compute for one microbatch takes about a millisecond on a data-center GPU; copying its boundary
tensor to the host with a plain `.cpu()` takes several, and blocks the runtime thread meanwhile, so the
GPU idles between batches. Here the runtime only records an event after a batch's outputs
(`ready_event`) and goes on with the next batch; the copy to the host runs later, in the handler's worker
thread, on a stream of its own into pinned memory (`to_host`), overlapping the next batch's compute. A
reply in a lossy codec is encoded on the device first (8-bit values cross PCIe, not 32-bit ones). Inputs
travel the other way through pinned staging buffers on the same copy stream (`to_device`).

On a CPU every call here is a no-op: tensors are already where they must be.
"""

from __future__ import annotations

import threading

import torch


class DeviceCopies:
    """A device's copy stream and what it takes to use it; inert on a CPU."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._lock = threading.Lock()  # one copy at a time on the stream: its synchronize covers one batch

    def ready_event(self) -> torch.cuda.Event | None:
        """Called on the runtime thread after a batch's outputs are enqueued: marks when they exist."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, tensors: list[torch.Tensor], ready: torch.cuda.Event | None) -> list[torch.Tensor]:
        """The tensors in (pinned) host memory, copied on the copy stream once `ready`; blocks the calling
        thread (a worker's, not the runtime's) until the copy is done."""
        if not self.cuda or not any(t.is_cuda for t in tensors):
            return [t.cpu() for t in tensors]
        with self._lock, torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            hosts = []
            for tensor in tensors:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)  # its memory is not reused before the copy has read it
                hosts.append(host)
            self._stream.synchronize()
        return hosts

    def wait(self, ready: torch.cuda.Event | None) -> None:
        """Blocks the calling thread until `ready` (before it encodes device tensors on the device)."""
        if ready is not None:
            ready.synchronize()

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors on the device, staged through pinned memory on the copy stream; the runtime's stream
        waits for the copies, so the caller may use the results at once."""
        if not self.cuda:
            return [t.to(self.device) for t in tensors]
        with self._lock, torch.cuda.stream(self._stream):
            moved = []
            for tensor in tensors:
                if tensor.is_cuda:
                    moved.append(tensor)
                    continue
                staged = tensor if tensor.is_pinned() else torch.empty_like(tensor, pin_memory=True).copy_(tensor)
                moved.append(staged.to(self.device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(copied)
        for tensor in moved:
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return moved
