"""Prometheus metrics (--metrics-port) of a real local swarm, scraped with curl while it trains."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
from conftest import SMALL_CORPUS, metrics_url, model_flags, run_p2p_client
from hivemind.p2p import PeerID
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarm.compression import get_codec
from swarm.net.transport import StageCallError, call_stage
from swarm.proto import FORWARD, ErrorCode, StageRequest

TARGET, MICRO = 8, 4
METRICS_LINE = re.compile(r"Metrics on (http://127\.0\.0\.1:(\d+)/metrics)")

# every name the README documents, with its type, as the endpoint declares them (# TYPE lines)
PEER_METRICS = {
    "swarm_peer_info": "gauge",
    "swarm_peer_stage": "gauge",
    "swarm_peer_step": "gauge",
    "swarm_peer_queue_length": "gauge",
    "swarm_peer_throughput_samples_per_second": "gauge",
    "swarm_peer_samples_accumulated": "gauge",
    "swarm_peer_samples_stepped": "gauge",
    "swarm_peer_mates": "gauge",
    "swarm_peer_inference_seconds": "gauge",
    "swarm_peer_inference_sessions": "gauge",
    "swarm_peer_inference_delay_seconds": "gauge",
    "swarm_peer_state": "gauge",
    "swarm_peer_open_streams": "gauge",
    "swarm_peer_calls_total": "counter",
    "swarm_peer_errors_total": "counter",
    "swarm_peer_samples_total": "counter",
    "swarm_peer_bytes_total": "counter",
    "swarm_peer_call_seconds": "histogram",
    "swarm_peer_averaging_seconds": "histogram",
    "swarm_peer_refused_streams_total": "counter",
    "swarm_peer_moves_total": "counter",
    "swarm_peer_stale_gradients_total": "counter",
    "swarm_peer_abandoned_calls_total": "counter",
    "swarm_peer_busy_refusals_total": "counter",
    "swarm_peer_duplicate_backwards_total": "counter",
    "swarm_peer_averaging_rounds_total": "counter",
    "swarm_peer_samples_lost_total": "counter",
    "swarm_peer_samples_doubled_total": "counter",
    "swarm_peer_samples_left_out_total": "counter",
    "swarm_peer_divergences_total": "counter",
    "swarm_peer_resyncs_total": "counter",
    "swarm_peer_failed_rounds_total": "counter",
    "swarm_peer_round_bytes_sent_total": "counter",
    "swarm_peer_round_bytes_received_total": "counter",
    "swarm_peer_refused_mate_messages_total": "counter",
}
TRAINER_METRICS = {
    "swarm_trainer_info": "gauge",
    "swarm_trainer_step": "gauge",
    "swarm_trainer_samples_per_second": "gauge",
    "swarm_trainer_loss": "gauge",
    "swarm_trainer_live_peers": "gauge",
    "swarm_trainer_samples_total": "counter",
    "swarm_trainer_calls_total": "counter",
    "swarm_trainer_call_seconds": "histogram",
    "swarm_trainer_errors_total": "counter",
    "swarm_trainer_bytes_total": "counter",
    "swarm_trainer_retries_total": "counter",
    "swarm_trainer_requeued_total": "counter",
    "swarm_trainer_samples_resent_total": "counter",
    "swarm_trainer_bad_replies_total": "counter",
    "swarm_trainer_bans_total": "counter",
}


class Scrape:
    """One scrape of a metrics endpoint: the declared types and every sample's value by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[sample.name].append((sample.labels, sample.value))

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name` over the samples whose labels include `labels` (0 if there is none)."""
        return sum(v for found, v in self.samples.get(name, []) if labels.items() <= found.items())

    def labels(self, name: str) -> list[dict[str, str]]:
        return [found for found, _ in self.samples.get(name, [])]


def curl(url: str) -> Scrape:
    """Scrapes `url` with the real curl, as a Prometheus server or an operator would."""
    result = subprocess.run(["curl", "-sS", "--fail", "--max-time", "10", url], capture_output=True, text=True)
    assert result.returncode == 0, f"curl {url} failed ({result.returncode}): {result.stderr}"
    return Scrape(result.stdout)


def poll(url: str, ready, what: str, process: subprocess.Popen, timeout: float = 60.0) -> Scrape:
    """Scrapes `url` until `ready(scrape)` holds (AssertionError after `timeout` or if `process` exits)."""
    deadline = time.monotonic() + timeout
    while True:
        scrape = curl(url)
        if ready(scrape):
            return scrape
        assert process.poll() is None, f"the process exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s:\n{scrape.text}"
        time.sleep(0.3)


def settled(scrape: Scrape) -> bool:
    """A peer with nothing queued, whose every call read has been answered: each of MICRO samples, but the
    trainer's first contact (a one-token forward before its first step)."""
    calls = scrape.value("swarm_peer_call_seconds_count")
    answered = (calls - 1) * MICRO + 1
    return scrape.value("swarm_peer_queue_length") == 0 and answered == scrape.value("swarm_peer_samples_total")


def assert_declares(scrape: Scrape, expected: dict[str, str]) -> None:
    declared = {name: scrape.types.get(name) for name in expected}
    assert declared == expected, f"declared types differ: {declared}"


def send_wrong_stage(initial_peers: list[str], peer_id: str) -> None:
    """A stage call for a stage the peer does not host: it must be refused with WRONG_STAGE."""

    async def go(p2p):
        request = StageRequest(kind=FORWARD, model="gpt-tiny", stage=2, step=0)
        hidden = [torch.randn(1, 64, 128)]
        with pytest.raises(StageCallError) as refused:
            await call_stage(p2p, PeerID.from_base58(peer_id), request, hidden, get_codec("none"), timeout=30)
        assert refused.value.code == ErrorCode.WRONG_STAGE

    run_p2p_client(initial_peers, go)


@pytest.mark.timeout(150)
def test_peers_and_trainer_serve_documented_metrics_while_training(local_swarm):
    local_swarm.start_bootstrap()
    peer_flags = [*model_flags(), "--target-batch-size", str(TARGET), "--announce-period", "0.5"]
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, [*peer_flags, "--metrics-port", "0"])
    trainer = local_swarm.start_trainer(
        "trainer",
        [
            *model_flags(),
            "--steps",
            "10000",  # runs until stopped below, once its endpoint has been read
            "--microbatch-size",
            str(MICRO),
            "--data",
            SMALL_CORPUS,
            "--compression",
            "fp16",  # activations and gradients in fp16, token ids and targets packed ("packed-int")
            "--no-progress",
            "--metrics-port",
            "0",
        ],
    )
    peer_urls = [metrics_url(local_swarm, f"peer{stage}") for stage in range(3)]
    assert len(set(peer_urls)) == 3, peer_urls

    # the trainer, while it trains
    url = metrics_url(local_swarm, "trainer")
    scrape = poll(url, lambda s: s.value("swarm_trainer_step") >= 3, "trainer at step 3", trainer)
    assert_declares(scrape, TRAINER_METRICS)
    assert scrape.value("swarm_trainer_samples_total") >= 3 * TARGET
    assert 0 < scrape.value("swarm_trainer_loss") < 10 and scrape.value("swarm_trainer_samples_per_second") > 0
    for stage in range(3):
        assert scrape.value("swarm_trainer_live_peers", stage=str(stage)) == 1
        assert scrape.value("swarm_trainer_calls_total", stage=str(stage), kind="backward") >= 6
    for stage in range(2):
        assert scrape.value("swarm_trainer_calls_total", stage=str(stage), kind="forward") >= 6
    assert scrape.value("swarm_trainer_call_seconds_count") >= 15
    assert scrape.value("swarm_trainer_bytes_total", direction="sent", codec="fp16") > 0
    assert scrape.value("swarm_trainer_bytes_total", direction="received", codec="fp16") > 0
    (info,) = scrape.labels("swarm_trainer_info")
    assert info["model"] == "gpt-tiny" and info["num_stages"] == "3" and info["peer_id"]

    # Ctrl-C: the trainer finishes cleanly, and the peers keep what they served
    local_swarm.signal("trainer", signal.SIGINT)
    assert trainer.wait(30) == 0

    peer_ids = []
    for stage, peer_url in enumerate(peer_urls):
        # calls the trainer left behind finish on the peer a moment later
        scrape = poll(peer_url, settled, f"peer{stage} settled", local_swarm.processes[f"peer{stage}"])
        assert_declares(scrape, PEER_METRICS)
        (info,) = scrape.labels("swarm_peer_info")
        peer_ids.append(info["peer_id"])
        assert scrape.value("swarm_peer_stage") == stage
        assert scrape.value("swarm_peer_step") >= 3
        assert scrape.value("swarm_peer_state", state="serving") == 1
        assert scrape.value("swarm_peer_state", state="joining") == 0
        # per step, two microbatches: a forward and a backward each, but on the last stage (one call for both)
        assert scrape.value("swarm_peer_calls_total", protocol="/swarm/stage") >= (6 if stage == 2 else 12)
        assert scrape.value("swarm_peer_samples_total", kind="backward") >= 3 * TARGET
        assert scrape.value("swarm_peer_throughput_samples_per_second") > 0
        assert scrape.value("swarm_peer_samples_stepped") >= 3 * TARGET
        assert scrape.value("swarm_peer_averaging_seconds_count") >= 3
        assert scrape.value("swarm_peer_averaging_rounds_total") >= 3
        assert scrape.value("swarm_peer_errors_total") == 0, scrape.labels("swarm_peer_errors_total")
        # stage 0 reads token ids (packed, as a compressing codec sends integers), the others fp16
        # activations; all answer in fp16
        received = "packed-int" if stage == 0 else "fp16"
        assert scrape.value("swarm_peer_bytes_total", direction="received", codec=received) > 0
        assert scrape.value("swarm_peer_bytes_total", direction="sent", codec="fp16") > 0
    assert len(set(peer_ids)) == 3

    # an error, by its code
    send_wrong_stage(local_swarm.initial_peers, peer_ids[0])
    scrape = curl(peer_urls[0])
    assert scrape.value("swarm_peer_errors_total", protocol="/swarm/stage", code="WRONG_STAGE") == 1
    assert scrape.value("swarm_peer_errors_total") == 1


def test_a_metrics_port_in_use_is_one_clear_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "swarm", "peer", "--stage", "0", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"swarm peer: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_metrics_port_out_of_range_is_refused_before_start():
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "train", "--metrics-port", "65536"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().endswith("--metrics-port must be within 0..65535 (0: a free port), got 65536")


def test_without_the_flag_nothing_of_prometheus_is_loaded():
    loaded = (
        "sorted(m for m in sys.modules"
        " if m.startswith(('prometheus_client', 'swarm.ops.prometheus', 'swarm.trainer.metrics',"
        " 'swarm.peer.metrics')))"
    )
    code = f"import sys, swarm.cli, swarm.peer.server, swarm.trainer.trainer; print({loaded})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_peer_that_moves_keeps_counting_from_where_it_was():
    from swarm.config import PeerConfig, load_config
    from swarm.peer.metrics import PeerMetrics
    from swarm.peer.server import Peer

    peer = Peer(load_config(PeerConfig, {"stage": "0"}, environ={}))
    try:
        peer.metrics = PeerMetrics(peer)
        peer._build(0, resume=False)
        peer.runtime.stale_gradients, peer.mates.rounds = 3, 5  # as if it had served a while
        peer._build(1, resume=False)  # the move: a new runtime and mates, whose tallies start at 0
        peer.moves += 1
        peer.runtime.stale_gradients = 1
        scrape = Scrape(generate_latest(peer.metrics.registry).decode())
    finally:
        peer.dht.shutdown()
    assert scrape.value("swarm_peer_stage") == 1
    assert scrape.value("swarm_peer_moves_total") == 1
    assert scrape.value("swarm_peer_stale_gradients_total") == 4
    assert scrape.value("swarm_peer_averaging_rounds_total") == 5
