"""What each role's command runs, and the main that runs one from its command line.

`swarm.cli` is the `swarm` program: these commands and the demo. A role forked from the demo's
forkserver (`swarm.launch.role_forkserver`) runs `run_command_line` with these commands alone: the
same parsing, logging and exit codes as the program, without the demo that forks it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm import __version__
from swarm.config import (
    ConfigError,
    DHTConfig,
    IdentityConfig,
    MonitorConfig,
    PeerConfig,
    StatusConfig,
    TrainerConfig,
    add_options,
    load_config,
)
from swarm.config.inference_settings import EvalConfig, GenerateConfig
from swarm.config.plan_flag import plan_settings
from swarm.config.trust_settings import TrustRootConfig, VouchConfig
from swarm.process.allocator import keep_large_buffers
from swarm.process.lifeline import die_with_launcher


@dataclass(frozen=True)
class Command:
    """A subcommand of `swarm`: its settings, what runs them (returning the exit code), and its one-line help."""

    config: type
    run: Callable[[Any], int]
    help: str


def _peer(config: PeerConfig) -> int:
    from swarm.peer.server import Peer
    from swarm.records.announced_settings import check_against_swarm

    peer = Peer(config)  # joined the DHT: its records say what the swarm trains with
    try:
        check_against_swarm(config, peer.dht, config.run_id)
    except ConfigError:  # a newcomer whose settings differ from the swarm's serves nothing
        peer.dht.shutdown()
        raise
    peer.run()
    return 0


def _train(config: TrainerConfig) -> int:
    from swarm.ops.plots import PlotError
    from swarm.trainer.trainer import TrainingError, run_trainer

    try:
        run_trainer(config)
    except TrainingError as e:
        logging.getLogger("swarm").error(f"Training stopped: {e}")
        return 1
    except PlotError as e:
        logging.getLogger("swarm").error(f"Trained, but drew no plot: {e}")
        return 1
    return 0


def _generate(config: GenerateConfig) -> int:
    from swarm.inference.commands import run_generate

    return run_generate(config)


def _eval(config: EvalConfig) -> int:
    from swarm.inference.commands import run_eval

    return run_eval(config)


def _dht(config: DHTConfig) -> int:
    from swarm.ops.bootstrap import run_bootstrap

    run_bootstrap(config)
    return 0


def _status(config: StatusConfig) -> int:
    from swarm.ops.status import run_status

    run_status(config)
    return 0


def _monitor(config: MonitorConfig) -> int:
    from swarm.ops.monitor import MonitorError, run_monitor

    try:
        run_monitor(config)
    except MonitorError as e:
        logging.getLogger("swarm").error(f"swarm monitor: {e}")
        return 1
    return 0


def _identity(config: IdentityConfig) -> int:
    from swarm.net.identity import IdentityError, load_identity

    try:
        identity = load_identity(config.identity_path)
    except IdentityError as e:
        print(f"swarm identity: error: {e}", file=sys.stderr)
        return 2
    print(identity.peer_id)
    return 0


def _trust_root(config: TrustRootConfig) -> int:
    from swarm.trust.vouchers import TrustError, make_root_key

    try:
        public = make_root_key(Path(config.root_key))
    except TrustError as e:
        print(f"swarm trust-root: error: {e}", file=sys.stderr)
        return 2
    print(f"# the root key is in {config.root_key}: keep it private; put this line in the swarm file")
    print(f"trust_root: {public}")
    return 0


def _vouch(config: VouchConfig) -> int:
    from swarm.trust.vouchers import TrustError, load_root_key, make_voucher

    try:
        make_voucher(load_root_key(Path(config.root_key)), config.name, Path(config.out))
    except TrustError as e:
        print(f"swarm vouch: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {config.out}: start the trainer with --voucher {config.out}")
    return 0


ROLES: dict[str, Command] = {
    "peer": Command(PeerConfig, _peer, "host one pipeline stage and serve it to trainers"),
    "train": Command(TrainerConfig, _train, "drive training through the swarm's stages"),
    "generate": Command(GenerateConfig, _generate, "continue a prompt with the swarm's live weights, as it trains"),
    "eval": Command(EvalConfig, _eval, "the held-out loss of the model as the swarm holds it now"),
    "dht": Command(DHTConfig, _dht, "run a bootstrap DHT node that others join through"),
    "status": Command(StatusConfig, _status, "show the swarm's stages and peers"),
    "monitor": Command(MonitorConfig, _monitor, "serve a live web dashboard of the swarm"),
    "identity": Command(IdentityConfig, _identity, "make or read an identity file and print its peer id"),
    "trust-root": Command(TrustRootConfig, _trust_root, "make the organizer's root key that vouches for trainers"),
    "vouch": Command(VouchConfig, _vouch, "make a trainer's voucher with the organizer's root key"),
}


def build_parser(commands: Mapping[str, Command]) -> argparse.ArgumentParser:
    """The `swarm` command line with `commands` as its subcommands."""
    parser = argparse.ArgumentParser(prog="swarm", description="Decentralized training with SWARM parallelism.")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in commands.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.config.__doc__, allow_abbrev=False)
        add_options(sub, command.config)
    return parser


def setup_logging(level: str, role: str) -> None:
    """Log lines on stderr, each naming the role."""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # hivemind's own INFO lines are noise for a user; keep its warnings
    logging.getLogger("hivemind").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def run_command_line(argv: Sequence[str] | None, commands: Mapping[str, Command]) -> int:
    """Parses `argv` as a `swarm` command line over `commands` and runs the command it names; returns the exit code."""
    die_with_launcher()  # first: a launcher killed while this process starts must still take it along
    parser = build_parser(commands)
    args = vars(parser.parse_args(argv))
    name, level = args.pop("command"), args.pop("log_level")
    command = commands[name]
    try:
        config = load_config(command.config, args)
    except ConfigError as e:
        parser.exit(2, f"swarm {name}: error: {e}\n")
    setup_logging(level, name)
    if getattr(config, "plan", ""):
        logging.getLogger("swarm").info(f"Settings from the plan {config.plan}: {plan_settings(config)}")
    keep_large_buffers()  # tensors on the wire are megabytes: see swarm.process.allocator
    from swarm.net.dht_node import JoinError
    from swarm.peer.checkpoint import CheckpointError

    try:
        return command.run(config)
    except ConfigError as e:  # a setting found unusable at start, e.g. a --metrics-port already in use
        print(f"swarm {name}: error: {e}", file=sys.stderr)
        return 2
    except (JoinError, CheckpointError) as e:
        logging.getLogger("swarm").error(f"swarm {name}: {e}")
        return 1
