"""Prompting, streaming and checking helpers shared by the structured-output tests."""

import json
from dataclasses import dataclass, replace

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from llmserve.engine.engine import Engine
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.tokenizer import Tokenizer


def chat_prompt(tokenizer: Tokenizer, text: str) -> dict:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    return {"prompt_token_ids": ids}


@dataclass
class Streamed:
    """One request's deltas, joined."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_deltas: int


def stream(engine: Engine, prompts: list, params: list[SamplingParams]) -> list[Streamed]:
    """Run a batch with `output_kind=DELTA`, stepping the engine by hand as a server does,
    and join each request's deltas."""
    request_ids = [engine.add_request(p, replace(sp, output_kind=RequestOutputKind.DELTA))
                   for p, sp in zip(prompts, params, strict=True)]
    joined = {rid: Streamed("", [], None, 0) for rid in request_ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            (delta,) = output.outputs
            got = joined[output.request_id]
            got.text += delta.text
            got.token_ids += delta.token_ids
            got.num_deltas += 1
            if output.finished:
                got.finish_reason = delta.finish_reason
    return [joined[rid] for rid in request_ids]


def json_violation(validator: Draft202012Validator, text: str) -> str | None:
    """Why `text` is not a JSON document `validator` accepts; None if it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e})"
    error = best_match(validator.iter_errors(value))
    return None if error is None else f"{error.message} at {list(error.absolute_path)}"
