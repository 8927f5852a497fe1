"""The inputs of this trainer's applied backwards, kept (bounded) in case the peer that applied them dies
before its stage steps: the stage then names them lost, and they are sent again."""

from __future__ import annotations

from collections import OrderedDict

import torch


class ResendBuffer:
    """The inputs of applied backwards, by (stage, microbatch), oldest dropped first past a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple[int, int], tuple[list[torch.Tensor], int]] = OrderedDict()

    def put(self, key: tuple[int, int], tensors: list[torch.Tensor]) -> None:
        """Keeps `tensors` under `key`, dropping the oldest past the budget (inputs larger than it are not kept)."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > self.max_bytes:
            return
        if key in self._items:
            self.bytes -= self._items.pop(key)[1]
        self._items[key] = (tensors, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self._items.popitem(last=False)[1][1]

    def get(self, key: tuple[int, int]) -> list[torch.Tensor] | None:
        """The inputs kept under `key`, or None if they were never kept or were dropped since."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def __len__(self) -> int:
        return len(self._items)
