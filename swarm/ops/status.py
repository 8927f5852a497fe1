"""`swarm status`: a table of the swarm's stages and their peers, read from the DHT."""

from __future__ import annotations

import time

from hivemind.utils import get_dht_time

from swarm.config import StatusConfig
from swarm.net.dht_node import start_dht
from swarm.records.stage_records import StageRecord, fetch_stage_records


def format_status(records: dict[int, list[StageRecord]], now: float) -> str:
    """The table `swarm status` prints, one line per peer, grouped by stage."""
    header = f"{'stage':>5}  {'peer':<20} {'state':<8} {'step':>6} {'samples/s':>10} {'queue':>5} {'stale':>6}"
    lines = [f"{header} {'expires':>8}"]
    for stage in sorted(records):
        peers = sorted(records[stage], key=lambda r: r.peer_id)
        if not peers:
            lines.append(f"{stage:>5}  {'(no peer)':<20}")
        for r in peers:
            lines.append(
                f"{stage:>5}  {r.peer_id[-20:]:<20} {r.state:<8} {r.step:>6} {r.throughput:>10.1f} "
                f"{r.queue_length:>5} {r.stale_gradients:>6} {r.expiration - now:>7.1f}s"
            )
    return "\n".join(lines)


def run_status(config: StatusConfig) -> None:
    """Prints the status table once, or every --watch seconds until Ctrl-C."""
    dht = start_dht(config)
    try:
        while True:
            records = fetch_stage_records(dht, config.run_id, config.num_stages)
            print(format_status(records, get_dht_time()), flush=True)
            if not config.watch:
                return
            time.sleep(config.watch)
            print()
    except KeyboardInterrupt:
        pass
    finally:
        dht.shutdown()
