"""Benchmarks run by ``kvlb bench ...`` (I/O: they read the clock and print)."""
