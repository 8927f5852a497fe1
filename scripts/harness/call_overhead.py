"""The cost of one stage call beyond the stage's own compute, through a live peer: what a microbatch pays for
crossing processes. Prints one JSON object.

A bootstrap node and one peer (a middle stage, one torch thread) start on this machine; this process calls
the peer with forward and backward requests one after another, as a trainer does. The overhead of a call is
its round trip less the compute the peer spent on it, which the peer itself counts (`busy_seconds` in its
info, read before and after each series): what remains is encoding, the wire, decoding, the checks and the
hand-offs between threads. It is reported per call and per MB of tensors moved (request and reply).

It imports only what every version of swarm since the rooms of swarm/ has, so that `scripts/bench_gpu.py`
runs it against an older tree too (PYTHONPATH) and compares today's path with that one in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import tempfile
import time

import torch


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-tiny", help="model preset")
    parser.add_argument("--num-stages", type=int, default=6, help="stages the model is cut into (one block each)")
    parser.add_argument("--microbatch-size", type=int, default=64, help="samples per call")
    parser.add_argument("--calls", type=int, default=30, help="timed calls of each kind")
    parser.add_argument("--no-shared-memory", action="store_true", help="keep tensors on the socket")
    return parser.parse_args()


async def _series(net, peer_id, spec, backward: bool, tensors: list[torch.Tensor], calls: int) -> dict:
    from swarm.compression import get_codec
    from swarm.net.transport import call_stage, get_peer_info
    from swarm.proto import BACKWARD, FORWARD, StageRequest

    codec = get_codec("none")
    kind = BACKWARD if backward else FORWARD
    moved = []

    async def one() -> None:
        # microbatch id 0: not a training microbatch, so nothing is held toward a step
        request = StageRequest(model=spec.name, stage=1, kind=kind, step=0, microbatch_id=0)
        _, outputs = await call_stage(net, peer_id, request, tensors, codec, 60.0)
        moved.append(sum(t.numel() * t.element_size() for t in [*tensors, *outputs]))

    for _ in range(3):  # warm-up
        await one()
    busy = (await get_peer_info(net, peer_id)).busy_seconds
    start = time.perf_counter()
    for _ in range(calls):
        await one()
    elapsed = time.perf_counter() - start
    compute = (await get_peer_info(net, peer_id)).busy_seconds - busy
    per_call = (elapsed - compute) / calls
    megabytes = statistics.median(moved) / 1e6
    return {
        "round_trip_ms": round(elapsed / calls * 1e3, 3),
        "compute_ms": round(compute / calls * 1e3, 3),
        "overhead_ms": round(per_call * 1e3, 3),
        "mb_moved": round(megabytes, 3),
        "overhead_us_per_mb": round(per_call * 1e6 / megabytes, 1),
    }


async def _measure(args: argparse.Namespace, initial_peers: list[str]) -> dict:
    from hivemind.p2p import PeerID

    from swarm.models import get_model_spec
    from swarm.net.dht_node import TetheredDHT, connect_to_daemon
    from swarm.net.direct_plane import DirectPlane
    from swarm.records.stage_records import fetch_stage_records

    spec = get_model_spec(args.model)
    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        deadline = time.monotonic() + 90
        while not (records := fetch_stage_records(dht, "swarm", args.num_stages).get(1)):
            if time.monotonic() > deadline:
                raise SystemExit("the peer did not announce itself within 90 s")
            await asyncio.sleep(0.2)
        options = {}
        if "shared_memory" in inspect.signature(DirectPlane).parameters:
            options["shared_memory"] = not args.no_shared_memory
        net = DirectPlane(await connect_to_daemon(dht), dht.identity, **options)
        net.learn(records)
        peer_id = PeerID.from_base58(records[0].peer_id)
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(args.microbatch_size, spec.seq_len, spec.boundary_width, generator=generator)
        grad = torch.randn(hidden.shape, generator=generator) * 1e-3
        result = {
            "forward": await _series(net, peer_id, spec, False, [hidden], args.calls),
            "backward": await _series(net, peer_id, spec, True, [hidden, grad], args.calls),
            "calls_by_path": dict(net.calls),
        }
        await net.shutdown()
        return result
    finally:
        dht.shutdown()


def main() -> None:
    args = _options()
    torch.set_num_threads(1)
    from swarm.launch.local_swarm import LocalSwarm
    from swarm.process.allocator import keep_large_buffers

    keep_large_buffers()  # as a trainer does: the buffers of one call serve the next without fresh pages

    peer_flags = ["--model", args.model, "--num-stages", str(args.num_stages), "--num-threads", "1"]
    peer_flags += ["--target-batch-size", str(10**6)]  # never steps: every call meets the same parameters
    peer_flags += ["--max-batch-samples", str(max(256, args.microbatch_size))]
    if args.no_shared_memory:
        peer_flags.append("--no-shared-memory")
    with LocalSwarm(tempfile.mkdtemp(prefix="call-overhead-")) as swarm:
        swarm.start_bootstrap()
        swarm.start_peer("peer", 1, peer_flags)
        result = asyncio.run(_measure(args, swarm.initial_peers))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
