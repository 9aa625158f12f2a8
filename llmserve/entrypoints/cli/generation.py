"""`llmserve generate` and `llmserve chat`: streaming one prompt, batch JSONL files, a REPL.

Input JSONL, one object a line: exactly one of `"prompt"` (text), `"messages"` (a chat
conversation, rendered with the model's template) or `"prompt_token_ids"`, an optional
`"id"` copied to the output, and optional SamplingParams fields (`"max_tokens"`,
`"temperature"`, `"seed"`, ...) that override the command-line flags for that line.
"""

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, TextIO

from llmserve.engine.engine import Engine
from llmserve.errors import LLMServeError
from llmserve.llm import LLM
from llmserve.outputs import OutputAccumulator, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

# what an input line may set (how outputs are reported is not the line's business)
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"output_kind"}
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_REPL_EXIT = "/exit"
_REPL_RESET = "/reset"


@dataclass(frozen=True)
class BatchItem:
    """One input line, validated: its prompt (one of three forms) and sampling params."""

    line_no: int
    kind: str  # one of PROMPT_KEYS
    value: Any
    params: SamplingParams
    id: Any = None


# ---- streaming ---------------------------------------------------------------------------


def stream_completion(
    engine: Engine, prompt: str | dict[str, Any], params: SamplingParams, out: TextIO
) -> RequestOutput:
    """Run one request alone, writing each new piece of its text (of choice 0) to `out` as
    it comes; returns the full output."""
    params = replace(params, output_kind=RequestOutputKind.DELTA)
    request_id = engine.add_request(prompt, params)
    accumulated = OutputAccumulator()
    try:
        while True:
            for delta in engine.step():
                if delta.request_id != request_id:
                    continue
                accumulated.add(delta)
                # newly visible text only: a held-back stop-string prefix is never shown
                text = "".join(c.text for c in delta.outputs if c.index == 0)
                if text:
                    out.write(text)
                    out.flush()
                if delta.finished:
                    return accumulated.build()
    except BaseException:
        engine.abort_request(request_id)
        raise


