"""The runs a peer started with `--run-id auto` may serve: one swarm file per run (`--runs a.yaml,b.yaml`).

Each file is the swarm file its organizer publishes (`swarm.config.swarm_file`): the run's id, model,
cut, batch and optimizer, where to join. Two keys weigh the run against the others, read here alone:
`total_steps`, the steps the run trains in all (its remaining work is what its stages have not yet
stepped), and `priority`, its weight (1 by default). The peer serves a run with the settings of its
file; its own flags keep what is its own (device, ports, checkpoint folder, identity).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from swarm.config.options import ConfigError, load_config, read_settings_file
from swarm.config.roles import PeerConfig
from swarm.config.swarm_file import SWARM_SETTINGS

MAX_RUNS = 64  # files one peer weighs; each costs a read of its stages' records per look
RUN_KEYS = ("total_steps", "priority")


@dataclass(frozen=True)
class RunFile:
    """One run a peer may serve: its file, its weight, its work, and the peer's settings for serving it."""

    path: str
    run_id: str
    total_steps: int
    priority: float
    config: PeerConfig  # the peer's own settings, with the run's from its file


def read_run_file(path: str, own: PeerConfig) -> RunFile:
    """One run's file, checked; its settings stand over the peer's for the keys the file holds."""
    try:
        data = read_settings_file(path)
    except ConfigError as e:
        raise ConfigError(f"--runs: {e}") from None
    steps, priority = data.get("total_steps"), data.get("priority", 1)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"--runs: {path} must give total_steps, the steps the run trains in all (got {steps!r})")
    if not isinstance(priority, (int, float)) or isinstance(priority, bool) or not 0 < priority < math.inf:
        raise ConfigError(f"--runs: {path}: priority must be a positive number, got {priority!r}")
    unknown = sorted(set(data) - set(SWARM_SETTINGS))
    if unknown:
        raise ConfigError(f"--runs: {path}: {unknown} are not swarm settings; known: {sorted(SWARM_SETTINGS)}")
    run_id = data.get("run_id")
    if not isinstance(run_id, str) or not run_id or run_id == "auto":
        raise ConfigError(f"--runs: {path} must name its run (run_id), not auto")
    fields = {f.name for f in dataclasses.fields(PeerConfig)}
    settings = {k: v for k, v in data.items() if k in fields}
    try:
        from_file = load_config(PeerConfig, {}, {}, path) if settings else None
    except ConfigError as e:
        raise ConfigError(f"--runs: {e}") from None
    taken = {k: getattr(from_file, k) for k in settings} if from_file is not None else {}
    # the stage is chosen per run, and a plan file names the stages of one run only
    config = dataclasses.replace(own, **taken, runs=[], stage="auto", plan="", plan_name="")
    try:
        config.check()
    except ConfigError as e:
        raise ConfigError(f"--runs: {path}: {e}") from None
    return RunFile(path, run_id, steps, float(priority), config)


def read_run_files(own: PeerConfig) -> list[RunFile]:
    """Every file of `--runs`, checked: each names a run of its own."""
    if len(own.runs) > MAX_RUNS:
        raise ConfigError(f"--runs: at most {MAX_RUNS} runs, got {len(own.runs)}")
    runs = [read_run_file(path, own) for path in own.runs]
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--runs: two files name the same run: {sorted(i for i in ids if ids.count(i) > 1)}")
    return runs
