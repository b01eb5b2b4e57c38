"""Benchmarks: the experiment runner (``python -m benchmarks.runner SPEC``), systems benchmarks."""
