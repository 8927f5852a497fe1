"""The settings of each command: `swarm dht`, `peer`, `train`, `demo`, `identity`, `status` and `monitor`."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from swarm.config.faults_flag import FaultError, parse_faults
from swarm.config.options import ConfigError, option
from swarm.config.plan_flag import PlanFileConfig
from swarm.config.preemption_flag import PreemptionSourceError, parse_notice_source
from swarm.config.shared import MetricsConfig, ModelConfig, NetworkConfig
from swarm.config.trust_settings import TrustConfig, VoucherConfig

ROBUST_SUMS = ("exact", "centered-clip")  # --robust-sum: see swarm.peer.contribution_bounds


@dataclass
class DHTConfig(NetworkConfig):
    """`swarm dht`: a bootstrap node that holds nothing but the DHT."""

    address_file: str | None = option(None, "write this node's multiaddrs to FILE once it is up")

    def check(self) -> None:
        NetworkConfig.check(self)
        if self.client_mode:
            raise ConfigError("--client-mode: a bootstrap node must accept connections; it cannot be a DHT client")


@dataclass
class PeerConfig(NetworkConfig, ModelConfig, MetricsConfig, TrustConfig, PlanFileConfig):
    """`swarm peer`: hosts one stage, serves forward and backward, steps its optimizer."""

    stage: str = option(
        "auto", "the stage to host, 0-based, or auto: the stage where this peer raises the swarm's throughput most"
    )
    runs: list[str] = option(
        [],
        "with --run-id auto: the swarm files of the runs this peer may serve (each with its total_steps and "
        "priority); it serves the run that needs it most, the one with the longest remaining time first, and moves "
        "between them as that changes",
    )
    device: str = option(
        "cpu",
        "torch device for the stage, e.g. cpu or cuda:0; all: one peer per visible CUDA device (or a list, "
        "cuda:0,cuda:2), each a process of its own with its own ports, checkpoint folder and identity file",
    )
    offload: bool = option(
        False,
        "keep the stage's blocks (their parameters, gradients and optimizer state) in host memory and stream them "
        "to the device a group at a time, so a stage larger than the device's memory trains; exact, at the cost of "
        "the copies, paid once per batch: a batch merges all that is queued, up to --max-batch-samples (not limited by "
        "--max-batch-seconds)",
    )
    offload_group: int = option(
        0, "with --offload: blocks per group streamed to the device (0: a group takes a quarter of its free memory)"
    )
    compile: bool = option(
        False,
        "compile the stage's blocks with torch.compile (the first calls take longer while it compiles; measure with "
        "scripts/bench_gpu.py before relying on it); not with --offload",
    )
    num_threads: int = option(1, "torch CPU threads (keep low when several peers share a machine)")
    target_batch_size: int = option(32, "samples per optimizer step, summed over all microbatches")
    lr: float = option(1e-3, "AdamW learning rate")
    weight_decay: float = option(0.01, "AdamW weight decay")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    max_batch_samples: int = option(256, "largest batch the peer runs at once, merging queued requests")
    max_batch_seconds: float = option(
        0.1,
        "merge queued requests only up to this many seconds of estimated work, so the next stage gets a "
        "steady flow rather than bursts (0: merge up to --max-batch-samples)",
    )
    max_microbatch: int = option(
        0,
        "most samples one call may carry (a trainer's microbatch); announced, so that trainers split larger "
        "microbatches into parts of at most this, and the request size the peer accepts follows from it and the "
        "stage's boundary size (0: --max-batch-samples)",
    )
    max_request_mb: float = option(
        0.0,
        "largest request the peer accepts, in MiB, in place of what follows from --max-microbatch and the stage's "
        "boundary size (0: that); the microbatch announced is then the largest whose backward fits",
    )
    max_queue: int = option(
        1024, "requests a peer keeps queued at most; past that it answers busy (UNAVAILABLE) at once"
    )
    max_streams_per_caller: int = option(
        256, "streams one caller may hold open at once, over all protocols; more are closed unanswered"
    )
    request_memory_mb: float = option(
        1024.0,
        "MiB of stage requests the peer holds at once over all its callers (at least two of its largest); a "
        "request past that is answered busy (UNAVAILABLE) and its caller tries another peer",
    )
    inference_chunk_ms: float = option(
        5.0,
        "inference (INFER calls: `swarm generate`, `swarm eval`) runs only while no training request waits, in "
        "chunks of about this much work, so a training request waits at most one chunk",
    )
    inference_memory_mb: float = option(
        256.0, "MiB of generation sessions' KV caches the peer keeps, the least recently used given up first"
    )
    inference_sessions_per_caller: int = option(
        8, "generation sessions one caller may hold on this peer (0: none, stateless inference only)"
    )
    uplink_turns: bool = option(
        True,
        "replies to one caller leave one at a time, the smallest first, each at the link's full rate, which "
        "lowers their mean time to arrive; --no-uplink-turns sends them at once, sharing the link",
    )
    emulate_uplink_mbit: float = option(
        0.0, "for tests and benchmarks: replies cross an emulated uplink of this many Mbit/s, shared by those in flight"
    )
    announce_period: float = option(2.0, "seconds between DHT announcements")
    record_ttl: float = option(10.0, "seconds an announcement stays valid if the peer vanishes")
    checkpoint_dir: str | None = option(None, "directory for the stage's checkpoints; resume from it if present")
    checkpoint_every: int = option(0, "save a checkpoint every N steps (0: only on a clean exit)")
    standby_stages: int = option(
        1,
        "hold a standby copy (parameters, optimizer state, step) of the next N stages, so that a stage whose "
        "every peer dies is restored from it (0: hold none)",
    )
    standby_stages_under_churn: int = option(
        2,
        "while the swarm shows churn (a peer died within ten minutes), hold copies of this many next stages "
        "instead (when more than --standby-stages): copies on peers of two stages survive a wave that takes a stage "
        "with every peer of the stage before it",
    )
    standby_copies: int = option(
        3,
        "the most standby copies of each stage the swarm keeps: of the peers that would hold one, the first N in turn "
        "over the stages before it (ranked by a digest of their ids) do, so that a large swarm does not follow every "
        "stage with every peer (0: no cap, every peer holds its --standby-stages)",
    )
    standby_deltas: int = option(
        8,
        "keep the summed gradient of this stage's last N steps (N times the parameters' size, in host memory, "
        "only while some peer holds a copy of the stage), so that holders catch their copies up step by step "
        "instead of downloading the whole state (0: keep none; copies are refreshed whole)",
    )
    standby_calm_deltas: bool = option(
        True,
        "in the calm too, catch standby copies up by step deltas once a quarter of --standby-deltas steps behind, so "
        "that a first wave loses a few steps, not up to --standby-every (a third of the state per step per copy, "
        "against the whole state every --standby-every steps); --no-standby-calm-deltas follows only while peers die",
    )
    standby_every: int = option(
        15,
        "refresh a standby copy whole once its stage is this many steps ahead of it, where the stage's step "
        "deltas cannot catch it up (copies follow their stage by the deltas otherwise: see --standby-deltas)",
    )
    standby_share: float = option(
        0.05,
        "the most of the time a standby copy's whole refreshes may take: after a refresh "
        "whose transfer took T seconds, the next waits T / this, however many steps go by (step deltas are not "
        "held back: see --standby-calm-deltas; while the swarm shows churn, a whole refresh waits T / 0.5 at most)",
    )
    standby_memory_mb: float = option(
        4096.0,
        "host memory the standby copies may take, in MiB; past it they go to --checkpoint-dir if given, "
        "else the copy is not held",
    )
    shutdown_timeout: float = option(15.0, "seconds a peer waits for in-flight requests when asked to stop")
    preemption_notice: str = option(
        "none", "where a spot interruption notice comes from: none, aws, gcp or file:PATH (leave when PATH exists)"
    )
    preemption_poll: float = option(5.0, "seconds between checks for a preemption notice")
    averaging_timeout: float = option(30.0, "seconds a stage-mate averaging round waits for a silent mate")
    averaging_codec: str = option("none", "codec for gradients sent to stage-mates (none is exact)")
    robust_sum: str = option(
        "exact",
        "how this peer sums its slice of its stage's gradients: exact (the plain sum, as one process trains) or "
        "centered-clip (with 3 or more mates, a gradient far from the others pulls the sum a few honest spreads "
        "at most; an honest mate's gradient of a few unusual samples is sometimes clipped too)",
    )
    max_staleness: int = option(
        1, "apply a backward whose forward ran up to N steps ago (counted as stale); refuse older ones"
    )
    short_wait: float = option(
        20.0,
        "seconds a stage whose mate died holding samples waits for the trainers to send them again, "
        "before it steps without them (counting them as lost); trainers whose records say they finished are "
        "not waited for",
    )
    ledger: str | None = option(
        None, "append a JSON line per step to FILE: the microbatches summed and lost, by id (for chaos tests)"
    )
    faults: str = option(
        "",
        "for tests: deterministic faults, comma-separated POINT[@N]=ACTION[:ARG] (see swarm/config/faults_flag.py), "
        "e.g. after_backward@1=drop_reply",
    )
    rebalance_period: float = option(
        60.0, "mean seconds between checks whether moving to the bottleneck helps (randomised; 0: pinned, never moves)"
    )
    rebalance_margin: float = option(
        0.2,
        "move only if the lower of the two stages gains more than this fraction of the peer's own throughput "
        "(hysteresis; measured noise is held apart, by each speed's measured spread)",
    )
    rebalance_horizon: float = option(
        600.0,
        "seconds a move's gain is counted for against its cost (the state download and the averaging it "
        "disturbs): a move is made only if it pays within this time",
    )
    move_bandwidth_mbit: float = option(
        100.0,
        "download bandwidth, Mbit/s, the balance rule assumes for a moving peer's state (every peer must assume "
        "the same, so that all compute the same plan)",
    )
    direct_port: int = option(
        0,
        "TCP port of the direct data plane, on the --host-maddrs host (0: any free port; -1: none, every call to "
        "this peer goes over libp2p)",
    )
    direct_host: str = option(
        "",
        "host or IP to announce for the direct data plane (default: the listening host, or where that is "
        "0.0.0.0, the first non-loopback IPv4 address libp2p sees)",
    )
    simulated_speed: float = option(
        0.0,
        "for tests and benchmarks: behave as a device of this many samples/s on a stage of average cost, "
        "padding compute with sleep (0: the real speed)",
    )

    @property
    def initial_stage(self) -> int | None:
        """The stage given with --stage, or None for auto."""
        return None if self.stage == "auto" else int(self.stage)

    @property
    def max_call_samples(self) -> int:
        """The most samples one call may carry: --max-microbatch, or --max-batch-samples where it is 0."""
        return self.max_microbatch or self.max_batch_samples

    def _check_standby(self) -> None:
        if (
            self.standby_stages < 0
            or self.standby_deltas < 0
            or self.standby_stages_under_churn < 0
            or self.standby_copies < 0
            or self.standby_every < 1
            or self.standby_memory_mb < 0
            or not 0 < self.standby_share <= 1
        ):
            raise ConfigError(
                "--standby-stages, --standby-stages-under-churn, --standby-copies and --standby-deltas must be 0 or "
                "more, --standby-every at least 1, --standby-memory-mb 0 or more, --standby-share above 0 and at most 1"
            )

    def _check_runs(self) -> None:
        if (self.run_id == "auto") != bool(self.runs):
            raise ConfigError("--run-id auto and --runs go together: the swarm files of the runs to choose among")
        if self.runs and (self.plan or self.stage != "auto" or self.device == "all" or "," in self.device):
            raise ConfigError("--run-id auto chooses the run and its stage: give no --plan or --stage, and one device")

    def check(self) -> None:
        NetworkConfig.check(self)
        if self.client_mode:
            raise ConfigError("--client-mode: a peer serves its stage, so it must accept connections (or use a relay)")
        self._check_runs()
        self.take_plan(self.model_blocks())
        ModelConfig.check(self)
        MetricsConfig.check(self)
        TrustConfig.check(self)
        if self.stage != "auto":
            try:
                stage = int(self.stage)
            except ValueError:
                raise ConfigError(f"--stage must be auto or a number, got {self.stage!r}") from None
            if not 0 <= stage < self.num_stages:
                raise ConfigError(f"--stage must be within 0..{self.num_stages - 1} or auto, got {self.stage}")
            self.stage = str(stage)
        if not -1 <= self.direct_port < 65536:
            raise ConfigError(f"--direct-port must be a TCP port, 0 for any or -1 for none: {self.direct_port}")
        if self.direct_host:
            from swarm.net.direct_plane import format_direct_address, parse_direct_address

            if parse_direct_address(format_direct_address(self.direct_host, 1)) is None:
                raise ConfigError(f"--direct-host: {self.direct_host!r} is not a host name or IP address")
        if self.rebalance_period < 0:
            raise ConfigError("--rebalance-period must be 0 (never move) or positive")
        self._check_standby()
        if self.rebalance_margin < 0:
            raise ConfigError("--rebalance-margin must be 0 or more")
        if self.rebalance_horizon <= 0 or self.move_bandwidth_mbit <= 0:
            raise ConfigError("--rebalance-horizon and --move-bandwidth-mbit must be positive")
        if self.max_batch_seconds < 0:
            raise ConfigError("--max-batch-seconds must be 0 (no limit) or positive")
        if self.offload_group < 0:
            raise ConfigError("--offload-group must be 0 (sized from the device's memory) or positive")
        if self.compile and self.offload:
            raise ConfigError("--compile and --offload do not combine: an offloaded block moves between devices")
        if (
            self.simulated_speed < 0
            or self.inference_chunk_ms <= 0
            or min(self.inference_memory_mb, self.emulate_uplink_mbit) < 0
        ):
            raise ConfigError(
                "--simulated-speed must be 0 (real speed) or positive, --inference-chunk-ms positive, "
                "--inference-memory-mb and --emulate-uplink-mbit 0 or more"
            )
        for name in ("target_batch_size", "max_batch_samples", "num_threads", "max_queue", "max_streams_per_caller"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.max_microbatch <= self.max_batch_samples or self.max_request_mb < 0:
            raise ConfigError(
                "--max-microbatch must be 0 (--max-batch-samples) or at most --max-batch-samples (the most the peer "
                f"runs at once, {self.max_batch_samples}), and --max-request-mb 0 (from the model) or positive"
            )
        if self.request_memory_mb <= 0:
            raise ConfigError("--request-memory-mb must be positive (it is raised to two of the largest requests)")
        if self.lr <= 0:
            raise ConfigError("--lr must be positive")
        if self.averaging_timeout <= 0:
            raise ConfigError("--averaging-timeout must be positive")
        try:
            parse_notice_source(self.preemption_notice)
        except PreemptionSourceError as e:
            raise ConfigError(f"--preemption-notice: {e}") from None
        if self.max_staleness < 0:
            raise ConfigError("--max-staleness must be 0 or more")
        if self.short_wait <= 0:
            raise ConfigError("--short-wait must be positive")
        try:
            parse_faults(self.faults)
        except FaultError as e:
            raise ConfigError(f"--faults: {e}") from None
        from swarm.compression import CODECS

        if self.robust_sum not in ROBUST_SUMS:
            raise ConfigError(f"--robust-sum must be one of {list(ROBUST_SUMS)}, got {self.robust_sum!r}")
        if self.averaging_codec not in CODECS:
            raise ConfigError(f"--averaging-codec must be one of {sorted(CODECS)}, got {self.averaging_codec!r}")


@dataclass
class TrainerConfig(NetworkConfig, ModelConfig, MetricsConfig, VoucherConfig, PlanFileConfig):
    """`swarm train`: drives microbatches through the stages; holds no parameters."""

    steps: int = option(100, "optimizer steps to train for")
    microbatch_size: int = option(8, "samples in one microbatch")
    max_in_flight: int | None = option(
        None,
        "a fixed number of microbatches in flight at once; default: a window sized from what the pipeline "
        "delivers, twice its rate times a microbatch's round trip when nothing queues (the bandwidth-delay "
        "product), from 16, at least 8 (or one per stage) and at most --in-flight-ceiling; the summary reports "
        "its sizes",
    )
    in_flight_ceiling: int = option(
        256, "without --max-in-flight: the most microbatches in flight the window sized from the links may reach"
    )
    overlap_steps: bool = option(
        False,
        "start the next step's microbatches while the last backwards of the step before finish, so stages do not "
        "idle at step boundaries; gradients may then be one step stale (within the peers' --max-staleness) and a "
        "stage's batch may take in samples that arrive while it fills, so training no longer matches one process",
    )
    data: str | None = option(
        None,
        "what to train on: a text file, a folder (every text file under it, recognised by content), or "
        "hf:NAME_OR_PATH, a Hugging Face dataset: a folder saved with save_to_disk, a local .json/.jsonl/.csv/"
        ".parquet/text file, or a hub name hf:NAME[:CONFIG] (needs pip install -e '.[hf]'); "
        "default: Python's standard library",
    )
    data_split: str = option("train", "with --data hf:...: the dataset split to read")
    text_column: str = option("text", "with --data hf:...: the column that holds the text")
    tokenizer: str | None = option(
        None,
        "tokenize with this tokenizer (a tokenizer.json file, a folder holding one, or a hub name; needs "
        "pip install -e '.[hf]') instead of bytes; the model then needs --vocab-size as large as the tokenizer's, "
        "on this trainer and every peer (the trainer names the size if it is missing)",
    )
    max_corpus_mb: float = option(32.0, "read at most this many MiB of the corpus")
    data_seed: int | None = option(
        None, "seed of the order samples are drawn in (default: --seed); give each trainer of a swarm its own"
    )
    compression: str = option(
        "auto",
        "codec for activations and gradients, both ways: auto (chosen per peer from its measured bandwidth), "
        "none (exact), fp16, bf16, 8bit or 4bit",
    )
    max_codec_error: float = option(
        0.01, "with --compression auto, never use a codec whose relative error on activations exceeds this"
    )
    emulate_bandwidth_mbit: float = option(
        0.0, "for tests and benchmarks: slow every link to a peer to this bandwidth each way (0: off)"
    )
    emulate_latency_ms: float = option(0.0, "for tests and benchmarks: add this one-way latency to every call")
    emulate_own_link: bool = option(
        True,
        "with --emulate-bandwidth-mbit: cap this trainer's own link at that bandwidth too, shared by its calls to "
        "every peer, as a real uplink is; --no-emulate-own-link gives each peer's link the bandwidth alone",
    )
    call_timeout: float = option(
        60.0, "longest a stage call may take before it is retried elsewhere (deadlines follow each peer's latency)"
    )
    call_timeout_floor: float = option(15.0, "shortest deadline given to a stage call, however fast the peer")
    max_retries: int = option(5, "attempts per stage call (on different peers) before it is re-queued")
    stage_wait_timeout: float = option(
        120.0,
        "seconds a stage may go without a live peer, or without completing any call while one is re-queued, "
        "before training stops with an error",
    )
    resend_buffer_mb: float = option(
        256.0,
        "MiB of applied backwards' inputs kept to send again if the peer that applied them dies before its "
        "stage steps (oldest dropped first; 0: keep none, such samples are then lost and counted)",
    )
    ledger: str | None = option(
        None, "append a JSON line per microbatch fed through every stage to FILE, by id (for chaos tests)"
    )
    spot_check_share: float = option(
        0.02,
        "share of calls (forwards, and backwards past the first stage) sent again to another peer of the stage "
        "to compare outputs or input gradients; a peer whose answer two others contradict is accused (needs "
        "--voucher in a swarm with a --trust-root; 0: no checks)",
    )
    summary_file: str | None = option(None, "write a JSON summary of the run to FILE")
    plot: str | None = option(None, "draw loss and samples/s per step into this PNG file at the end")
    progress: bool = option(True, "show a progress bar")

    def check(self) -> None:
        NetworkConfig.check(self)
        self.take_plan(self.model_blocks())
        ModelConfig.check(self)
        MetricsConfig.check(self)
        VoucherConfig.check(self)
        for name in ("steps", "microbatch_size", "max_in_flight", "in_flight_ceiling", "max_retries"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 < self.call_timeout_floor <= self.call_timeout:
            raise ConfigError("--call-timeout-floor must be positive and at most --call-timeout")
        from swarm.compression import CODECS

        if self.compression != "auto" and self.compression not in CODECS:
            raise ConfigError(f"--compression must be auto or one of {sorted(CODECS)}, got {self.compression!r}")
        if self.max_codec_error < 0:
            raise ConfigError("--max-codec-error must be 0 or more")
        if self.resend_buffer_mb < 0:
            raise ConfigError("--resend-buffer-mb must be 0 or more")
        if not 0 <= self.spot_check_share <= 1:
            raise ConfigError("--spot-check-share must be between 0 and 1")
        if self.emulate_bandwidth_mbit < 0 or self.emulate_latency_ms < 0:
            raise ConfigError("--emulate-bandwidth-mbit and --emulate-latency-ms must be 0 or more")
        check_data_path(self.data)
        check_plot_path(self.plot)


@dataclass
class DemoConfig(ModelConfig):
    """`swarm demo`: a bootstrap node, one peer per stage and a trainer, all on this machine."""

    steps: int = option(300, "optimizer steps to train for")
    target_batch_size: int = option(32, "samples per optimizer step")
    microbatch_size: int = option(8, "samples in one microbatch")
    max_in_flight: int | None = option(
        None, "a fixed number of microbatches in flight at once; default: a window sized from the links"
    )
    lr: float = option(3e-3, "AdamW learning rate")
    data: str | None = option(
        None,
        "what to train on: a text file, a folder of text files, or hf:NAME_OR_PATH, a Hugging Face dataset "
        "(see swarm train --help); default: Python's standard library",
    )
    data_split: str = option("train", "with --data hf:...: the dataset split to read")
    text_column: str = option("text", "with --data hf:...: the column that holds the text")
    tokenizer: str | None = option(
        None, "tokenize with this tokenizer (see swarm train --help) instead of bytes; sets --vocab-size to match"
    )
    log_dir: str | None = option(None, "directory for the processes' logs (default: a temporary one)")
    summary_file: str | None = option(None, "write the trainer's JSON summary to FILE")
    plot: str = option("auto", "PNG file for the loss and samples/s plot: auto for LOG_DIR/loss.png, none for no plot")

    def check(self) -> None:
        ModelConfig.check(self)
        check_data_path(self.data)
        if self.plot not in ("auto", "none"):
            check_plot_path(self.plot)


def check_plot_path(plot: str | None) -> None:
    """`--plot` must name a .png file that can be written, and matplotlib must be there to draw it (checked before
    training, not after it)."""
    if plot is None:
        return
    if importlib.util.find_spec("matplotlib") is None:  # an optional dependency (swarm.ops.plots)
        raise ConfigError("--plot: drawing plots needs matplotlib: pip install 'swarm-trainer[plot]'")
    path = Path(plot)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot: {plot} must be a .png file")
    if path.is_dir():
        raise ConfigError(f"--plot: {plot} is a folder; give a .png file")
    folder = next((p for p in path.absolute().parents if p.exists()), None)
    if folder is None or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"--plot: cannot write into {folder or path.parent}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"--plot: {plot} is not writable")


def check_data_path(data: str | None) -> None:
    """`--data` must name a file or folder that exists (checked before any process starts)."""
    if data is not None and data.startswith("hf:"):
        if not data[3:]:
            raise ConfigError("--data hf: names no dataset; give hf:NAME or hf:PATH")
        return  # a hub name or a local path: told apart, and checked, when the trainer loads it
    if data is not None and not Path(data).exists():
        raise ConfigError(f"--data: {data} does not exist; give a text file or a folder of them")


@dataclass
class IdentityConfig:
    """`swarm identity`: makes (or reads) an identity file and prints its peer id, for --allowlist files."""

    identity_path: str = option("identity.key", "the identity file; made with a new RSA key if it does not exist")


@dataclass
class StatusConfig(NetworkConfig):
    """`swarm status`: a view of the swarm's stages and peers."""

    num_stages: int = option(3, "number of stages to show")
    watch: float = option(0.0, "refresh every N seconds (0: print once)")


@dataclass
class MonitorConfig(NetworkConfig):
    """`swarm monitor`: a live web dashboard of the swarm's stages, peers, balance, trainers and loss."""

    num_stages: int = option(3, "number of stages to show")
    host: str = option("127.0.0.1", "address the dashboard listens on; 0.0.0.0 lets other machines see it")
    port: int = option(8471, "port the dashboard listens on (0: any free port; the URL is printed)")
    refresh: float = option(2.0, "seconds between reads of the swarm from the DHT")

    def check(self) -> None:
        NetworkConfig.check(self)
        if not 1 <= self.num_stages <= 1024:
            raise ConfigError(f"--num-stages must be within 1..1024, got {self.num_stages}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be within 0..65535 (0: any free port), got {self.port}")
        if not self.host.strip():
            raise ConfigError("--host must name an address, e.g. 127.0.0.1 or 0.0.0.0")
        if not 0.1 <= self.refresh <= 3600:
            raise ConfigError(f"--refresh must be within 0.1..3600 seconds, got {self.refresh}")
