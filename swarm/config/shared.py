"""Settings more than one role shares: how to join the swarm's DHT, the model and its cut, the metrics endpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass

from swarm.config.options import ConfigError, option

MAX_VOCAB_SIZE = 2**20  # larger than any tokenizer in use; bounds the embedding a typo could ask for


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
    swarm_key_file: str | None = option(
        None,
        "private swarm: file with the swarm's shared key (`swarm swarm-key --swarm-key-file PATH` makes one; copy "
        "it to every member, readable by its owner only); without it a process can read no DHT record, store "
        "none, and open no call to a member; default: an open swarm",
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
        "call peers that announce a direct address over TCP (both sides prove their identity key, and the swarm key "
        "with --swarm-key-file; the data is encrypted and authenticated), falling back to libp2p where that fails; "
        "--no-direct keeps every call on libp2p",
    )

    shared_memory: bool = option(
        True,
        "pass tensors through shared memory (/dev/shm) to and from processes on this host that agree to it, "
        "instead of through TCP; --no-shared-memory keeps them on the socket",
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
        from swarm.net.swarm_key import SwarmKeyError, load_swarm_key

        try:
            load_swarm_key(self.swarm_key_file)
        except SwarmKeyError as e:
            raise ConfigError(f"--swarm-key-file: {e}") from None
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
        "gpt-tiny",
        "model preset (gpt-tiny, gpt-tiny-bottleneck, gpt-small, gpt-medium, gpt-large, gpt-xl; Llama-style: "
        "llama-tiny, llama-small, llama-1.1b, llama-3.2-1b); see also --hf-checkpoint",
    )
    hf_checkpoint: str | None = option(
        None,
        "fine-tune a published model: a local folder with a Hugging Face Llama checkpoint (config.json, and "
        "model.safetensors or shards named by model.safetensors.index.json); the model is then the checkpoint's "
        "(its shape and vocabulary; named hf:FOLDER_NAME unless --model gives another hf:NAME), peers start "
        "their stage from its weights, and a trainer, which reads only config.json, needs --tokenizer (usually "
        "the same folder). Every peer and trainer of the swarm gives it",
    )
    num_stages: int = option(3, "number of pipeline stages the model is cut into")
    stage_blocks: list[int] = option(
        [],
        "blocks of each stage, first to last, for an uneven cut (e.g. 1,2,3: one --num-stages count each, adding "
        "up to the model's blocks; `swarm plan` chooses one); empty: as even as possible. Every peer and trainer "
        "of a swarm must agree",
    )
    seed: int = option(0, "seed of the initial parameters and of the data order")
    vocab_size: int = option(
        0,
        "token ids the model knows: 0 for the byte-level default (257: 256 bytes and an end-of-document token); "
        "with a trainer's --tokenizer, the size it names; every peer and trainer of a swarm must agree",
    )
    dtype: str = option(
        "auto",
        "compute dtype: bf16 or fp32, or auto (bf16 on a CUDA device that supports it, fp32 on a CPU; a trainer "
        "takes the swarm's); parameters and optimizer state stay float32, hidden states and their gradients "
        "travel in it; every peer and trainer of a swarm must agree (fp16 is refused: it needs loss scaling)",
    )

    def model_spec(self):
        """The model's spec: the checkpoint's with --hf-checkpoint, else the preset with --vocab-size if given."""
        from swarm.models import get_model_spec

        cut = {"stage_blocks": tuple(self.stage_blocks)} if self.stage_blocks else {}
        if self.hf_checkpoint:
            from dataclasses import replace

            from swarm.models.hf_checkpoint import read_spec

            return replace(read_spec(self.hf_checkpoint, self.model if self.model.startswith("hf:") else None), **cut)
        return get_model_spec(self.model, **({"vocab_size": self.vocab_size} if self.vocab_size else {}), **cut)

    def model_blocks(self) -> int:
        """The model's blocks (0 if the model is unknown: `check` says so)."""
        from swarm.models import get_model_spec

        try:
            return (self._checkpoint_spec() if self.hf_checkpoint else get_model_spec(self.model)).n_layer
        except (ValueError, ConfigError):
            return 0

    def check(self) -> None:
        from swarm.models import get_model_spec

        try:
            spec = self._checkpoint_spec() if self.hf_checkpoint else get_model_spec(self.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not 1 <= self.num_stages <= spec.n_layer:
            raise ConfigError(f"--num-stages must be within 1..{spec.n_layer} for {spec.name}, got {self.num_stages}")
        blocks = self.stage_blocks
        if blocks and (len(blocks) != self.num_stages or min(blocks) < 1 or sum(blocks) != spec.n_layer):
            raise ConfigError(
                f"--stage-blocks {','.join(map(str, blocks))} must give each of the {self.num_stages} stages "
                f"(--num-stages) at least one block, {spec.n_layer} in all for {spec.name}"
            )
        if self.vocab_size != 0 and not 2 <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise ConfigError(f"--vocab-size must be 0 (bytes) or within 2..{MAX_VOCAB_SIZE}, got {self.vocab_size}")
        from swarm.models.precision import DTYPE_CHOICES, FP16_REFUSAL

        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.dtype == "fp16":
            raise ConfigError(FP16_REFUSAL)

    def _checkpoint_spec(self):
        """The spec of --hf-checkpoint; ConfigError if the folder or a setting is wrong. The model's name, which
        peers and trainers announce and look for, is --model if that is hf:NAME, else hf:FOLDER_NAME."""
        from swarm.models.hf_checkpoint import CheckpointError

        try:
            spec = self.model_spec()
        except CheckpointError as e:
            raise ConfigError(f"--hf-checkpoint: {e}") from None
        self.model = spec.name
        if self.vocab_size not in (0, spec.vocab_size):
            raise ConfigError(f"--vocab-size {self.vocab_size}: the checkpoint's model knows {spec.vocab_size} ids")
        if getattr(self, "tokenizer", "") is None:  # a trainer or the demo, on bytes
            raise ConfigError(
                "--hf-checkpoint trains the checkpoint's model on its own token ids, not on bytes: give --tokenizer "
                f"(usually the checkpoint's folder, {self.hf_checkpoint}, which holds its tokenizer.json)"
            )
        return spec


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
