"""A `llmserve` subcommand as the CLI's registry holds it, and how a list of them becomes
argparse subcommands."""

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any


@dataclass(frozen=True)
class Command:
    """One subcommand.

    `add_arguments(parser)` declares its flags; `run(args)` does the work and returns the
    exit code (None: 0), importing what it needs (torch, the engine) itself so that
    `llmserve --help` stays quick; `check(parser, args)`, if given, enforces rules between
    flags with `parser.error` (exit 2) before anything runs. A command whose
    `add_arguments` adds subcommands of its own (`bench`) has no `run`.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None] | None
    description: str | None = None
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None


def add_commands(subparsers: Any, commands: Sequence[Command]) -> None:
    """One parser per command under `subparsers`, in order; each accepts `-v` too (a group
    of subcommands leaves it to them)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show INFO logs")
    for command in commands:
        parser = subparsers.add_parser(
            command.name, parents=[common] if command.run is not None else [],
            help=command.help, description=command.description)
        command.add_arguments(parser)
        if command.run is not None:
            parser.set_defaults(run=command.run)
        if command.check is not None:
            parser.set_defaults(check=partial(command.check, parser))
