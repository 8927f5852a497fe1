"""swarm: decentralized training of large models on cheap, unreliable hardware."""

__version__ = "0.1.0"
