"""One request's stream of outputs, delivered on the event loop that submitted it."""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmserve.outputs import OutputAccumulator, RequestOutput
from llmserve.sampling_params import RequestOutputKind

MAX_PENDING_OUTPUTS = 64  # unread outputs a stream keeps before merging them


@dataclass
class RequestStream:
    """The outputs of one request, delivered on the event loop that submitted it.

    Iterate it with `async for`; leaving the loop early (or cancelling the task) must be
    followed by `abort()` — `AsyncEngine.generate()` does this for you. The outputs are of
    the request's `output_kind`: deltas as they come, snapshots, or only the final one.
    """

    request_id: str
    loop: asyncio.AbstractEventLoop
    engine: Any  # the AsyncEngine that runs it (`abort`)
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    deadline: float | None = None  # time.monotonic() past which it is timed out
    admitted: asyncio.Future = field(init=False)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    num_merged: int = 0  # outputs merged because the reader fell behind
    _accumulated: OutputAccumulator = field(default_factory=OutputAccumulator)

    def __post_init__(self) -> None:
        self.admitted = self.loop.create_future()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            if self.output_kind is RequestOutputKind.DELTA:
                return item
            self._accumulated.add(item)
            if self.output_kind is RequestOutputKind.CUMULATIVE or item.finished:
                return self._accumulated.build()
        raise StopAsyncIteration

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def put(self, item: Any) -> None:
        """Queue an output (or the error that ends the stream); on the stream's loop.

        Past `MAX_PENDING_OUTPUTS` unread deltas, they are merged with the new one into a
        single delta (the same tokens, text and logprobs), so a reader that falls behind
        costs its request's own output at most, never an unbounded queue."""
        if isinstance(item, RequestOutput) and self.queue.qsize() >= MAX_PENDING_OUTPUTS:
            merged = OutputAccumulator()
            while not self.queue.empty():
                merged.add(self.queue.get_nowait())  # only outputs: an error ends the stream
            merged.add(item)
            item = merged.build()
            self.num_merged += 1
        self.queue.put_nowait(item)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)


def set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
