"""What a stage's robust sum costs and bounds, on real gradients: prints one JSON object.

gpt-tiny trains `--steps` steps on the built-in corpus in one process (24 samples a step). At each step,
every sample's gradient of stage 1 (of 3) is taken apart, and the step's samples are dealt to `--mates`
mates at random (a mate may hold 1 sample or many), each contributing the sum of its samples' gradients,
cut into one slice per mate as an averaging round cuts them. Per slice, three sums:
- `plain`: the contributions summed as they are;
- `norm_clip`: each scaled by the round's norm bound (`owner_scales`, by vouched samples), today's round;
- `centered`: the norm-clipped contributions through `centered_sum` (CenteredClip where one stands out).

Honest rounds: how often `centered` stood out at all (it must not: a round of honest mates stays exact).
Attacked rounds: one mate of the group (holding its share of the samples, less than half of them) replaces
its contribution by an attack; the error of each sum is its distance from the honest mates' own mean
gradient, relative to that mean's norm. Attacks: `flipped` (minus its honest gradient), `flipped_x10`,
`noise` (a random direction of its honest norm), `near_zero` (a thousandth of it) and `inflated_x100`.
`centered_seconds_ratio_*`: `centered_sum` against the plain sum on a slice of `--slice-parameters`, in an
honest round (where it only looks) and an attacked one (where it also sums with CenteredClip).

    python scripts/bench_robust_sum.py --steps 10 --mates 3,4,8
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.models import initial_stage  # noqa: E402
from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer  # noqa: E402
from swarm.models.registry import get_model_spec  # noqa: E402
from swarm.peer.contribution_bounds import centered_sum  # noqa: E402
from swarm.peer.round_slices import owner_scales, reduce_slice, slice_bounds  # noqa: E402
from swarm.trainer.data import ByteCorpus  # noqa: E402

TARGET, STAGES, MIDDLE = 24, 3, 1
ATTACKS = {
    "flipped": lambda g: -g,
    "flipped_x10": lambda g: -10 * g,
    "noise": lambda g: torch.randn_like(g) * (g.norm() / math.sqrt(g.numel())),
    "near_zero": lambda g: g * 1e-3,
    "inflated_x100": lambda g: g * 100,
}


def per_sample_gradients(steps: int, seed: int) -> list[list[torch.Tensor]]:
    """Per step, each sample's gradient of the middle stage (flat float32), training as a peer would."""
    spec = get_model_spec("gpt-tiny")
    stages = [initial_stage(spec, k, STAGES, seed, None) for k in range(STAGES)]
    optimizers = [build_optimizer(stage, OptimizerSettings()) for stage in stages]
    corpus = ByteCorpus(max_bytes=2**20)  # the built-in data: the Python standard library's sources
    gradients = []
    for step in range(steps):
        batch = corpus.batch(step, TARGET, spec.seq_len, seed)
        samples = []
        for tokens in batch.split(1):
            before = flat(stages[MIDDLE])
            inputs = hidden = tokens[:, :-1]
            for stage in stages[:-1]:
                hidden = stage(hidden, tokens=inputs)
            stages[-1](hidden, tokens[:, 1:], tokens=inputs).sum().backward()
            samples.append(flat(stages[MIDDLE]) - before)
        gradients.append(samples)
        for stage, optimizer in zip(stages, optimizers):
            apply_accumulated_step(stage, optimizer, TARGET)
    return gradients


def flat(module: torch.nn.Module) -> torch.Tensor:
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in module.parameters()]
    return torch.cat(parts).clone()


def deal(samples: int, mates: int, rng: random.Random) -> list[int]:
    """Sample counts of `mates` mates that share `samples`, each at least one, at random."""
    cuts = sorted(rng.sample(range(1, samples), mates - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, samples])]


