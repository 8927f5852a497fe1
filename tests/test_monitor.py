"""`swarm monitor`: the snapshot it builds, and its dashboard rendered by headless Chromium from a live swarm."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import SMALL_CORPUS

from swarm.ops.monitor_snapshot import MAX_HISTORY, MonitorHistory, build_snapshot
from swarm.records.stage_records import JOINING, SERVING, StageRecord
from swarm.records.trainer_records import ProgressPoint, TrainerRecord

CHROMIUM = "/usr/bin/chromium"
ARTIFACT = Path(__file__).resolve().parent.parent / "test-artifacts" / "monitor.png"
FIRST_TRAINER_COLOR = (0xD9, 0x48, 0x0F)  # COLORS[0] of the page: its first trainer's lines
PEERS = [
    "12D3KooWCCxwv4TYQSH9TvqY5yqfLN57aG2hSPVbHBz7ZrHtywdp",
    "12D3KooWHC2fW5dayrHQFixWeqLUbXSpBFYcsCEGbpuJWffMLvEE",
    "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",
]


def record(peer: str, stage: int, throughput: float, state: str = SERVING) -> StageRecord:
    return StageRecord(peer, stage, "gpt-tiny", 2, state, 5, throughput, 1, 32, 0, 3, expiration=110.0)


def trainer(peer: str, steps: range, banned: tuple[str, ...] = ()) -> TrainerRecord:
    points = tuple(ProgressPoint(1000.0 + s, s, 5.0 - s / 10, 20.0) for s in steps)
    return TrainerRecord(peer, "gpt-tiny", 2, steps[-1], 8 * len(steps), points[-1].loss, 20.0, 3, banned, points)


def test_snapshot_shows_each_stages_load_against_the_ideal_and_the_move_that_fixes_it():
    # stage 0 has two peers of 10 samples/s, stage 1 one of 5: the pipeline runs at 5, and moving one peer
    # from stage 0 (gpt-tiny's 2 stages differ in cost, so not exactly) would lift it
    records = {0: [record(PEERS[0], 0, 10.0), record(PEERS[1], 0, 10.0)], 1: [record(PEERS[2], 1, 5.0)]}
    snapshot = build_snapshot("run", 2, records, [trainer(PEERS[0], range(1, 4), (PEERS[2],))], MonitorHistory(), 100.0)
    json.dumps(snapshot, allow_nan=False)  # what the page receives must be strict JSON
    stages, balance = snapshot["stages"], snapshot["balance"]
    assert [s["capacity"] for s in stages] == [20.0, 5.0] and snapshot["stages_served"] == 2
    assert balance["throughput"] == 5.0 and balance["bottleneck"] == 1 and stages[1]["bottleneck"]
    assert balance["ideal_throughput"] > 5.0 and balance["ideal_proven"]
    assert stages[1]["load"] < 1.0 < stages[0]["load"]
    assert [(m["source"], m["target"]) for m in balance["moves"]] == [(0, 1)]
    assert {p["peer_id"]: p["banned_by"] for p in snapshot["peers"]}[PEERS[2]] == 1
    assert snapshot["peers"][0]["expires_in"] == pytest.approx(10.0)


def test_snapshot_of_an_empty_swarm_and_of_joining_peers():
    snapshot = build_snapshot("run", 3, {0: [record(PEERS[0], 0, 0.0, JOINING)]}, [], MonitorHistory(), 100.0)
    json.dumps(snapshot, allow_nan=False)
    assert snapshot["stages_served"] == 0 and snapshot["stages"][0]["joining"] == 1
    assert snapshot["balance"]["bottleneck"] is None and all(s["load"] is None for s in snapshot["stages"])


def test_history_accumulates_across_reads_and_stays_bounded():
    history = MonitorHistory()
    history.add([trainer(PEERS[0], range(1, 33))])
    history.add([trainer(PEERS[0], range(20, 52)), trainer(PEERS[1], range(1, 3))])
    series = history.series()
    assert [p[1] for p in series[PEERS[0]]] == list(range(1, 52)) and len(series[PEERS[1]]) == 2
    for start in range(52, MAX_HISTORY + 200, 32):
        history.add([trainer(PEERS[0], range(start, start + 32))])
    kept = history.series()[PEERS[0]]
    assert len(kept) == MAX_HISTORY and kept[-1][1] == start + 31


# --- the live dashboard ---------------------------------------------------------------------------


def get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    """(status, content type, body) of one request to the monitor."""
    parts = urllib.request.urlparse(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request(method, parts.path or "/")
        reply = connection.getresponse()
        return reply.status, reply.getheader("Content-Type", ""), reply.read()
    finally:
        connection.close()


def wait_for(condition, what: str, timeout: float, monitor: subprocess.Popen, log: Path):
    """Polls `condition()` until it returns something truthy; fails with the monitor's log on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        assert monitor.poll() is None, f"the monitor exited:\n{log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def chromium(*args: str, profile: Path, timeout: float = 90.0) -> str:
    """Runs headless Chromium on its own profile; stops it and all its helpers however it ends."""
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
    ]
    browser = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = browser.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", "timed out"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(browser.pid, signal.SIGKILL)  # its zygote and renderers share the group
        browser.wait(5)
    assert browser.returncode == 0, f"chromium failed ({browser.returncode}): {err[-2000:]}"
    return out


