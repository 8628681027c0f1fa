"""Benchmarks against the reference implementations (`make bench`); see bench/NOTES.md."""
