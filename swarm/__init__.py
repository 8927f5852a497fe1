"""swarm: decentralized training of large models on cheap, unreliable hardware."""

from swarm.deferred_imports import defer_unused_imports

__version__ = "0.1.0"

defer_unused_imports()  # before anything imports hivemind: see swarm.deferred_imports
