"""The swarm simulator's parts; `scripts/simulate.py` is its command line and says what it models."""
