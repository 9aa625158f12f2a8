"""The `llmserve` command line: pull, models, generate, run-batch, chat, memory, serve, router,
bench, train-heads.

One module per command, each declaring a `Command` (its flags and its handler); `COMMANDS`
is the registry, in the order `--help` lists them. Handlers import what they need (torch,
the engine) themselves, so that `--help` and usage errors stay quick. User errors
(`LLMServeError`, `ValueError`) print one `error: ...` line on stderr and exit 1; usage
errors exit 2 (argparse); Ctrl-C exits 130.
"""

import argparse
import logging
import os
import sys

from llmserve.cpu_info import set_thread_policy
from llmserve.entrypoints.cli import (
    bench,
    chat,
    generate,
    memory,
    pull,
    router,
    run_batch,
    serve,
    train_heads,
)
from llmserve.entrypoints.cli.command import add_commands
from llmserve.errors import LLMServeError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
COMMANDS = (pull.PULL, pull.MODELS, generate.COMMAND, run_batch.COMMAND, chat.COMMAND,
            memory.COMMAND, serve.COMMAND, router.COMMAND, bench.COMMAND, train_heads.COMMAND)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and, as a script, exits with) the process exit code."""
    set_thread_policy()  # before any command loads torch (OpenMP reads it as it loads)
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve` relaunches replicas
    if hasattr(args, "check"):
        args.check(args)  # rules between flags: parser.error, exit 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if _is_torchrun_worker(args):  # ranks > 0 of an engine torchrun started
            from llmserve.executor.worker import run_external_worker

            run_external_worker(args.device or "cpu",
                                getattr(args, "pipeline_parallel_size", None) or 1)
            return 0
        return args.run(args) or 0
    except (LLMServeError, ValueError) as e:
        message = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout piped into `head` and closed: not an error
        sys.stderr.close()
        return 0


def _is_torchrun_worker(args: argparse.Namespace) -> bool:
    return (getattr(args, "distributed_executor_backend", None) == "external_launcher"
            and os.environ.get("RANK", "0") != "0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show INFO logs")
    parser.set_defaults(verbose=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub, COMMANDS)
    return parser
