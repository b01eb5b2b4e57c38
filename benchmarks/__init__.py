"""Benchmarks: the strategy grid (``python -m benchmarks.grid``), systems figures and plots."""
