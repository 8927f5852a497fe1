"""Preemption waves in chaos.py: which peers a wave takes, and the command line that asks for them."""

from __future__ import annotations

import random
import signal

import chaos
import pytest

from harness.churn import Churn
from harness.churn_waves import wave_size, wave_victims
from swarm.records.stage_records import LEAVING, SERVING, StageRecord

PEERS = [f"peer{stage}-{serial}" for stage in range(3) for serial in range(1, 4)]  # 9 peers, as a 3 x 3 swarm


@pytest.mark.parametrize(
    ("live", "share", "size"),
    [(9, 0.5, 5), (8, 0.5, 4), (9, 1.0, 9), (9, 0.01, 1), (1, 0.5, 1), (10, 0.3, 3), (4, 0.99, 4), (0, 0.5, 0)],
)
def test_a_wave_takes_its_share_rounded_half_up_at_least_one_and_at_most_all(live, share, size):
    assert wave_size(live, share) == size


@pytest.mark.parametrize("share", [0.0, -0.5, 1.01, float("nan")])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        wave_size(9, share)


def test_the_victims_are_distinct_live_peers_and_the_same_for_a_seed_whatever_the_order():
    victims = wave_victims(PEERS, 0.5, random.Random(7))
    assert len(victims) == len(set(victims)) == 5 and set(victims) <= set(PEERS)
    assert wave_victims(reversed(PEERS), 0.5, random.Random(7)) == victims
    # another seed picks other peers (with 126 ways to choose 5 of 9, some seed among a few does)
    assert any(wave_victims(PEERS, 0.5, random.Random(seed)) != victims for seed in range(8))


def test_a_whole_wave_takes_every_peer_and_a_wave_of_none_takes_nothing():
    assert sorted(wave_victims(PEERS, 1.0, random.Random(0))) == sorted(PEERS)
    assert wave_victims([], 0.5, random.Random(0)) == []


def test_the_command_line_takes_a_wave_with_its_defaults():
    args = chaos.parse_args(["--wave", "0.5", "--peers-per-stage", "3", "--trainers", "2"])
    assert (args.wave, args.wave_every, args.refill_after, args.trace) == (0.5, 30.0, 5.0, None)
    assert chaos.mode(args).startswith("waves of 0.5 of the peers every 30.0s")
    assert chaos.parse_args([]).wave is None  # off unless asked for: kill mode stays the default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--wave", "0"], "in (0, 1]"),
        (["--wave", "1.5"], "in (0, 1]"),
        (["--wave", "0.5", "--trace", "trace.csv"], "--wave and --trace"),
        (["--wave", "0.5", "--wave-every", "0"], "--wave-every"),
        (["--wave", "0.5", "--refill-after", "-1"], "--refill-after"),
    ],
)
def test_a_wrong_wave_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        chaos.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def on(peer: str, stage: int, state: str = SERVING) -> StageRecord:
    return StageRecord(peer * 4, stage, "gpt-tiny", 3, state, 5, 10.0, 0, 24, 0, 1)


def test_a_peer_that_moved_counts_on_the_stage_its_records_put_it_on():
    """Measured in a wave run: a restorer that had moved was still counted on its first stage, so the wave that
    killed its new stage's other peers counted a loss that never was, and one that killed the restorer itself
    would have counted none. Each wave reads the records, and follows such moves first."""
    churn = Churn(None, None, signal.SIGKILL, random.Random(0), None)  # bookkeeping only: no swarm needed
    churn.stage_of = {"peer0-1": 0, "peer0-2": 0, "peer1-3": 1}
    churn.peer_ids = {"peer0-1": "A" * 4, "peer0-2": "B" * 4, "peer1-3": "C" * 4}
    records = {0: [on("A", 0), on("B", 0, LEAVING)], 1: [on("B", 1)], 2: []}  # B left 0 to restore 1; C not read
    churn.follow_moves(records)
    assert churn.stage_of == {"peer0-1": 0, "peer0-2": 1, "peer1-3": 1}
    assert churn.layout() == [1, 2, 0]
