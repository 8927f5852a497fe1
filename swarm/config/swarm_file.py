"""The swarm file: one YAML an organizer publishes, read by every role of the swarm with `--config`.

It holds the settings every process of one swarm must share (examples/swarm.yaml is one): the
run, where to join, the model and its cut, the batch and the optimizer, the codecs. A volunteer
then needs nothing else (`swarm peer --config swarm.yaml --device cuda:0`), and a trainer only its
own choices (`swarm train --config swarm.yaml --steps 1000 --data corpus/`).

Each role reads the keys it uses and passes over the others named here, so one file serves them
all; any other key it does not know is still an error (a typo). Per-process settings (device,
ports, stage, data, steps) stay out of the file, as flags or environment variables.
"""

from __future__ import annotations

SWARM_SETTINGS: dict[str, str] = {
    "run_id": "the run's name: processes of other runs are ignored",
    "total_steps": "the steps the run trains in all: what peers choosing among runs weigh (`--run-id auto`)",
    "priority": "the run's weight against the other runs of the swarm (1: as any other; `--run-id auto`)",
    "initial_peers": "where a newcomer joins (any live member will do, so these may differ, but must be members)",
    "model": "the model preset every stage is cut from",
    "hf_checkpoint": "the published checkpoint every stage starts from (a folder of the same name on every machine)",
    "num_stages": "how the model is cut into stages",
    "stage_blocks": "how many blocks each stage holds (an uneven cut; empty: as even as possible)",
    "seed": "the initial parameters (and the trainers' default data order)",
    "vocab_size": "the token ids every stage's embedding and head know",
    "tokenizer": "how trainers turn text into those ids",
    "dtype": "what stages compute in and boundary tensors travel in",
    "target_batch_size": "the samples a stage steps on",
    "lr": "the optimizer: replicas of a stage step alike only with the same settings",
    "weight_decay": "the optimizer",
    "beta1": "the optimizer",
    "beta2": "the optimizer",
    "averaging_codec": "how stage-mates send each other gradients",
    "compression": "how trainers send activations and gradients",
    "rebalance_margin": "the balance rule: every peer must compute the same plan",
    "rebalance_horizon": "the balance rule",
    "move_bandwidth_mbit": "the balance rule",
    "trust_root": "the organizer's key: whose trainers' work counts (without it the swarm is open)",
}
