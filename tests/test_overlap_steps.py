"""--overlap-steps on a real local swarm: the trainer starts each step while the backwards of the one before
finish; the peers apply those one-step-stale gradients, and every sample fed is stepped on exactly once."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_CORPUS, model_flags, run_p2p_client
from hivemind.p2p import PeerID

from swarm.net.dht_node import TetheredDHT
from swarm.net.transport import get_peer_info
from swarm.records.sample_ledger import account, read_ledger
from swarm.records.stage_records import fetch_stage_records

STEPS, TARGET, MICRO = 12, 24, 4


def peer_infos(initial_peers: list[str]) -> list:
    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        records = fetch_stage_records(dht, "swarm", 3)
    finally:
        dht.shutdown()

    async def go(p2p):
        return [await get_peer_info(p2p, PeerID.from_base58(records[s][0].peer_id)) for s in range(3)]

    return run_p2p_client(initial_peers, go)


@pytest.mark.timeout(240)
def test_overlapped_steps_train_and_step_on_every_sample_once(local_swarm, tmp_path):
    local_swarm.start_bootstrap()
    for stage in range(3):
        flags = [*model_flags(), "--target-batch-size", str(TARGET), "--ledger", str(tmp_path / f"peer{stage}.jsonl")]
        local_swarm.start_peer(f"peer{stage}", stage, flags)
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer(
        "trainer",
        [*model_flags(), "--steps", str(STEPS), "--microbatch-size", str(MICRO), "--max-in-flight", "8"]
        + ["--overlap-steps", "--data", SMALL_CORPUS, "--compression", "none", "--no-progress"]
        + ["--summary-file", str(summary_file), "--ledger", str(tmp_path / "trainer.jsonl")],
    )
    assert trainer.wait(180) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * TARGET
    losses = summary["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses

    infos = peer_infos(local_swarm.initial_peers)
    report = account(read_ledger(tmp_path / "trainer.jsonl"), read_ledger(tmp_path.glob("peer*.jsonl")))
    assert report["totals"]["samples_doubled"] == 0, report["totals"]
    for stage, info in enumerate(infos):
        counts = report["stages"][stage]
        # the peers' batches no longer line up with the trainer's steps: a stage steps once its batch is full,
        # with what arrived meanwhile, and the last samples may still wait in its batch when training ends
        assert info.samples_stepped + info.samples_accumulated == STEPS * TARGET, (stage, info)
        assert counts["samples_stepped"] == info.samples_stepped, (stage, counts)
        assert counts["samples_lost"] == info.samples_accumulated, (stage, counts)
        assert STEPS * TARGET // (TARGET + 8 * MICRO) <= info.step <= STEPS, (stage, info.step)
    # a step's first microbatches ran their forwards before the stage took the step before: one step stale
    assert infos[0].stale_gradients > 0, infos[0]
