"""One peer per device in one command: `swarm peer --device all` on a machine with several GPUs.

Each device gets a peer process of its own (a stage is one data-parallel replica per GPU, and a process
per GPU keeps one GPU's stall from holding up the others). The processes share every setting given,
except what must differ between peers on one machine: the device, the ports (each one above the
given one, where one is fixed), the checkpoint folder and identity file (one per device, suffixed with
its index) and the ledger file. They leave together: Ctrl-C or SIGTERM stops them all, cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

from swarm.config import ConfigError, PeerConfig
from swarm.config.options import to_flags
from swarm.launch.local_swarm import LocalSwarm

logger = logging.getLogger(__name__)

PORT = re.compile(r"(/tcp/)([0-9]+)")


def device_list(spec: str, cuda_devices: int) -> list[str]:
    """The devices `--device` names: `all` (every visible CUDA device) or a comma-separated list."""
    if spec == "all":
        if cuda_devices == 0:
            raise ConfigError("--device all: no CUDA device is visible here; name devices (cpu, cuda:0,...) instead")
        return [f"cuda:{index}" for index in range(cuda_devices)]
    devices = [d.strip() for d in spec.split(",")]
    if any(not d for d in devices):
        raise ConfigError(f"--device {spec!r}: an empty device name in the list")
    return devices


def _shifted(maddr: str, offset: int) -> str:
    """A multiaddr whose fixed TCP port is `offset` higher (port 0, any free one, stays 0)."""
    return PORT.sub(lambda m: m.group(1) + (str(int(m.group(2)) + offset) if int(m.group(2)) else "0"), maddr)


def _suffixed(path: str | None, index: int) -> str | None:
    return None if path is None else f"{path}.dev{index}"


def config_for_device(config: PeerConfig, device: str, index: int) -> PeerConfig:
    """The settings of the peer on `device`, the `index`-th of the machine's peers."""
    changes = {
        "device": device,
        "host_maddrs": [_shifted(m, index) for m in config.host_maddrs],
        "announce_maddrs": [_shifted(m, index) for m in config.announce_maddrs],
        "checkpoint_dir": None if config.checkpoint_dir is None else f"{config.checkpoint_dir}/dev{index}",
        "identity_path": _suffixed(config.identity_path, index),
        "ledger": _suffixed(config.ledger, index),
    }
    if config.direct_port:
        changes["direct_port"] = config.direct_port + index
    if config.metrics_port:
        changes["metrics_port"] = config.metrics_port + index
    return dataclasses.replace(config, **changes)


def run_device_peers(config: PeerConfig, devices: list[str]) -> int:
    """Runs one peer per device until all have left, or until stopped (SIGTERM, Ctrl-C: each peer leaves
    cleanly); the exit code is the first nonzero one of the peers, else 0."""
    with LocalSwarm(env={"OMP_NUM_THREADS": str(config.num_threads)}) as swarm:
        for index, device in enumerate(devices):
            swarm.spawn(f"peer-dev{index}", "peer", to_flags(config_for_device(config, device, index)))
        logger.info(
            f"Started {len(devices)} peers ({', '.join(devices)}); their logs are in {swarm.workdir}. "
            "Ctrl-C stops them all"
        )
        try:
            while any(process.poll() is None for process in swarm.processes.values()):
                time.sleep(0.5)
        except SystemExit:  # a signal: leaving the block stops every peer, each as it stops on its own
            pass
    codes = {name: process.poll() for name, process in swarm.processes.items()}
    for name, code in codes.items():
        level = logging.INFO if code == 0 else logging.ERROR
        logger.log(level, f"{name} left with exit code {code}; its log: {swarm.log_path(name)}")
    return next((code for code in codes.values() if code), 0)
