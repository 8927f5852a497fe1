"""Named insider attacks against real processes: one JSON object saying which failed, and by what.

Each attack runs on its own local swarm with a trust root (3 stages of gpt-tiny, a vouched trainer),
next to one honest run of the same training. An insider attack runs on each stage of `--stages` in
turn: that stage has two peers, peer{stage}a honest and peer{stage}b the insider, and every other stage
one. An attack has failed when the training ends as the honest run does (the same steps and samples on
the attacked stage, the final loss within `--loss-spread` of the honest one) and the honest processes
logged the refusal that stopped it, which is reported as evidence.

    python scripts/adversary.py                       # every attack, insiders on stage 1
    python scripts/adversary.py --stages 0,1,2        # every attack, an insider on each stage in turn
    python scripts/adversary.py --attacks fake-progress --steps 4
    python scripts/adversary.py --attacks '' --everywhere inflate-samples,fake-progress,wrong-backwards

`--everywhere` runs one insider on every stage at once (each stage's attack in turn from the list, or the
one attack on all), and judges the final loss against the run-to-run spread of `--honest-runs` honest runs
of other data orders: it fails as an attack where each stage stepped on the honest samples and the loss is
within that spread (or equal to the honest one, for attacks refused before any of their work was used).

Attacks (the insider holds a valid key and signed record; see scripts/harness/hostile_peer.py):
- `inflate-samples`: a mate claims 4,096 made-up microbatches of 256 samples in every round;
- `fake-progress`: a mate tells its mates it holds a target batch of made-up microbatches;
- `unvouched-trainer`: a second trainer with no voucher feeds the swarm alongside the real one;
- `foreign-voucher`: a second trainer signs receipts with a voucher of another root;
- `wrong-outputs`: a peer adds noise to every forward it answers (its stage gets a third, honest peer for
  the trainer's spot checks to side with, and the trainer checks a quarter of its forwards). The forwards
  it answered before it was caught are trained on, so the loss moves: this attack has failed when the
  honest processes logged the liar accused at step 10 at the latest, and its stage stepped on every
  sample. Not on the last stage, which answers no forward alone;
- `wrong-backwards`: a peer adds noise to the input gradients of every backward it answers, and is caught
  the same way (a checked backward is asked again of other peers as a check that holds nothing). Not on
  the first stage, whose backward answers no input gradient (its gradient goes to the rounds);
- `owner-lies`: a mate returns its slice's sum reversed and 100 times larger in every round (its stage gets a
  third, honest peer); its mates' audit of the sums catches it at its first round;
- `state-takeover`: two insiders (peer1b, peer1c on stage 1) answer a crafted state 1,000 steps ahead,
  each confirming the other's; once training ends, an honest newcomer (peer1d) joins their stage. It has
  failed when the newcomer took the state of the step the swarm trained to.
- `record-flood`: four identities each sign a copy of an honest serving record on the attacked stage,
  renew it, and hold every call to them open unanswered (scripts/harness/record_flood.py). It slows
  rather than steers: it has failed only where training took at most 3 times as long as the honest run
  plus 15 s (a round waits a few seconds for mates that never worked, once or a few times), its two honest
  mates ended on the same parameters, and its final loss is within 0.1 of the honest run's (which has one
  peer on that stage: two mates' sums round differently, see SLOWING_LOSS_SPREAD).
- `near-state-takeover`: the same crafted state one step ahead, where the insiders' recent receipts vouch
  for them, against three honest peers (peer1a, peer1e, peer1f on stage 1): the version more vouched peers
  hold wins, so it fails where more honest peers than insiders had work within the last 8 steps (over a
  short run, routing may give an honest peer none: run it with --steps 4 or more).

Attacks the swarm does not bound yet are listed under `not_covered`, so the report never reads as
more than it shows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from swarm.launch.local_swarm import LocalSwarm  # noqa: E402
from swarm.peer.checkpoint import load_checkpoint  # noqa: E402
from swarm.peer.round_waiting import ABSENT_GRACE  # noqa: E402
from swarm.trust.vouchers import load_root_key, make_root_key, make_voucher  # noqa: E402

HOSTILE = Path(__file__).parent / "harness" / "hostile_peer.py"
FLOOD = Path(__file__).parent / "harness" / "record_flood.py"
FLOOD_IDENTITIES = 4
CORPUS = str(Path(argparse.__file__))
MODEL = ["--model", "gpt-tiny", "--num-stages", "3", "--seed", "7"]
TARGET = 24
ATTACKS = {
    "inflate-samples": ("peer", "without a receipt from a vouched trainer naming it; they do not count"),
    "fake-progress": ("peer", "samples without a receipt naming it; they do not count"),
    "unvouched-trainer": ("trainer", "needs its trainer's receipt"),
    "foreign-voucher": ("trainer", "signed by a key the trust root did not vouch for"),
    "wrong-outputs": ("peer", "is accused by trainer"),
    "wrong-backwards": ("peer", "is accused by trainer"),
    "owner-lies": ("peer", "lied about its sum"),
    "state-takeover": ("peer", "shows no receipt from a vouched trainer naming it"),
    "near-state-takeover": ("peer", "Took stage"),
    "record-flood": ("flood", "get work once they answer one"),
}
# what an attack needs beyond the common layout (letters after `peer{stage}`, on the attacked stage): a third peer
# to side with the honest one when the trainer's spot check finds two answers disagreeing, and a share of
# checked forwards that finds the liar within the few steps an attack runs (the default, 2%, takes about 20
# steps here: see docs/operating.md); a second insider; an honest newcomer that joins once training ended
EXTRA_PEERS = {
    "wrong-outputs": "c",
    "wrong-backwards": "c",
    "owner-lies": "c",
    "state-takeover": "c",
    "near-state-takeover": "cef",
}
INSIDERS = {"state-takeover": "bc", "near-state-takeover": "bc", "record-flood": ""}  # else `b` alone
NEWCOMER = {"state-takeover": "d", "near-state-takeover": "d"}
TRAINER_FLAGS = {name: ["--spot-check-share", "0.25"] for name in ("wrong-outputs", "wrong-backwards")}
# attacks found only after their harm is trained on (a spot check samples answers already used): the run's loss
# moves, so the bound is the step at which the honest processes logged the liar accused, at most this one
DETECTED_AFTER_USE = {"wrong-outputs": 10, "wrong-backwards": 10}
# attacks caught by the honest peers in a round, before any steps on the lie: the work the insider took until the
# trainers read its mates' reports is lost (not steered), so the judge is the round the honest peers caught it in and
# whether they all ended on the same parameters
CAUGHT_IN_ROUND = {"owner-lies": 1}
# attacks that slow training rather than steer it: failed only where it took at most this many times as long as the
# honest run (a loaded machine slows the attacked run's extra calls as much) plus a few of a round's waits for a
# member that never worked (paid once: a wait each step costs the steps times ABSENT_GRACE, over this slack from 4
# steps on). Under a CI run's load: honest 4.0-7.2 s, attacked 19.5-24.3 s; on an idle machine: 2.6-4.3 s and 9-13 s
SLOWING = {"record-flood": 3.0}
SLOWING_SLACK = 3 * ABSENT_GRACE
# and its loss within this of the honest run's: the attacked swarm has two mates on its stage where the honest one has
# one, and their sums round in another order, which Adam magnifies where a gradient is near zero. With codecs chosen
# per run, one step's loss spread by up to 0.26 over 8 steps (0.05 on the mean of the last 5); with exact calls, by
# 1e-4 (8 steps: 4.2320 honest, 4.2321 flooded). A flood identity answers nothing, so it cannot move the loss
# further: the judge is the time, the samples and the replicas agreeing
SLOWING_LOSS_SPREAD = 0.1
WAITED = re.compile(r"step (\d+): no (?:gradients|slices) from \d+ mate\(s\) within")
# where an attack does not apply: the last stage answers no forward alone (one backward per microbatch computes
# its forward and loss); the first stage's backward answers no input gradient
NOT_APPLICABLE = {"wrong-outputs": 2, "wrong-backwards": 0}
NOT_COVERED = {
    "majority-gradient": (
        "a member holding more than half of a round's vouched samples sets its norm bound, so its gradient "
        "(reversed or inflated) goes in whole, and one holding half does so for a tiny gradient (of two mates, the "
        "other's is then left out); below the bound, a minority's reversed gradient still pulls the sum by its "
        "share times the bound, unless --robust-sum centered-clip (scripts/bench_robust_sum.py) bounds it"
    ),
    "state-takeover-majority": (
        "as many identities that a vouched trainer gave work lately as honest peers on a stage, announcing a "
        "crafted state at most 8 steps ahead: the most advanced of the versions most vouched peers hold is taken"
    ),
}


def wait_serving(swarm: LocalSwarm, names: list[str], timeout: float = 120.0) -> None:
    """Waits until each named peer logged that it serves (all within `timeout`)."""
    deadline = time.monotonic() + timeout
    for name in names:
        wait_logged(swarm, name, "Serving stage", max(0.0, deadline - time.monotonic()))


def layout(plan: dict[int, str]) -> list[tuple[int, str]]:
    """(stage, name) of each peer: `peer{stage}` alone on its stage, but on each attacked stage of `plan`
    (stage -> attack) an honest `peer{stage}a`, the insider `peer{stage}b` and what the attack needs beyond."""
    letters = {t: f"ab{EXTRA_PEERS.get(attack, '')}" for t, attack in plan.items()}
    return [(t, f"peer{t}{letter}") for t in range(3) for letter in letters.get(t, [""])]


def honest_name(plan: dict[int, str], stage: int) -> str:
    """The honest peer whose checkpoint stands for `stage`."""
    return f"peer{stage}a" if stage in plan else f"peer{stage}"


def wait_logged(swarm: LocalSwarm, name: str, needle: str, timeout: float = 120.0) -> None:
    """Waits until process `name` logged `needle`."""
    deadline = time.monotonic() + timeout
    while needle not in swarm.log_path(name).read_text(errors="replace"):
        if swarm.processes[name].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} never logged {needle!r}:\n{swarm.log_path(name).read_text()[-2000:]}")
        time.sleep(0.2)


def run_swarm(workdir: Path, keys: dict, steps: int, plan: dict[int, str], data_seed: int | None = None) -> dict:
    """One trusted swarm training `steps` steps, with each attack of `plan` (stage -> attack) on its stage (an
    empty plan: the honest run); `data_seed` draws the samples in another order."""
    root = ["--trust-root", keys["public"]]
    # the single-stage attacks' extras (an intruding trainer, a flood, a newcomer) go with a plan of one stage
    stage, attack = next(iter(plan.items())) if len(plan) == 1 else (1, None)
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        peer = [*MODEL, "--target-batch-size", str(TARGET), "--lr", "3e-3", "--announce-period", "0.5", *root]
        peers = layout(plan)
        for on, name in peers:
            flags = [*peer, "--checkpoint-dir", str(workdir / name)]
            hostile = plan.get(on)
            if hostile is not None and ATTACKS[hostile][0] == "peer" and name in insiders(hostile, on):
                pinned = ["--stage", str(on), "--initial-peers", *swarm.initial_peers, "--rebalance-period", "0"]
                swarm.spawn(name, "peer", [*pinned, *flags], prefix=[sys.executable, str(HOSTILE), hostile, "--"])
            else:
                swarm.start_peer(name, on, flags)
        names = [name for _, name in peers]
        wait_serving(swarm, names)
        if attack == "record-flood":  # its records up before training starts
            flood = [sys.executable, str(FLOOD), "--initial-peers", *swarm.initial_peers, "--stage", str(stage)]
            swarm.spawn("flood", "dht", [], prefix=[*flood, "--identities", str(FLOOD_IDENTITIES), "--"])
            wait_logged(swarm, "flood", "renewed")
        trainer = [*MODEL, "--steps", str(steps), "--microbatch-size", "4", "--data", CORPUS, "--no-progress"]
        # exact calls: the judge compares losses, and a codec chosen from bandwidth measured on a loaded machine
        # differs between runs (8bit to one peer in one run, none in the next), which moves the loss more than an
        # attack that failed may (at lr 3e-3 the exact run's step 8 jumps to 6.3 where an 8bit one falls to 3.1)
        trainer += ["--compression", "none"]
        summary_file = workdir / "summary.json"
        own = [*root, "--voucher", keys["voucher"], "--summary-file", str(summary_file)]
        own += ["--data-seed", str(data_seed)] if data_seed is not None else []
        own += next((TRAINER_FLAGS[a] for a in plan.values() if a in TRAINER_FLAGS), [])
        honest = swarm.start_trainer("trainer", [*trainer, *own])
        if attack == "unvouched-trainer":
            swarm.start_trainer("intruder", [*trainer, "--data-seed", "11"])
        if attack == "foreign-voucher":
            swarm.start_trainer("intruder", [*trainer, "--voucher", keys["foreign"], "--data-seed", "11"])
        code = honest.wait(600)
        if "intruder" in swarm.processes:
            swarm.processes["intruder"].wait(300)
        if "flood" in swarm.processes:
            swarm.stop("flood")
        if attack in NEWCOMER:
            newcomer = f"peer{stage}{NEWCOMER[attack]}"
            swarm.start_peer(newcomer, stage, [*peer, "--checkpoint-dir", str(workdir / newcomer)])
            wait_serving(swarm, [newcomer])
            names.append(newcomer)
        for name in names:
            swarm.stop(name)
        summary = json.loads(summary_file.read_text()) if code == 0 else {}
        logs = {name: swarm.log_path(name).read_text(errors="replace") for name in swarm_names(swarm)}
    samples = {}
    for t in range(3):
        checkpoint = load_checkpoint(workdir / honest_name(plan, t), "gpt-tiny", t, 3)
        samples[t] = checkpoint.samples_stepped if checkpoint is not None else 0
    agree = {
        t: replicas_agree(workdir, t, [name for on, name in peers if on == t and name not in insiders(a, t)])
        for t, a in plan.items()
    }
    return {
        "code": code,
        "loss": summary.get("last_loss", math.nan),
        "samples": samples,
        "logs": logs,
        "seconds": summary.get("seconds", math.inf),
        # each step's loss and the calls that went again: where two runs' final losses part, from which step, and
        # whether a retry or a stale backward came with it
        "trace": {
            "losses": " ".join(f"{x:.4f}" for x in summary.get("losses", [])),  # one line of the report
            **{key: summary.get(key) for key in ("retries", "stale_resent", "samples_resent")},
        },
        "replicas_agree": agree,
    }


def replicas_agree(workdir: Path, stage: int, names: list[str]) -> bool:
    """Whether the honest peers of the attacked stage ended at the same step on the same parameters."""
    checkpoints = [load_checkpoint(workdir / name, "gpt-tiny", stage, 3) for name in names]
    if not checkpoints or any(c is None for c in checkpoints):
        return False
    first = checkpoints[0]
    return all(
        c.step == first.step
        and c.parameters.keys() == first.parameters.keys()
        and all(torch.equal(c.parameters[k], first.parameters[k]) for k in first.parameters)
        for c in checkpoints
    )


def insiders(attack: str | None, stage: int) -> list[str]:
    """The insiders of `attack` on `stage` (none in the honest run)."""
    return [f"peer{stage}{letter}" for letter in INSIDERS.get(attack, "b")] if attack is not None else []


def swarm_names(swarm: LocalSwarm) -> list[str]:
    return sorted(path.stem for path in swarm.workdir.glob("*.log"))


def evidence(logs: dict[str, str], needle: str, where: str, hostile: list[str]) -> str | None:
    """The first log line holding `needle` in an honest process's log (the trainers' for a trainer attack)."""
    for name, text in logs.items():
        honest = name.startswith("intruder") if where == "trainer" else name not in hostile
        for line in text.splitlines() if honest else ():
            if needle in line:  # a long line (a traceback's, say) is cut around the needle, never through it
                line = line.strip()
                start = max(0, min(line.index(needle) - 150, len(line) - 300))
                return f"{name}: {'...' if start else ''}{line[start : start + 300]}"
    return None


def judge(run: dict, honest: dict, attack: str, stage: int, args: argparse.Namespace) -> dict:
    """Whether `attack` on `stage` failed: the evidence that stopped it, and how its training compares."""
    where, needle = ATTACKS[attack]
    hostile = [*insiders(attack, stage), "flood"]
    newcomer = f"peer{stage}{NEWCOMER[attack]}" if attack in NEWCOMER else None
    proof = evidence({newcomer: run["logs"][newcomer]} if newcomer else run["logs"], needle, where, hostile)
    unchanged = run["code"] == 0 and run["samples"][stage] == honest["samples"][stage]
    if newcomer:  # it took the state the swarm trained to, not the crafted one
        unchanged = unchanged and f"Took stage {stage} state at step {args.steps} " in run["logs"][newcomer]
    spread = max(args.loss_spread, SLOWING_LOSS_SPREAD) if attack in SLOWING else args.loss_spread
    close = abs(run["loss"] - honest["loss"]) <= spread
    if attack in SLOWING:  # what it is after is time: the training must take about as long as the honest one
        close = close and run["seconds"] <= SLOWING[attack] * honest["seconds"] + SLOWING_SLACK
        unchanged = unchanged and run["replicas_agree"].get(stage, False)
    if attack in DETECTED_AFTER_USE:  # bounded in time instead: accused within its steps
        close = bool(proof) and int(re.search(r"at step (\d+)", proof).group(1)) <= DETECTED_AFTER_USE[attack]
    if attack in CAUGHT_IN_ROUND:  # the work it took until trainers left it out is lost: judged by the honest replicas
        caught_at = re.search(r"step (\d+): owner", proof or "")
        unchanged = run["code"] == 0 and run["replicas_agree"][stage]
        close = bool(caught_at) and int(caught_at.group(1)) <= CAUGHT_IN_ROUND[attack]
    result = {
        "attack": attack,
        "stage": stage,
        "failed": bool(proof and unchanged and close),
        "evidence": proof,
        "samples": run["samples"][stage],
        "final_loss": round(run["loss"], 4),
        "train_seconds": round(run["seconds"], 1),
        "trace": run["trace"],
    }
    if attack in SLOWING:  # the steps at which an honest mate's round waited out a member that never answered
        mates = [text for name, text in run["logs"].items() if name.startswith(f"peer{stage}") and name not in hostile]
        result["waited_steps"] = sorted({int(m) for text in mates for m in WAITED.findall(text)})
    if newcomer:
        result["newcomer"] = evidence({newcomer: run["logs"][newcomer]}, f"Took stage {stage} state", where, [])
    return result


def everywhere_plans(attacks: list[str]) -> list[dict[int, str]]:
    """The plans of `--everywhere`: each attack on all the stages it applies to, and where more than one is
    named, a mixed plan too (stage t takes the list's t-th attack that applies to it)."""
    plans = [{t: a for t in range(3) if NOT_APPLICABLE.get(a) != t} for a in attacks]
    if len(attacks) > 1:
        mixed = {}
        for t in range(3):
            fits = [a for a in attacks if NOT_APPLICABLE.get(a) != t]
            if fits:
                mixed[t] = fits[t % len(fits)]
        plans.append(mixed)
    return [plan for plan in plans if plan]


def judge_everywhere(run: dict, honest: dict, spread: tuple[float, float], plan: dict[int, str]) -> dict:
    """Whether the insiders of `plan`, one on each of its stages at once, failed: every stage stepped on the
    honest run's samples, the honest replicas agree, and the final loss is within the honest runs' spread."""
    low, high = spread
    proofs = {}
    for stage, attack in plan.items():
        where, needle = ATTACKS[attack]
        if needle.startswith("is accused"):  # every peer reads accusations: the one naming this stage
            needle = f"of stage {stage} {needle}"
        mates = {name: text for name, text in run["logs"].items() if name.startswith(f"peer{stage}")}
        proofs[stage] = evidence(mates, needle, where, insiders(attack, stage))
    samples = all(run["samples"][t] == honest["samples"][t] for t in range(3))
    # an attack whose work was used before it was caught moves the loss: the spread bounds how far
    within = abs(run["loss"] - honest["loss"]) <= high - low + 1e-6
    agree = all(run["replicas_agree"].values())
    return {
        "plan": {str(t): a for t, a in plan.items()},
        "failed": bool(run["code"] == 0 and all(proofs.values()) and samples and within and agree),
        "evidence": {str(t): proof for t, proof in proofs.items()},
        "samples": [run["samples"][t] for t in range(3)],
        "final_loss": round(run["loss"], 4),
        "replicas_agree": agree,
        "train_seconds": round(run["seconds"], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated attacks to run")
    parser.add_argument("--stages", default="1", help="comma-separated stages each insider attack runs on, in turn")
    parser.add_argument("--steps", type=int, default=4, help="steps each swarm trains")
    parser.add_argument("--loss-spread", type=float, default=0.02, help="how far the final loss may be from honest")
    parser.add_argument("--workdir", help="keep every swarm's logs and checkpoints here (default: a temporary one)")
    parser.add_argument(
        "--everywhere",
        default="",
        help="comma-separated peer attacks to run with an insider on every stage at once (see above)",
    )
    parser.add_argument(
        "--honest-runs", type=int, default=3, help="with --everywhere: honest runs of other data orders for the spread"
    )
    args = parser.parse_args()
    attacks = [a for a in args.attacks.split(",") if a]
    everywhere = [a for a in args.everywhere.split(",") if a]
    if unknown := [a for a in attacks + everywhere if a not in ATTACKS]:
        parser.error(f"unknown attacks {unknown}; known: {sorted(ATTACKS)}")
    if wrong := [a for a in everywhere if ATTACKS[a][0] != "peer" or a in NEWCOMER or a in INSIDERS]:
        parser.error(f"--everywhere takes attacks of one insider peer; not {wrong}")
    if everywhere and args.honest_runs < 2:
        parser.error("--honest-runs must be at least 2: a spread needs two runs")
    stages = [int(s) for s in args.stages.split(",") if s.strip().isdigit()]
    if not stages or any(s > 2 for s in stages) or len(stages) != len(args.stages.split(",")):
        parser.error(f"--stages {args.stages!r}: comma-separated stages of the 3, e.g. 0,1,2")
    with tempfile.TemporaryDirectory(prefix="swarm-adversary-") as tmp:
        tmp = Path(args.workdir or tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        keys = {"public": make_root_key(tmp / "root.key")}
        make_voucher(load_root_key(tmp / "root.key"), "trainer", tmp / "trainer.voucher")
        make_root_key(tmp / "foreign.key")
        make_voucher(load_root_key(tmp / "foreign.key"), "intruder", tmp / "foreign.voucher")
        keys.update(voucher=str(tmp / "trainer.voucher"), foreign=str(tmp / "foreign.voucher"))
        honest = run_swarm(tmp / "honest", keys, args.steps, {})
        results = []
        for attack in attacks:
            on = stages if ATTACKS[attack][0] in ("peer", "flood") else [1]
            for stage in [s for s in on if NOT_APPLICABLE.get(attack) != s]:
                run = run_swarm(tmp / f"{attack}-{stage}", keys, args.steps, {stage: attack})
                results.append(judge(run, honest, attack, stage, args))
        spread, at_once = None, []
        if everywhere:
            # the run-to-run spread: the same swarm drawing its samples in other orders
            losses = [honest["loss"]]
            for seed in range(1, args.honest_runs):
                losses.append(run_swarm(tmp / f"honest-{seed}", keys, args.steps, {}, data_seed=100 + seed)["loss"])
            spread = (min(losses), max(losses))
            for plan in everywhere_plans(everywhere):
                name = "everywhere-" + "-".join(plan[t] for t in sorted(plan))
                run = run_swarm(tmp / name, keys, args.steps, plan)
                at_once.append(judge_everywhere(run, honest, spread, plan))
    report = {
        "honest": {
            "samples": min(honest["samples"].values()),  # every stage of an honest run steps on the same
            "final_loss": round(honest["loss"], 4),
            "train_seconds": round(honest["seconds"], 1),
            "trace": honest["trace"],
        },
        "attacks": results,
        "everywhere": at_once,
        "honest_spread": [round(x, 4) for x in spread] if spread else None,
        "all_failed": all(r["failed"] for r in results + at_once),
        "not_covered": NOT_COVERED,
    }
    print(json.dumps(report, indent=1))
    return 0 if report["all_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
