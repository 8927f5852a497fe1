"""What a training run ends with: its summary, or the error that stopped it."""

from __future__ import annotations

from dataclasses import dataclass, field


class TrainingError(RuntimeError):
    """Training cannot go on: a stage stayed empty too long, or a call failed past its retries."""


@dataclass
class TrainingSummary:
    """What a training run did, as printed at the end and written to --summary-file."""

    dtype: str = ""  # what boundary tensors travelled in (--dtype as the swarm resolved it; "" if peers said none)
    steps: int = 0
    first_step: int = 0
    samples: int = 0
    seconds: float = 0.0
    samples_per_second: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    retries: int = 0
    samples_resent: int = 0  # backwards sent again because the peer that applied them died before its step
    lost_not_held: int = 0  # samples a stage asked for again that the resend buffer no longer held
    stale_resent: int = 0  # backwards refused as too stale, sent again at the stage's current step
    requeued: int = 0  # calls that ran out of attempts and were queued again after a pause
    backwards_moved: int = 0  # backwards served by another peer than their forward (its peer gone or busy)
    bans: int = 0
    bad_replies: int = 0  # replies refused for what they held (count, shape, dtype, values): sent elsewhere
    step_seconds: list[float] = field(default_factory=list)  # since the start, at the end of each step
    bytes_sent: int = 0
    bytes_received: int = 0
    codecs: dict[str, str] = field(default_factory=dict)  # per peer, at the end (with --compression auto)
    # stage calls opened per path: direct (TCP), libp2p, and direct tries that failed (then made over libp2p)
    calls_by_path: dict[str, int] = field(default_factory=dict)
    # start-up, in seconds after the process was launched: every stage found, and the first step done
    found_swarm_after_launch_s: float = float("nan")
    first_step_after_launch_s: float = float("nan")
    losses: list[float] = field(default_factory=list)
    # without a fixed --max-in-flight: the window's size at the end, its largest, its size at the end of each
    # step, and the smallest round trip of a microbatch it measured (seconds)
    in_flight_window: int = 0
    in_flight_window_largest: int = 0
    in_flight_window_per_step: list[int] = field(default_factory=list)
    in_flight_round_trip_s: float = float("nan")
    # after the last step: seconds until every stage stepped past it, and whether every stage did (a stage that
    # waits for other trainers' samples to fill its step does not)
    settle_seconds: float = 0.0
    settled: bool = False
    # forwards drawn for a spot check, compared, found disagreeing, left undecided, and accusations made
    spot_checks: dict[str, int] = field(default_factory=dict)
    # copies of answered forwards sent to peers that never answered this trainer: answered, and failed
    trial_forwards: dict[str, int] = field(default_factory=dict)
