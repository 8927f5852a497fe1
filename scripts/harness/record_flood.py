"""Identities that each publish a serving record on a stage and stall every call: a record flood.

For scripts/adversary.py's `record-flood`: each identity holds a valid key and signs its own record,
a copy of an honest serving peer's on the stage (its step, settings and speed), renewed as peers renew
theirs. It answers nothing: every stream opened to it, on every swarm protocol, is held open unanswered,
the costliest silence for a caller (a refused stream fails at once). It runs until it is stopped.

    python scripts/harness/record_flood.py --initial-peers ADDR --stage 1 --identities 4
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from swarm.net.dht_node import TetheredDHT  # noqa: E402
from swarm.net.transport import INFO_PROTOCOL, STAGE_PROTOCOL  # noqa: E402
from swarm.peer.mates import MATE_PROTOCOLS  # noqa: E402
from swarm.records.stage_records import SERVING, StageRecord, announce, fetch_stage_records  # noqa: E402

PROTOCOLS = [STAGE_PROTOCOL, INFO_PROTOCOL, *MATE_PROTOCOLS]


async def stall(_info, _reader, writer) -> None:
    """Holds a stream open, unanswered, until the caller gives up."""
    try:
        await asyncio.Event().wait()
    finally:
        writer.close()


def copy_of(honest: StageRecord, peer_id: str) -> StageRecord:
    """An honest record as `peer_id`'s own: the same step, settings and speed, no direct plane."""
    return dataclasses.replace(honest, peer_id=peer_id, direct="", standbys=(), moving_to=-1, expiration=0.0)


async def flood(args: argparse.Namespace) -> None:
    nodes = [TetheredDHT(initial_peers=args.initial_peers, start=True) for _ in range(args.identities)]
    for node in nodes:
        p2p = await node.replicate_p2p()
        for protocol in PROTOCOLS:
            await p2p.add_binary_stream_handler(protocol, stall)
    ids = {node: str(node.peer_id) for node in nodes}
    renewals = 0
    while True:
        records = await asyncio.to_thread(fetch_stage_records, nodes[0], args.run_id, args.num_stages, args.stage)
        honest = [r for r in records[args.stage] if r.state == SERVING and r.peer_id not in ids.values()]
        for node in nodes if honest else ():
            record = copy_of(max(honest, key=lambda r: r.step), ids[node])
            await asyncio.to_thread(announce, node, args.run_id, record, args.ttl)
        renewals += bool(honest)
        if renewals == 2:  # every identity's record is out, renewed once
            print(f"stage {args.stage}: {len(nodes)} identities' records renewed, every call to them held", flush=True)
        await asyncio.sleep(args.period)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of the swarm's DHT")
    parser.add_argument("--stage", type=int, default=1, help="the stage whose records are flooded")
    parser.add_argument("--identities", type=int, default=4, help="identities, each with its own record")
    parser.add_argument("--num-stages", type=int, default=3, help="stages of the swarm")
    parser.add_argument("--run-id", default="swarm", help="the swarm's run id")
    parser.add_argument("--period", type=float, default=0.5, help="seconds between renewals")
    parser.add_argument("--ttl", type=float, default=10.0, help="seconds each record stays valid")
    argv = sys.argv[1:]
    # started through LocalSwarm's `prefix`: the `swarm` command line after `--` is not run
    asyncio.run(flood(parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)))


if __name__ == "__main__":
    main()
