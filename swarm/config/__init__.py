"""Typed configuration for every role, from CLI flags, environment variables and a YAML file.

Each setting is declared once, as a dataclass field with a help text (`swarm.config.options`); the
same declaration makes the flag `--target-batch-size`, the variable `SWARM_TARGET_BATCH_SIZE` and the
YAML key `target_batch_size`. Precedence: flag, then environment, then the `--config` file, then default.

- `options`: `option`, `add_options`, `load_config`, `to_flags`: the machinery.
- `shared`, `roles`: the settings, those several roles share and each command's.
- `swarm_file`: the settings a whole swarm shares, which one file an organizer publishes holds.
- `faults_flag`, `preemption_flag`: the values of the two flags that are small languages.

Configuration sits below everything else in swarm: it imports no role.
"""

from swarm.config.options import ENV_PREFIX, ConfigError, add_options, load_config, option, to_flags
from swarm.config.roles import (
    DemoConfig,
    DHTConfig,
    IdentityConfig,
    MonitorConfig,
    PeerConfig,
    StatusConfig,
    TrainerConfig,
    check_data_path,
    check_plot_path,
)
from swarm.config.shared import MAX_VOCAB_SIZE, MetricsConfig, ModelConfig, NetworkConfig
from swarm.config.swarm_file import SWARM_SETTINGS
from swarm.config.trust_settings import TrustConfig, VoucherConfig

__all__ = [
    "ENV_PREFIX",
    "MAX_VOCAB_SIZE",
    "SWARM_SETTINGS",
    "ConfigError",
    "DHTConfig",
    "DemoConfig",
    "IdentityConfig",
    "MetricsConfig",
    "ModelConfig",
    "MonitorConfig",
    "NetworkConfig",
    "PeerConfig",
    "StatusConfig",
    "TrainerConfig",
    "TrustConfig",
    "VoucherConfig",
    "add_options",
    "check_data_path",
    "check_plot_path",
    "load_config",
    "option",
    "to_flags",
]
