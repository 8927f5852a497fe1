"""Launching roles: each role's command and the main that runs it, the local swarm (the demo and the tests'
swarms) and the forkserver it forks from."""
