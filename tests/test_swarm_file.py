"""The swarm file: one YAML (examples/swarm.yaml) that every role reads, a swarm started from it that trains, and
a newcomer whose settings differ from the swarm's told which setting and the value to use."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from conftest import SMALL_CORPUS

from swarm.cli import COMMANDS
from swarm.config import SWARM_SETTINGS, ConfigError, PeerConfig, TrainerConfig, load_config
from swarm.launch.local_swarm import LocalSwarm
from swarm.proto import PROTOCOL_VERSION
from swarm.records.announced_settings import differing_settings, swarm_settings
from swarm.records.stage_records import JOINING, SERVING, StageRecord

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "swarm.yaml"
PEER_IDS = [f"12D3KooW{'ABCDEFGHJK'[i]}" + "x" * 30 for i in range(10)]


def test_every_command_reads_the_example_and_its_keys_are_the_swarm_settings():
    settings = yaml.safe_load(EXAMPLE.read_text())
    assert set(settings) <= set(SWARM_SETTINGS)
    for name, command in COMMANDS.items():
        if name != "identity":  # a key file's tool, not a member of any swarm
            load_config(command.config, {}, environ={}, config_file=str(EXAMPLE))
    peer = load_config(PeerConfig, {"device": "cuda:0"}, environ={}, config_file=str(EXAMPLE))
    assert (peer.model, peer.num_stages, peer.target_batch_size, peer.run_id) == ("gpt-tiny", 2, 16, "tiny-example")
    assert peer.device == "cuda:0"  # the volunteer's own, on its command line


def test_a_typo_in_a_swarm_file_is_still_refused_with_the_known_keys(tmp_path):
    typo = tmp_path / "swarm.yaml"
    typo.write_text(EXAMPLE.read_text() + "target_bacth_size: 64\n")
    for config in (PeerConfig, TrainerConfig):
        with pytest.raises(ConfigError, match=r"unknown settings \['target_bacth_size'\]; known: \[.*'model'"):
            load_config(config, {}, environ={}, config_file=str(typo))


def record(peer: int, target_batch_size: int = 16, state: str = SERVING, model: str = "gpt-tiny") -> StageRecord:
    return StageRecord(
        PEER_IDS[peer], peer % 2, model, 2, state, 0, 10.0, 0, target_batch_size, 0, PROTOCOL_VERSION, vocab_size=257
    )


def test_the_swarm_setting_is_what_most_serving_peers_announce():
    config = load_config(PeerConfig, {"target_batch_size": 32}, environ={}, config_file=str(EXAMPLE))
    agreeing = [record(0), record(1), record(2, target_batch_size=32)]
    assert swarm_settings(agreeing) == (
        {"model": "gpt-tiny", "num_stages": 2, "stage_blocks": (), "vocab_size": 257, "target_batch_size": 16},
        3,
    )
    assert differing_settings(config, agreeing) == (
        "this swarm trains with --target-batch-size 16 (you gave 32), as most of its 3 serving peers announce: "
        "set target_batch_size: 16 or use the swarm's file"
    )
    # a split swarm, joining peers and the newcomer's own record from before a restart: nothing to hold it to
    assert differing_settings(config, [record(0), record(1, target_batch_size=32)]) is None
    assert differing_settings(config, [record(0, state=JOINING), record(1, state=JOINING)]) is None
    assert differing_settings(config, [record(0)], exclude=PEER_IDS[0]) is None
    # every setting that differs is named, and a trainer has no batch size of its own to compare
    trainer = load_config(TrainerConfig, {"model": "gpt-micro", "num_stages": 3}, environ={}, config_file=str(EXAMPLE))
    assert differing_settings(trainer, [record(0), record(1)]) == (
        "this swarm trains with --model gpt-tiny (you gave gpt-micro), --num-stages 2 (you gave 3), as most of its "
        "2 serving peers announce: set model: gpt-tiny, num_stages: 2 or use the swarm's file"
    )


def wait_for(condition, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def swarm_from_file(tmp_path_factory):
    """A bootstrap node (the organizer's), and two peers started with the swarm file and nothing else."""
    workdir = tmp_path_factory.mktemp("swarm-file")
    with LocalSwarm(workdir / "logs") as swarm:
        settings = yaml.safe_load(EXAMPLE.read_text())
        settings["initial_peers"] = swarm.start_bootstrap()  # the organizer publishes its bootstrap's address
        swarm_file = workdir / "swarm.yaml"
        swarm_file.write_text(yaml.safe_dump(settings))
        for name in ("peer0", "peer1"):  # one after the other: the second sees the first's stage and takes the other
            swarm.spawn(name, "peer", ["--config", str(swarm_file)])
            wait_for(lambda name=name: "Serving stage" in swarm.log_path(name).read_text(errors="replace"), name)
        yield swarm, swarm_file


@pytest.mark.timeout(300)
def test_a_swarm_started_from_the_file_trains(swarm_from_file, tmp_path):
    swarm, swarm_file = swarm_from_file
    stages = {swarm.log_path(name).read_text().split("Serving stage ", 1)[1][:3] for name in ("peer0", "peer1")}
    assert stages == {"0/2", "1/2"}, stages
    summary_file = tmp_path / "summary.json"
    trainer = swarm.spawn(
        "trainer",
        "train",
        ["--config", str(swarm_file), "--steps", "4", "--data", SMALL_CORPUS, "--no-progress"]
        + ["--summary-file", str(summary_file)],
    )
    assert trainer.wait(180) == 0, swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 4 and summary["samples"] == 4 * 16  # the file's target_batch_size


@pytest.mark.timeout(300)
def test_a_peer_whose_settings_differ_is_told_the_setting_and_the_value(swarm_from_file):
    swarm, swarm_file = swarm_from_file
    newcomer = swarm.spawn("newcomer", "peer", ["--config", str(swarm_file), "--target-batch-size", "32"])
    assert newcomer.wait(120) == 2
    log = swarm.log_path("newcomer").read_text()
    assert (
        "swarm peer: error: this swarm trains with --target-batch-size 16 (you gave 32), as most of its 2 serving "
        "peers announce: set target_batch_size: 16 or use the swarm's file"
    ) in log, log[-3000:]
    assert "Traceback" not in log and "Serving stage" not in log


@pytest.mark.timeout(300)
def test_a_trainer_whose_settings_differ_is_told_the_setting_and_the_value(swarm_from_file):
    swarm, swarm_file = swarm_from_file
    trainer = swarm.spawn(
        "wrong-trainer", "train", ["--config", str(swarm_file), "--num-stages", "3", "--steps", "1", "--no-progress"]
    )
    assert trainer.wait(120) == 2
    log = swarm.log_path("wrong-trainer").read_text()
    assert (
        "swarm train: error: this swarm trains with --num-stages 2 (you gave 3), as most of its 2 serving peers "
        "announce: set num_stages: 2 or use the swarm's file"
    ) in log, log[-3000:]
    assert "Traceback" not in log
