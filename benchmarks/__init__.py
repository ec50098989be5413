"""Benchmarks: run from a checkout as ``python -m benchmarks.<area>.<name>``; not installed."""
