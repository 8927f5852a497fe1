"""swarm: decentralized training of large models on cheap, unreliable hardware."""

from swarm.deferred_imports import defer_unused_imports
from swarm.process.tensor_sharing import share_tensors_by_descriptor

__version__ = "0.1.0"

defer_unused_imports()  # before anything imports hivemind: see swarm.deferred_imports
share_tensors_by_descriptor()  # likewise: see swarm.process.tensor_sharing
