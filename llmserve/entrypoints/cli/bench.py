"""`llmserve bench ...`: the benchmarks, one subcommand each. Errors follow the CLI's rule:
one `error: ...` line, exit 1."""

import argparse

from llmserve.entrypoints.cli.bench_embed import EMBED
from llmserve.entrypoints.cli.bench_engine import KERNELS, LATENCY, SCALING, THROUGHPUT
from llmserve.entrypoints.cli.bench_quality import QUALITY, SPEC
from llmserve.entrypoints.cli.bench_server import (
    HOSTILE,
    MODELS,
    PLOT,
    SERVE,
    SOAK,
    STARTUP,
)
from llmserve.entrypoints.cli.bench_vision import VISION
from llmserve.entrypoints.cli.command import Command, add_commands

BENCHMARKS = (THROUGHPUT, SERVE, LATENCY, KERNELS, QUALITY, SPEC, SCALING, SOAK, EMBED,
              HOSTILE, STARTUP, MODELS, VISION, PLOT)


def _arguments(bench: argparse.ArgumentParser) -> None:
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    add_commands(kinds, BENCHMARKS)


COMMAND = Command("bench", help="benchmarks", add_arguments=_arguments, run=None)
