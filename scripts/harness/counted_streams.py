"""Counting (and optionally shaping) every byte a process's streams carry, outside the code being measured.

A benchmark must not trust a counter kept by the code under test, so the streams themselves are wrapped:
`CountedStream` stands in for a call's reader and writer (or the one object the direct plane uses for
both) and adds every byte written and read to a `Traffic`. Two ways to put it in place:

- `CountedNetwork` wraps the object a swarm process hands its protocols (a hivemind `P2P` or the direct
  plane standing in for it): the calls it opens and the handlers registered on it see counted streams;
- `count_hivemind_streams` patches hivemind's `P2P` class in this process (hivemind's averager opens its
  own `P2P` in a child process), with the caller's side of unary calls counted too.

With a `LinkShape`, the process's streams share one emulated network interface: every byte written waits
for the interface's uplink, every byte read for its downlink (bandwidth, `swarm.net.link_shaper`), and each
stream's first message pays the one-way latency once. So a peer that sends fifteen gradients at once
waits for all fifteen to leave, as it would behind one real link; the sender's and the receiver's waits
overlap, which makes this an approximation of a link, not a model of TCP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)  # at DEBUG: every stream opened and served, with its protocol

NIC = "interface"  # the one key of the shaper: every peer's bytes share this process's interface


@dataclass
class Traffic:
    """Bytes written and read on counted streams, and when the first stream of a watched protocol opened."""

    sent: int = 0
    received: int = 0
    first_watched_at: float = 0.0  # time.time(); 0 until a stream of the watched protocol opens
    watch: str = ""  # a protocol name fragment: opening such a stream marks the data phase of a round

    def add_sent(self, count: int) -> None:
        self.sent += count

    def add_received(self, count: int) -> None:
        self.received += count

    def opened(self, protocol: str) -> None:
        if self.watch and self.watch in protocol and not self.first_watched_at:
            self.first_watched_at = time.time()


class SharedTraffic(Traffic):
    """A `Traffic` whose figures live in shared memory: a forked child counts, its parent reads."""

    def __init__(self, watch: str = "") -> None:
        import multiprocessing

        self._sent = multiprocessing.RawValue("q", 0)
        self._received = multiprocessing.RawValue("q", 0)
        self._first = multiprocessing.RawValue("d", 0.0)
        self.watch = watch

    @property
    def sent(self) -> int:
        return self._sent.value

    @property
    def received(self) -> int:
        return self._received.value

    @property
    def first_watched_at(self) -> float:
        return self._first.value

    @first_watched_at.setter
    def first_watched_at(self, value: float) -> None:
        self._first.value = value

    def add_sent(self, count: int) -> None:
        self._sent.value += count

    def add_received(self, count: int) -> None:
        self._received.value += count


class Shaper:
    """One emulated network interface of a process: bandwidth each way (Mbit/s, 0: unlimited) and latency."""

    def __init__(self, bandwidth_mbit: float, latency_ms: float) -> None:
        from swarm.net.link_shaper import LinkShape, LinkShaper

        self.latency = latency_ms / 1000
        self.links = LinkShaper(LinkShape(bandwidth_mbit=bandwidth_mbit, latency_ms=0.0))

    async def up(self, count: int) -> None:
        await self.links.send(NIC, count)

    async def down(self, count: int) -> None:
        await self.links.receive(NIC, count)


class CountedStream:
    """A call's reader and writer (one object on the direct plane, two on libp2p) that count every byte."""

    def __init__(self, reader: Any, writer: Any, traffic: Traffic, shaper: Shaper | None = None) -> None:
        self._reader, self._writer = reader, writer
        self._traffic, self._shaper = traffic, shaper
        self._unshaped = 0  # bytes written since the last drain
        self._first = True  # the stream's first message still owes the one-way latency

    # --- writing ---------------------------------------------------------------------------------

    def write(self, data) -> None:
        count = len(memoryview(data).cast("B"))
        self._traffic.add_sent(count)
        self._unshaped += count
        self._writer.write(data)

    async def drain(self) -> None:
        if self._shaper is not None and self._unshaped:
            count, self._unshaped = self._unshaped, 0
            await self._shaper.up(count)
            if self._first:
                self._first = False
                await asyncio.sleep(self._shaper.latency)
        await self._writer.drain()

    # --- reading ---------------------------------------------------------------------------------

    async def readexactly(self, n: int):
        data = await self._reader.readexactly(n)
        await self._received(len(data))
        return data

    async def read(self, n: int = -1):
        data = await self._reader.read(n)
        await self._received(len(data))
        return data

    async def _received(self, count: int) -> None:
        self._traffic.add_received(count)
        if self._shaper is not None and count:
            await self._shaper.down(count)

    def at_eof(self) -> bool:
        return self._reader.at_eof()

    def __getattr__(self, name: str) -> Any:
        # close, is_closing, wait_closed, get_extra_info, shared (the direct plane's shared memory: kept off)
        return getattr(self._writer, name)


def counted_handler(handler, traffic: Traffic, shaper: Shaper | None):
    """`handler(info, reader, writer)` given counted streams."""

    async def counted(info, reader, writer) -> None:
        stream = CountedStream(reader, writer, traffic, shaper)
        logger.debug(f"serving {getattr(info, 'proto', '?')} from {str(info.peer_id)[-6:]}")
        await handler(info, stream, stream)
        logger.debug(f"served {getattr(info, 'proto', '?')} from {str(info.peer_id)[-6:]}")

    return counted


class CountedNetwork:
    """A swarm process's network object (`P2P` or `DirectPlane`) whose calls and handlers use counted streams."""

    def __init__(self, network: Any, traffic: Traffic, shaper: Shaper | None = None) -> None:
        self._network, self._traffic, self._shaper = network, traffic, shaper

    async def call_binary_stream_handler(self, peer_id, protocol: str):
        self._traffic.opened(protocol)
        logger.debug(f"calling {protocol} on {str(peer_id)[-6:]}")
        info, reader, writer = await self._network.call_binary_stream_handler(peer_id, protocol)
        stream = CountedStream(reader, writer, self._traffic, self._shaper)
        return info, stream, stream

    async def add_binary_stream_handler(self, protocol: str, handler, *args, **kwargs) -> None:
        await self._network.add_binary_stream_handler(
            protocol, counted_handler(handler, self._traffic, self._shaper), *args, **kwargs
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._network, name)


def count_hivemind_streams(traffic: Traffic, shaper: Shaper | None = None) -> None:
    """Counts every stream hivemind's `P2P` opens or serves in this process from now on (and unary calls' sides)."""
    from hivemind.p2p import P2P

    open_stream, add_handler = P2P.call_binary_stream_handler, P2P.add_binary_stream_handler
    unary = P2P._call_unary_protobuf_handler

    async def call_binary_stream_handler(self, peer_id, handler_name: str):
        traffic.opened(handler_name)
        info, reader, writer = await open_stream(self, peer_id, handler_name)
        stream = CountedStream(reader, writer, traffic, shaper)
        return info, stream, stream

    async def add_binary_stream_handler(self, name: str, handler, balanced: bool = False) -> None:
        await add_handler(self, name, counted_handler(handler, traffic, shaper), balanced)

    async def call_unary(self, peer_id, handle_name: str, input, output_protobuf_type):
        traffic.add_sent(input.ByteSize())
        response = await unary(self, peer_id, handle_name, input, output_protobuf_type)
        traffic.add_received(response.ByteSize())
        return response

    P2P.call_binary_stream_handler = call_binary_stream_handler
    P2P.add_binary_stream_handler = add_binary_stream_handler
    P2P._call_unary_protobuf_handler = call_unary
