"""Benchmark and accuracy harnesses (problems, accuracy report, latency sweep)."""
