"""Launching roles: the local swarm (the demo and the tests' swarms) and the forkserver it forks from."""
