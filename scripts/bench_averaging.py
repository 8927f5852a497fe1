"""What a stage's averaging round costs as the stage grows: 2 to 16 mates, three engines; prints one JSON object.

One stage of `--sizes` mates, each a real process with its own DHT node and libp2p daemon, no trainers: every
mate holds a random float32 gradient of `--parameters` values and made-up microbatch ids, and all start a
round at the same moment (`scripts/harness/averaging_mate.py`). Engines, in one run:
- `all_to_all`: `StageMates.average` of the tree at `--baseline-ref` (today's round: every mate sends its
  whole gradient to every other), exported beside this one (`harness.baseline_tree`);
- `new`: `StageMates.average` of this working tree;
- `hivemind`: hivemind's DecentralizedAverager (butterfly all-reduce after matchmaking), a group of all mates.
Our rounds run on the direct plane as peers' do (shared memory off: a stage's mates live on different hosts;
`--libp2p` sends everything through libp2p instead); `--bandwidth-mbit` / `--latency-ms` give every mate
one emulated interface (`harness.counted_streams`, on `swarm.net.link_shaper`).

Per engine and size: seconds per round (the slowest mate's, median over `--rounds` after `--warmup`),
bytes sent and received per peer per round (counted on the streams, also in gradient sizes), peak memory
per peer (RSS high-water during the rounds less RSS before them; hivemind's averager process included),
CPU seconds per round of all mates' processes, and whether every mate's result was the exact sum.
`must_show` holds issue 31's figures: at the largest size, bytes sent per peer in gradient sizes (at most
2.5) and the round time over that at the smallest size (at most 2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

from harness.averaging_group import GroupSpec, run_group  # noqa: E402
from harness.baseline_tree import REPOSITORY, environment_for, export_tree  # noqa: E402

ENGINES = ("all_to_all", "new", "hivemind")
SENT_LIMIT, TIME_RATIO_LIMIT = 2.5, 2.0  # issue 31: at 16 mates, against 2


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16], help="mates per stage")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--parameters", type=int, default=2**21, help="gradient size (float32 values)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine and size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (connections, buffers)")
    parser.add_argument("--baseline-ref", default="94d0c98", help="commit whose round is the all-to-all")
    parser.add_argument("--libp2p", action="store_true", help="our rounds over libp2p, not the direct plane")
    parser.add_argument("--bandwidth-mbit", type=float, default=0.0, help="each mate's emulated link (0: none)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency of that link")
    parser.add_argument(
        "--matchmaking-time",
        type=float,
        default=5.0,
        help="hivemind's min_matchmaking_time (a full group starts at once)",
    )
    parser.add_argument("--round-timeout", type=float, default=60.0, help="seconds a round may wait for a mate")
    parser.add_argument("--size-timeout", type=float, default=600.0, help="seconds one engine at one size may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="the mates log every stream, with times")
    parser.add_argument("--log-dir", type=Path, default=None, help="the mates' logs (default: a temporary folder)")
    args = parser.parse_args()
    if min(args.sizes) < 2 or args.rounds < 1 or args.parameters < 1:
        parser.error("--sizes of at least 2, --rounds and --parameters of at least 1")
    return args


def _environments(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    here = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    environments = {"new": here, "hivemind": here}
    if "all_to_all" in args.engines:
        environments["all_to_all"] = environment_for(export_tree(args.baseline_ref))
    return environments


def must_show(engines: dict[str, dict]) -> dict:
    """Issue 31's figures per engine: at the largest size, gradients sent per peer and the time over the smallest."""
    shown = {}
    for name, sizes in engines.items():
        done = {int(n): figures for n, figures in sizes.items() if "round_s" in figures}
        if len(done) < 2:
            continue
        small, large = done[min(done)], done[max(done)]
        sent, ratio = large["sent_gradients_per_peer"], large["round_s"] / small["round_s"]
        shown[name] = {
            "mates": [min(done), max(done)],
            "sent_gradients_per_peer": sent,
            "round_time_ratio": round(ratio, 2),
            "meets": sent <= SENT_LIMIT and ratio <= TIME_RATIO_LIMIT and large["exact"],
        }
    return shown


def main() -> None:
    args = _options()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the mates of the group under way end too
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-averaging-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    environments = _environments(args)
    extra = ["--round-timeout", str(args.round_timeout), "--matchmaking-time", str(args.matchmaking_time)]
    extra += ["--bandwidth-mbit", str(args.bandwidth_mbit), "--latency-ms", str(args.latency_ms)]
    extra += ["--libp2p"] if args.libp2p else []
    extra += ["--log-level", "DEBUG"] if args.trace else []
    engines: dict[str, dict] = {name: {} for name in args.engines}
    load_before = os.getloadavg()[0]
    for size in args.sizes:  # sizes outside, engines inside: drift in the machine's load touches all alike
        for name in args.engines:
            spec = GroupSpec(
                engine="hivemind" if name == "hivemind" else "swarm",
                mates=size,
                parameters=args.parameters,
                rounds=args.rounds,
                warmup=args.warmup,
                seed=args.seed,
                env=environments[name],
                extra=extra,
                deadline=args.size_timeout,
                log_dir=log_dir,
                label=name,
            )
            engines[name][str(size)] = run_group(spec)
            print(f"{name} at {size} mates: {json.dumps(engines[name][str(size)])}", file=sys.stderr, flush=True)
    head = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    result = {
        "bench": "averaging",
        "parameters": args.parameters,
        "gradient_bytes": 4 * args.parameters,
        "sizes": args.sizes,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "path": "libp2p" if args.libp2p else "direct",
        "link": {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms}
        if args.bandwidth_mbit or args.latency_ms
        else None,
        "baseline_ref": args.baseline_ref,
        "head": head.stdout.strip(),
        "cpus": os.cpu_count(),
        # other work on the machine slows every engine: the 1-minute load average at the start and the end
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "engines": engines,
        "must_show": must_show(engines),
        "log_dir": str(log_dir),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
