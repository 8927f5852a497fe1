"""Typed configuration for every role, from CLI flags, environment variables and a YAML file.

Each setting is declared once, as a dataclass field with a help text; the same declaration makes
the flag `--target-batch-size`, the variable `SWARM_TARGET_BATCH_SIZE` and the YAML key
`target_batch_size`. Precedence: flag, then environment, then the `--config` file, then default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

ENV_PREFIX = "SWARM_"
MAX_VOCAB_SIZE = 2**20  # larger than any tokenizer in use; bounds the embedding a typo could ask for
C = TypeVar("C")


class ConfigError(ValueError):
    """A setting that cannot be used: unknown key, wrong type, or out of range."""


def option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    """A config field: its default, its help text, and extra argparse options (e.g. choices)."""
    kwargs: dict[str, Any] = {"metadata": {"help": help, **argparse_kwargs}}
    if isinstance(default, list):
        kwargs["default_factory"] = lambda: list(default)
    else:
        kwargs["default"] = default
    return field(**kwargs)


def _base_type(annotation: Any) -> tuple[type, bool, bool]:
    """(element type, is_optional, is_list) of a field annotation such as `list[str]` or `int | None`."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional, annotation = True, args[0]
        origin = typing.get_origin(annotation)
    if origin is list:
        return typing.get_args(annotation)[0], optional, True
    return annotation, optional, False


def _convert(value: Any, annotation: Any, source: str) -> Any:
    kind, optional, is_list = _base_type(annotation)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{source}: a value is required")
    if is_list:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{source}: expected a list, got {value!r}")
        return [_convert(item, kind, source) for item in items if item != ""]
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{source}: expected true or false, got {value!r}")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: expected {kind.__name__}, got {value!r}") from None


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one flag per field of config class `cls`, and `--config FILE`."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with settings (keys as the flags, with _)")
    for f, annotation in _fields(cls):
        kind, _, is_list = _base_type(annotation)
        meta = dict(f.metadata)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f"{meta.pop('help')} (default: {default}; env {ENV_PREFIX}{f.name.upper()})"
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text, **meta}
        if kind is bool and not is_list:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif is_list:
            parser.add_argument(flag, nargs="*", metavar=f.name.upper(), **kwargs)
        else:
            parser.add_argument(flag, metavar=kind.__name__.upper(), **kwargs)


def load_config(
    cls: type[C],
    cli: Mapping[str, Any] | argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> C:
    """Builds config `cls` from flags (only those given), environment variables and a YAML file."""
    cli = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli or {})
    environ = os.environ if environ is None else environ
    config_file = cli.pop("config", None) or config_file
    from_file: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file) as file:
                from_file = yaml.safe_load(file) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {config_file}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {config_file} is not valid YAML: {e}") from None
        if not isinstance(from_file, dict):
            raise ConfigError(f"config file {config_file} must hold a mapping of settings")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise ConfigError(f"config file {config_file}: unknown settings {unknown}; known: {sorted(known)}")
    values = {}
    for f, annotation in _fields(cls):
        env_name = ENV_PREFIX + f.name.upper()
        if f.name in cli:
            values[f.name] = _convert(cli[f.name], annotation, "--" + f.name.replace("_", "-"))
        elif env_name in environ:
            values[f.name] = _convert(environ[env_name], annotation, env_name)
        elif f.name in from_file:
            values[f.name] = _convert(from_file[f.name], annotation, f"{config_file}: {f.name}")
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


def to_flags(config: Any) -> list[str]:
    """The CLI flags that reproduce `config` (used to launch processes with the same settings)."""
    flags = []
    for f, annotation in _fields(type(config)):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        kind, _, is_list = _base_type(annotation)
        if value is None:
            continue
        if is_list:
            flags += [flag, *map(str, value)]
        elif kind is bool:
            flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


# ---------------------------------------------------------------------------------------------
# The settings of each role.


