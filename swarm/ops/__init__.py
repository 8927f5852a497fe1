"""Operator tools: the bootstrap node, `swarm status`, the monitor and its dashboard, plots."""
