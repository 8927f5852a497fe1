"""One declaration per setting: flags, environment and YAML, with clear errors for bad input."""

from __future__ import annotations

import pytest

from swarm.cli import build_parser, main
from swarm.config import ConfigError, PeerConfig, TrainerConfig, load_config, to_flags


def parse(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(argv))
    args.pop("command"), args.pop("log_level")
    return args


def test_precedence_flag_env_file_default(tmp_path):
    config_file = tmp_path / "peer.yaml"
    config_file.write_text("stage: 2\nlr: 0.5\nweight_decay: 0.2\ninitial_peers: [/ip4/1.2.3.4/tcp/5/p2p/X]\n")
    config = load_config(
        PeerConfig,
        parse(["peer", "--config", str(config_file), "--stage", "1"]),
        environ={"SWARM_LR": "0.25"},
    )
    assert config.initial_stage == 1  # flag beats file
    assert config.lr == 0.25  # environment beats file
    assert config.weight_decay == 0.2  # file beats default
    assert config.initial_peers == ["/ip4/1.2.3.4/tcp/5/p2p/X"]
    assert config.beta1 == 0.9  # default


def test_round_trip_through_flags():
    config = load_config(TrainerConfig, {"steps": 3, "progress": False, "initial_peers": ["a", "b"]}, environ={})
    again = load_config(TrainerConfig, parse(["train", *to_flags(config)]), environ={})
    assert again == config


def test_flag_typo_is_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["peer", "--stgae", "1"])
    assert info.value.code == 2
    assert "unrecognized arguments: --stgae" in capsys.readouterr().err


@pytest.mark.parametrize(
    "source, message",
    [
        ({"cli": {"stage": 7}}, "--stage must be within 0..2"),
        ({"env": {"SWARM_TARGET_BATCH_SIZE": "lots"}}, "SWARM_TARGET_BATCH_SIZE: expected int"),
        ({"cli": {"model": "gpt-huge"}}, "unknown model"),
        ({"file": "stage: 1\nsteps: 9\n"}, "unknown settings ['steps']"),
        ({"file": "[1, 2"}, "not valid YAML"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path, source, message):
    config_file = None
    if "file" in source:
        config_file = tmp_path / "c.yaml"
        config_file.write_text(source["file"])
    with pytest.raises(ConfigError, match=None) as info:
        load_config(PeerConfig, source.get("cli", {}), environ=source.get("env", {}), config_file=config_file)
    assert message in str(info.value)