@pytest.mark.timeout(240)
def test_dashboard_shows_a_live_swarm_in_headless_chromium(local_swarm, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium; CI installs it)")
    from PIL import Image

    local_swarm.start_bootstrap()
    model = ["--model", "gpt-tiny", "--num-stages", "2", "--seed", "3"]
    for stage in (0, 1):
        local_swarm.start_peer(f"peer{stage}", stage, [*model, "--target-batch-size", "8", "--announce-period", "0.5"])
    # more steps than the test lasts: the swarm is still training while the browser looks at it
    train = [*model, "--steps", "100000", "--microbatch-size", "4", "--data", SMALL_CORPUS, "--no-progress"]
    local_swarm.start_trainer("trainer", train)
    flags = ["--initial-peers", *local_swarm.initial_peers, "--num-stages", "2", "--port", "0", "--refresh", "0.5"]
    monitor = local_swarm.spawn("monitor", "monitor", flags)
    log = local_swarm.log_path("monitor")

    def printed_url() -> str | None:
        found = re.search(r"Dashboard: (http://127\.0\.0\.1:\d+/)", log.read_text(errors="replace"))
        return found and found.group(1)

    url = wait_for(printed_url, "the monitor's URL", 60, monitor, log)

    def live_snapshot() -> dict | None:
        status, content_type, body = get(url + "api/swarm")
        assert status == 200 and content_type == "application/json"
        snapshot = json.loads(body)
        served = snapshot["stages_served"] == 2 and all(s["capacity"] > 0 for s in snapshot["stages"])
        points = [p for series in snapshot["history"].values() for p in series]
        return snapshot if served and snapshot["trainers"] and len(points) >= 3 else None

    snapshot = wait_for(live_snapshot, "both stages served and 3 loss points", 150, monitor, log)
    peers = {p["peer_id"]: p for p in snapshot["peers"]}
    assert sorted(p["stage"] for p in peers.values()) == [0, 1]
    assert all(p["state"] == SERVING and p["throughput"] > 0 for p in peers.values())
    (trainer_id,) = [t["peer_id"] for t in snapshot["trainers"]]
    losses = [p[2] for p in snapshot["history"][trainer_id]]
    assert all(0 < loss < 10 for loss in losses) and snapshot["age"] is not None and snapshot["error"] is None
    # no placement of these peers beats the ideal: the bottleneck is at it or (a swap would help) under it
    balance, loads = snapshot["balance"], [s["load"] for s in snapshot["stages"]]
    assert 0 < balance["throughput"] <= balance["ideal_throughput"] and 0.5 < min(loads) <= 1 + 1e-9
    assert get(url + "nothing-here")[0] == 404 and get(url, "POST")[0] == 405
    status, content_type, page = get(url)
    assert status == 200 and content_type.startswith("text/html") and b"/api/swarm" in page
    assert not re.search(rb"""(src|href)=["']?https?:""", page), "the page must load nothing from elsewhere"

    dom = chromium("--virtual-time-budget=5000", "--dump-dom", url, profile=tmp_path / "profile-dom")
    assert re.search(r'id="stages-served"[^>]*>2/2<', dom), dom[:3000]
    assert 'id="live" class="ok"' in dom, "the page did not reach the monitor"
    for peer_id in peers:
        assert f'title="{peer_id}"' in dom, f"peer {peer_id} is not in the peers table"
    chart = re.search(r'<svg[^>]*id="loss-chart"[^>]*>(.*?)</svg>', dom, re.S)
    assert chart, "no loss chart"
    path = re.search(r'<path[^>]*class="series"[^>]*data-trainer="([^"]+)" data-points="(\d+)"', chart.group(1))
    assert path and path.group(1) == trainer_id and int(path.group(2)) >= 3, chart.group(1)[:2000]

    shot = tmp_path / "monitor.png"
    chromium(
        "--virtual-time-budget=5000",
        f"--screenshot={shot}",
        "--window-size=1280,900",
        "--hide-scrollbars",
        url,
        profile=tmp_path / "profile-shot",
    )
    ARTIFACT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)
    print(f"dashboard screenshot: {ARTIFACT}")
    with Image.open(ARTIFACT) as image:
        assert image.format == "PNG" and image.size == (1280, 900)
        pixels = image.convert("RGB")
    colors = pixels.getcolors(maxcolors=1 << 20)
    assert len(colors) > 200, f"the screenshot looks blank: {len(colors)} colours"
    line_pixels = sum(n for n, rgb in colors if max(abs(a - b) for a, b in zip(rgb, FIRST_TRAINER_COLOR)) <= 8)
    assert line_pixels > 500, f"the trainer's chart lines are not in the screenshot ({line_pixels} pixels)"
