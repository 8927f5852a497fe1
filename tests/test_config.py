"""One declaration per setting: flags, environment and YAML, with clear errors for bad input."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from swarm.cli import build_parser, main
from swarm.config import ConfigError, PeerConfig, TrainerConfig, load_config, to_flags

ADDRESS = "/ip4/1.2.3.4/tcp/5/p2p/12D3KooWCCxwv4TYQSH9TvqY5yqfLN57aG2hSPVbHBz7ZrHtywdp"


def parse(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(argv))
    args.pop("command"), args.pop("log_level")
    return args


def test_precedence_flag_env_file_default(tmp_path):
    config_file = tmp_path / "peer.yaml"
    config_file.write_text(f"stage: 2\nlr: 0.5\nweight_decay: 0.2\ninitial_peers: [{ADDRESS}]\n")
    config = load_config(
        PeerConfig,
        parse(["peer", "--config", str(config_file), "--stage", "1"]),
        environ={"SWARM_LR": "0.25"},
    )
    assert config.initial_stage == 1  # flag beats file
    assert config.lr == 0.25  # environment beats file
    assert config.weight_decay == 0.2  # file beats default
    assert config.initial_peers == [ADDRESS]
    assert config.beta1 == 0.9  # default


def test_round_trip_through_flags():
    peers = [ADDRESS, ADDRESS.replace("1.2.3.4", "5.6.7.8")]
    config = load_config(TrainerConfig, {"steps": 3, "progress": False, "initial_peers": peers}, environ={})
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
        ({"cli": {"initial_peers": ["/ip4/10.0.0/tcp/31337"]}}, "--initial-peers: '/ip4/10.0.0/tcp/31337' is not a"),
        ({"cli": {"initial_peers": ["/ip4/10.0.0.1/tcp/31337"]}}, "names no peer"),
        ({"cli": {"host_maddrs": ["0.0.0.0:31337"]}}, "--host-maddrs: '0.0.0.0:31337' is not a multiaddr"),
        ({"env": {"SWARM_ROBUST_SUM": "median"}}, "--robust-sum must be one of ['exact', 'centered-clip']"),
        ({"cli": {"stage_blocks": ["3,3"]}}, "--stage-blocks 3,3 must give each of the 3 stages"),
        ({"cli": {"stage_blocks": ["4", "1", "2"]}}, "6 in all for gpt-tiny"),
        ({"env": {"SWARM_STAGE_BLOCKS": "6,0,0"}}, "at least one block"),
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


def test_a_missing_data_path_is_one_clear_line_and_exit_code_2(tmp_path, capsys):
    missing = tmp_path / "no-such-corpus"
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", str(missing)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == f"swarm train: error: --data: {missing} does not exist; give a text file or a folder of them"


@pytest.mark.timeout(120)
def test_an_unreachable_bootstrap_is_one_clear_line_and_a_nonzero_exit(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nobody listens on
    port = closed.getsockname()[1]
    closed.close()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWCCxwv4TYQSH9TvqY5yqfLN57aG2hSPVbHBz7ZrHtywdp"
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "train", "--initial-peers", address, "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"none of --initial-peers answered ({address})" in result.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("", "names no peer id"),
        ("QmQpxnFN8rPtXyAVCRyP1nuDwi7BmadxomZrH78sHNVpz2\nnot-a-peer-id\n", ":2: 'not-a-peer-id' is not a peer id"),
    ],
)
def test_a_bad_allowlist_is_one_clear_line_and_exit_code_2(tmp_path, capsys, content, message):
    allowlist = tmp_path / "allowlist.txt"
    if content is not None:
        allowlist.write_text(content)
    with pytest.raises(SystemExit) as info:
        main(["peer", "--allowlist", str(allowlist)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("swarm peer: error: --allowlist: ") and message in err and "\n" not in err, err


def test_an_identity_file_is_made_once_and_read_back(tmp_path, capsys):
    key = tmp_path / "peer.key"
    assert main(["identity", "--identity-path", str(key)]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["identity", "--identity-path", str(key)]) == 0
    assert capsys.readouterr().out.strip() == first and first.startswith("Qm")
    key.chmod(0o600)
    key.write_bytes(b"not a key")
    with pytest.raises(SystemExit) as info:
        main(["peer", "--identity-path", str(key)])
    assert info.value.code == 2
    assert "holds no libp2p private key" in capsys.readouterr().err
