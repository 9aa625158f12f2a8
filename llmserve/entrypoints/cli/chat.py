"""`llmserve chat`: an interactive chat in the terminal (the REPL is in `generation.py`)."""

import argparse
from pathlib import Path
from typing import Any

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

# As llama.cpp's interactive defaults; a reply ends at the end of the turn well before this.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 2048}


def cmd_chat(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli.generation import chat_repl

    params = sampling_params(sampling_options(args, CHAT_DEFAULTS))
    images = [_read_image(path) for path in args.image or ()]  # refused before loading
    llm = make_llm(args)
    if images and llm.engine.input_processor.images is None:
        raise LLMServeError("--image: this model reads text only")
    chat_repl(llm, params, args.system, images=images)
    return 0


def _read_image(path: str) -> Any:
    from llmserve.multimodal.images import decode_image

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise LLMServeError(f"--image: cannot read {path}: {e.strerror or e}") from None
    try:
        return decode_image(data)
    except LLMServeError as e:
        raise LLMServeError(f"--image {path}: {e}") from None


def _arguments(chat: argparse.ArgumentParser) -> None:
    add_model_flag(chat)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--image", action="append", metavar="FILE",
                      help="an image for the first message (a vision-language model); "
                           "repeat for several")
    add_sampling_flags(chat)
    add_engine_flags(chat)


COMMAND = Command("chat", help="interactive chat in the terminal", add_arguments=_arguments,
                  run=cmd_chat)
