"""Harnesses that only tests and benchmarks use: network labs and spot-trace replay."""
