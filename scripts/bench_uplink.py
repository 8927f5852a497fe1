"""Replies that share a peer's uplink: sent at once, or one at a time (`--uplink-turns`), measured on one swarm.

Prints one JSON object. Two peers of stage 0 run behind an emulated uplink of `--uplink-mbit` (`swarm peer
--emulate-uplink-mbit`: the replies in flight share its rate, as TCP flows share a bottleneck), one that sends
its replies to a caller at once (`--no-uplink-turns`) and one that sends them in turn, the smallest first (the
default). This process sends each of them `--transfers` equal forward calls at once, `--rounds` times,
alternating, and times each call from its sending to its reply read. The mean of a round's completions, in
turns against at once, is the figure: 2.5 against 4 transfers' time for four equal transfers, where the link is
the bottleneck (each reply here crosses it in about `reply_seconds`; the forward itself takes milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

import torch
from hivemind.p2p import PeerID

from swarm.compression import get_codec
from swarm.launch.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.net.dht_node import TetheredDHT
from swarm.net.direct_plane import DirectPlane
from swarm.net.identity import load_identity
from swarm.net.transport import call_stage
from swarm.proto import FORWARD, StageRequest
from swarm.records.stage_records import SERVING, fetch_stage_records


async def one_round(p2p: DirectPlane, peer: str, args: argparse.Namespace, tokens: torch.Tensor) -> list[float]:
    """Completion seconds of `--transfers` forward calls sent to `peer` at once."""

    async def call() -> float:
        request = StageRequest(kind=FORWARD, model=args.model, stage=0, step=0, reply_codec="none")
        started = time.perf_counter()
        await call_stage(p2p, PeerID.from_base58(peer), request, [tokens], get_codec("none"), timeout=120)
        return time.perf_counter() - started

    return list(await asyncio.gather(*[call() for _ in range(args.transfers)]))


async def bench(swarm: LocalSwarm, peers: dict[str, str], args: argparse.Namespace) -> dict:
    dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            records = fetch_stage_records(dht, "swarm", 3, only=0)[0]
            if {r.peer_id for r in records if r.state == SERVING} >= set(peers.values()):
                break
            if time.monotonic() > deadline:
                sys.exit(f"the peers did not start; logs in {swarm.workdir}")
            await asyncio.sleep(0.5)
        p2p = DirectPlane(await dht.replicate_p2p(), dht.identity, dial=True)
        p2p.learn(records)
        tokens = torch.randint(0, 256, (args.batch, get_model_spec(args.model).seq_len))
        for name in peers:  # warm: connections open, kernels run once
            await one_round(p2p, peers[name], argparse.Namespace(**{**vars(args), "transfers": 1}), tokens)
        means: dict[str, list[float]] = {name: [] for name in peers}
        for _ in range(args.rounds):
            for name, peer in peers.items():
                means[name].append(statistics.mean(await one_round(p2p, peer, args, tokens)))
    finally:
        dht.shutdown()
    at_once, in_turn = statistics.median(means["at_once"]), statistics.median(means["in_turn"])
    reply_bytes = args.batch * get_model_spec(args.model).seq_len * get_model_spec(args.model).d_model * 4
    return {
        "reply_bytes": reply_bytes,
        "reply_seconds": round(reply_bytes * 8 / (args.uplink_mbit * 1e6), 3),
        "mean_completion_at_once_s": [round(m, 3) for m in means["at_once"]],
        "mean_completion_in_turn_s": [round(m, 3) for m in means["in_turn"]],
        "median_at_once_s": round(at_once, 3),
        "median_in_turn_s": round(in_turn, 3),
        "ratio_in_turn_to_at_once": round(in_turn / at_once, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-tiny", help="model preset (stage 0 of 3 answers the calls)")
    parser.add_argument("--uplink-mbit", type=float, default=4.0, help="the peers' emulated uplink")
    parser.add_argument("--transfers", type=int, default=4, help="equal calls sent at once")
    parser.add_argument("--batch", type=int, default=8, help="samples per call (its reply: batch x seq x width floats)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per peer, alternating")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-uplink-")
    peers = {}
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        for name, turns in (("at_once", "--no-uplink-turns"), ("in_turn", "--uplink-turns")):
            key = f"{workdir}/{name}.key"
            peers[name] = str(load_identity(key).peer_id)
            flags = ["--model", args.model, "--num-stages", "3", "--identity-path", key, turns]
            swarm.start_peer(
                name, 0, [*flags, "--emulate-uplink-mbit", str(args.uplink_mbit), "--announce-period", "1"]
            )
        result = asyncio.run(bench(swarm, peers, args))
    print(json.dumps({"bench": "uplink", **vars(args), **result}))


if __name__ == "__main__":
    main()
