"""`swarm plan`: reads a cluster file, prints the chosen plan and its predicted samples/s, writes the plan file."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.config.options import ConfigError, option

if TYPE_CHECKING:  # the planner pulls in numpy and torch: imported when `swarm plan` runs, not for every command
    from swarm.planning.cluster import Cluster
    from swarm.planning.pipeline_model import Plan


@dataclass
class PlanConfig:
    """`swarm plan`: cuts, layout, microbatch size, windows and codecs for the peers and links a cluster file
    describes (docs/operating.md, "Planning a swarm")."""

    cluster: str = option("cluster.yaml", "the cluster file (YAML or JSON): model, peers, trainers, links")
    out: str = option("plan.json", "where the plan file is written ('-': print it only)")
    current: str = option(
        "", "a plan file in use: the new plan is written only if it beats that one by more than --replan-threshold"
    )
    replan_threshold: float = option(0.1, "with --current: the least relative gain that makes a new plan worth taking")

    def check(self) -> None:
        if not 0 <= self.replan_threshold <= 10:
            raise ConfigError(f"--replan-threshold must be within 0..10, got {self.replan_threshold}")


def run_plan(config: PlanConfig) -> int:
    """Plans the cluster; returns 0, 1 if --current stands (no new plan written), 2 on a bad input."""
    from swarm.planning.cluster import ClusterError, read_cluster
    from swarm.planning.planner import plan_pipeline, replan_gain

    try:
        cluster = read_cluster(config.cluster)
        if config.current:
            gain, chosen = replan_gain(read_plan(Path(config.current), cluster), cluster)
        else:
            gain, chosen = float("inf"), plan_pipeline(cluster)
    except ClusterError as e:
        print(f"swarm plan: error: {e}", file=sys.stderr)
        return 2
    content = chosen.to_dict(cluster)
    print(json.dumps(content, indent=2))
    if config.current and gain < 1 + config.replan_threshold:
        print(f"the plan in use stands: the best found is {gain:.3f}x as fast", file=sys.stderr)
        return 1
    if config.out != "-":
        try:
            Path(config.out).write_text(json.dumps(content, indent=2) + "\n")
        except OSError as e:
            print(f"swarm plan: error: cannot write the plan file {config.out}: {e.strerror}", file=sys.stderr)
            return 2
        print(
            f"plan written to {config.out}: {content['predicted_samples_per_s']} samples/s predicted", file=sys.stderr
        )
    return 0


def read_plan(path: Path, cluster: Cluster) -> Plan:
    """The Plan a plan file holds, against the cluster's peers (a peer it does not name is idle); read as peers and
    trainers read it (`swarm.config.plan_flag.read_plan_file`)."""
    from swarm.config.plan_flag import read_plan_file
    from swarm.planning.cluster import ClusterError
    from swarm.planning.pipeline_model import Plan

    try:
        data = read_plan_file(str(path))
    except ConfigError as e:
        raise ClusterError(str(e)) from None
    blocks = tuple(data["blocks_per_stage"])
    if sum(blocks) != cluster.model.n_layer:
        raise ClusterError(
            f"{path}: blocks_per_stage {list(blocks)} must be positive and add up to {cluster.model.n_layer}"
        )
    return Plan(blocks, tuple(data["stages"].get(p.name, -1) for p in cluster.peers), data["microbatch_size"])
