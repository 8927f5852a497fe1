"""Copies between a GPU and the host off the runtime's critical path: on a CPU every copy is a no-op that
hands back the very tensors; on a GPU the outputs reach pinned host memory exactly, after the event that
marks them done, while the device goes on with later work."""

from __future__ import annotations

import pytest
import torch

from swarm.peer.device_copies import DeviceCopies


def test_on_a_cpu_nothing_moves():
    copies = DeviceCopies("cpu")
    tensors = [torch.randn(3, 4), torch.arange(5)]
    assert copies.ready_event() is None
    assert all(a is b for a, b in zip(copies.to_host(tensors, None), tensors))
    assert all(torch.equal(a, b) for a, b in zip(copies.to_device(tensors), tensors))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_outputs_reach_pinned_host_memory_exactly_while_the_device_goes_on():
    copies = DeviceCopies("cuda:0")
    host_in = torch.randn(64, 512, 768)
    (on_device,) = copies.to_device([host_in])
    assert on_device.is_cuda and torch.equal(on_device.cpu(), host_in)
    output = on_device * 2 + 1  # enqueued on the compute stream
    ready = copies.ready_event()
    later = torch.randn(4096, 4096, device="cuda:0") @ torch.randn(4096, 4096, device="cuda:0")  # more work queued
    (host_out,) = copies.to_host([output], ready)
    assert host_out.is_pinned() and not host_out.is_cuda
    assert torch.equal(host_out, host_in * 2 + 1)
    torch.cuda.synchronize()
    assert later.shape == (4096, 4096)
