"""The `swarm` command: one subcommand per role."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from swarm import __version__
from swarm.config import (
    ConfigError,
    DemoConfig,
    DHTConfig,
    IdentityConfig,
    MonitorConfig,
    PeerConfig,
    StatusConfig,
    TrainerConfig,
    add_options,
    load_config,
)
from swarm.process.allocator import keep_large_buffers
from swarm.process.lifeline import die_with_launcher


def _peer(config: PeerConfig) -> int:
    from swarm.peer.server import run_peer

    run_peer(config)
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


def _demo(config: DemoConfig) -> int:
    from swarm.launch.demo import run_demo

    return run_demo(config)


COMMANDS: dict[str, tuple[type, Callable, str]] = {
    "demo": (DemoConfig, _demo, "train the tiny model on a local swarm of processes (the quick start)"),
    "peer": (PeerConfig, _peer, "host one pipeline stage and serve it to trainers"),
    "train": (TrainerConfig, _train, "drive training through the swarm's stages"),
    "dht": (DHTConfig, _dht, "run a bootstrap DHT node that others join through"),
    "status": (StatusConfig, _status, "show the swarm's stages and peers"),
    "monitor": (MonitorConfig, _monitor, "serve a live web dashboard of the swarm"),
    "identity": (IdentityConfig, _identity, "make or read an identity file and print its peer id"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="Decentralized training with SWARM parallelism.")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (config_cls, _, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=config_cls.__doc__, allow_abbrev=False)
        add_options(sub, config_cls)
    return parser


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # hivemind's own INFO lines are noise for a user; keep its warnings
    logging.getLogger("hivemind").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def main(argv: Sequence[str] | None = None) -> int:
    """The `swarm` command: parses `argv` and runs the role it names; returns the exit code."""
    die_with_launcher()  # first: a launcher killed while this process starts must still take it along
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command, level = args.pop("command"), args.pop("log_level")
    config_cls, handler, _ = COMMANDS[command]
    try:
        config = load_config(config_cls, args)
    except ConfigError as e:
        parser.exit(2, f"swarm {command}: error: {e}\n")
    setup_logging(level, command)
    keep_large_buffers()  # tensors on the wire are megabytes: see swarm.process.allocator
    from swarm.net.dht_node import JoinError
    from swarm.peer.checkpoint import CheckpointError

    try:
        return handler(config)
    except ConfigError as e:  # a setting found unusable at start, e.g. a --metrics-port already in use
        print(f"swarm {command}: error: {e}", file=sys.stderr)
        return 2
    except (JoinError, CheckpointError) as e:
        logging.getLogger("swarm").error(f"swarm {command}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