@dataclass
class NetworkConfig:
    """How a process joins the swarm's DHT."""

    initial_peers: list[str] = option([], "multiaddrs of any live swarm member to join through")
    host_maddrs: list[str] = option(
        ["/ip4/127.0.0.1/tcp/0"],
        "multiaddrs to listen on; use /ip4/0.0.0.0/tcp/PORT to accept other machines",
    )
    announce_maddrs: list[str] = option([], "public multiaddrs to announce when behind NAT or a port forward")
    identity_path: str | None = option(
        None,
        "file with this process's RSA private key, for a stable peer id (made there if missing; "
        "`swarm identity FILE` makes one and prints its peer id); default: a new key at every start",
    )
    allowlist: str | None = option(
        None,
        "private swarm: file of the peer ids allowed in, one per line; others are served nothing and "
        "their DHT records are ignored",
    )
    run_id: str = option("swarm", "name of the training run; processes of other runs are ignored")
    startup_timeout: float = option(30.0, "seconds to wait for the libp2p daemon to start")
    use_relay: bool = option(
        True,
        "circuit relays: reach members behind NAT through a relay, and relay for others (within the libp2p "
        "daemon's limits: 16 circuits per peer, 30 min each)",
    )
    use_auto_relay: bool = option(
        True,
        "when this process is found unreachable from outside (behind NAT or a firewall), reserve a slot on a "
        "relay (--trusted-relays, else the --initial-peers) and serve through it; inert where reachable",
    )
    trusted_relays: list[str] = option(
        [], "multiaddrs of the relays to use when unreachable (default: the --initial-peers)"
    )
    relay_service: bool = option(
        True,
        "with --use-relay, relay for members behind NAT that reserve a slot here; useful on bootstrap nodes and "
        "peers others can reach, inert on those nobody can",
    )
    client_mode: bool = option(
        False,
        "DHT client: listen for no connections and hold no DHT records for others (trainers and `swarm status` "
        "behind NAT then need nothing opened); peers and bootstrap nodes must serve, so they refuse it",
    )
    check_reachability: bool = option(
        True, "at start, ask another member to dial this process back, and say whether it is reachable from outside"
    )
    direct: bool = option(
        True,
        "call peers that announce a direct address over plain TCP (both sides prove their identity key; the data "
        "is not encrypted), falling back to libp2p where that fails; --no-direct keeps every call on libp2p",
    )

    def check(self) -> None:
        from hivemind.utils.multiaddr import Multiaddr

        for flag, addresses in (
            ("--initial-peers", self.initial_peers),
            ("--host-maddrs", self.host_maddrs),
            ("--announce-maddrs", self.announce_maddrs),
            ("--trusted-relays", self.trusted_relays),
        ):
            for address in addresses:
                try:
                    protocols = [p.name for p in Multiaddr(address).protocols()]
                except Exception as e:
                    raise ConfigError(f"{flag}: {address!r} is not a multiaddr ({e})") from None
                if flag in ("--initial-peers", "--trusted-relays") and "p2p" not in protocols:
                    raise ConfigError(
                        f"{flag}: {address!r} names no peer; give the whole address a swarm member "
                        "prints, ending in /p2p/PEER_ID"
                    )
        if self.trusted_relays and not self.use_relay:
            raise ConfigError("--trusted-relays needs --use-relay")
        from swarm.net.allowlist import AllowlistError, load_allowlist

        try:
            load_allowlist(self.allowlist)
        except AllowlistError as e:
            raise ConfigError(f"--allowlist: {e}") from None
        if self.identity_path is not None and os.path.exists(self.identity_path):
            from swarm.net.identity import IdentityError, read_identity

            try:
                read_identity(self.identity_path)
            except IdentityError as e:
                raise ConfigError(f"--identity-path: {e}") from None


