"""Benchmarks: `make bench` (or `python -m benchmarks.<name>` from the repository root)."""