def sums(contributions: list[torch.Tensor], counts: list[int]) -> dict[str, torch.Tensor]:
    """The three sums, slice by slice as the mates' owners compute them; and whether `centered` stood out."""
    size, owners = contributions[0].numel(), len(contributions)
    plain, clipped, centered, stood_out = [], [], [], False
    for lo, hi in slice_bounds(size, owners):
        pieces = [c[lo:hi] for c in contributions]
        claims = [float(c.norm()) for c in contributions]
        scales = owner_scales(claims, [float(p.norm()) for p in pieces], counts, by_samples=True)
        plain.append(reduce_slice(pieces, [1.0] * owners))
        clipped.append(reduce_slice(pieces, scales))
        robust, _ = centered_sum([p * s for p, s in zip(pieces, scales)], counts)
        stood_out |= robust is not None
        centered.append(clipped[-1] if robust is None else robust)
    return {"plain": torch.cat(plain), "norm_clip": torch.cat(clipped), "centered": torch.cat(centered)}, stood_out


def measure(gradients: list[list[torch.Tensor]], mates: int, rng: random.Random) -> dict:
    honest_stood_out, errors = 0, {attack: {"plain": [], "norm_clip": [], "centered": []} for attack in ATTACKS}
    for samples in gradients:
        counts = deal(len(samples), mates, rng)
        order = rng.sample(range(len(samples)), len(samples))
        groups, start = [], 0
        for count in counts:
            groups.append(torch.stack([samples[i] for i in order[start : start + count]]).sum(0))
            start += count
        _, stood_out = sums(groups, counts)
        honest_stood_out += stood_out
        attacker = min(range(mates), key=lambda i: abs(counts[i] - len(samples) / mates))  # a typical share
        honest = [i for i in range(mates) if i != attacker]
        target = sum(groups[i] for i in honest) / sum(counts[i] for i in honest)
        for attack, forge in ATTACKS.items():
            forged = [forge(g) if i == attacker else g for i, g in enumerate(groups)]
            results, _ = sums(forged, counts)
            for name, total in results.items():
                mean = total / sum(counts)
                errors[attack][name].append(float((mean - target).norm() / target.norm()))
    rounds = len(gradients)
    return {
        "honest_rounds": rounds,
        "honest_rounds_centered_stood_out": honest_stood_out,
        "relative_error_median": {
            attack: {name: round(sorted(v)[len(v) // 2], 4) for name, v in by_sum.items()}
            for attack, by_sum in errors.items()
        },
    }


def timing(parameters: int, mates: int, attacked: bool, repeats: int = 3) -> float:
    """`centered_sum` over the plain sum of one slice, seconds against seconds (best of `repeats`): in an honest
    round (it only looks) or with one contribution flipped (it also computes CenteredClip)."""
    counts = [8] * mates
    pieces = [torch.randn(parameters) * 8 for _ in range(mates)]
    if attacked:
        pieces[0] = pieces[0] * -50
    plain, centered = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        reduce_slice(pieces, [1.0] * mates)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        centered_sum(pieces, counts)
        centered.append(time.perf_counter() - start)
    return min(centered) / min(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps (rounds per group size)")
    parser.add_argument("--mates", default="3,4,8", help="comma-separated group sizes")
    parser.add_argument("--seed", type=int, default=0, help="model and dealing seed")
    parser.add_argument("--slice-parameters", type=int, default=4_000_000, help="slice size for the timing")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    gradients = per_sample_gradients(args.steps, args.seed)
    rng = random.Random(args.seed)
    sizes = [int(m) for m in args.mates.split(",")]
    report = {
        "model": "gpt-tiny",
        "stage": f"{MIDDLE} of {STAGES}",
        "parameters": gradients[0][0].numel(),
        "by_mates": {str(m): measure(gradients, m, rng) for m in sizes},
        "centered_seconds_ratio_honest": {str(m): round(timing(args.slice_parameters, m, False), 1) for m in sizes},
        "centered_seconds_ratio_attacked": {str(m): round(timing(args.slice_parameters, m, True), 1) for m in sizes},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
