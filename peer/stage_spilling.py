"""Stage spilling: a stage whose blocks live in host memory and visit the device a group at a time.

With `--offload` a peer keeps its stage's transformer blocks (their parameters, gradients and optimizer
state) in host memory, pinned where the device is a GPU, and only the small parts of the stage around
them (`enter` and `leave`: embeddings, boundary projections, final norm and head) on the device. Every
batch streams the blocks to the device in groups of a few blocks; while one group computes, the next
one is already being copied on a side CUDA stream (double buffering), so at most two groups' weights
are on the device at once. The runtime merges the queued requests into one batch before it gets
here, so one pass of loads serves every merged microbatch.

A backward runs forward group by group keeping only each group's input (a checkpoint at every group
boundary), then walks the groups in reverse: load, recompute the group's forward from its input,
backpropagate, send its parameter gradients to the host parameters' `.grad`, pass the input gradient
down. The last group's forward keeps its graph, so it is not recomputed. The optimizer step streams
each parameter with its gradient and moments to the device and runs the stage's own optimizer there.

It is exact: every operation is the one the in-memory stage runs, on the same device, in the same
order (recomputing a group from its saved input repeats its forward bit for bit; a parameter used once
gets the same gradient whether it is backpropagated with the whole stage or its group alone). On a CPU
device the copies are no-ops (the "device copy" is the host tensor itself) and the same code runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from swarm.models.optimizer import apply_accumulated_step, steps_on_device

# Of the device memory a stage may use, the share one group's weights take by default: two groups in
# flight and one group's gradients leave a quarter for activations and the resident parts.
GROUP_SHARE = 4


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """How many bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


def block_bytes(block: nn.Module) -> int:
    """The bytes one block's parameters and buffers take on the device."""
    return tensor_bytes(t for t in (*block.parameters(), *block.buffers()))


def default_group_size(module: nn.Module, device: torch.device, memory: int | None = None) -> int:
    """Blocks per group so that one group's weights take 1/GROUP_SHARE of `memory` bytes (default: what the
    device has free, within a per-process memory fraction if one is set; on a CPU, where spilling saves
    nothing, the whole stage is one group)."""
    blocks = list(module.blocks)
    if not blocks:
        return 1
    if memory is None:
        if device.type != "cuda":
            return len(blocks)
        memory = device_memory_free(device)
    largest = max(block_bytes(block) for block in blocks)
    return max(1, min(len(blocks), memory // GROUP_SHARE // max(largest, 1)))


def cuda_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a bare "cuda"): the memory-fraction calls take no other."""
    return device.index if device.index is not None else torch.cuda.current_device()


def device_memory_free(device: torch.device) -> int:
    """Bytes this process may still allocate on a CUDA device: its free memory, and under a cap set with
    torch.cuda.set_per_process_memory_fraction what the cap leaves."""
    index = cuda_index(device)
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch only
    if fraction is not None:
        free = min(free, int(fraction(index) * total) - torch.cuda.memory_allocated(index))
    return max(free, 0)


class _Loading:
    """Tensors on their way to the device; `wait` makes the compute stream wait for them and returns them."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None, device: torch.device) -> None:
        self.tensors, self.event, self.device = tensors, event, device

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.event)
            for tensor in self.tensors:
                # allocated on the copy stream, used on this one: not reused before this one is done with it
                tensor.record_stream(stream)
        return self.tensors


