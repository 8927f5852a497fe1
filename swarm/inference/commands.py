"""`swarm generate` and `swarm eval`: join the DHT, find a serving peer per stage, read the live model."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict

from tqdm import tqdm

from swarm.config.inference_settings import EvalConfig, GenerateConfig, InferenceConfig
from swarm.inference.evaluation import evaluate_batch, summarize
from swarm.inference.generation import GenerationSession, generate
from swarm.inference.stage_client import NoPeerError, StageClient
from swarm.models import EOD_TOKEN
from swarm.net.dht_node import connect_to_daemon, start_dht
from swarm.net.direct_plane import DirectPlane
from swarm.net.transport import StageCallError
from swarm.process.event_loop import run
from swarm.trainer.data import CorpusError, load_corpus

logger = logging.getLogger(__name__)


class TextCodec:
    """Text to token ids and back: bytes with the end-of-document token, or a trainer's --tokenizer."""

    def __init__(self, tokenizer: str | None) -> None:
        self.tokenizer = None
        if tokenizer is not None:
            from swarm.trainer.hugging_face import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            ids = self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
            return ids or [self.tokenizer.end_of_document]
        return list(text.encode("utf-8")) or [EOD_TOKEN]

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.tokenizer.decode(tokens)
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def _read_swarm(config: InferenceConfig, name: str, body, errors: tuple[type[Exception], ...] = ()):
    """Joins the DHT and runs `body(client)` once every stage has a serving peer; None, the error logged, where the
    swarm (or one of `errors`) stops it."""
    dht = start_dht(config)

    async def main():
        p2p = DirectPlane(await connect_to_daemon(dht), dht.identity, dial=config.direct, shared_memory=False)
        client = StageClient(dht, config, p2p)
        await client.wait_for_swarm()
        return await body(client)

    try:
        return run(main())
    except (NoPeerError, StageCallError, *errors) as e:
        logger.error(f"swarm {name}: {e}")
        return None
    finally:
        dht.shutdown()


def run_generate(config: GenerateConfig) -> int:
    """`swarm generate`: prints the prompt's continuation as it comes, then one line on what it took."""
    text = TextCodec(config.tokenizer)
    prompt = text.encode(config.prompt)
    spec = config.model_spec()
    started = time.perf_counter()

    async def body(client: StageClient):
        session = GenerationSession(client, spec, config.num_stages)
        sys.stdout.write(config.prompt)
        try:
            return await generate(
                session,
                prompt,
                config.max_new_tokens,
                config.temperature,
                config.top_k,
                config.sample_seed,
                on_token=lambda token: (sys.stdout.write(text.decode([token])), sys.stdout.flush()),
            )
        finally:
            await session.close()

    record = _read_swarm(config, "generate", body, (ValueError,))
    if record is None:
        return 1
    seconds = time.perf_counter() - started
    low, high = min(record.steps), max(record.steps)
    steps = f"step {low}" if low == high else f"steps {low}..{high}"
    print(
        f"\nGenerated {len(record.tokens)} tokens in {seconds:.1f}s with the weights of {steps}; "
        f"{record.replays} prefix replay(s) after a lost peer",
        flush=True,
    )
    _write(config.output_file, {"prompt": prompt, **asdict(record)})
    return 0


def run_eval(config: EvalConfig) -> int:
    """`swarm eval`: scores --samples held-out sequences through the swarm, with a progress bar; prints the loss."""
    spec = config.model_spec()
    try:
        corpus = load_corpus(config.data, int(config.max_corpus_mb * 2**20), config.tokenizer)
    except CorpusError as e:
        logger.error(f"swarm eval: {e}")
        return 1

    async def body(client: StageClient):
        losses, steps = [], []
        with tqdm(total=config.samples, desc="eval", unit="seq", disable=None) as bar:
            for index in range(0, config.samples, config.batch_size):
                size = min(config.batch_size, config.samples - index)
                windows = corpus.batch(index, size, spec.seq_len, config.data_seed)
                batch_losses, step = await evaluate_batch(client, spec, windows)
                losses.append(batch_losses)
                steps.append(step)
                bar.update(size)
        return summarize(losses, steps)

    record = _read_swarm(config, "eval", body)
    if record is None:
        return 1
    print(
        f"Held-out loss {record.loss:.4f} (perplexity {record.perplexity:.2f}) over {record.samples} sequences "
        f"of {corpus.name}, with the weights of steps {min(record.steps)}..{max(record.steps)}",
        flush=True,
    )
    _write(config.output_file, asdict(record))
    return 0


def _write(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as file:
            json.dump(payload, file, indent=1)
