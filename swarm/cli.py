"""The `swarm` command: one subcommand per role (`swarm.launch.commands`), and the demo that runs them all."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from swarm.config import DemoConfig
from swarm.launch import commands


def _demo(config: DemoConfig) -> int:
    from swarm.launch.demo import run_demo

    return run_demo(config)


COMMANDS: dict[str, commands.Command] = {
    "demo": commands.Command(DemoConfig, _demo, "train the tiny model on a local swarm of processes (the quick start)"),
    **commands.ROLES,
}


def build_parser() -> argparse.ArgumentParser:
    """The `swarm` command line: every subcommand and its flags."""
    return commands.build_parser(COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    """The `swarm` command: parses `argv` and runs the role it names; returns the exit code."""
    return commands.run_command_line(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
