"""Speed on one GPU, and the per-call overhead any machine can measure; prints one JSON object.

On a CUDA device (at most about 5 minutes):
- `reference`: one process training the model's stages in each dtype, and in bf16 with the blocks compiled
  (`--compile`): samples/s, TFLOP/s and MFU (model
  FLOPs utilization: 6 x parameters + attention, per token, over the chip's dense peak in that dtype);
- `swarm`: a local swarm of `--num-stages` peers sharing the one GPU, in bf16, against the bf16 reference
  (ratio) and the GPU's busy fraction (nvidia-smi, sampled every 0.5 s while the trainer trains);
- `spilling`: one stage with `--offload` under a memory cap (`torch.cuda.set_per_process_memory_fraction`)
  against the same stage in memory: samples/s and whether the parameters came out identical.

Everywhere (CPUs included), `step_host_work`: the host's share of a stage's step, alone and with the slice
math a round with mates adds (`scripts/harness/step_host_work.py`); and `call_overhead`: what a stage call
costs beyond the stage's compute through a live peer (`scripts/harness/call_overhead.py`), per MB moved,
for this tree over shared memory and over
TCP, and for an older tree (`--baseline-ref`, today's path before this one) in the same run, rounds
interleaved so that drift in the machine's load touches all alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

from harness.baseline_tree import environment_for, export_tree  # noqa: E402


def _probe(env: dict[str, str] | None, extra: list[str], args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "harness.call_overhead", "--calls", str(args.calls), *extra]
    command += ["--microbatch-size", str(args.overhead_microbatch)]
    done = subprocess.run(command, cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the overhead probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def call_overhead(args: argparse.Namespace) -> dict:
    """Per-call overhead of this tree (shared memory, TCP) and of `--baseline-ref`, medians over rounds."""
    import os

    variants: dict[str, tuple[dict[str, str] | None, list[str]]] = {
        "shared_memory": ({**os.environ, "PYTHONPATH": str(SCRIPTS)}, []),
        "tcp": ({**os.environ, "PYTHONPATH": str(SCRIPTS)}, ["--no-shared-memory"]),
    }
    if args.baseline_ref:
        variants["baseline"] = (environment_for(export_tree(args.baseline_ref)), [])
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (env, extra) in variants.items():
            runs[name].append(_probe(env, extra, args))
    result: dict = {"microbatch_mb": None, "rounds": args.rounds, "calls_per_round": args.calls}
    for name, measured in runs.items():
        result[name] = {
            kind: {
                "overhead_us_per_mb": statistics.median(m[kind]["overhead_us_per_mb"] for m in measured),
                "overhead_ms": statistics.median(m[kind]["overhead_ms"] for m in measured),
                "compute_ms": statistics.median(m[kind]["compute_ms"] for m in measured),
            }
            for kind in ("forward", "backward")
        }
        result["microbatch_mb"] = measured[0]["forward"]["mb_moved"] / 2
    if "baseline" in result:
        result["baseline_ref"] = args.baseline_ref
        for name in ("shared_memory", "tcp"):
            ours, before = result[name], result["baseline"]
            result[f"{name}_vs_baseline"] = {
                kind: round(ours[kind]["overhead_us_per_mb"] / before[kind]["overhead_us_per_mb"], 3)
                for kind in ("forward", "backward")
            }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-medium", help="GPU runs: model preset")
    parser.add_argument("--num-stages", type=int, default=4, help="GPU runs: stages (one peer each on the one GPU)")
    parser.add_argument("--steps", type=int, default=10, help="GPU runs: optimizer steps per measurement")
    parser.add_argument("--target-batch-size", type=int, default=64, help="GPU runs: samples per step")
    parser.add_argument("--microbatch-size", type=int, default=8, help="GPU runs: samples per microbatch")
    parser.add_argument("--max-in-flight", type=int, default=16, help="GPU runs: microbatches in flight")
    parser.add_argument(
        "--device",
        default="cuda",
        help="GPU runs: device (cpu runs them on a small --model: a smoke test of the bench)",
    )
    parser.add_argument("--spill-model", default="gpt-large", help="GPU runs: model whose one stage is spilled")
    parser.add_argument("--baseline-ref", default="8ce2d8a", help="older commit whose call path is measured too")
    parser.add_argument("--rounds", type=int, default=3, help="overhead: interleaved rounds per variant")
    parser.add_argument("--calls", type=int, default=10, help="overhead: timed calls of each kind per round")
    parser.add_argument(
        "--overhead-microbatch",
        type=int,
        default=384,
        help="overhead: samples per call of gpt-tiny (384: a 12.6 MB boundary tensor, a gpt-small microbatch of 8's)",
    )
    parser.add_argument("--skip-overhead", action="store_true", help="only the GPU runs")
    parser.add_argument(
        "--step-work-model", default="gpt-medium", help="step host work: model of the stage timed ('' skips it)"
    )
    args = parser.parse_args()

    result: dict = {"bench": "gpu", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available() or args.device == "cpu":
        from harness.gpu_runs import gpu_runs

        result.update(gpu_runs(args))
    else:
        result["gpu"] = "not measured: no CUDA device here"
    if not args.skip_overhead:
        result["call_overhead"] = call_overhead(args)
    if args.step_work_model:
        from harness.step_host_work import step_host_work

        result["step_host_work"] = step_host_work(args.step_work_model)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
