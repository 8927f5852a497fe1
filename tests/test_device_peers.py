"""One peer per device in one command (`swarm peer --device all`, or a list): each device's peer is a process
of its own with its own ports, checkpoint folder and identity, and they leave together, cleanly."""

from __future__ import annotations

import signal

import pytest
from conftest import wait_for_records

from swarm.config import ConfigError, PeerConfig
from swarm.launch.device_peers import config_for_device, device_list


def test_devices_are_listed_and_each_peer_gets_its_own_ports_and_files():
    assert device_list("all", 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert device_list("cuda:1, cuda:3", 4) == ["cuda:1", "cuda:3"]
    with pytest.raises(ConfigError, match="no CUDA device"):
        device_list("all", 0)
    with pytest.raises(ConfigError, match="empty"):
        device_list("cuda:0,,cuda:1", 2)
    config = PeerConfig(
        host_maddrs=["/ip4/0.0.0.0/tcp/31338", "/ip4/127.0.0.1/tcp/0"],
        checkpoint_dir="ckpt",
        identity_path="peer.key",
        direct_port=4000,
        metrics_port=0,
    )
    second = config_for_device(config, "cuda:1", 1)
    assert second.device == "cuda:1"
    assert second.host_maddrs == ["/ip4/0.0.0.0/tcp/31339", "/ip4/127.0.0.1/tcp/0"]  # a free port stays free
    assert (second.checkpoint_dir, second.identity_path, second.direct_port) == ("ckpt/dev1", "peer.key.dev1", 4001)
    assert second.metrics_port == 0 and second.ledger is None
    assert config_for_device(config, "cuda:0", 0).host_maddrs == config.host_maddrs


@pytest.mark.timeout(180)
def test_one_command_starts_a_peer_per_device_and_stops_them_together(local_swarm, tmp_path):
    local_swarm.start_bootstrap()
    checkpoints = tmp_path / "ckpt"
    flags = ["--model", "gpt-tiny", "--num-stages", "2", "--device", "cpu,cpu", "--checkpoint-dir", str(checkpoints)]
    launcher = local_swarm.start_peer("peers", "auto", flags)
    records = wait_for_records(
        local_swarm.initial_peers, lambda r: sum(len(v) for v in r.values()) == 2, num_stages=2, timeout=120
    )
    assert len({record.peer_id for recs in records.values() for record in recs}) == 2
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=90) == 0
    for index in (0, 1):  # each left cleanly: its checkpoint is in its own folder
        assert list((checkpoints / f"dev{index}").glob("*.safetensors")), f"no checkpoint from device {index}"
