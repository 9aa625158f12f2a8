"""`llmserve generate`: stream one completion, or run a JSONL file of prompts as one
continuous batch (`generation.py` does the work)."""

import argparse
import sys
from pathlib import Path

from llmserve.entrypoints.cli.args import (
    add_engine_flags,
    add_model_flag,
    add_sampling_flags,
    make_llm,
    sampling_options,
    sampling_params,
)
from llmserve.entrypoints.cli.command import Command
from llmserve.errors import LLMServeError

GENERATE_DEFAULTS = {"max_tokens": 256}


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli import generation

    base = sampling_options(args, GENERATE_DEFAULTS)
    if args.prompt is not None:
        params = sampling_params(base)
        generation.generate_one(make_llm(args), args.prompt, params, args.chat)
        return 0
    items = generation.read_batch(Path(args.input), base)  # all lines checked before loading
    if args.output == "-":
        generation.generate_batch(make_llm(args), items, sys.stdout, args.chat)
        return 0
    out_path = Path(args.output)
    if not out_path.parent.is_dir():
        raise LLMServeError(f"cannot write {out_path}: folder {out_path.parent} does not exist")
    llm = make_llm(args)
    try:
        with out_path.open("w", encoding="utf-8") as out:
            generation.generate_batch(llm, items, out, args.chat)
    except OSError as e:
        raise LLMServeError(f"cannot write {out_path}: {e.strerror or e}") from None
    print(f"wrote {len(items)} results to {out_path}", file=sys.stderr)
    return 0


def _arguments(gen: argparse.ArgumentParser) -> None:
    add_model_flag(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to complete; streamed to stdout")
    source.add_argument("--input", metavar="IN.jsonl", help="JSONL file of prompts")
    gen.add_argument("--output", metavar="OUT.jsonl", help="where --input results go ('-': stdout)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap text prompts as a user turn in the model's chat template")
    add_sampling_flags(gen)
    add_engine_flags(gen)


def _check_generate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.input is not None and args.output is None:
        parser.error("--input needs --output")
    if args.prompt is not None and args.output is not None:
        parser.error("--output goes with --input; --prompt streams to stdout")


COMMAND = Command(
    "generate", help="complete one prompt or a JSONL file of prompts",
    description="Stream one completion (--prompt) or run a JSONL file of prompts as one "
    "continuous batch (--input/--output); input lines: {\"prompt\"|\"messages\"|"
    "\"prompt_token_ids\": ..., \"id\"?, sampling overrides?}.",
    add_arguments=_arguments, run=cmd_generate, check=_check_generate_args)
