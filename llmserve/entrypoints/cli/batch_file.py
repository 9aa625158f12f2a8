"""`llmserve run-batch`: an OpenAI Batch input file run offline through the server's handlers.

Input, one request a line (OpenAI's batch format; blank lines are skipped):

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per input line, in input order:

    {"id": "batch_req_<hex>", "custom_id": "a", "error": null,
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}}

`body` is what the server answers the same request: the server's own handlers
(`OpenAIServingChat`, `OpenAIServingCompletion`) build it, called in-process on an
`AsyncEngine`, every line in flight at once up to `max_concurrency` (one continuous batch).
A request the server refuses gets the server's status and error body in `response`; a line
that is not a request (not a JSON object, no custom_id, a custom_id used before) gets
`"response": null, "error": {"code", "message"}`.

Resuming: a line whose custom_id has a result in the output file already (any but a 5xx or a
line-level error) is not run again; new results are appended as they come (a crash loses
none), then the file is rewritten in input order.
"""

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel
from tqdm.auto import tqdm

from llmserve.engine.async_engine import AsyncEngine
from llmserve.entrypoints.openai.http_layer import exception_error
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    random_id,
)
from llmserve.entrypoints.openai.serving_base import OpenAIServing
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.errors import LLMServeError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
Record = dict[str, Any]


@dataclass(frozen=True)
class BatchLine:
    """One input line: a request, or (`error` set) why it is not one."""

    index: int  # position among the input's non-blank lines
    custom_id: str | None
    method: Any = None
    url: Any = None
    body: Any = None
    error: dict[str, str] | None = None  # {"code", "message"}


@dataclass
class BatchSummary:
    """A run's counts: of the lines it ran (`run_lines`), or of the whole output
    (`run_batch_file`); tokens and time are always this run's."""

    num_ok: int = 0  # status 200
    num_errors: int = 0  # anything else
    num_skipped: int = 0  # had a result in the output file already
    num_output_tokens: int = 0
    elapsed_s: float = 0.0

    def line(self) -> str:
        rate = self.num_output_tokens / max(self.elapsed_s, 1e-9)
        skipped = f" ({self.num_skipped} from an earlier run)" if self.num_skipped else ""
        return (f"{self.num_ok} ok, {self.num_errors} errors{skipped}; "
                f"{self.num_output_tokens} output tokens in {self.elapsed_s:.1f} s "
                f"({rate:.1f} tok/s)")


# ---- reading ------------------------------------------------------------------------------


def read_batch_lines(path: Path) -> list[BatchLine]:
    """Every non-blank line of `path`; the second line with a custom_id is an error."""
    try:
        texts = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    except OSError as e:
        raise LLMServeError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise LLMServeError(f"{path} is not UTF-8 text") from None
    seen: set[str] = set()
    return [parse_line(i, text, seen) for i, text in enumerate(texts)]