@dataclass
class ModelConfig:
    """Which model the swarm trains and how it is cut into stages."""

    model: str = option(
        "gpt-tiny", "model preset (gpt-tiny, gpt-tiny-bottleneck, gpt-small, gpt-medium, gpt-large, gpt-xl)"
    )
    num_stages: int = option(3, "number of pipeline stages the model is cut into")
    seed: int = option(0, "seed of the initial parameters and of the data order")
    vocab_size: int = option(
        0,
        "token ids the model knows: 0 for the byte-level default (257: 256 bytes and an end-of-document token); "
        "with a trainer's --tokenizer, the size it names; every peer and trainer of a swarm must agree",
    )

    def model_spec(self):
        """The model's spec: the preset, with --vocab-size if given."""
        from swarm.models import get_model_spec

        return get_model_spec(self.model, **({"vocab_size": self.vocab_size} if self.vocab_size else {}))

    def check(self) -> None:
        from swarm.models import get_model_spec

        try:
            spec = get_model_spec(self.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not 1 <= self.num_stages <= spec.n_layer:
            raise ConfigError(f"--num-stages must be within 1..{spec.n_layer} for {spec.name}, got {self.num_stages}")
        if self.vocab_size != 0 and not 2 <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise ConfigError(f"--vocab-size must be 0 (bytes) or within 2..{MAX_VOCAB_SIZE}, got {self.vocab_size}")


@dataclass
class MetricsConfig:
    """Where a peer or trainer serves its Prometheus metrics (off unless --metrics-port is given)."""

    metrics_port: int | None = option(
        None, "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: pick a free port; default off)"
    )
    metrics_host: str = option(
        "127.0.0.1", "address the metrics endpoint listens on; 0.0.0.0 lets other machines scrape it"
    )

    def check(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be within 0..65535 (0: a free port), got {self.metrics_port}")
        if not self.metrics_host.strip():
            raise ConfigError("--metrics-host must name an address, e.g. 127.0.0.1 or 0.0.0.0")


@dataclass
class DHTConfig(NetworkConfig):
    """`swarm dht`: a bootstrap node that holds nothing but the DHT."""

    address_file: str | None = option(None, "write this node's multiaddrs to FILE once it is up")

    def check(self) -> None:
        NetworkConfig.check(self)
        if self.client_mode:
            raise ConfigError("--client-mode: a bootstrap node must accept connections; it cannot be a DHT client")


@dataclass
class PeerConfig(NetworkConfig, ModelConfig, MetricsConfig):
    """`swarm peer`: hosts one stage, serves forward and backward, steps its optimizer."""

    stage: str = option(
        "auto", "the stage to host, 0-based, or auto: the stage where this peer raises the swarm's throughput most"
    )
    device: str = option("cpu", "torch device for the stage, e.g. cpu or cuda:0")
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
    max_request_mb: float = option(256.0, "largest request the peer accepts, in MiB")
    max_queue: int = option(
        1024, "requests a peer keeps queued at most; past that it answers busy (UNAVAILABLE) at once"
    )
    max_streams_per_caller: int = option(
        256, "streams one caller may hold open at once, over all protocols; more are closed unanswered"
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
    standby_every: int = option(5, "refresh each standby copy once its stage is this many steps ahead of it")
    standby_share: float = option(
        0.01,
        "the most of the time a standby copy's refreshes may take: after a refresh that took T seconds, "
        "the next waits T / this, however many steps go by",
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
    max_staleness: int = option(
        1, "apply a backward whose forward ran up to N steps ago (counted as stale); refuse older ones"
    )
    short_wait: float = option(
        20.0,
        "seconds a stage whose mate died holding samples waits for the trainers to send them again, "
        "before it steps without them (counting them as lost)",
    )
    ledger: str | None = option(
        None, "append a JSON line per step to FILE: the microbatches summed and lost, by id (for chaos tests)"
    )
    faults: str = option(
        "",
        "for tests: deterministic faults, comma-separated POINT[@N]=ACTION[:ARG] (see swarm/peer/faults.py), "
        "e.g. after_backward@1=drop_reply",
    )
    rebalance_period: float = option(
        60.0, "mean seconds between checks whether moving to the bottleneck helps (randomised; 0: pinned, never moves)"
    )
    rebalance_margin: float = option(
        0.5,
        "move only if the lower of the two stages gains more than this fraction of the peer's own throughput "
        "(hysteresis against noisy speed measurements)",
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

    def check(self) -> None:
        NetworkConfig.check(self)
        if self.client_mode:
            raise ConfigError("--client-mode: a peer serves its stage, so it must accept connections (or use a relay)")
        ModelConfig.check(self)
        MetricsConfig.check(self)
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
        if (
            self.standby_stages < 0
            or self.standby_every < 1
            or self.standby_memory_mb < 0
            or not 0 < self.standby_share <= 1
        ):
            raise ConfigError(
                "--standby-stages must be 0 or more, --standby-every at least 1, --standby-memory-mb 0 or more, "
                "--standby-share above 0 and at most 1"
            )
        if self.rebalance_margin < 0:
            raise ConfigError("--rebalance-margin must be 0 or more")
        if self.rebalance_horizon <= 0 or self.move_bandwidth_mbit <= 0:
            raise ConfigError("--rebalance-horizon and --move-bandwidth-mbit must be positive")
        if self.max_batch_seconds < 0:
            raise ConfigError("--max-batch-seconds must be 0 (no limit) or positive")
        if self.simulated_speed < 0:
            raise ConfigError("--simulated-speed must be 0 (real speed) or positive")
        for name in ("target_batch_size", "max_batch_samples", "num_threads", "max_queue", "max_streams_per_caller"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.lr <= 0:
            raise ConfigError("--lr must be positive")
        if self.averaging_timeout <= 0:
            raise ConfigError("--averaging-timeout must be positive")
        from swarm.peer.preemption import PreemptionSourceError, notice_source

        try:
            notice_source(self.preemption_notice)
        except PreemptionSourceError as e:
            raise ConfigError(f"--preemption-notice: {e}") from None
        if self.max_staleness < 0:
            raise ConfigError("--max-staleness must be 0 or more")
        if self.short_wait <= 0:
            raise ConfigError("--short-wait must be positive")
        from swarm.peer.faults import FaultError, parse_faults

        try:
            parse_faults(self.faults)
        except FaultError as e:
            raise ConfigError(f"--faults: {e}") from None
        from swarm.compression import CODECS

        if self.averaging_codec not in CODECS:
            raise ConfigError(f"--averaging-codec must be one of {sorted(CODECS)}, got {self.averaging_codec!r}")


@dataclass
class TrainerConfig(NetworkConfig, ModelConfig, MetricsConfig):
    """`swarm train`: drives microbatches through the stages; holds no parameters."""

    steps: int = option(100, "optimizer steps to train for")
    microbatch_size: int = option(8, "samples in one microbatch")
    max_in_flight: int = option(8, "microbatches in flight at once (with --in-flight-from-links: at most)")
    in_flight_from_links: bool = option(
        False,
        "size the microbatches in flight from what the pipeline delivers: twice its rate times a microbatch's "
        "round trip when nothing queues (the bandwidth-delay product), between 1 and --max-in-flight. For slow or "
        "distant links give --max-in-flight room (e.g. 256); the summary reports the window's sizes",
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
    summary_file: str | None = option(None, "write a JSON summary of the run to FILE")
    plot: str | None = option(None, "draw loss and samples/s per step into this PNG file at the end")
    progress: bool = option(True, "show a progress bar")

    def check(self) -> None:
        NetworkConfig.check(self)
        ModelConfig.check(self)
        MetricsConfig.check(self)
        for name in ("steps", "microbatch_size", "max_in_flight", "max_retries"):
            if getattr(self, name) < 1:
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
    max_in_flight: int = option(6, "microbatches in flight at once")
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
    """`--plot` must name a .png file that can be written (checked before training, not after it)."""
    if plot is None:
        return
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