class DeviceCopier:
    """Host-to-device loads on one side stream and device-to-host stores on another (on a GPU), so that
    copies in both directions overlap the compute. On a CPU every copy is the tensor itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device) if self.cuda else None
        self.store_stream = torch.cuda.Stream(device) if self.cuda else None
        self._stores: torch.cuda.Event | None = None  # recorded on the store stream by `settle_stores`

    def load(self, tensors: list[torch.Tensor]) -> _Loading:
        """Starts copying host tensors to the device; the result's `wait` hands them over."""
        if not self.cuda:
            return _Loading([t.detach() for t in tensors], None, self.device)
        with torch.cuda.stream(self.load_stream):
            copies = [t.detach().to(self.device, non_blocking=True) for t in tensors]
            event = torch.cuda.Event()
            event.record(self.load_stream)
        return _Loading(copies, event, self.device)

    def store(self, tensor: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of a device tensor, written into `host` where given, else into a new pinned tensor;
        it is complete after `finish_stores`. On a CPU: `tensor` itself (or `host`, if that is another
        tensor, with `tensor` copied in)."""
        if not self.cuda:
            if host is not None and host.data_ptr() != tensor.data_ptr():
                return host.copy_(tensor)
            return tensor
        if host is None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.store_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.store_stream):
            host.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(self.store_stream)
        return host

    def event(self) -> torch.cuda.Event | None:
        """An event recorded on the compute stream now (None on a CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self, event: torch.cuda.Event | None) -> None:
        """Waits on the host until the device has passed `event` (nothing for None)."""
        if event is not None:
            event.synchronize()

    def settle_stores(self) -> None:
        """Waits until the stores issued before the previous call are done: called once a group, it keeps at
        most two groups' stores (and the device memory they hold) in flight, however slow the way back."""
        if not self.cuda:
            return
        self.synchronize(self._stores)
        self._stores = torch.cuda.Event()
        self._stores.record(self.store_stream)

    def finish_stores(self) -> None:
        """Waits until every stored tensor has reached the host."""
        if self.cuda:
            self.store_stream.synchronize()


class _Prefetch:
    """Loads lists of host tensors in order, each one while the one before it is in use (double buffering).

    The caller takes a list, enqueues its work on it, drops it and calls `prefetch`: the next list starts
    loading once the work on the list before is done on the device, so at most two lists are there at once
    however far the host runs ahead of the device."""

    def __init__(self, copier: DeviceCopier, lists: list[list[torch.Tensor]]) -> None:
        self.copier, self.lists = copier, lists
        self.next = 0
        self.done: torch.cuda.Event | None = None  # recorded after the work on the list taken before
        self.pending = self._load_next()

    def _load_next(self) -> _Loading | None:
        if self.next >= len(self.lists):
            return None
        self.next += 1
        return self.copier.load(self.lists[self.next - 1])

    def take(self) -> list[torch.Tensor]:
        """The next list, on the device as far as the compute stream is concerned."""
        loading, self.pending = self.pending or self._load_next(), None
        return loading.wait()

    def mark(self) -> None:
        """Notes that the work the next load must not overlap in memory (on the list last taken, or on any
        weights held before the first) is enqueued."""
        self.done = self.copier.event()

    def prefetch(self) -> None:
        """Call once the work on the list last taken is enqueued and the list dropped: waits until the work on
        the list before it is done, then starts loading the next one, which overlaps the work just enqueued."""
        previous = self.done
        self.mark()
        self.copier.synchronize(previous)
        if self.pending is None:
            self.pending = self._load_next()


@dataclass
class _Run:
    """A group's forward with its graph: its input leaf, its output and its weights on the device."""

    input: torch.Tensor
    output: torch.Tensor
    weights: list[torch.Tensor]


class SpilledStage:
    """Runs a stage module (`enter`, `blocks`, `leave`) with its blocks in host memory.

    Called like the module (`stage(x, targets, tokens=...)`), it returns what the module returns, and a
    backward through its result fills the same `.grad`s the module's would (the spilled parameters' on the
    host). The module must have blocks called as `block(hidden, context)` whose shared context needs no
    gradient. Building this moves everything but the blocks to `device` and the blocks to (pinned) host
    memory; the parameters keep their identity, so the module's optimizer still holds them.
    """

    def __init__(self, module: nn.Module, device: torch.device | str, group_size: int = 0) -> None:
        self.module = module
        self.device = torch.device(device)
        self.copier = DeviceCopier(self.device)
        _place(module, self.device)
        blocks = list(module.blocks)
        size = group_size if group_size > 0 else default_group_size(module, self.device)
        self.groups: list[list[nn.Module]] = [blocks[i : i + size] for i in range(0, len(blocks), size)]
        # per group: its blocks' (block, names, host tensors, which of them are parameters), in load order
        self._weights = [_group_weights(group) for group in self.groups]
        self._host_lists = [[t for _, _, tensors, _ in weights for t in tensors] for weights in self._weights]
        self.spilled = [p for block in blocks for p in block.parameters()]
        unit_bytes = max(1, max((tensor_bytes(iter(h)) for h in self._host_lists), default=1) // GROUP_SHARE)
        self._step_units = _step_units(self.spilled, unit_bytes)

    def __call__(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The module's forward, the blocks streamed through the device (see the module for the arguments)."""
        module = self.module
        hidden, context = module.enter(x, tokens)
        if self.groups:
            if _needs_grad(context):
                raise NotImplementedError("spilling a stage whose blocks' shared context needs a gradient")
            keep = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in self.spilled))
            hidden = _StreamedBlocks.apply(self, keep, hidden, context, *self.spilled)
        return module.leave(hidden, targets, context)

    # --- the blocks, forward and backward ------------------------------------------------------------

    def forward_groups(self, ctx: Any, hidden: torch.Tensor, context: Any) -> torch.Tensor:
        """The blocks on `hidden`, a group at a time. With `ctx` (a backward will follow) each group's input
        is kept in it, and the last group's graph: the groups run with gradients on, as a stage in memory
        runs them for its backward."""
        loads = _Prefetch(self.copier, self._host_lists)
        if ctx is None:
            for index in range(len(self.groups)):
                hidden = self._run_group(index, loads.take(), hidden, context)
                loads.prefetch()
            return hidden
        ctx.saved, ctx.context = [], context
        ctx.autocast = _autocast_state(self.device)
        with torch.enable_grad():
            for index in range(len(self.groups)):
                leaf = hidden.detach().requires_grad_(True)
                ctx.saved.append(leaf)
                weights = loads.take()
                output = self._run_group(index, weights, leaf, context, with_grad=True)
                hidden = output.detach()
                if index < len(self.groups) - 1:
                    del weights, output
                loads.prefetch()
        ctx.kept = _Run(leaf, output, weights)
        return hidden

    def backward_groups(self, ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Backpropagates the blocks' output gradient through the groups in reverse, recomputing each but the
        last from its saved input; returns the input gradient and the spilled parameters' gradients (on the
        host, in `self.spilled`'s order)."""
        last = len(self.groups) - 1
        # the first load of the reverse walk overlaps the last group's backward
        loads = _Prefetch(self.copier, [self._host_lists[index] for index in reversed(range(last))])
        grads: list[list[torch.Tensor | None]] = [[] for _ in self.groups]
        grad, grads[last] = self._group_grads(last, ctx.kept, grad)
        ctx.kept = None  # its weights leave the device before a third group arrives
        loads.mark()
        for index in reversed(range(last)):
            leaf = ctx.saved[index].detach().requires_grad_(True)
            ctx.saved[index] = None
            weights = loads.take()
            with torch.enable_grad(), torch.autocast(self.device.type, **ctx.autocast):
                output = self._run_group(index, weights, leaf, ctx.context, with_grad=True)
            grad, grads[index] = self._group_grads(index, _Run(leaf, output, weights), grad)
            del weights, output, leaf
            loads.prefetch()
        self.copier.finish_stores()
        return grad, [g for group in grads for g in group]

    def _group_grads(self, index: int, run: _Run, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One group's backward: its input's gradient, and its parameters' gradients stored to the host."""
        params = [
            t
            for (_, _, _, is_param), ts in _split(self._weights[index], run.weights)
            for t, p in zip(ts, is_param)
            if p
        ]
        input_grad, *param_grads = torch.autograd.grad(run.output, [run.input, *params], grad, allow_unused=True)
        stored = [None if g is None else self.copier.store(g) for g in param_grads]
        self.copier.settle_stores()
        return input_grad, stored

    def _run_group(
        self,
        index: int,
        weights: list[torch.Tensor],
        hidden: torch.Tensor,
        context: Any,
        with_grad: bool = False,
    ) -> torch.Tensor:
        """One group's blocks on `hidden`, with their weights taken from `weights` (device copies)."""
        for (block, names, _, is_param), tensors in _split(self._weights[index], weights):
            if with_grad:
                tensors = [t.requires_grad_(True) if p else t for t, p in zip(tensors, is_param)]
            hidden = functional_call(block, dict(zip(names, tensors)), (hidden, context))
        return hidden

    # --- the optimizer step --------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, num_samples: int) -> None:
        """`apply_accumulated_step` for this stage: the resident parameters step where they are; the spilled
        ones step on the device, a few at a time, each streamed there with its gradient and optimizer state
        and back, so they step with the same arithmetic as in memory."""
        grads = {id(p): p.grad for p in self.spilled}
        for param in self.spilled:
            param.grad = None
        apply_accumulated_step(self.module, optimizer, num_samples)  # steps and clears the resident ones
        units = [[p for p in unit if grads[id(p)] is not None] for unit in self._step_units]
        units = [unit for unit in units if unit]
        lists, keys = [], []
        for unit in units:
            unit_keys = [_moment_keys(optimizer, p) for p in unit]
            moments = [optimizer.state[p][key] for p, names in zip(unit, unit_keys) for key in names]
            lists.append([*(p.data for p in unit), *(grads[id(p)] for p in unit), *moments])
            keys.append(unit_keys)
        loads = _Prefetch(self.copier, lists)
        for unit, unit_keys, host in zip(units, keys, lists):
            self._step_unit(optimizer, unit, unit_keys, host, loads.take(), num_samples)
            self.copier.settle_stores()
            loads.prefetch()
        self.copier.finish_stores()

    def _step_unit(
        self,
        optimizer: torch.optim.Optimizer,
        unit: list[nn.Parameter],
        keys: list[list[str]],
        host: list[torch.Tensor],
        loaded: list[torch.Tensor],
        num_samples: int,
    ) -> None:
        """Steps one unit of parameters on the device and stores them and their optimizer state back."""
        count, fused = len(unit), steps_on_device(optimizer)
        host_data, moments = host[:count], iter(loaded[2 * count :])
        host_moments = iter(host[2 * count :])
        for param, data, grad, names in zip(unit, loaded[:count], loaded[count : 2 * count], keys):
            param.data = data
            param.grad = grad
            state = optimizer.state[param]
            for key in names:
                state[key] = next(moments)
            if fused and isinstance(state.get("step"), torch.Tensor):  # a fused step counts where the parameter is
                state["step"] = state["step"].to(data.device)
        with torch.no_grad():
            for param in unit:
                param.grad.div_(num_samples)
        optimizer.step()  # only this unit has gradients now
        for param, data, names in zip(unit, host_data, keys):
            stepped = param.data
            param.grad = None
            param.data = data
            self.copier.store(stepped, data)
            state = optimizer.state[param]
            previous = {key: next(host_moments) for key in names}
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device != data.device:
                    state[key] = self.copier.store(value, previous.get(key))


class _StreamedBlocks(torch.autograd.Function):
    """The spilled blocks as one autograd node: the host parameters are its inputs, so their gradients
    reach their `.grad` through autograd's own accumulation, as a stage's in memory do."""

    @staticmethod
    def forward(ctx: Any, stage: SpilledStage, keep: bool, hidden: torch.Tensor, context: Any, *params: Any) -> Any:
        ctx.stage = stage
        return stage.forward_groups(ctx if keep else None, hidden, context)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        input_grad, param_grads = ctx.stage.backward_groups(ctx, grad)
        wanted = ctx.needs_input_grad[4:]
        return (None, None, input_grad, None, *(g if want else None for g, want in zip(param_grads, wanted)))


def _needs_grad(value: Any) -> bool:
    """Whether a tensor, or any tensor in a tuple or list of them (a stage's context), requires a gradient."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    return isinstance(value, (tuple, list)) and any(_needs_grad(item) for item in value)


def _autocast_state(device: torch.device) -> dict[str, Any]:
    """The autocast in force for `device`'s kind, to recompute a group under it."""
    kind = device.type
    if hasattr(torch, "get_autocast_dtype"):
        return {"enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind)}
    if kind == "cuda":  # torch before 2.4
        return {"enabled": torch.is_autocast_enabled(), "dtype": torch.get_autocast_gpu_dtype()}
    return {"enabled": torch.is_autocast_cpu_enabled(), "dtype": torch.get_autocast_cpu_dtype()}


def _place(module: nn.Module, device: torch.device) -> None:
    """Everything but the blocks to `device`; the blocks to host memory, pinned if the device is a GPU."""
    blocks = module.blocks
    module.blocks = nn.ModuleList()
    try:
        module.to(device)
    finally:
        module.blocks = blocks
    blocks.to("cpu")
    if device.type != "cuda":
        return
    for param in blocks.parameters():
        param.data = param.data.pin_memory()
    for sub in blocks.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.pin_memory()


def _group_weights(group: list[nn.Module]) -> list[tuple[nn.Module, list[str], list[torch.Tensor], list[bool]]]:
    """Each block of a group with the names and host tensors of its parameters and buffers."""
    weights = []
    for block in group:
        named = [(name, p, True) for name, p in block.named_parameters()]
        named += [(name, b, False) for name, b in block.named_buffers()]
        weights.append((block, [n for n, _, _ in named], [t for _, t, _ in named], [p for _, _, p in named]))
    return weights


def _split(weights: list, tensors: list[torch.Tensor]) -> Iterator[tuple[tuple, list[torch.Tensor]]]:
    """Pairs each block's entry with its slice of a group's loaded tensors."""
    start = 0
    for entry in weights:
        count = len(entry[1])
        yield entry, tensors[start : start + count]
        start += count


def _step_units(params: list[nn.Parameter], unit_bytes: int) -> list[list[nn.Parameter]]:
    """The spilled parameters in consecutive units of about `unit_bytes` (a larger parameter alone)."""
    units: list[list[nn.Parameter]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if not units or size + nbytes > unit_bytes:
            units.append([])
            size = 0
        units[-1].append(param)
        size += nbytes
    return units


def _moment_keys(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> list[str]:
    """The optimizer's per-parameter state tensors shaped like the parameter (AdamW's moments), by key."""
    state = optimizer.state.get(param, {})
    return [
        key
        for key, value in state.items()
        if key != "step" and isinstance(value, torch.Tensor) and value.shape == param.shape
    ]