def parse_line(index: int, text: str, seen: set[str]) -> BatchLine:
    """One line, its custom_id added to `seen`; a malformed line gets `error`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(index, None, error=_error("invalid_json", f"line {index + 1} is not "
                                                   f"valid JSON ({e.msg} at column {e.colno})"))
    if not isinstance(obj, dict):
        return BatchLine(index, None, error=_error(
            "invalid_request", f"line {index + 1} is not a JSON object"))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(index, None, error=_error(
            "missing_custom_id", f"line {index + 1} has no custom_id (a non-empty string)"))
    if custom_id in seen:
        return BatchLine(index, custom_id, error=_error(
            "duplicate_custom_id", f"line {index + 1}: custom_id {custom_id!r} is used by an "
            "earlier line"))
    seen.add(custom_id)
    return BatchLine(index, custom_id, obj.get("method"), obj.get("url"), obj.get("body"))


def read_done(path: Path) -> dict[str, Record]:
    """Results in an earlier output file worth keeping, by custom_id (the last one wins);
    unreadable lines (a crash's cut-off last line) are ignored."""
    if not path.exists():
        return {}
    done = {}
    for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and _worth_keeping(record):
            done[record["custom_id"]] = record
    return done


def _worth_keeping(record: Record) -> bool:
    """A response from the handlers that running again would not change: not a 5xx (the
    engine failed), not a line-level error (judged again, for free)."""
    response = record.get("response")
    return (isinstance(record.get("custom_id"), str) and isinstance(response, dict)
            and isinstance(response.get("status_code"), int) and response["status_code"] < 500)


# ---- running ------------------------------------------------------------------------------


class BatchHandlers:
    """The server's handlers for the batch URLs, on one engine and served model name."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.routes: dict[str, tuple[type[BaseModel], OpenAIServing]] = {
            CHAT_URL: (ChatCompletionRequest, OpenAIServingChat(engine, model_name)),
            COMPLETIONS_URL: (CompletionRequest, OpenAIServingCompletion(engine, model_name)),
        }

    async def run(self, line: BatchLine) -> Record:
        """The output record of a request line (the server's errors included; raises only
        when cancelled)."""
        try:
            body = await self._respond(line)
        except Exception as e:  # the server's error handlers see the same exceptions
            status, body = exception_error(e)
            return _record(line.custom_id, _response(status, random_id("req"), body))
        return _record(line.custom_id, _response(200, body["id"], body))

    async def _respond(self, line: BatchLine) -> dict[str, Any]:
        if line.method != "POST":
            raise BadRequest(f"method {line.method!r} is not supported; batch requests are "
                             "POST", param="method", code="invalid_method")
        if line.url not in self.routes:
            raise BadRequest(f"url {line.url!r} is not supported; use one of "
                             f"{', '.join(self.routes)}", param="url", code="invalid_url")
        model, handler = self.routes[line.url]
        request = model.model_validate(line.body)
        if request.stream:
            raise BadRequest("stream is not supported in a batch", param="stream")
        return await handler.create(request, time.time())


async def run_lines(
    engine: AsyncEngine | None, model_name: str, lines: list[BatchLine],
    on_result: Callable[[BatchLine, Record], None], max_concurrency: int = 64,
    use_tqdm: bool = True,
) -> BatchSummary:
    """Run the request `lines` (no `error`) through the handlers, at most `max_concurrency`
    at a time, calling `on_result` as each finishes (in completion order). Starts and shuts
    down `engine` (None: there are no lines)."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    if engine is None:
        return BatchSummary()
    handlers = BatchHandlers(engine, model_name)
    summary = BatchSummary()
    bar = tqdm(total=len(lines), desc="Processed requests", unit="req", dynamic_ncols=True,
               disable=not use_tqdm)
    pending = iter(lines)  # shared by the workers; next() never awaits, so no races
    start = time.perf_counter()

    async def worker() -> None:
        for line in pending:
            record = await handlers.run(line)
            on_result(line, record)
            _count(summary, record)
            summary.elapsed_s = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix_str(f"output {summary.num_output_tokens / summary.elapsed_s:.1f} "
                                "tok/s", refresh=False)

    engine.start()
    try:
        await asyncio.gather(*(worker() for _ in range(min(max_concurrency, len(lines)))))
    finally:
        bar.close()
        await engine.shutdown(0.0)  # nothing is left in flight but after an error
    summary.elapsed_s = time.perf_counter() - start
    return summary


def _count(summary: BatchSummary, record: Record) -> None:
    if _is_ok(record):
        summary.num_ok += 1
        summary.num_output_tokens += record["response"]["body"]["usage"]["completion_tokens"]
    else:
        summary.num_errors += 1


def _is_ok(record: Record) -> bool:
    return record["response"] is not None and record["response"]["status_code"] == 200


def run_batch_file(
    make_engine: Callable[[], AsyncEngine], model_name: str, lines: list[BatchLine],
    out: Path | TextIO, max_concurrency: int = 64, use_tqdm: bool = True,
) -> BatchSummary:
    """Run a batch file's `lines` into `out`: a path (resumed if it holds results, written
    whole and in order at the end) or a stream (results in order as they are ready).
    `make_engine` is called (the model loaded) only if some line is left to run."""
    done = read_done(out) if isinstance(out, Path) else {}
    # line-level errors need no engine: they are judged again, here
    results: list[Record | None] = [
        _record(line.custom_id, None, line.error) if line.error is not None
        else done.get(line.custom_id) for line in lines]
    todo = [line for line, result in zip(lines, results, strict=True) if result is None]
    engine = make_engine() if todo else None
    if isinstance(out, Path):
        summary = _run_into_file(engine, model_name, todo, results, out, max_concurrency,
                                 use_tqdm)
    else:
        summary = _run_into_stream(engine, model_name, todo, results, out, max_concurrency,
                                   use_tqdm)
    summary.num_skipped = sum(line.error is None for line in lines) - len(todo)
    summary.num_ok = sum(_is_ok(record) for record in results)
    summary.num_errors = len(results) - summary.num_ok
    return summary


def _run_into_file(engine: AsyncEngine | None, model_name: str, todo: list[BatchLine],
                   results: list[Record | None], path: Path, max_concurrency: int,
                   use_tqdm: bool) -> BatchSummary:
    try:
        with path.open("a+", encoding="utf-8") as journal:
            if journal.tell() > 0:  # a crash may have cut the last line short
                journal.seek(journal.tell() - 1)
                if journal.read(1) != "\n":
                    journal.write("\n")

            def on_result(line: BatchLine, record: Record) -> None:
                results[line.index] = record
                journal.write(_json_line(record))
                journal.flush()

            summary = asyncio.run(run_lines(engine, model_name, todo, on_result,
                                            max_concurrency, use_tqdm))
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with temp.open("w", encoding="utf-8") as f:
            f.writelines(_json_line(record) for record in results)
        os.replace(temp, path)
    except OSError as e:
        raise LLMServeError(f"cannot write {path}: {e.strerror or e}") from None
    return summary


def _run_into_stream(engine: AsyncEngine | None, model_name: str, todo: list[BatchLine],
                     results: list[Record | None], out: TextIO, max_concurrency: int,
                     use_tqdm: bool) -> BatchSummary:
    written = 0  # results[:written] are out

    def write_ready() -> None:
        nonlocal written
        while written < len(results) and results[written] is not None:
            out.write(_json_line(results[written]))
            written += 1
        out.flush()

    def on_result(line: BatchLine, record: Record) -> None:
        results[line.index] = record
        write_ready()

    write_ready()  # the line-level errors before the first request
    return asyncio.run(run_lines(engine, model_name, todo, on_result, max_concurrency,
                                 use_tqdm))


# ---- records ------------------------------------------------------------------------------


def _record(custom_id: str | None, response: Record | None,
            error: dict[str, str] | None = None) -> Record:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


def _response(status: int, request_id: str, body: dict[str, Any]) -> Record:
    return {"status_code": status, "request_id": request_id, "body": body}


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def _json_line(record: Record | None) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"

