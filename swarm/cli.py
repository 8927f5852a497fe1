"""The `swarm` command: one subcommand per role (`swarm.launch.commands`), and the demo that runs them all."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from swarm.config import DemoConfig, PeerConfig
from swarm.launch import commands


def _demo(config: DemoConfig) -> int:
    from swarm.launch.demo import run_demo

    return run_demo(config)


def _peers(config: PeerConfig) -> int:
    """`swarm peer`, where `--device all` (or a list of devices) starts one peer process per device."""
    if config.device != "all" and "," not in config.device:
        return commands.ROLES["peer"].run(config)
    import torch

    from swarm.launch.device_peers import device_list, run_device_peers

    return run_device_peers(config, device_list(config.device, torch.cuda.device_count()))


COMMANDS: dict[str, commands.Command] = {
    "demo": commands.Command(DemoConfig, _demo, "train the tiny model on a local swarm of processes (the quick start)"),
    **commands.ROLES,
    "peer": commands.Command(PeerConfig, _peers, commands.ROLES["peer"].help),
}


def build_parser() -> argparse.ArgumentParser:
    """The `swarm` command line: every subcommand and its flags."""
    return commands.build_parser(COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    """The `swarm` command: parses `argv` and runs the role it names; returns the exit code."""
    return commands.run_command_line(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
