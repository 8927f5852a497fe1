"""scripts/adversary.py against real swarms: an insider attack fails, and the report says by what."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "adversary.py"


@pytest.mark.timeout(420)
def test_a_trainer_signing_with_another_roots_voucher_changes_nothing():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--attacks", "foreign-voucher", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    (attack,) = report["attacks"]
    assert attack["failed"] and "did not vouch for" in attack["evidence"], attack
    assert attack["stage1_samples"] == report["honest"]["stage1_samples"] == 2 * 24
    assert report["not_covered"], "the report names the attacks it does not cover"
