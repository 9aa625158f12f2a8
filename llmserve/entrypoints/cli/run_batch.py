"""`llmserve run-batch`: an OpenAI Batch file run offline through the server's handlers
(`batch_file.py` does the work)."""

import argparse
import sys
from pathlib import Path
from typing import Any

from llmserve.entrypoints.cli.args import ENGINE_FLAGS, add_engine_flags, add_model_flag, given
from llmserve.entrypoints.cli.command import Command
from llmserve.errors import LLMServeError


def cmd_run_batch(args: argparse.Namespace) -> int:
    from llmserve.config.engine import EngineConfig
    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.engine.engine import Engine
    from llmserve.entrypoints.cli.batch_file import read_batch_lines, run_batch_file
    from llmserve.entrypoints.openai.server import served_model_id

    lines = read_batch_lines(Path(args.input))  # read before the model loads
    if not lines:
        raise LLMServeError(f"{args.input} holds no requests")
    out: Path | Any = sys.stdout if args.output == "-" else Path(args.output)
    if isinstance(out, Path) and not out.parent.is_dir():
        raise LLMServeError(f"cannot write {out}: folder {out.parent} does not exist")
    config = EngineConfig(model=args.model, **given(args, ENGINE_FLAGS))
    model_name = args.served_model_name or served_model_id(args.model)
    summary = run_batch_file(lambda: AsyncEngine(Engine(config)), model_name, lines, out,
                             args.max_concurrency, use_tqdm=not args.no_progress)
    where = "stdout" if out is sys.stdout else out
    print(f"run-batch: {summary.line()}; results in {where}", file=sys.stderr)
    return 0


def _arguments(batch: argparse.ArgumentParser) -> None:
    add_model_flag(batch)
    batch.add_argument("-i", "--input", required=True, metavar="IN.jsonl",
                       help="OpenAI Batch input file")
    batch.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                       help="results ('-': stdout, in order as they are ready)")
    batch.add_argument("--served-model-name",
                       help="the model id bodies may name (default: --model)")
    batch.add_argument("--max-concurrency", type=int, default=64, metavar="N",
                       help="requests in flight at most (default 64)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_flags(batch)


def _check_run_batch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be at least 1, got {args.max_concurrency}")


COMMAND = Command(
    "run-batch", help="run an OpenAI Batch file offline",
    description="Run an OpenAI Batch input file (lines {\"custom_id\", \"method\": "
    "\"POST\", \"url\": \"/v1/chat/completions\" or \"/v1/completions\", \"body\"}) "
    "through the server's handlers as one continuous batch; the output has one line per "
    "input line, in order, in OpenAI's batch output format. An existing output file is "
    "resumed: lines with a result there are not run again.",
    add_arguments=_arguments, run=cmd_run_batch, check=_check_run_batch_args)
