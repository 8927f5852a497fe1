"""The trainer's Prometheus metrics (`swarm train --metrics-port`), all named swarm_trainer_*.

Values the trainer keeps anyway (its step, throughput, the counts in its summary, its router's
peers and bans) are read when the endpoint is scraped; only calls, errors, bytes and durations
are counted as they happen. Nothing imports this module unless --metrics-port is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from swarm import __version__
from swarm.ops.prometheus import DURATION_BUCKETS, CountersFrom, error_name

if TYPE_CHECKING:
    from swarm.config import TrainerConfig
    from swarm.net.transport import CallStats
    from swarm.policy.router import Router
    from swarm.trainer.outcome import TrainingSummary


class TrainerMetrics:
    """What `swarm train --metrics-port` exports, all named swarm_trainer_*."""

    def __init__(
        self, config: TrainerConfig, trainer_id: str, summary: TrainingSummary, router: Router, step: Callable[[], int]
    ) -> None:
        """Reads the trainer's `summary` and `router` when scraped; `step` returns the step it feeds next."""
        self.registry = CollectorRegistry()
        registry = self.registry
        Info("swarm_trainer", "what this trainer trains", registry=registry).info(
            {
                "peer_id": trainer_id,
                "model": config.model,
                "num_stages": str(config.num_stages),
                "run_id": config.run_id,
                "version": __version__,
            }
        )
        Gauge("swarm_trainer_step", "the optimizer step this trainer feeds next", registry=registry).set_function(step)
        Gauge(
            "swarm_trainer_samples_per_second", "samples per second over this run's finished steps", registry=registry
        ).set_function(lambda: summary.samples_per_second)
        self.loss = Gauge("swarm_trainer_loss", "mean loss of the latest finished step", registry=registry)
        self.samples = Counter("swarm_trainer_samples", "samples of finished steps", registry=registry)
        live = Gauge("swarm_trainer_live_peers", "peers this trainer may call, per stage", ["stage"], registry=registry)
        for stage in range(config.num_stages):
            live.labels(str(stage)).set_function(lambda stage=stage: len(router.live_peers(stage)))
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
                        lambda: router.bans_issued,
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
