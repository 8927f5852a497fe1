"""Inference through a live swarm: `swarm generate` and `swarm eval` against one process with the same weights,
and a generation that loses a peer midway."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest
import torch
from conftest import SMALL_CORPUS, trainer_flags, wait_for_records
from test_peer_death import trainer_exit_code

from swarm.config.inference_settings import GenerateConfig
from swarm.inference.generation import GenerationSession, generate
from swarm.inference.reference import generate_locally, losses_locally
from swarm.inference.stage_client import StageClient
from swarm.models import get_model_spec
from swarm.models.stage import build_stage
from swarm.net.dht_node import TetheredDHT
from swarm.net.direct_plane import DirectPlane
from swarm.net.identity import load_identity
from swarm.trainer.data import load_corpus

SEED = 7


def flags(model: str) -> list[str]:
    return ["--model", model, "--num-stages", "3", "--seed", str(SEED)]


def serving(counts: dict[int, int]):
    return lambda records: all(sum(r.state == "serving" for r in records.get(s, [])) >= n for s, n in counts.items())


def reference_stages(model: str) -> list:
    spec = get_model_spec(model)
    return [build_stage(spec, stage, 3, SEED).eval() for stage in range(3)]


def test_generate_gives_the_tokens_of_one_process_and_eval_its_loss(local_swarm, tmp_path):
    model = "gpt-tiny-subspace"  # its later stages take the token ids too: every input a session carries
    initial_peers = local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, [*flags(model), "--announce-period", "0.5"])
    wait_for_records(initial_peers, serving({0: 1, 1: 1, 2: 1}))
    command = [sys.executable, "-m", "swarm"]
    joined = ["--initial-peers", *initial_peers, *flags(model)]

    prompt = "import os\n"
    out = tmp_path / "generated.json"
    run = [*command, "generate", *joined, "--prompt", prompt, "--max-new-tokens", "24", "--output-file", str(out)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Generated 24 tokens" in done.stdout and "step 0" in done.stdout
    generated = json.loads(out.read_text())
    stages = reference_stages(model)
    assert generated["tokens"] == generate_locally(stages, list(prompt.encode()), 24)
    assert generated["steps"] == [0] * 24 and generated["replays"] == 0

    out = tmp_path / "eval.json"
    run = [*command, "eval", *joined, "--data", SMALL_CORPUS, "--samples", "12", "--batch-size", "5"]
    done = subprocess.run([*run, "--output-file", str(out)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Held-out loss" in done.stdout
    measured = json.loads(out.read_text())
    corpus = load_corpus(SMALL_CORPUS)
    seq_len = get_model_spec(model).seq_len
    windows = [corpus.batch(index, min(5, 12 - index), seq_len, 1_000_003) for index in range(0, 12, 5)]
    expected = torch.cat([losses_locally(stages, w) for w in windows]).mean().item()
    assert measured["samples"] == 12
    assert abs(measured["loss"] - expected) < 1e-5, (measured["loss"], expected)


def test_a_peer_killed_mid_generation_costs_a_replay_not_the_answer(local_swarm, tmp_path):
    model = "gpt-tiny"
    initial_peers = local_swarm.start_bootstrap()
    identities = {}
    for name, stage in (("peer0", 0), ("peer1a", 1), ("peer1b", 1), ("peer2", 2)):
        path = tmp_path / f"{name}.key"
        identities[str(load_identity(str(path)).peer_id)] = name
        local_swarm.start_peer(name, stage, [*flags(model), "--announce-period", "0.5", "--identity-path", str(path)])
    wait_for_records(initial_peers, serving({0: 1, 1: 2, 2: 1}))
    config = GenerateConfig(initial_peers=initial_peers, model=model, num_stages=3, seed=SEED, call_timeout=20.0)
    prompt, new_tokens = list(b"def main():\n    "), 30
    killed = []

    async def main(dht: TetheredDHT):
        p2p = DirectPlane(await dht.replicate_p2p(), dht.identity, dial=True, shared_memory=False)
        client = StageClient(dht, config, p2p)
        await client.wait_for_swarm()
        session = GenerationSession(client, get_model_spec(model), 3)

        def on_token(token: int) -> None:
            if len(session.record.tokens) == 10:  # mid-generation: the stage 1 peer holding the session dies
                killed.append(identities[session.peers[1]])
                local_swarm.stop(killed[-1], signal.SIGKILL)

        try:
            return await generate(session, prompt, new_tokens, 0.8, 20, seed=3, on_token=on_token)
        finally:
            await session.close()

    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        record = asyncio.run(asyncio.wait_for(main(dht), 240))
    finally:
        dht.shutdown()
    assert killed and killed[0] in ("peer1a", "peer1b")
    assert record.replays == 1  # stage 1's prefix, once, on its other peer
    assert record.tokens == generate_locally(reference_stages(model), prompt, new_tokens, 0.8, 20, seed=3)


@pytest.mark.timeout(420)
def test_generation_reads_the_live_weights_while_a_trainer_trains(local_swarm, tmp_path):
    """Generation and training share the peers: the trainer finishes its steps with a falling loss, and each
    generated token names the step of the weights that predicted it, steps that move on as training does."""
    model = "gpt-tiny"
    initial_peers = local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(
            f"peer{stage}", stage, [*flags(model), "--announce-period", "0.5", "--target-batch-size", "16"]
        )
    wait_for_records(initial_peers, serving({0: 1, 1: 1, 2: 1}))
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(12, summary_file))
    out = tmp_path / "generated.json"
    command = [sys.executable, "-m", "swarm", "generate", "--initial-peers", *initial_peers, *flags(model)]
    generated = []
    while trainer.poll() is None:
        done = subprocess.run(
            [*command, "--max-new-tokens", "40", "--output-file", str(out)], capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr[-3000:]
        generated.append(json.loads(out.read_text()))
    assert trainer_exit_code(local_swarm, trainer, 240) == 0
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 12 and summary["last_loss"] < summary["first_loss"]
    steps = [step for record in generated for step in record["steps"]]
    assert steps == sorted(steps) and all(0 <= s <= 12 for s in steps)
