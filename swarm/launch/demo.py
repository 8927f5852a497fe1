"""`swarm demo`: the main job on one machine.

A bootstrap DHT node, one peer per stage and a trainer, each a separate process on 127.0.0.1,
train the tiny model on the default corpus; everything is shut down at the end or on Ctrl-C.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tempfile
import time

from swarm.config import DemoConfig
from swarm.launch.local_swarm import LocalSwarm

logger = logging.getLogger(__name__)


def run_demo(config: DemoConfig) -> int:
    """Runs the demo swarm; returns the trainer's exit code."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop cleanly on SIGTERM as on Ctrl-C
    # a shell without job control starts background jobs with SIGINT ignored: `kill -INT` must still stop us
    signal.signal(signal.SIGINT, signal.default_int_handler)
    workdir = config.log_dir or tempfile.mkdtemp(prefix="swarm-demo-")
    summary_file = config.summary_file or f"{workdir}/summary.json"
    plot_file = {"auto": f"{workdir}/loss.png", "none": None}.get(config.plot, config.plot)
    vocab_size = config.vocab_size
    if config.tokenizer and not vocab_size:
        vocab_size = tokenizer_vocab_size(config.tokenizer)
        if vocab_size is None:
            return 2
    peer_flags, trainer_flags = role_flags(config, vocab_size, summary_file)
    with LocalSwarm(workdir, preloaded=True) as swarm:
        logger.info(f"Starting a bootstrap node, {config.num_stages} peers and a trainer; logs in {workdir}")
        swarm.start_bootstrap()
        for stage in range(config.num_stages):
            swarm.start_peer(f"peer{stage}", stage, peer_flags)
        trainer = swarm.start_trainer("trainer", trainer_flags, log=False)
        try:
            returncode = trainer.wait()
        except KeyboardInterrupt:
            logger.info("Interrupted: stopping the trainer and the peers")
            trainer.send_signal(signal.SIGTERM)
            try:
                returncode = trainer.wait(30)
            except subprocess.TimeoutExpired:
                returncode = 130
            returncode = returncode or 130
        logger.info("Shutting the swarm down")
        started = time.monotonic()
    logger.info(f"All processes stopped in {time.monotonic() - started:.1f}s")
    try:
        with open(summary_file) as file:
            summary = json.load(file)
    except (OSError, ValueError):
        logger.error(f"The trainer left no summary; see the logs in {workdir}")
        return returncode or 1
    plot_line = ""
    if plot_file:  # drawn here from the summary: a plot that fails costs nothing of the run
        from swarm.ops.plots import PlotError, curves_from_summary, plot_training

        try:
            title = f"swarm demo: {config.model}, {config.num_stages} stages"
            drawn = plot_training([curves_from_summary(summary, config.model)], plot_file, title)
            plot_line = f"\n  loss plot:    {drawn}"
        except PlotError as e:
            logger.error(f"No loss plot: {e}")
    print(
        "\nDemo summary\n"
        f"  steps:        {summary['steps']} ({summary['samples']} samples)\n"
        f"  throughput:   {summary['samples_per_second']:.1f} samples/s\n"
        f"  first loss:   {summary['first_loss']:.3f}\n"
        f"  last loss:    {summary['last_loss']:.3f} (mean of the last 5 steps)\n"
        f"  retried calls: {summary['retries']}\n"
        f"  logs:         {workdir}"
        f"{plot_line}",
        flush=True,
    )
    return returncode


def role_flags(config: DemoConfig, vocab_size: int, summary_file: str) -> tuple[list[str], list[str]]:
    """The flags of the demo's peers and of its trainer: the same model, and each role's own settings."""
    model_flags = ["--model", config.model, "--num-stages", str(config.num_stages), "--seed", str(config.seed)]
    model_flags += ["--dtype", config.dtype]
    if config.hf_checkpoint:  # the checkpoint says the vocabulary
        model_flags += ["--hf-checkpoint", config.hf_checkpoint]
    else:
        model_flags += ["--vocab-size", str(vocab_size)]
    peer_flags = [*model_flags, "--target-batch-size", str(config.target_batch_size), "--lr", str(config.lr)]
    trainer_flags = [
        *model_flags,
        "--steps",
        str(config.steps),
        "--microbatch-size",
        str(config.microbatch_size),
        "--summary-file",
        summary_file,
    ]
    if config.max_in_flight is not None:
        trainer_flags += ["--max-in-flight", str(config.max_in_flight)]
    if config.data:
        trainer_flags += ["--data", config.data, "--data-split", config.data_split]
        trainer_flags += ["--text-column", config.text_column]
    if config.tokenizer:
        trainer_flags += ["--tokenizer", config.tokenizer]
    return peer_flags, trainer_flags


def tokenizer_vocab_size(tokenizer: str) -> int | None:
    """The model vocabulary that `tokenizer`'s ids need, for every process of the demo; None (said why) if unusable."""
    from swarm.trainer.data import CorpusError
    from swarm.trainer.hugging_face import load_tokenizer

    try:
        return load_tokenizer(tokenizer).vocab_size
    except CorpusError as e:
        print(f"swarm demo: error: {e}", file=sys.stderr)
        return None
