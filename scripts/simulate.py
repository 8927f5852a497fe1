"""Discrete-event simulation of a swarm at internet scale, driving the real Router and balance rule.

Thousands of peers and their trainers run in simulated time on one machine. The objects that
decide where work goes are the ones the real system uses: every trainer routes its calls with a
`swarm.policy.router.Router` (the clock is simulated time), every peer decides whether to move with
`swarm.policy.balance.plan_moves`, and every newcomer picks its stage with `swarm.policy.balance.choose_stage`.
Prints one JSON object on stdout; progress goes to stderr.

What is modelled:
- Peers: a speed in samples/s of backward work on a stage of cost 1 (integers, spread 10x by
  default), one FIFO server each. A call of n samples on a stage of cost c takes n*c/speed
  seconds for a backward and a third of that for a forward (a backward recomputes the forward).
- Measured throughput, as the real runtime measures it: a peer starting on a stage times one batch,
  then folds every backward it runs into a moving average (0.9 old, 0.1 new) of seconds per sample
  (`swarm.policy.throughput_average`, the runtime's own); each timing is off by a relative error
  drawn with deviation `--throughput-noise`.
- Announcements: a single DHT-like view holds each peer's record (state, stage, measured
  throughput, queue length) with `expiration = now + --record-ttl`, renewed every
  `--announce-period` seconds; a change of state is announced at once, as the real peer does.
  Every router is updated from the view at each renewal; a vanished peer's last records stay in
  it until they expire, as in the real DHT, so it is still routed to and still counted by the
  balance rule until then.
- Trainers: `--trainers` trainers, each with its own Router, together keep `--in-flight`
  microbatches of `--microbatch` samples in flight. A microbatch goes forward through stages
  0..S-1, then backward S-1..0; serving is stateless, so any peer of a stage may take a backward.
  A call to a peer that is not serving that stage is refused at once (UNAVAILABLE if the peer
  still hosts the stage, WRONG_STAGE if it already moved on; both retried elsewhere, as the real
  trainer does); a call to a vanished peer fails after `--connection-error-seconds`; a call
  running past `router.deadline` times out (the peer still does the work). Every failure is
  reported to the router and the call retried on another peer; after `max_retries` attempts it
  is re-queued after a backoff, as the real trainer does (which stops training when a call runs
  out of attempts after its stage has completed no call for `stage_wait_timeout`; the simulation
  counts how often that would have happened instead).
- Noisy measurements and lapsing records (`simulation.view_faults`): `--announce-noise` puts a
  uniform relative error on every announced throughput; `--lapse-rate` and `--stage-lapse-rate`
  make a peer's record, or a whole stage's, vanish from the view for about `--lapse-seconds` while
  the peers live. The balance rule reads the view as the real peer does, through
  `swarm.policy.held_records` (lapsed records held for a grace period, each peer's spread measured
  from its renewals) with its guards: `--deviations`, `--hold`, `--cooldown` (`--old-rule`: none).
- Averaging (`simulation.averaging`, with `--target-batch-size`): each peer has a link (bandwidth in
  `--link-mbit`, one-way latency in `--latency-ms`); when a stage's peers have run a step's samples,
  its mates run a reduce-scatter round, 4 latencies plus 2 (n-1)/n gradients (4 bytes per
  parameter, `--stage-params`) over the slowest mate's link plus the sum; the mates serve on
  meanwhile, as peers do, held only when a round outlasts a step (`--rounds-hold-mates`: serving
  nothing through a round, as the round before did).
- Rebalancing, as the real peer does it, timed by its own `swarm.policy.rebalance_timing`: every
  `--rebalance-period` seconds times a random factor in [0.5, 1.5] (the first time in [0, 1], so a
  whole plan is carried out within one period), a serving peer computes `plan_moves` on the current
  view (computed once per view and shared, since every peer reading that view computes the same
  plan), with the cost of a move from `--state-mb`, `--bandwidth-mbit`, `--move-seconds` and
  `--move-horizon` (`swarm.policy.balance.MoveCost`). If the plan moves it, a second look 1 to 2
  announce periods later must still move it (to the target that look gives). It announces LEAVING on
  its source at once, naming its target, so that every plan counts it there while it is on its way,
  and finishes its queue; only then does it announce JOINING on the target (with a fresh timing)
  (`--target-at-decision`: it announces JOINING on the target at once, a change to the peer worth
  weighing). It serves the target after the state download, and checks again after a random
  [0.5, 1.5] periods.
- Newcomers, as the real `--stage auto` peer: after a random pause of up to `--announce-period`,
  it reads the view, picks `choose_stage`, and announces JOINING there at once with its speed as
  throughput, so newcomers after it see its choice; it serves after the state download. Its first
  look at the plan then comes after [0.5, 1.5] periods, as after a move (the real newcomer's first
  look comes within one period, as a peer's that has not moved yet).
- Churn: `--trace FILE` replays a spot trace (`time_ms,add|remove,node`) compressed into
  `--trace-minutes`, as a live-instance count scaled so that the trace's peak is `--peers`
  (`harness.spot_trace.live_peer_targets`, never below one instance per stage). A rise launches
  fresh instances (fresh speeds; started at once, or spread over `--join-spread` seconds of boot
  time); a fall preempts instances at random, all at once, as a spot market reclaims many
  together. An instance preempted before it has picked a stage never joins. The count at time 0
  is the starting layout.

What is not modelled: network transfers and latency of calls (a call costs only its compute; links
carry only the averaging rounds), the optimizer step itself, stale gradients, a peer merging
queued calls into one batch (total work is the same), partial failures other than a peer
vanishing, the time a moving peer takes to hand over its gradients and build the new stage
(part of `--move-seconds`), and DHT read delays beyond the announce period.

Overload: a peer serves its calls in order; as the real runtime, it drops a queued call whose
caller's deadline passed before it could start it (the caller has retried elsewhere), but a call
it has started runs to the end. `--compute-abandoned` computes every call, as the runtime did
before: under overload the queues then fill with work nobody waits for, the retries pile on, and
the swarm stays congested after the overload has passed.

Measures, per window of `--window` simulated seconds: samples completed per second; the
assignment throughput (the least stage capacity from the true speeds of serving peers), at the
window's end and averaged over it; the ideal for the live peers at the window's end
(`ideal_assignment`, its search capped, while at most 200 peers are live, otherwise the upper
bound sum(speeds)/sum(costs); `ideal_method` counts which). Capacities are in backward samples/s,
the unit peers announce; a pipeline completes at most capacity / (1 + 1/3) samples/s, since each
sample also takes a forward, and the measured fractions are taken against that.

Reported per scenario (the steady state is the last half of the windows):
`steady_state_fraction_of_ideal` (mean assignment / ideal), `measured_fraction_of_ideal` (from
samples completed), `measured_fraction_of_capacity` (samples completed against the assignment in
force), `time_to_90pct_s` (first window at 0.9 of ideal), `moves`, `moves_per_peer_hour`,
`oscillations` (a peer moving back to a stage it left less than 15 minutes before, longer than the
600 s cool-down; `moves_back`: returns at any time; `returns_within_cooldown`), `record_lapses`,
`averaging` (rounds, mates, seconds per round and per step, MB per peer per round, and the share of a
step spent averaging),
`empty_stage_seconds`, how often a stage lost its last serving peer (`stage_emptied_by_move`:
a move the view itself allowed no room for; `_by_stale_move`: the view showed another serving
peer that had vanished; `_by_churn`: a preemption), failed calls by kind, and the wall time. The
scenario runs once per `--margins` value (`by_margin`) and once with rebalancing off
(`no_rebalance`), all from the same seed, so the same peers, speeds and churn. A margin is the
balance rule's hysteresis: a move must lift the lower of its two stages by more than margin
times the mover's own throughput; a sweep such as `--margins 0,0.1,0.25,0.5,1.0` shows the trade
between reaching the ideal and the moves it costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.spot_trace import read_trace
from simulation.engine import Simulation
from simulation.scenario import SimConfig
from simulation.study import run_scenario, run_study

# what the tests and studies use from here, beside the command line
__all__ = ["SimConfig", "Simulation", "run_scenario", "run_study", "build_parser", "config_from_args", "main"]

DEFAULT_MARGINS = (0.0, 0.1, 0.25, 0.5, 1.0)  # the sweep of hysteresis margins a study runs


def parse_floats(text: str) -> tuple[float, ...]:
    """'0.1,0.2' -> (0.1, 0.2)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--peers", type=int, default=d.peers, help="peers (with --trace: peak live peers)")
    p.add_argument("--stages", type=int, default=d.stages, help="pipeline stages")
    p.add_argument("--minutes", type=float, default=d.minutes, help="simulated minutes")
    p.add_argument(
        "--start",
        choices=("skewed", "all-in-one", "auto"),
        default=d.start,
        help="starting layout: skewed (70%% on stage 0, the rest spread), all-in-one (all on stage 0), "
        "auto (each peer picks choose_stage in random order)",
    )
    p.add_argument("--speed-min", type=int, default=d.speed_min, help="slowest peer, samples/s of backward work")
    p.add_argument("--speed-max", type=int, default=d.speed_max, help="fastest peer, samples/s of backward work")
    p.add_argument("--stage-costs", type=parse_floats, default=None, help="relative cost per stage, e.g. 1,1,2 (all 1)")
    p.add_argument(
        "--microbatch", type=int, default=d.microbatch, help="samples per microbatch (larger: fewer events, faster)"
    )
    p.add_argument("--in-flight", type=int, default=None, help="microbatches in flight over all trainers (2x peers)")
    p.add_argument("--trainers", type=int, default=d.trainers, help="trainers, each with its own Router")
    p.add_argument("--no-rebalance", action="store_true", help="peers never move (newcomers still pick a stage)")
    p.add_argument(
        "--rebalance-period", type=float, default=d.rebalance_period, help="mean seconds between a peer's checks"
    )
    p.add_argument(
        "--margin",
        type=float,
        default=d.margin,
        help="hysteresis of the balance rule: a move must lift the lower of its two stages by more than this "
        "times the mover's own throughput",
    )
    p.add_argument(
        "--margins",
        type=parse_floats,
        default=DEFAULT_MARGINS,
        help="comma list: run once per margin too, reported under by_margin ('' for none)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the comparison run with rebalancing off")
    p.add_argument("--announce-period", type=float, default=d.announce_period, help="seconds between view refreshes")
    p.add_argument("--record-ttl", type=float, default=d.record_ttl, help="seconds a record outlives its peer")
    p.add_argument("--move-seconds", type=float, default=d.move_seconds, help="fixed part of a state download")
    p.add_argument("--state-mb", type=float, default=d.state_mb, help="state downloaded by a moving or joining peer")
    p.add_argument("--bandwidth-mbit", type=float, default=d.bandwidth_mbit, help="download bandwidth, Mbit/s")
    p.add_argument(
        "--move-horizon",
        type=float,
        default=d.move_horizon,
        help="seconds a move's gain is counted for against its cost (the peer's --rebalance-horizon)",
    )
    p.add_argument(
        "--throughput-noise",
        type=float,
        default=d.throughput_noise,
        help="relative error of one batch's timing; a peer announces a moving average of them",
    )
    p.add_argument(
        "--announce-noise",
        type=float,
        default=d.announce_noise,
        help="relative error of each announced throughput, uniform in +-this (0.2: +-20%%), drawn at each announcement",
    )
    p.add_argument(
        "--lapse-rate", type=float, default=d.lapse_rate, help="per renewal, chance a live peer's record lapses"
    )
    p.add_argument(
        "--stage-lapse-rate",
        type=float,
        default=d.stage_lapse_rate,
        help="per renewal, chance a whole stage's records lapse (its key out of reach)",
    )
    p.add_argument(
        "--lapse-seconds", type=float, default=d.lapse_seconds, help="a lapse lasts this times a factor in [0.5, 1.5]"
    )
    p.add_argument(
        "--deviations",
        type=float,
        default=d.deviations,
        help="standard deviations of the measured noise a move must clear (0: none)",
    )
    p.add_argument(
        "--hold", type=float, default=None, help="seconds the balance rule holds a lapsed record (default: the peer's)"
    )
    p.add_argument(
        "--cooldown",
        type=float,
        default=None,
        help="seconds a peer may not return to a stage it left (default: --move-horizon, as the peer)",
    )
    p.add_argument(
        "--old-rule",
        action="store_true",
        help="the balance rule without its guards against noise and lapses: --deviations 0 --hold 0 --cooldown 0",
    )
    p.add_argument(
        "--target-batch-size",
        type=int,
        default=d.target_batch_size,
        help="samples per optimizer step; a stage's mates then average (0: averaging not modelled)",
    )
    p.add_argument(
        "--stage-params",
        type=float,
        default=d.stage_params,
        help="parameters of a stage of mean cost, whose gradient (4 bytes each) mates average (0: --state-mb / 12 B)",
    )
    p.add_argument(
        "--link-mbit",
        type=parse_floats,
        default=(d.link_mbit_min, d.link_mbit_max),
        help="MIN,MAX: each peer's link bandwidth, Mbit/s, drawn uniformly",
    )
    p.add_argument(
        "--latency-ms",
        type=parse_floats,
        default=(d.latency_ms_min, d.latency_ms_max),
        help="MIN,MAX: each peer's one-way latency, ms, drawn uniformly",
    )
    p.add_argument(
        "--rounds-hold-mates",
        action="store_true",
        help="stage-mates serve nothing while their round runs (the round before peers served through it), "
        "instead of serving on, held only when a step comes due before the round before it is over",
    )
    p.add_argument(
        "--target-at-decision",
        action="store_true",
        help="a moving peer announces JOINING on its target as soon as it decides to move, not once it has "
        "drained its queue as the real peer does (to weigh that change)",
    )
    p.add_argument(
        "--compute-abandoned",
        action="store_true",
        help="a peer computes a queued call even after its caller has given up, instead of dropping it as the "
        "real runtime does (to weigh that rule)",
    )
    p.add_argument(
        "--connection-error-seconds",
        type=float,
        default=d.connection_error_seconds,
        help="seconds until a call to a vanished peer fails (at most its deadline)",
    )
    p.add_argument("--deadline-floor", type=float, default=d.deadline_floor, help="router's shortest call deadline")
    p.add_argument("--deadline-ceiling", type=float, default=d.deadline_ceiling, help="router's longest call deadline")
    p.add_argument("--window", type=float, default=d.window, help="simulated seconds per measurement window")
    p.add_argument(
        "--trace", default=None, help="spot trace to replay as a live-instance count (time_ms,add|remove,node lines)"
    )
    p.add_argument(
        "--trace-minutes", type=float, default=None, help="simulated minutes the whole trace spans (--minutes)"
    )
    p.add_argument(
        "--join-spread",
        type=float,
        default=d.join_spread,
        help="instances launched together boot over up to this many seconds (0: all at once)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="random seed")
    p.add_argument("--series", action="store_true", help="include the per-window time series")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The scenario the command line describes; ValueError if it makes no sense."""
    config = SimConfig(
        peers=args.peers,
        stages=args.stages,
        minutes=args.minutes,
        start=args.start,
        speed_min=args.speed_min,
        speed_max=args.speed_max,
        stage_costs=args.stage_costs,
        microbatch=args.microbatch,
        in_flight=args.in_flight,
        trainers=args.trainers,
        rebalance=not args.no_rebalance,
        rebalance_period=args.rebalance_period,
        margin=args.margin,
        announce_period=args.announce_period,
        record_ttl=args.record_ttl,
        move_seconds=args.move_seconds,
        state_mb=args.state_mb,
        bandwidth_mbit=args.bandwidth_mbit,
        move_horizon=args.move_horizon,
        throughput_noise=args.throughput_noise,
        announce_noise=args.announce_noise,
        lapse_rate=args.lapse_rate,
        stage_lapse_rate=args.stage_lapse_rate,
        lapse_seconds=args.lapse_seconds,
        deviations=0.0 if args.old_rule else args.deviations,
        hold=0.0 if args.old_rule else args.hold,
        cooldown=0.0 if args.old_rule else args.cooldown,
        target_batch_size=args.target_batch_size,
        stage_params=args.stage_params,
        serve_during_rounds=not args.rounds_hold_mates,
        link_mbit_min=_pair(args.link_mbit, "--link-mbit")[0],
        link_mbit_max=_pair(args.link_mbit, "--link-mbit")[1],
        latency_ms_min=_pair(args.latency_ms, "--latency-ms")[0],
        latency_ms_max=_pair(args.latency_ms, "--latency-ms")[1],
        target_at_decision=args.target_at_decision,
        skip_abandoned=not args.compute_abandoned,
        connection_error_seconds=args.connection_error_seconds,
        deadline_floor=args.deadline_floor,
        deadline_ceiling=args.deadline_ceiling,
        window=args.window,
        trace=args.trace,
        trace_minutes=args.trace_minutes,
        join_spread=args.join_spread,
        seed=args.seed,
        series=args.series,
    )
    if config.peers < 1 or config.stages < 1 or config.minutes <= 0 or config.microbatch < 1:
        raise ValueError("--peers, --stages, --minutes and --microbatch must be positive")
    if not 1 <= config.speed_min <= config.speed_max:
        raise ValueError("need 1 <= --speed-min <= --speed-max")
    if config.stage_costs is not None and (len(config.stage_costs) != config.stages or min(config.stage_costs) <= 0):
        raise ValueError(f"--stage-costs needs {config.stages} positive numbers")
    if min(config.announce_period, config.window, config.bandwidth_mbit, config.move_horizon) <= 0:
        raise ValueError("--announce-period, --window, --bandwidth-mbit and --move-horizon must be positive")
    if config.margin < 0 or any(m < 0 for m in args.margins):
        raise ValueError("margins must be 0 or more")
    if config.throughput_noise < 0 or (config.trace_minutes is not None and config.trace_minutes <= 0):
        raise ValueError("--throughput-noise must be 0 or more, --trace-minutes positive")
    if min(config.rebalance_period, config.join_spread, config.move_seconds, config.state_mb) < 0:
        raise ValueError("--rebalance-period, --join-spread, --move-seconds and --state-mb must be 0 or more")
    if config.trace is not None:
        if not Path(config.trace).is_file():
            raise ValueError(f"--trace {config.trace}: no such file")
        read_trace(config.trace)  # a malformed line is refused here, with its number
    if config.trainers < 1 or (config.in_flight is not None and config.in_flight < 1):
        raise ValueError("--trainers and --in-flight must be at least 1")
    if not (0 <= config.announce_noise < 1 and 0 <= config.lapse_rate <= 1 and 0 <= config.stage_lapse_rate <= 1):
        raise ValueError("--announce-noise must be in [0, 1), --lapse-rate and --stage-lapse-rate in [0, 1]")
    if min(config.lapse_seconds, config.deviations, config.grace, config.cooldown_seconds) < 0:
        raise ValueError("--lapse-seconds, --deviations, --hold and --cooldown must be 0 or more")
    if config.target_batch_size < 0 or config.stage_params < 0 or config.link_mbit_min <= 0:
        raise ValueError("--target-batch-size and --stage-params must be 0 or more, --link-mbit positive")
    return config


def _pair(values: tuple[float, ...], flag: str) -> tuple[float, float]:
    """MIN,MAX (or one value for both), in order; ValueError otherwise."""
    if len(values) == 1:
        values = (values[0], values[0])
    if len(values) != 2 or not 0 <= values[0] <= values[1]:
        raise ValueError(f"{flag} takes MIN,MAX with 0 <= MIN <= MAX")
    return values[0], values[1]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"simulate.py: {e}", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    report = run_study(config, args.margins, baseline=not args.no_baseline, log=log)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