def chat_prompt(llm: LLM, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The rendered chat prompt and its token ids (no BOS added: the template writes it),
    with the images of its image parts on a vision-language model."""
    images = llm.engine.input_processor.images
    if images is None:
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return text, {"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}
    text, inputs = images.render_chat(llm.tokenizer, messages, add_generation_prompt=True)
    ids, placed = images.encode(llm.tokenizer, text, inputs)
    return text, {"prompt_token_ids": ids, "multi_modal_data": {"image": placed}}


def generate_one(llm: LLM, prompt: str, params: SamplingParams, use_chat: bool) -> None:
    """`generate --prompt`: stream the completion to stdout."""
    engine_prompt: str | dict[str, Any] = prompt
    if use_chat:
        _, engine_prompt = chat_prompt(llm, [{"role": "user", "content": prompt}])
    stream_completion(llm.engine, engine_prompt, params, sys.stdout)
    sys.stdout.write("\n")


# ---- batch JSONL -------------------------------------------------------------------------


def read_batch(path: Path, base: dict[str, Any]) -> list[BatchItem]:
    """Parse and validate every line of `path` before any model is loaded."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LLMServeError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise LLMServeError(f"{path} is not UTF-8 text") from None
    items = []
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            try:
                items.append(_parse_line(line, line_no, base))
            except ValueError as e:
                raise LLMServeError(f"{path} line {line_no}: {e}") from None
    if not items:
        raise LLMServeError(f"{path} holds no prompts")
    return items


def _parse_line(line: str, line_no: int, base: dict[str, Any]) -> BatchItem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError(f"needs exactly one of {', '.join(PROMPT_KEYS)}, got {len(given)}")
    kind = given[0]
    _check_prompt(kind, obj[kind])
    unknown = set(obj) - set(PROMPT_KEYS) - SAMPLING_FIELDS - {"id"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    overrides = {k: v for k, v in obj.items() if k in SAMPLING_FIELDS}
    try:
        params = SamplingParams(**{**base, **overrides})
    except TypeError as e:  # e.g. a string where a number belongs
        raise ValueError(f"bad sampling parameter: {e}") from None
    return BatchItem(line_no, kind, obj[kind], params, obj.get("id"))


def _check_prompt(kind: str, value: Any) -> None:
    if kind == "prompt" and not (isinstance(value, str) and value):
        raise ValueError("'prompt' must be a non-empty string")
    if kind == "prompt_token_ids" and not (
        isinstance(value, list) and value and all(type(t) is int for t in value)
    ):
        raise ValueError("'prompt_token_ids' must be a non-empty list of integers")
    if kind == "messages" and not (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        raise ValueError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")


def generate_batch(
    llm: LLM, items: list[BatchItem], out: TextIO, use_chat: bool, use_tqdm: bool = True
) -> None:
    """Run every item through `LLM.generate` (one continuous batch); write results in order."""
    prompts, texts = [], []
    for item in items:
        try:
            text, prompt = _engine_prompt(llm, item, use_chat)
        except LLMServeError as e:
            raise LLMServeError(f"line {item.line_no}: {e}") from None
        prompts.append(prompt)
        texts.append(text)
    outputs = llm.generate(prompts, [item.params for item in items], use_tqdm=use_tqdm)
    for index, (item, text, output) in enumerate(zip(items, texts, outputs, strict=True)):
        out.write(json.dumps(_result_record(index, item, text, output), ensure_ascii=False))
        out.write("\n")


def _engine_prompt(
    llm: LLM, item: BatchItem, use_chat: bool
) -> tuple[str | None, str | dict[str, Any]]:
    """(the prompt text to report, what the engine gets) for one item."""
    if item.kind == "messages":
        return chat_prompt(llm, item.value)
    if item.kind == "prompt" and use_chat:
        return chat_prompt(llm, [{"role": "user", "content": item.value}])
    if item.kind == "prompt":
        return item.value, item.value
    return None, {"prompt_token_ids": item.value}


def _result_record(
    index: int, item: BatchItem, prompt_text: str | None, output: RequestOutput
) -> dict[str, Any]:
    completion = output.outputs[0]
    record: dict[str, Any] = {} if item.id is None else {"id": item.id}
    record.update(
        index=index,
        prompt=prompt_text,
        text=completion.text,
        token_ids=completion.token_ids,
        finish_reason=completion.finish_reason,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_output_tokens=len(completion.token_ids),
    )
    return record


# ---- chat REPL ---------------------------------------------------------------------------


def chat_repl(
    llm: LLM,
    params: SamplingParams,
    system: str | None,
    read_line: Callable[[str], str] = input,
    images: list | None = None,
) -> None:
    """Talk to the model turn by turn; `/reset` clears the history, `/exit` or EOF ends.
    `images` (PIL images, on a vision-language model) go with the first message.

    Ctrl-C while the model answers stops that answer (it is not kept in the history);
    Ctrl-C at the prompt ends the session.
    """
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"Chatting with {llm.engine.loaded.source.name}; {_REPL_RESET} clears the "
              f"history, {_REPL_EXIT} or Ctrl-D ends.", file=sys.stderr)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        try:
            line = read_line(">>> " if interactive else "").strip()
        except EOFError:
            break
        if line == _REPL_EXIT:
            break
        if line == _REPL_RESET:
            history = list(start)
            continue
        if not line:
            continue
        first = len(history) == len(start)
        content: Any = line
        if images and first:
            content = [*({"type": "image", "image": image} for image in images),
                       {"type": "text", "text": line}]
        history.append({"role": "user", "content": content})
        _, prompt = chat_prompt(llm, history)
        try:
            output = stream_completion(llm.engine, prompt, params, sys.stdout)
        except KeyboardInterrupt:
            history.pop()
            print()
            continue
        print()
        history.append({"role": "assistant", "content": output.outputs[0].text})
