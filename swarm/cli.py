"""The `swarm` command: one subcommand per role (`swarm.launch.commands`), and the demo that runs them all."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.config import DemoConfig, PeerConfig
from swarm.config.options import option
from swarm.launch import commands
from swarm.planning.command import PlanConfig, run_plan


def _demo(config: DemoConfig) -> int:
    from swarm.launch.demo import run_demo

    return run_demo(config)


def _peers(config: PeerConfig) -> int:
    """`swarm peer`, where `--device all` (or a list of devices) starts one peer process per device, and
    `--run-id auto` one peer process at a time, for the run that needs it most."""
    if config.runs:
        from swarm.launch.auto_run import run_auto_peer

        return run_auto_peer(config)
    if config.device != "all" and "," not in config.device:
        return commands.ROLES["peer"].run(config)
    import torch

    from swarm.launch.device_peers import device_list, run_device_peers

    return run_device_peers(config, device_list(config.device, torch.cuda.device_count()))


@dataclass
class SwarmKeyConfig:
    """`swarm swarm-key`: makes a private swarm's shared key file (or reads one) and prints its fingerprint."""

    swarm_key_file: str = option(
        "swarm.key",
        "the key file; made with a new random key (readable by its owner only) if it does not exist. Copy it to "
        "every member and start each with --swarm-key-file",
    )


def _swarm_key(config: SwarmKeyConfig) -> int:
    """Prints the key's fingerprint (equal on every member holding the same key), making the key if missing."""
    from swarm.net.swarm_key import SwarmKeyError, make_swarm_key, read_swarm_key

    try:
        exists = os.path.exists(config.swarm_key_file)
        key = read_swarm_key(config.swarm_key_file) if exists else make_swarm_key(config.swarm_key_file)
    except SwarmKeyError as e:
        print(f"swarm swarm-key: error: {e}", file=sys.stderr)
        return 2
    print(key.fingerprint)
    return 0


COMMANDS: dict[str, commands.Command] = {
    "demo": commands.Command(DemoConfig, _demo, "train the tiny model on a local swarm of processes (the quick start)"),
    **commands.ROLES,
    "peer": commands.Command(PeerConfig, _peers, commands.ROLES["peer"].help),
    "plan": commands.Command(
        PlanConfig, run_plan, "choose cuts, layout, microbatch, windows and codecs for a cluster file's peers and links"
    ),
    "swarm-key": commands.Command(
        SwarmKeyConfig, _swarm_key, "make a private swarm's shared key file (or read one) and print its fingerprint"
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The `swarm` command line: every subcommand and its flags."""
    return commands.build_parser(COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    """The `swarm` command: parses `argv` and runs the role it names; returns the exit code."""
    return commands.run_command_line(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
