"""Prometheus metrics: the endpoint a peer or trainer serves with --metrics-port, and the trainer's metrics.

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

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, Metric

from swarm import __version__
from swarm.config import ConfigError
from swarm.proto import ErrorCode

if TYPE_CHECKING:
    from swarm.net.transport import CallStats
    from swarm.net.wire import Part
    from swarm.trainer.trainer import Trainer

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


class TrainerMetrics:
    """What `swarm train --metrics-port` exports, all named swarm_trainer_*."""

    def __init__(self, trainer: Trainer) -> None:
        config = trainer.config
        self.registry = CollectorRegistry()
        registry = self.registry
        Info("swarm_trainer", "what this trainer trains", registry=registry).info(
            {
                "peer_id": trainer.trainer_id,
                "model": config.model,
                "num_stages": str(config.num_stages),
                "run_id": config.run_id,
                "version": __version__,
            }
        )
        Gauge("swarm_trainer_step", "the optimizer step this trainer feeds next", registry=registry).set_function(
            lambda: trainer.step
        )
        summary = trainer.summary
        Gauge(
            "swarm_trainer_samples_per_second", "samples per second over this run's finished steps", registry=registry
        ).set_function(lambda: summary.samples_per_second)
        self.loss = Gauge("swarm_trainer_loss", "mean loss of the latest finished step", registry=registry)
        self.samples = Counter("swarm_trainer_samples", "samples of finished steps", registry=registry)
        live = Gauge("swarm_trainer_live_peers", "peers this trainer may call, per stage", ["stage"], registry=registry)
        for stage in range(config.num_stages):
            live.labels(str(stage)).set_function(lambda stage=stage: len(trainer.router.live_peers(stage)))
        self.calls = Counter(
            "swarm_trainer_calls", "stage calls answered, per stage and kind", ["stage", "kind"], registry=registry
        )
        self.call_seconds = Histogram(
            "swarm_trainer_call_seconds",
            "duration of answered stage calls, network included",
            ["stage", "kind"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "swarm_trainer_errors",
            "failed stage call attempts, per error code (UNAVAILABLE also for timeouts and broken streams)",
            ["code"],
            registry=registry,
        )
        self.bytes = Counter(
            "swarm_trainer_bytes",
            "bytes of answered stage calls, per direction and the codec the call used",
            ["direction", "codec"],
            registry=registry,
        )
        registry.register(
            CountersFrom(
                [
                    ("swarm_trainer_retries", "stage calls tried again on another peer", lambda: summary.retries, ()),
                    ("swarm_trainer_requeued", "calls out of attempts, queued again", lambda: summary.requeued, ()),
                    (
                        "swarm_trainer_samples_resent",
                        "samples sent again to a stage that lost them with a peer",
                        lambda: summary.samples_resent,
                        (),
                    ),
                    (
                        "swarm_trainer_bad_replies",
                        "replies refused for what they held",
                        lambda: summary.bad_replies,
                        (),
                    ),
                    (
                        "swarm_trainer_bans",
                        "times a failing peer was banned for a while",
                        lambda: trainer.router.bans_issued,
                        (),
                    ),
                ]
            )
        )

    def call_answered(self, stage: int, backward: bool, codec: str, stats: CallStats, seconds: float) -> None:
        """Counts one answered stage call."""
        stage_label, kind = str(stage), "backward" if backward else "forward"
        self.calls.labels(stage_label, kind).inc()
        self.call_seconds.labels(stage_label, kind).observe(seconds)
        self.bytes.labels("sent", codec).inc(stats.bytes_sent)
        self.bytes.labels("received", codec).inc(stats.bytes_received)

    def call_failed(self, code: int) -> None:
        """Counts one failed attempt of a stage call."""
        self.errors.labels(error_name(code)).inc()

    def step_finished(self, samples: int, loss: float) -> None:
        """Counts one finished optimizer step."""
        self.samples.inc(samples)
        self.loss.set(loss)
