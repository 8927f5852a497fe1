"""One mate of a stage for scripts/bench_averaging.py: a real process averaging a gradient with its mates.

Started by `harness.averaging_group`, one process per mate, with a DHT node (and its libp2p daemon) of its
own. It speaks to its starter in lines on stdin and stdout: it says its addresses, then that it is ready;
for each `{"round": i, "at": T}` it waits until the wall-clock time T, runs one averaging round and answers
with what the round took and what it gave; `{"stop": true}` ends it, after it has said its peak memory.

Engines (`--engine`):
- `swarm`: the stage's runtime and `StageMates` as a peer builds them (`peer/server.py`), its network the
  direct plane over libp2p as a peer's is (shared memory off: mates of a stage live on different hosts),
  the mates known from their signed DHT records; a round is `StageMates.average(step, grad_sum, held)`,
  called as the runtime calls it. The code is whatever `swarm` this process imports: run under an older
  tree's PYTHONPATH (`harness.baseline_tree`), it measures that tree's round.
- `hivemind`: hivemind's `DecentralizedAverager` (butterfly all-reduce, groups formed by matchmaking over
  the DHT) with a group of all the mates; a round is `step(weight=samples)`.

Every byte is counted on the streams themselves (`harness.counted_streams`). The gradient holds small
integers (`bench_gradient`), so the exact sum does not depend on the order of the additions and every
engine's result can be compared bit for bit with it (hivemind's mean times the group's size, exact for a
group of a power of two).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from harness.counted_streams import (
    CountedNetwork,
    Shaper,
    SharedTraffic,
    Traffic,
    count_hivemind_streams,
)

logger = logging.getLogger("harness.averaging_mate")  # run as __main__: named as the module

PROTOCOL_PREFIX = "@@ "  # the lines meant for the starter; anything else on stdout is ignored
RUN_ID = "bench-averaging"
MODEL = "bench-averaging"
TRAINER = "bench-trainer"


def bench_gradient(seed: int, rank: int, size: int) -> torch.Tensor:
    """Mate `rank`'s gradient sum: float32 integers in [-4, 4], so that any order of summing them is exact."""
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    return torch.randint(-4, 5, (size,), generator=generator, dtype=torch.int16).float()


def digest(tensor: torch.Tensor) -> str:
    """A short hash of a float32 vector's values (-0.0 taken as 0.0)."""
    return hashlib.sha256((tensor.float() + 0.0).numpy().tobytes()).hexdigest()[:20]


def emit(**fields) -> None:
    sys.stdout.write(PROTOCOL_PREFIX + json.dumps(fields) + "\n")
    sys.stdout.flush()


# --- what a process holds and spends --------------------------------------------------------------------


def status_kib(pid: int, field: str) -> int:
    """A `/proc/PID/status` figure in KiB (VmRSS, VmHWM); 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak(pid: int) -> int:
    """Resets the process's RSS high-water mark to its current RSS (Linux 4.0+); returns that RSS in KiB."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass
    return status_kib(pid, "VmRSS")


