"""How long a peer joining a busy stage takes from process start to serving; prints one JSON object.

A local swarm (one peer per stage) trains for a while; then peers join stage 1 one after another.
For each it reports the time from launching the process until its record says `serving` in the
DHT, and the part of that spent downloading and loading the mates' state (from the peer's log).
As a baseline from the same run: the same measurement for the first peer of a stage, which has
no state to download.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time

from hivemind import DHT

from swarm.launch.local_swarm import LocalSwarm
from swarm.net.dht_node import TetheredDHT
from swarm.records.stage_records import SERVING, fetch_stage_records


def wait_serving(dht: DHT, stage: int, count: int, timeout: float = 180.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        records = fetch_stage_records(dht, "swarm", 3)
        if sum(r.state == SERVING for r in records[stage]) >= count:
            return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError(f"stage {stage} did not reach {count} serving peers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--joins", type=int, default=3, help="peers to join stage 1, one after another")
    parser.add_argument("--train-steps", type=int, default=30, help="steps trained before the first join")
    args = parser.parse_args()
    flags = ["--model", "gpt-tiny", "--num-stages", "3", "--announce-period", "0.5"]
    with LocalSwarm(tempfile.mkdtemp(prefix="bench-join-")) as swarm:
        swarm.start_bootstrap()
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)  # ends with this process
        try:
            first = []
            for stage in range(3):
                launched = time.monotonic()
                swarm.start_peer(f"peer{stage}", stage, flags)
                first.append(wait_serving(dht, stage, 1) - launched)
            trainer = swarm.start_trainer("trainer", [*flags[:4], "--steps", str(args.train_steps), "--no-progress"])
            trainer.wait(600)
            joins, downloads = [], []
            for index in range(args.joins):
                launched = time.monotonic()
                swarm.start_peer(f"join{index}", 1, flags)
                joins.append(wait_serving(dht, 1, 2 + index) - launched)
                log = swarm.log_path(f"join{index}").read_text()
                found = re.search(r"Joined stage 1 at step (\d+) in ([\d.]+)s", log)
                downloads.append(float(found.group(2)) if found else float("nan"))
                step = int(found.group(1)) if found else -1
        finally:
            dht.shutdown()
    result = {
        "model": "gpt-tiny",
        "joined_at_step": step,
        "join_to_serving_s": [round(t, 2) for t in joins],
        "state_download_s": downloads,
        "first_peer_to_serving_s": [round(t, 2) for t in first],
        "join_median_s": round(statistics.median(joins), 2),
        "ratio_join_to_first_peer": round(statistics.median(joins) / statistics.median(first), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
