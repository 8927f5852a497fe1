"""The Prometheus metrics of a peer (`swarm peer --metrics-port`), all named swarm_peer_*.

A peer may move to another stage: it then builds a new runtime and a new set of stage-mates,
whose tallies start from zero. The counters exported here are over the whole process, so the
tallies of the stages it left are kept and added to those of the stage it hosts now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from swarm import __version__
from swarm.net.allowlist import Handler, StreamGate
from swarm.net.transport import INFO_PROTOCOL, STAGE_PROTOCOL
from swarm.net.wire import Part
from swarm.ops.prometheus import DURATION_BUCKETS, CountersFrom, error_name, tensor_bytes_by_codec
from swarm.peer.inference_handler import InferenceHandler
from swarm.peer.mates import StageMates
from swarm.peer.runtime import RoundResult, StageRuntime
from swarm.records.stage_records import JOINING, LEAVING, SERVING

if TYPE_CHECKING:
    from swarm.config import PeerConfig

# (metric name without _total, help, where the stage keeps the tally): reset when the peer changes stage
STAGE_TALLIES: list[tuple[str, str, Callable[[StageRuntime, StageMates], int]]] = [
    ("swarm_peer_stale_gradients", "backwards applied against an older step", lambda r, m: r.stale_gradients),
    ("swarm_peer_abandoned_calls", "calls dropped: their caller had given up", lambda r, m: r.abandoned),
    ("swarm_peer_busy_refusals", "calls refused because the queue was full", lambda r, m: r.busy_refusals),
    ("swarm_peer_duplicate_backwards", "backwards that came again, not applied twice", lambda r, m: r.duplicates),
    ("swarm_peer_averaging_rounds", "averaging rounds with the stage-mates", lambda r, m: m.rounds),
    ("swarm_peer_samples_lost", "samples a step went without (lost with a mate)", lambda r, m: m.samples_lost),
    ("swarm_peer_samples_doubled", "samples a step counted twice", lambda r, m: m.samples_doubled),
    (
        "swarm_peer_samples_left_out",
        "samples of a mate's gradient beyond the bound, left out of a two-mate round",
        lambda r, m: m.samples_left_out,
    ),
    ("swarm_peer_divergences", "times this replica's parameters differed from its mates'", lambda r, m: m.divergences),
    ("swarm_peer_resyncs", "times this peer took a mate's state", lambda r, m: m.resyncs),
    (
        "swarm_peer_failed_rounds",
        "averaging round attempts given up and retried (a mate died, or the mates' views of the round differed)",
        lambda r, m: m.failed_rounds,
    ),
    ("swarm_peer_round_bytes_sent", "gradient bytes sent in averaging rounds", lambda r, m: m.round_bytes[0]),
    ("swarm_peer_round_bytes_received", "gradient bytes received in averaging rounds", lambda r, m: m.round_bytes[1]),
    (
        "swarm_peer_refused_mate_messages",
        "stage-mate messages refused: no signed record puts the sender on this stage",
        lambda r, m: m.refused_outsiders,
    ),
]


@dataclass(frozen=True)
class Hosting:
    """The stage this peer hosts now and the tallies of those it left, replaced as one on a move."""

    runtime: StageRuntime
    mates: StageMates
    earlier: dict[str, int] = field(default_factory=dict)
    inference: InferenceHandler | None = None

    def tally(self, name: str, read: Callable[[StageRuntime, StageMates], int]) -> int:
        return self.earlier.get(name, 0) + read(self.runtime, self.mates)


class MeteredPeer(Protocol):
    """What the metrics read of their peer (`swarm.peer.server.Peer`), at scrape time."""

    config: PeerConfig
    peer_id: str
    stage: int  # -1 while it chooses one
    state: str
    gate: StreamGate  # the streams open and refused, per caller
    moves: int


class PeerMetrics:
    """The metrics of one peer process, in a registry of its own; `registry` is what the endpoint serves."""

    def __init__(self, peer: MeteredPeer) -> None:
        config = peer.config
        self.peer = peer
        self.hosting: Hosting | None = None  # until the peer has built its stage
        self.registry = CollectorRegistry()
        Info("swarm_peer", "what this peer serves", registry=self.registry).info(
            {
                "peer_id": peer.peer_id,
                "model": config.model,
                "num_stages": str(config.num_stages),
                "run_id": config.run_id,
                "version": __version__,
            }
        )
        self._add_gauges()
        self._add_counters()

    def _add_gauges(self) -> None:
        """The gauges, each read at scrape time: of the peer, or of the stage it hosts then."""
        peer, registry = self.peer, self.registry

        def gauge(name: str, documentation: str, read: Callable[[Hosting], float]) -> None:
            # read at scrape time, from the stage hosted then
            Gauge(name, documentation, registry=registry).set_function(
                lambda: read(self.hosting) if self.hosting is not None else 0.0
            )

        Gauge(
            "swarm_peer_stage", "the stage this peer hosts (-1 while it chooses one)", registry=registry
        ).set_function(lambda: peer.stage)
        gauge("swarm_peer_step", "the stage's optimizer step", lambda h: h.runtime.step)
        gauge("swarm_peer_queue_length", "calls waiting in the runtime's queue", lambda h: h.runtime.queue_length)
        gauge(
            "swarm_peer_throughput_samples_per_second",
            "measured speed of backward work, in samples per second",
            lambda h: h.runtime.throughput,
        )
        gauge(
            "swarm_peer_samples_accumulated",
            "samples accumulated toward the current step",
            lambda h: h.runtime.samples_accumulated,
        )
        gauge(
            "swarm_peer_samples_stepped",
            "samples the stage has stepped on over its whole life (it comes with the stage's state)",
            lambda h: h.runtime.samples_stepped,
        )
        gauge("swarm_peer_mates", "stage-mates this peer knows from the DHT", lambda h: len(h.mates.mates))
        gauge(
            "swarm_peer_inference_seconds",
            "seconds spent on inference chunks, in the gaps training leaves (since the peer took its stage)",
            lambda h: h.inference.work.busy_seconds if h.inference is not None else 0.0,
        )
        gauge(
            "swarm_peer_inference_sessions",
            "generation sessions whose KV cache the peer holds",
            lambda h: len(h.inference.sessions or ()) if h.inference is not None else 0,
        )
        gauge(
            "swarm_peer_inference_delay_seconds",
            "the most a training request waited behind an inference chunk, of the latest ones",
            lambda h: max(h.runtime.requests.inference_delays, default=0.0),
        )
        state = Gauge("swarm_peer_state", "1 for the peer's state, 0 for the others", ["state"], registry=registry)
        for name in (JOINING, SERVING, LEAVING):
            state.labels(name).set_function(lambda name=name: float(peer.state == name))
        Gauge("swarm_peer_open_streams", "streams open now, all protocols", registry=registry).set_function(
            lambda: sum(peer.gate.open.values())
        )

    def _add_counters(self) -> None:
        """The counters and histograms: of calls, errors, samples, bytes and rounds, and the stages' tallies."""
        peer, registry = self.peer, self.registry
        self.calls = Counter(
            "swarm_peer_calls", "streams admitted, per protocol served", ["protocol"], registry=registry
        )
        self.errors = Counter(
            "swarm_peer_errors",
            "stage and info calls answered with an error, per protocol and error code",
            ["protocol", "code"],
            registry=registry,
        )
        self.samples = Counter(
            "swarm_peer_samples", "samples of stage calls served, per kind", ["kind"], registry=registry
        )
        self.bytes = Counter(
            "swarm_peer_bytes",
            "tensor bytes of stage calls, per direction and codec",
            ["direction", "codec"],
            registry=registry,
        )
        self.call_seconds = Histogram(
            "swarm_peer_call_seconds",
            "time this peer took to serve a stage call (queue and compute), per kind",
            ["kind"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.averaging_seconds = Histogram(
            "swarm_peer_averaging_seconds",
            "duration of the averaging rounds that ended in a step",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        registry.register(
            CountersFrom(
                [
                    (
                        "swarm_peer_refused_streams",
                        "streams closed unanswered, per reason (outsider: not in --allowlist; busy: over "
                        "--max-streams-per-caller)",
                        lambda: {(reason,): count for reason, count in peer.gate.refused.items()},
                        ("reason",),
                    ),
                    ("swarm_peer_moves", "times this peer moved to another stage", lambda: peer.moves, ()),
                    *(
                        (name, documentation, lambda name=name, read=read: self._tally(name, read), ())
                        for name, documentation, read in STAGE_TALLIES
                    ),
                ]
            )
        )

    def _tally(self, name: str, read: Callable[[StageRuntime, StageMates], int]) -> int:
        hosting = self.hosting
        return 0 if hosting is None else hosting.tally(name, read)

    def host(self, runtime: StageRuntime, mates: StageMates, inference: InferenceHandler | None = None) -> None:
        """The peer now hosts the stage of `runtime` and `mates` (and serves its `inference`); the tallies of the one
        it left are kept."""
        previous = self.hosting
        earlier = {}
        if previous is not None:
            earlier = {name: previous.tally(name, read) for name, _, read in STAGE_TALLIES}
        self.hosting = Hosting(runtime, mates, earlier, inference)

    def counting(self, handler: Handler, protocol: str) -> Handler:
        """`handler`, counting the streams it is given in swarm_peer_calls_total."""
        calls = self.calls.labels(protocol)

        async def counted(stream_info, reader, writer) -> None:
            calls.inc()
            await handler(stream_info, reader, writer)

        return counted

    def stage_request(self, parts: list[Part]) -> None:
        """A stage call's tensors were read."""
        for codec, size in tensor_bytes_by_codec(parts).items():
            self.bytes.labels("received", codec).inc(size)

    def stage_served(self, backward: bool, samples: int, seconds: float, parts: list[Part]) -> None:
        """A stage call was answered with these tensor `parts`."""
        kind = "backward" if backward else "forward"
        self.samples.labels(kind).inc(samples)
        self.call_seconds.labels(kind).observe(seconds)
        for codec, size in tensor_bytes_by_codec(parts).items():
            self.bytes.labels("sent", codec).inc(size)

    def stage_error(self, code: int) -> None:
        self.errors.labels(STAGE_PROTOCOL, error_name(code)).inc()

    def info_error(self, code: int) -> None:
        self.errors.labels(INFO_PROTOCOL, error_name(code)).inc()

    def stepped(self, round_result: RoundResult | None) -> None:
        """The stage stepped after `round_result` (None: it took a mate's state instead)."""
        if round_result is not None:
            self.averaging_seconds.observe(round_result.seconds)