def group_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's group (this mate, its DHT node or averager, their libp2p daemons)."""
    tick, group, me = os.sysconf("SC_CLK_TCK"), os.getpgrp(), os.getpid()
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) != group:
            continue
        program = "mate" if int(entry.name) == me else "p2pd" if "p2pd" in name else "children"
        totals[program] = totals.get(program, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


# --- the engines ---------------------------------------------------------------------------------------------


class BenchStage(torch.nn.Module):
    """A stage of one flat parameter of the gradient's size: what a round averages is all there is to it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.stage, self.num_stages = 0, 1
        self.weight = torch.nn.Parameter(torch.zeros(size))


class SwarmEngine:
    """A peer's runtime and `StageMates` on the direct plane, its mates seen through their DHT records."""

    def __init__(self, args: argparse.Namespace, dht, traffic: Traffic, shaper: Shaper | None) -> None:
        self.args, self.dht, self.traffic, self.shaper = args, dht, traffic, shaper
        self.loop = _new_loop()
        threading.Thread(target=self.loop.run_forever, name="mate-loop", daemon=True).start()

    def _on_loop(self, coroutine, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> None:
        from swarm.peer.mates import StageMates
        from swarm.peer.runtime import StageRuntime

        args = self.args
        module = BenchStage(args.parameters)
        # the optimizer never steps here: the round is what is measured
        runtime = StageRuntime(module, torch.optim.SGD(module.parameters(), lr=0.0), 2**30)
        self.runtime = runtime
        self.mates = StageMates(
            runtime, str(self.dht.peer_id), MODEL, averaging_timeout=args.round_timeout, short_wait=args.round_timeout
        )
        address = self._on_loop(self._open_network())
        self._announce(address)

    async def _open_network(self) -> str:
        from swarm.net.dht_node import connect_to_daemon
        from swarm.net.direct_plane import DirectPlane

        self.net = DirectPlane(await connect_to_daemon(self.dht), self.dht.identity, shared_memory=False)
        await self.mates.start(CountedNetwork(self.net, self.traffic, self.shaper))
        return "" if self.args.libp2p else await self.net.serve("127.0.0.1", 0, "127.0.0.1")

    def _announce(self, address: str) -> None:
        """Announces this mate serving the stage, and waits until the DHT shows every mate."""
        from swarm.proto import PROTOCOL_VERSION
        from swarm.records.stage_records import SERVING, StageRecord, announce, fetch_stage_records

        record = StageRecord(
            peer_id=str(self.dht.peer_id),
            stage=0,
            model=MODEL,
            num_stages=1,
            state=SERVING,
            step=0,
            throughput=1.0,
            queue_length=0,
            target_batch_size=2**20,
            stale_gradients=0,
            protocol_version=PROTOCOL_VERSION,
            direct=address,
        )
        announce(self.dht, RUN_ID, record, ttl=3600)
        deadline = time.monotonic() + self.args.setup_timeout
        while True:
            serving = [r for r in fetch_stage_records(self.dht, RUN_ID, 1)[0] if r.state == SERVING]
            if len(serving) >= self.args.mates:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"saw {len(serving)} of {self.args.mates} mates in the DHT")
            time.sleep(0.5)

        async def see() -> None:
            self.net.learn(serving)
            self.mates.update_records(serving)

        self._on_loop(see())

    def round(self, index: int, gradient: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
        """One round, called as the runtime calls it; then the step the runtime would take, without updating."""
        args, runtime = self.args, self.runtime
        first = (index * args.mates + args.rank) * args.microbatches
        held = {(TRAINER, first + i): args.microbatch_samples for i in range(args.microbatches)}
        step, dropped = runtime.step, self.mates.dropped_members
        result = self.mates.average(step, gradient, held)
        if isinstance(result, Future):  # a round that runs while the runtime goes on serving
            result = result.result()
        fingerprint = runtime.fingerprint
        runtime.step = step + 1
        runtime.version = (step + 1, fingerprint)
        runtime.last_round = result
        self.mates.on_step(step + 1, fingerprint)
        if result is None:
            return None, {"failed": True}
        return result.grad_sum, {"samples": result.samples, "dropped": self.mates.dropped_members - dropped}

    def processes(self) -> list[int]:
        return [os.getpid()]

    def stop(self) -> None:
        async def close() -> None:
            await self.mates.stop()
            await self.net.shutdown()

        try:
            self._on_loop(close(), timeout=20)
        except Exception:
            pass


class HivemindEngine:
    """hivemind's DecentralizedAverager over the mate's DHT, in a group of all the mates."""

    def __init__(self, args: argparse.Namespace, dht, traffic: SharedTraffic, shaper_args: tuple) -> None:
        self.args, self.dht, self.traffic, self.shaper_args = args, dht, traffic, shaper_args

    def start(self) -> None:
        from hivemind.averaging import DecentralizedAverager

        traffic, shaper_args = self.traffic, self.shaper_args

        class CountedAverager(DecentralizedAverager):
            def run(self) -> None:  # the averager's own process: count its streams
                count_hivemind_streams(traffic, Shaper(*shaper_args) if shaper_args else None)
                super().run()

        args = self.args
        self.averager = CountedAverager(
            averaged_tensors=[torch.zeros(args.parameters)],
            dht=self.dht,
            prefix="bench_averaging",
            target_group_size=args.mates,
            min_group_size=args.mates,
            min_matchmaking_time=args.matchmaking_time,
            request_timeout=min(3.0, args.matchmaking_time / 2),  # hivemind's defaults: 5 s and 3 s
            start=True,
        )

    def round(self, index: int, gradient: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
        args = self.args
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(gradient)
        samples = args.microbatches * args.microbatch_samples
        control = self.averager.step(weight=float(samples), timeout=args.round_timeout, wait=False)
        try:  # hivemind's timeout bounds the search for a group only: the round as a whole is bounded here
            gathered = control.result(args.round_timeout + 10)
        except Exception as e:
            control.cancel()
            return None, {"failed": True, "error": f"{type(e).__name__}: {e}"}
        if gathered is None:
            return None, {"failed": True}
        with self.averager.get_tensors() as tensors:
            total = tensors[0] * len(gathered)  # the group's mean, times its size: the sum
        extra = {"samples": samples * len(gathered), "group": len(gathered)}
        if self.traffic.first_watched_at:
            extra["matchmaking_at"] = self.traffic.first_watched_at
        return total, extra

    def processes(self) -> list[int]:
        return [os.getpid(), self.averager.pid]

    def stop(self) -> None:
        self.averager.shutdown()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# --- the process ---------------------------------------------------------------------------------------------


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["swarm", "hivemind"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--mates", type=int, required=True)
    parser.add_argument("--parameters", type=int, required=True, help="gradient size (float32 values)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--microbatches", type=int, default=4, help="microbatch ids each mate holds per round")
    parser.add_argument("--microbatch-samples", type=int, default=8)
    parser.add_argument("--round-timeout", type=float, default=120.0)
    parser.add_argument("--setup-timeout", type=float, default=180.0)
    parser.add_argument("--matchmaking-time", type=float, default=5.0, help="hivemind: min_matchmaking_time")
    parser.add_argument("--libp2p", action="store_true", help="swarm: no direct plane, every call over libp2p")
    parser.add_argument("--bandwidth-mbit", type=float, default=0.0, help="emulated interface (0: unshaped)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--log-level", default="INFO", help="of this process's log (its stderr)")
    return parser.parse_args()


def main() -> None:
    args = _options()
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("swarm", "harness"):
        logging.getLogger(name).setLevel(args.log_level)
    from swarm.net.dht_node import TetheredDHT
    from swarm.process.allocator import keep_large_buffers

    keep_large_buffers()  # as every role does (swarm.launch)
    torch.set_num_threads(1)
    shaped = args.bandwidth_mbit > 0 or args.latency_ms > 0
    shaper_args = (args.bandwidth_mbit, args.latency_ms) if shaped else ()
    # the DHT forks: before any thread
    dht = TetheredDHT(initial_peers=args.initial_peers or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    emit(maddrs=[str(m) for m in dht.get_visible_maddrs()], peer_id=str(dht.peer_id))
    gradient = bench_gradient(args.seed, args.rank, args.parameters)
    if args.engine == "swarm":
        traffic: Traffic = Traffic(watch="/grad")
        engine = SwarmEngine(args, dht, traffic, Shaper(*shaper_args) if shaped else None)
    else:
        traffic = SharedTraffic(watch="aggregate_part")
        engine = HivemindEngine(args, dht, traffic, shaper_args)
    engine.start()
    emit(ready=True)
    base = {pid: reset_peak(pid) for pid in engine.processes()}
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("stop"):
            break
        _one_round(engine, traffic, gradient, command["round"], command["at"])
    peaks = {pid: status_kib(pid, "VmHWM") - rss for pid, rss in base.items()}
    emit(peak_kib=sum(peaks.values()), peak_kib_by_process=list(peaks.values()), base_kib=sum(base.values()))
    engine.stop()
    dht.shutdown()


def settle(traffic: Traffic, quiet: float = 0.05, limit: float = 2.0) -> None:
    """Waits until no byte has moved for `quiet` seconds (at most `limit`): a round may return while its last
    sends to mates are still on their way, and their bytes belong to it."""
    deadline = time.monotonic() + limit
    moved = (traffic.sent, traffic.received)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = (traffic.sent, traffic.received)
        if now == moved:
            return
        moved = now


def _one_round(engine, traffic: Traffic, gradient: torch.Tensor, index: int, at: float) -> None:
    cpu = group_cpu_seconds()
    sent, received = traffic.sent, traffic.received
    traffic.first_watched_at = 0.0
    time.sleep(max(0.0, at - time.time()))
    try:
        logger.debug(f"round {index} starts")
        total, extra = engine.round(index, gradient)
        logger.debug(f"round {index} ends")
    except Exception as e:
        total, extra = None, {"failed": True, "error": f"{type(e).__name__}: {e}"}
    seconds = time.time() - at
    settle(traffic)
    after = group_cpu_seconds()
    if "matchmaking_at" in extra:
        extra["matchmaking_s"] = round(extra.pop("matchmaking_at") - at, 4)
    emit(
        round=index,
        seconds=round(seconds, 4),
        sent=traffic.sent - sent,
        received=traffic.received - received,
        digest=digest(total) if total is not None else "",
        cpu_s={program: round(after[program] - cpu.get(program, 0.0), 3) for program in after},
        **extra,
    )


if __name__ == "__main__":
    main()
