"""Benchmarks against the reference implementations (`make bench`); see docs/benchmarks.md."""
