"""Swarm-wide decisions as pure functions, testable without a network: routing, the balance rule, the
in-flight window and the rebalancing timing."""
