"""Benchmarks: each measures on the device it is given and ends stdout with one JSON record."""
