"""Training with inference in its bubbles: samples/s at inference loads of 0, 25, 50 and 100% of the spare
capacity, each stage's busy time split between the two, inference latency and training's queue wait.

Prints one JSON object. One local swarm of simulated devices (`--simulated-speed`: each peer pads its compute
to that speed with sleep, so the peers do not compete for this machine's cores) behind the trainer's link
shaper (`--emulate-bandwidth-mbit`, `--emulate-latency-ms`). A trainer trains `--steps` steps at each load in
turn; meanwhile this process sends INFER calls (forward only, `--infer-batch` samples each) to every stage.

The spare capacity of a stage is measured in the first run, with no inference: one minus its training busy
share, times its forward rate (three times the simulated speed, a forward costing a third of a backward). At a
load of L < 100% each stage gets calls at L times that rate (Poisson arrivals); at 100% each stage is kept
saturated (`--saturating-calls` calls outstanding at all times). The no-inference run is repeated last, and the
baseline is the mean of the two, so that drift over the bench shows in `baseline_spread`.

A stage's busy share is its busy seconds (training batches; inference chunks) over the window, read from its
info. Training's delay behind inference is what a training request that came during an inference chunk waited
for it, as each peer measured it: the 99th percentile and the most of its latest (at most one chunk,
`--inference-chunk-ms`, or one sample's forward where that is longer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from hivemind.p2p import PeerID

from swarm.config.inference_settings import InferenceConfig
from swarm.inference.stage_client import StageClient
from swarm.launch.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.net.dht_node import TetheredDHT
from swarm.net.direct_plane import DirectPlane
from swarm.net.transport import StageCallError, get_peer_info

FORWARD_SPEEDUP = 3.0  # a forward against a backward (which recomputes it), as the peers' simulated devices take it


class InferenceLoad:
    """Sends INFER calls to every stage at a rate (or saturating), and times them."""

    def __init__(self, client: StageClient, args: argparse.Namespace) -> None:
        self.client, self.args = client, args
        spec = get_model_spec(args.model)
        batch = args.infer_batch
        tokens = torch.randint(0, 256, (batch, spec.seq_len))
        width = spec.boundary_width
        self.inputs = [[tokens]] + [[torch.randn(batch, spec.seq_len, width) * 0.5] for _ in range(args.num_stages - 1)]
        self.latencies: list[float] = []
        self.failures = 0

    async def call(self, stage: int) -> None:
        started = time.perf_counter()
        try:
            await self.client.call_any(stage, self.inputs[stage])
            self.latencies.append(time.perf_counter() - started)
        except StageCallError:
            self.failures += 1

    async def saturate(self, stage: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.call(stage)

    async def at_rate(self, stage: int, calls_per_s: float, stop: asyncio.Event) -> None:
        pending: set[asyncio.Task] = set()
        while not stop.is_set():
            await asyncio.sleep(random.expovariate(calls_per_s))
            if len(pending) < 64:  # a stage that cannot keep up is not buried: the load is then its most
                task = asyncio.create_task(self.call(stage))
                pending.add(task)
                task.add_done_callback(pending.discard)
        await asyncio.gather(*pending, return_exceptions=True)

    async def run(self, load: float, spare: list[float], stop: asyncio.Event) -> None:
        args = self.args
        runs = []
        for stage in range(args.num_stages):
            if load >= 1.0:
                runs += [self.saturate(stage, stop) for _ in range(args.saturating_calls)]
            elif load > 0:
                rate = load * spare[stage] * args.simulated_speed * FORWARD_SPEEDUP / args.infer_batch
                runs.append(self.at_rate(stage, max(rate, 1e-3), stop))
        await asyncio.gather(*runs)


async def peer_infos(client: StageClient) -> list:
    await client.refresh()
    return [
        await get_peer_info(client.p2p, PeerID.from_base58(client.records[s][0].peer_id))
        for s in sorted(client.records)
    ]


def trainer_flags(args: argparse.Namespace, summary: str) -> list[str]:
    return [
        *["--model", args.model, "--num-stages", str(args.num_stages)],
        *["--steps", str(args.steps), "--microbatch-size", str(args.microbatch_size)],
        *["--max-in-flight", str(args.max_in_flight), "--summary-file", summary, "--no-progress"],
        *["--compression", "none", "--emulate-bandwidth-mbit", str(args.bandwidth_mbit)],
        *["--emulate-latency-ms", str(args.latency_ms)],
    ]


async def measure(swarm: LocalSwarm, client: StageClient, args, load: float, spare: list[float], index: int) -> dict:
    """One trainer run of `--steps` steps under `load`; its samples/s, busy shares, latencies and waits."""
    summary_file = os.path.join(swarm.workdir, f"summary-{index}.json")
    inference = InferenceLoad(client, args)
    stop = asyncio.Event()
    before = await peer_infos(client)
    started = time.perf_counter()
    sending = asyncio.create_task(inference.run(load, spare, stop))
    trainer = swarm.start_trainer(f"trainer{index}", trainer_flags(args, summary_file))
    code = await asyncio.get_running_loop().run_in_executor(None, trainer.wait)
    window = time.perf_counter() - started
    after = await peer_infos(client)
    stop.set()
    await sending
    if code != 0:
        sys.exit(f"the trainer failed at load {load}; logs in {swarm.workdir}")
    with open(summary_file) as file:
        summary = json.load(file)
    train_busy = [round((a.busy_seconds - b.busy_seconds) / window, 3) for a, b in zip(after, before)]
    infer_busy = [round((a.inference_seconds - b.inference_seconds) / window, 3) for a, b in zip(after, before)]
    latencies = sorted(inference.latencies)
    return {
        "load": load,
        "samples_per_s": round(summary["samples_per_second"], 2),
        "busy_training": train_busy,
        "busy_inference": infer_busy,
        "busy_total": [round(t + i, 3) for t, i in zip(train_busy, infer_busy)],
        "inference_calls": len(latencies),
        "inference_failures": inference.failures,
        "inference_p50_s": round(statistics.median(latencies), 4) if latencies else None,
        "inference_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 4) if latencies else None,
        "training_delay_behind_inference_p99_s": [round(info.inference_delay_p99, 4) for info in after],
        "training_delay_behind_inference_max_s": [round(info.inference_delay_max, 4) for info in after],
    }


async def bench(swarm: LocalSwarm, args: argparse.Namespace) -> dict:
    config = InferenceConfig(initial_peers=swarm.initial_peers, model=args.model, num_stages=args.num_stages)
    dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)
    try:
        client = StageClient(dht, config, DirectPlane(await dht.replicate_p2p(), dht.identity, dial=True))
        await client.wait_for_swarm()
        runs = [await measure(swarm, client, args, 0.0, [0.0] * args.num_stages, 0)]
        spare = [max(0.0, 1.0 - busy) for busy in runs[0]["busy_training"]]
        for index, load in enumerate(args.loads, start=1):
            runs.append(await measure(swarm, client, args, load, spare, index))
        runs.append(await measure(swarm, client, args, 0.0, spare, len(runs)))
    finally:
        dht.shutdown()
    baselines = [runs[0]["samples_per_s"], runs[-1]["samples_per_s"]]
    baseline = sum(baselines) / 2
    for run in runs:
        run["ratio_to_baseline"] = round(run["samples_per_s"] / baseline, 3)
    return {
        "runs": runs,
        "baseline_samples_per_s": round(baseline, 2),
        "spare_share": [round(s, 3) for s in spare],
        "baseline_spread": round(abs(baselines[0] - baselines[1]) / baseline, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-tiny", help="model preset")
    parser.add_argument("--num-stages", type=int, default=3, help="pipeline stages (one peer each)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each trainer run")
    parser.add_argument("--target-batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--microbatch-size", type=int, default=8, help="samples per microbatch")
    parser.add_argument("--max-in-flight", type=int, default=6, help="microbatches in flight")
    parser.add_argument("--simulated-speed", type=float, default=40.0, help="samples/s of backward work per device")
    parser.add_argument("--bandwidth-mbit", type=float, default=200.0, help="the trainer's emulated link")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="the trainer's emulated one-way latency")
    parser.add_argument("--inference-chunk-ms", type=float, default=5.0, help="the peers' inference chunk")
    parser.add_argument("--infer-batch", type=int, default=8, help="samples per inference call")
    parser.add_argument("--saturating-calls", type=int, default=2, help="calls outstanding per stage at 100%% load")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="inference loads")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-bubbles-")
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        for stage in range(args.num_stages):
            flags = ["--model", args.model, "--num-stages", str(args.num_stages)]
            flags += [
                "--target-batch-size",
                str(args.target_batch_size),
                "--simulated-speed",
                str(args.simulated_speed),
            ]
            flags += ["--inference-chunk-ms", str(args.inference_chunk_ms), "--announce-period", "1"]
            swarm.start_peer(f"peer{stage}", stage, flags)
        result = asyncio.run(bench(swarm, args))
    print(json.dumps({"bench": "bubbles", **{k: v for k, v in vars(args).items() if k != "loads"}, **result}))


if __name__ == "__main__":
    main()
