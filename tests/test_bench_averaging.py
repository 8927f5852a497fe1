"""scripts/bench_averaging.py at 2 mates: one JSON object; every round exact, or hivemind said why not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.averaging_group import count_fallbacks

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_averaging.py"
FIGURES = {
    "round_s",
    "sent_bytes_per_peer",
    "sent_gradients_per_peer",
    "received_bytes_per_peer",
    "received_gradients_per_peer",
    "peak_memory_mb_per_peer",
    "cpu_s_per_round",
    "exact",
}


def _logs(directory: Path, engine: str) -> dict[str, str]:
    """The end of each of the engine's mate logs, to say why a round was inexact."""
    return {log.name: log.read_text(errors="replace")[-1500:] for log in sorted(directory.glob(f"{engine}-*.log"))}


@pytest.mark.timeout(600)
def test_bench_averaging_two_mates(tmp_path):
    command = [sys.executable, str(SCRIPT), "--sizes", "2", "--parameters", "5000", "--rounds", "2"]
    command += ["--engines", "all_to_all", "new", "hivemind", "--log-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "averaging" and result["gradient_bytes"] == 20_000
    for engine in ("all_to_all", "new", "hivemind"):
        figures = result["engines"][engine]["2"]
        assert "error" not in figures, (engine, figures)
        assert FIGURES <= set(figures), (engine, figures)
        assert figures["rounds"] == 2 and figures["failed_rounds"] == 0, (engine, figures)
        # what every mate's round gave is the exact sum of both mates' gradients, bit for bit; hivemind may
        # end a round inexact without failing it (a part whose reducer failed keeps the mate's own values):
        # then the figures must say that hivemind said so
        explained = engine == "hivemind" and figures.get("hivemind_fallbacks", 0) > 0
        assert figures["exact"] or explained, (engine, figures, _logs(tmp_path, engine))
        # a mate sends at least half its gradient (its mate's share), at most a little over all of it
        assert 0.45 < figures["sent_gradients_per_peer"] < 1.5, (engine, figures)
        assert 0.45 < figures["received_gradients_per_peer"] < 1.5, (engine, figures)
        assert figures["round_s"] > 0 and figures["peak_memory_mb_per_peer"] >= 0
    # all-to-all: each mate sends its whole gradient to the other
    assert result["engines"]["all_to_all"]["2"]["sent_gradients_per_peer"] >= 1.0


def test_hivemind_fallbacks_are_counted_from_what_its_mates_logged(tmp_path):
    quiet, partial = tmp_path / "hivemind-2-0.log", tmp_path / "hivemind-2-1.log"
    quiet.write_text("[INFO] [hivemind.averaging.averager.run:311] started\n")
    partial.write_text(
        "[WARN] [hivemind.averaging.partition.__aiter__:174] Averaging: received 50.0% results\n"
        "[WARN] [hivemind.averaging.averager._step:484] CountedAverager caught AllreduceException('x'), retrying\n"
    )
    assert count_fallbacks([quiet, None, tmp_path / "absent.log"]) == 0
    assert count_fallbacks([quiet, partial]) == 2
