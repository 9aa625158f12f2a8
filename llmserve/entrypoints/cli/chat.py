"""`llmserve chat`: an interactive chat in the terminal (the REPL is in `generation.py`)."""

import argparse

from llmserve.entrypoints.cli.args import (
    add_engine_flags,
    add_model_flag,
    add_sampling_flags,
    make_llm,
    sampling_options,
    sampling_params,
)
from llmserve.entrypoints.cli.command import Command

# As llama.cpp's interactive defaults; a reply ends at the end of the turn well before this.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 2048}


def cmd_chat(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli.generation import chat_repl

    params = sampling_params(sampling_options(args, CHAT_DEFAULTS))
    chat_repl(make_llm(args), params, args.system)
    return 0


def _arguments(chat: argparse.ArgumentParser) -> None:
    add_model_flag(chat)
    chat.add_argument("--system", help="system prompt")
    add_sampling_flags(chat)
    add_engine_flags(chat)


COMMAND = Command("chat", help="interactive chat in the terminal", add_arguments=_arguments,
                  run=cmd_chat)
