"""Benchmarks (not tests): `python -m bench.loops`. See docs/benchmarks.md."""
