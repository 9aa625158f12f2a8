"""Benchmarks: offline throughput (`llmserve bench throughput`)."""
