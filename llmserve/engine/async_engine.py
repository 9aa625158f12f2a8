"""AsyncEngine: the engine's step loop in one background thread, streams for asyncio callers.

    event loop (HTTP)                       engine thread (owns the Engine, all model work)
    add_request() -> command queue  ---->   apply commands: add_request / abort_request
    await stream.admitted  <------------    admission result (or RequestRejected)
    async for out in stream  <----------    step() -> outputs, one call_soon_threadsafe a loop

Only the engine thread touches the `Engine`; callers talk to it through a locked command
list and a wake-up event, so the thread sleeps when there is nothing to do. Tokenization and
chat templating run on a small executor (`run_in_executor`), never on the event loop.

The engine always reports deltas (`RequestOutputKind.DELTA`): the engine thread does no
per-step copying, the metrics see each step's new tokens, and a stream whose caller asked
for FINAL_ONLY or CUMULATIVE outputs sums the deltas on its own event loop.
"""

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from llmserve.engine.engine import Engine
from llmserve.errors import LLMServeError
from llmserve.metrics import LOG_INTERVAL_S, EngineMetrics
from llmserve.outputs import OutputAccumulator, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFull(LLMServeError):
    """Too many requests are waiting; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineShutdown(LLMServeError):
    """The engine is shutting down (or stopped) and admits no new requests."""


class EngineStepError(LLMServeError):
    """A model step failed; the requests it held were aborted."""


class EngineUnavailable(EngineShutdown):
    """The engine cannot run any more steps (a tensor-parallel rank died): 503."""


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None
    stream: "RequestStream"
    kv_transfer: Any = None


@dataclass
class RequestStream:
    """The outputs of one request, delivered on the event loop that submitted it.

    Iterate it with `async for`; leaving the loop early (or cancelling the task) must be
    followed by `abort()` — `AsyncEngine.generate()` does this for you. The outputs are of
    the request's `output_kind`: deltas as they come, snapshots, or only the final one.
    """

    request_id: str
    loop: asyncio.AbstractEventLoop
    engine: "AsyncEngine"
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    admitted: asyncio.Future = field(init=False)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
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


class AsyncEngine:
    """Runs `engine` in a background thread; `generate()` streams a request's outputs.

    `max_num_waiting` caps the requests admitted but not yet running: beyond it `QueueFull`
    is raised at once (the server answers 429). Call `start()` once, `shutdown()` at the end.
    """

    def __init__(self, engine: Engine, max_num_waiting: int | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {max_num_waiting}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_num_waiting = max_num_waiting
        self.metrics = metrics or EngineMetrics()
        self.metrics.set_role(engine.config.kv_role)
        self._lock = threading.Lock()  # guards every field below up to _streams
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._num_waiting = 0  # scheduler's waiting queue, as of the engine's last turn
        self._accepting = True
        self._stop = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._wakeup = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="llmserve-tokenize")
        self._next_id = 0

    # ---- the caller's side (event loop) -----------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._accepting and self.engine.failure is None

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenization-sized work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None,
        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
        kv_transfer: Any = None,
    ) -> RequestStream:
        """Submit a request; returns its stream once the engine admitted it.
        `kv_transfer`: see `Engine.add_request` (disaggregated prefill/decode).

        Raises `QueueFull`, `EngineShutdown`, or the engine's `RequestRejected`/`ValueError`.
        """
        loop = asyncio.get_running_loop()
        deltas = params
        if params.output_kind is not RequestOutputKind.DELTA:
            deltas = replace(params, output_kind=RequestOutputKind.DELTA)
        with self._lock:
            if self.engine.failure is not None:
                raise EngineUnavailable(f"the engine is unavailable: {self.engine.failure}")
            if not self._accepting or not self._thread.is_alive():
                raise EngineShutdown("the server is shutting down; no new requests")
            num_waiting = self._num_waiting + len(self._adds)
            if self.max_num_waiting is not None and num_waiting >= self.max_num_waiting:
                raise QueueFull(f"too many requests waiting ({num_waiting}); retry later")
            if request_id is None:
                request_id = f"req-{self._next_id}"
                self._next_id += 1
            stream = RequestStream(request_id, loop, self, params.output_kind)
            self._adds.append(_Add(request_id, prompt, deltas, arrival_time or time.time(),
                                   priority, cache_salt, stream, kv_transfer))
        self._wakeup.set()
        try:
            await stream.admitted
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def generate(self, prompt: Any, params: SamplingParams,
                       **options: Any) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing or cancelling the iterator aborts the request."""
        stream = await self.add_request(prompt, params, **options)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV blocks are freed at the engine's next turn."""
        with self._lock:
            self._aborts.append(request_id)
        self._wakeup.set()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `timeout` s, abort the rest."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline and self._busy():
            await asyncio.sleep(0.05)
        with self._lock:
            self._stop = True
        self._wakeup.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._executor.shutdown(wait=False)
        self.engine.shutdown()  # the other tensor-parallel ranks

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._adds or self._streams)

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            self._wakeup.clear()
            if self._apply_commands():
                break
            if not engine.has_unfinished_requests():
                self._update_state()
                self._wakeup.wait(timeout=LOG_INTERVAL_S)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step must not take the server down
                if engine.executor is not None:  # a failed collective breaks the group
                    engine.executor.step_failed(e)
                if engine.failure is not None:  # nor can it step again: fail fast, 503
                    logger.error("engine unavailable (%s); failing the requests in flight",
                                 engine.failure)
                    self._fail_all(EngineUnavailable(
                        f"the engine is unavailable: {engine.failure}"))
                    continue
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(EngineStepError(f"the model step failed: {e}"))
                continue
            self._deliver(outputs)
            self._update_state()
        self._fail_all(EngineShutdown("the server shut down before the request finished"))

    def _apply_commands(self) -> bool:
        """Admit and abort as asked; returns True when the thread should stop."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            stop = self._stop
        for add in adds:
            self._admit(add)
        aborted = [self.engine.abort_request(rid) for rid in aborts
                   if self._streams.pop(rid, None) is not None]
        self.metrics.observe([out for out in aborted if out is not None])
        if aborted:
            self._update_state()
        return stop

    def _admit(self, add: _Add) -> None:
        try:
            self.engine.add_request(add.prompt, add.params, add.request_id, add.priority,
                                    add.arrival_time, add.cache_salt, add.kv_transfer)
        except Exception as e:
            add.stream.loop.call_soon_threadsafe(_set_exception, add.stream.admitted, e)
            return
        self._streams[add.request_id] = add.stream
        with self._lock:
            self._num_waiting += 1
        add.stream.loop.call_soon_threadsafe(_set_result, add.stream.admitted, None)

    def _deliver(self, outputs: list[Any]) -> None:
        """Hand outputs to their streams: one thread-safe call per event loop per step.

        Metrics are recorded first, so a client that has its answer finds it counted.
        """
        self.metrics.observe(outputs)
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop[stream.loop].append((stream.queue, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                final = self.engine.abort_request(request_id)
                self.metrics.observe([final] if final is not None else [])
            except Exception:
                logger.exception("aborting %s failed", request_id)
            _call_soon(stream.loop, _put_all, [(stream.queue, error)])

    def _update_state(self) -> None:
        scheduler, kv = self.engine.scheduler, self.engine.kv_manager
        with self._lock:
            self._num_waiting = scheduler.num_waiting
        speculator = self.engine.speculator
        self.metrics.update_state(scheduler.num_running, scheduler.num_waiting, kv.usage,
                                  scheduler.num_preemptions, kv.num_queries, kv.num_hits,
                                  speculator.stats if speculator is not None else None)
        self.metrics.update_prefill(self.engine.num_prefill_computed_tokens,
                                    self.engine.kv_transfer_stats)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
