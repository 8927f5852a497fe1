"""`--plan` and `--plan-name`: a process takes its settings from a plan file that `swarm plan` wrote.

Read here, below the roles, so that a plan's values are checked with every other setting before anything
starts. The plan's values stand over the flags they set (the process logs what it took):
- every process: the cut (`--num-stages`, and `--stage-blocks` where the plan's cut is uneven);
- a peer named by `--plan-name`: its `--stage`;
- a trainer: the plan's `--microbatch-size`, and named by `--plan-name`, its `--max-in-flight`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swarm.config.options import ConfigError, option


@dataclass
class PlanFileConfig:
    """The plan file a process may take its settings from."""

    plan: str = option(
        "",
        "a plan file from `swarm plan`: take its cut (--num-stages, --stage-blocks) and, with --plan-name, a peer "
        "its --stage, a trainer its --microbatch-size and --max-in-flight (the plan's values stand over those "
        "flags); empty: none",
    )
    plan_name: str = option("", "this process's name in --plan: a peer's or trainer's name in the cluster file")

    def take_plan(self, n_layer: int) -> dict[str, Any]:
        """Sets what the plan gives this process (a model of `n_layer` blocks); returns the settings taken."""
        if not self.plan:
            if self.plan_name:
                raise ConfigError("--plan-name names this process in a plan file: give the file with --plan")
            return {}
        if not n_layer:  # an unknown model: the model's own check says so
            return {}
        plan = read_plan_file(self.plan)
        blocks = plan["blocks_per_stage"]
        if sum(blocks) != n_layer:
            raise ConfigError(f"--plan {self.plan}: its cut {blocks} is not of this model's {n_layer} blocks")
        base, extra = divmod(n_layer, len(blocks))
        even = [base + (s < extra) for s in range(len(blocks))]
        taken: dict[str, Any] = {"num_stages": len(blocks), "stage_blocks": [] if blocks == even else blocks}
        if hasattr(self, "stage"):
            if self.plan_name:
                if self.plan_name not in plan["stages"]:
                    idle = " (the plan leaves it idle)" if self.plan_name in plan["idle"] else ""
                    raise ConfigError(f"--plan-name {self.plan_name}: no stage for it in {self.plan}{idle}")
                taken["stage"] = str(plan["stages"][self.plan_name])
        else:
            taken["microbatch_size"] = plan["microbatch_size"]
            if self.plan_name:
                if self.plan_name not in plan["max_in_flight"]:
                    raise ConfigError(f"--plan-name {self.plan_name}: {self.plan} plans no trainer of that name")
                taken["max_in_flight"] = plan["max_in_flight"][self.plan_name]
        for name, value in taken.items():
            setattr(self, name, value)
        return taken


def plan_settings(config: PlanFileConfig) -> str:
    """The settings a plan gives this process, as flags, for the log."""
    names = ["num_stages", "stage_blocks", "microbatch_size"] + (["stage", "max_in_flight"] if config.plan_name else [])
    shown = []
    for name in names:
        if hasattr(config, name):
            value = getattr(config, name)
            text = (",".join(map(str, value)) or "''") if isinstance(value, list) else value
            shown.append(f"--{name.replace('_', '-')} {text}")
    return " ".join(shown)


def read_plan_file(path: str) -> dict[str, Any]:
    """A plan file's settings, checked for type; ConfigError says what is wrong."""
    try:
        with open(path) as file:
            plan = json.load(file)
    except OSError as e:
        raise ConfigError(f"--plan: cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"--plan: {path} is not JSON: {e}") from None
    try:
        checked = {
            "blocks_per_stage": [int(b) for b in plan["blocks_per_stage"]],
            "stages": {str(k): int(v) for k, v in plan["stages"].items()},
            "idle": [str(p) for p in plan.get("idle", [])],
            "microbatch_size": int(plan["microbatch_size"]),
            "max_in_flight": {str(k): int(v) for k, v in plan["max_in_flight"].items()},
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"--plan: {path} is not a plan file from `swarm plan` ({type(e).__name__}: {e})") from None
    blocks = checked["blocks_per_stage"]
    if not blocks or min(blocks) < 1 or checked["microbatch_size"] < 1:
        raise ConfigError(f"--plan: {path} has no stages, an empty stage or no microbatch")
    windows = checked["max_in_flight"].values()
    if any(not 0 <= s < len(blocks) for s in checked["stages"].values()) or min(windows, default=1) < 1:
        raise ConfigError(f"--plan: {path} names a stage it does not cut or a window below 1")
    return checked
