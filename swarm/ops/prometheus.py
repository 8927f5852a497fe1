"""Prometheus plumbing shared by the peer's and the trainer's metrics: the endpoint served with --metrics-port,
duration buckets, and collectors read from a process's own tallies.

Each process keeps its metrics in a registry of its own (not prometheus_client's global one), so
importing this module registers nothing and two roles in one process never collide. Values that
mirror state the process keeps anyway (its step, queue, throughput, counts in its summary) are
read when the endpoint is scraped, so the work paths pay nothing for them; only what no state
holds yet (calls, errors, bytes, durations) is counted as it happens.

Nothing imports this module unless --metrics-port is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric

from swarm.config import ConfigError
from swarm.proto import ErrorCode

if TYPE_CHECKING:
    from swarm.net.wire import Part

logger = logging.getLogger(__name__)

# no *_created series: the start time of every counter doubles what a scrape carries and tells an operator nothing
disable_created_metrics()

# seconds: from a stage call on a fast link to an averaging round that waits out a silent mate
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serves `registry` at http://HOST:PORT/metrics on a daemon thread; returns the port (0 picks a free one).

    Call it after the DHT has forked: a listening socket opened before would be inherited by the DHT child.
    Raises ConfigError, one line, when the address cannot be bound (in use, not this machine's, no such host).
    """
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        reason = e.strerror or str(e)
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {reason}; choose another --metrics-port (0: any free one) "
            "or --metrics-host"
        ) from None
    actual = server.server_port
    shown = f"[{host}]" if ":" in host else host
    logger.info(f"Metrics on http://{shown}:{actual}/metrics")
    return actual


def tensor_bytes_by_codec(parts: Sequence[Part]) -> dict[str, int]:
    """Bytes of tensor data in `parts` (as `swarm.net.wire` cuts them), per the codec each tensor was encoded with."""
    sizes: dict[str, int] = {}
    codec = "none"
    for part in parts:
        if part.head.dtype:  # the first part of a tensor names its codec; the parts after it carry only data
            codec = part.head.codec or "none"
        sizes[codec] = sizes.get(codec, 0) + len(part.buffer)
    return sizes


def error_name(code: int) -> str:
    """The ErrorCode's name, as the `code` label shows it (a number no version knows is shown as it is)."""
    try:
        return ErrorCode.Name(code)
    except ValueError:
        return str(code)


class CountersFrom:
    """A collector of counters read from the process's own tallies at each scrape.

    Each entry is (name without _total, help, read); `read` returns a number or, for a labelled
    counter, a mapping from label values to numbers. The tallies must only grow while the process lives.
    """

    def __init__(self, entries: Iterable[tuple[str, str, Callable[[], Any], Sequence[str]]]) -> None:
        self.entries = list(entries)

    def collect(self) -> Iterator[Metric]:
        for name, documentation, read, labels in self.entries:
            family = CounterMetricFamily(name, documentation, labels=list(labels) or None)
            value = read()
            if labels:
                for label_values, number in value.items():
                    family.add_metric(list(label_values), float(number))
            else:
                family.add_metric([], float(value))
            yield family
