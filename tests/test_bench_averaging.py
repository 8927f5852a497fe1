"""scripts/bench_averaging.py at 2 mates and a tiny gradient: one JSON object, every engine exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
        # what every mate's round gave is the exact sum of both mates' gradients, bit for bit
        assert figures["exact"], (engine, figures)
        # a mate sends at least half its gradient (its mate's share), at most a little over all of it
        assert 0.45 < figures["sent_gradients_per_peer"] < 1.5, (engine, figures)
        assert 0.45 < figures["received_gradients_per_peer"] < 1.5, (engine, figures)
        assert figures["round_s"] > 0 and figures["peak_memory_mb_per_peer"] >= 0
    # all-to-all: each mate sends its whole gradient to the other
    assert result["engines"]["all_to_all"]["2"]["sent_gradients_per_peer"] >= 1.0
