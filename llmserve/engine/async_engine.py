"""AsyncEngine: the engine's step loop in one background thread, streams for asyncio callers.

    event loop (HTTP)                       engine thread (owns the Engine, all model work)
    add_request() -> command queue  ---->   apply commands: add_request / abort_request
    await stream.admitted  <------------    admission result (or RequestRejected)
    async for out in stream  <----------    step() -> outputs, one call_soon_threadsafe a loop

Only the engine thread touches the `Engine`; callers talk to it through a locked command
list and a wake-up event, so the thread sleeps when there is nothing to do. Tokenization and
chat templating run on a small executor (`run_in_executor`), never on the event loop.

Faults and overload:
* a model step that raises fails the requests of that step (`EngineStepError`: a 500, or
  an error event on a stream); the others go on;
* the engine thread itself dying fails every request, makes `is_running` false (`/health`
  503) and calls `on_fatal` (the server then exits non-zero, for a supervisor to restart);
  so does a rank on another host going away (torchrun's ranks: `exits_on_failure`), once
  the requests in flight have their 503;
* `max_num_waiting` caps queued requests (`QueueFull`: 429); `request_timeout` ends a
  request that outlives it (`RequestTimeout`), freeing its KV blocks;
* a stream whose reader falls behind keeps a bounded number of outputs (`request_stream.py`):
  older ones are merged into one, so a slow reader holds its own request's output, no more;
* a structured-output constraint is compiled, and its matchers made ready, on the grammar
  pool before the request reaches the engine thread (one thread, at the lowest CPU
  priority: the engine's threads come first), under `grammar_timeout`; past it, or over the
  parser's budget, the request is refused naming the field (`RequestRejected`: a 400), and
  a client that goes away while it waits cancels the wait. A constraint that fails while
  generating ends its request with `ConstraintFailed` (a 400, or an error event), never
  with text that breaks it.

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
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from llmserve.config.engine import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_NUM_WAITING
from llmserve.cpu_info import set_thread_priority
from llmserve.engine.engine import Engine
from llmserve.engine.input_processor import RequestRejected
from llmserve.engine.request_stream import (
    RequestStream,
    call_soon,
    put_all,
    set_exception,
    set_result,
)
from llmserve.errors import LLMServeError
from llmserve.lora.load_pool import LoadPool
from llmserve.metrics import LOG_INTERVAL_S, EngineMetrics
from llmserve.outputs import PoolingRequestOutput, RequestOutput
from llmserve.pooling_params import PoolingParams
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
    """The engine cannot run any more steps (a tensor-parallel rank died, or the engine
    thread itself): 503."""


class RequestTimeout(LLMServeError):
    """The request outlived the server's request timeout; its KV blocks were freed."""


class ConstraintFailed(LLMServeError):
    """The request's structured-output constraint could not be followed while generating
    (its parser budget spent); the message names the field (`structured_outputs.regex`)."""


ADAPTER_READ_TIMEOUT_S = 30.0  # to read again an adapter dropped from memory
MAX_ADAPTER_READS = 4  # running or queued (429 beyond)


def _lower_priority() -> None:
    """The grammar pool's thread runs on what the engine's threads leave: a constraint
    that takes seconds to compile takes them from idle cores, not from the engine's step."""
    set_thread_priority(threading.get_native_id(), "low")


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
    lora_request: Any = None
    grammars: list | None = None


class AsyncEngine:
    """Runs `engine` in a background thread; `generate()` streams a request's outputs.

    `max_num_waiting` caps the requests admitted but not yet running: beyond it `QueueFull`
    is raised at once (the server answers 429); None: no cap. `request_timeout` (seconds
    from arrival; None: none) ends requests that outlive it. `on_fatal` is called (from the
    engine thread) if that thread dies. Call `start()` once, `shutdown()` at the end.
    """

    def __init__(self, engine: Engine, max_num_waiting: int | None = DEFAULT_MAX_NUM_WAITING,
                 metrics: EngineMetrics | None = None, request_timeout: float | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S) -> None:
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {max_num_waiting}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if grammar_timeout <= 0:
            raise ValueError(f"grammar_timeout must be > 0 seconds, got {grammar_timeout}")
        self.engine = engine
        self.request_timeout = request_timeout
        self.grammar_timeout = grammar_timeout
        self.on_fatal = on_fatal
        self.fatal: BaseException | None = None  # what killed the engine thread, if it died
        self.tokenizer = engine.tokenizer
        # how prompts take images (a vision-language model), None: a text model
        self.image_prompts = engine.input_processor.images
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
        # set by the engine thread when it holds no request, has no command pending and has
        # published its state (metrics, KV usage) after the last one; cleared by any command
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="llmserve-tokenize")
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="llmserve-grammar-compile",
                                                initializer=_lower_priority)
        self._num_compiling = 0  # constraints queued or compiling on the grammar pool
        self._adapter_pool = LoadPool(1, MAX_ADAPTER_READS)
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
        kv_transfer: Any = None, lora_request: Any = None,
    ) -> RequestStream:
        """Submit a request; returns its stream once the engine admitted it.
        `kv_transfer`: see `Engine.add_request` (disaggregated prefill/decode).

        Raises `QueueFull`, `EngineShutdown`, or the engine's `RequestRejected`/`ValueError`.
        """
        loop = asyncio.get_running_loop()
        grammars = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammars = await self._prepare_grammars(params)
        if lora_request is not None:
            await self._read_adapter(lora_request)
        deltas, kind = params, RequestOutputKind.DELTA  # a pooling request: one output
        if isinstance(params, SamplingParams):
            kind = params.output_kind
            if kind is not RequestOutputKind.DELTA:
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
            deadline = None
            if self.request_timeout is not None:
                deadline = time.monotonic() + self.request_timeout
            stream = RequestStream(request_id, loop, self, kind, deadline)
            self._adds.append(_Add(request_id, prompt, deltas, arrival_time or time.time(),
                                   priority, cache_salt, stream, kv_transfer, lora_request,
                                   grammars))
            self._idle.clear()
        self._wakeup.set()
        try:
            await stream.admitted
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def _prepare_grammars(self, params: SamplingParams) -> list:
        """The request's grammar matchers (one per sequence), made ready on the grammar
        pool within `grammar_timeout`; `RequestRejected` naming the field if the
        constraint is invalid, over the parser's budget, or slower than that. Cancelling
        (the client went away) drops a job not yet started; one already compiling runs to
        its end (the parser's budget bounds it) and is discarded."""
        constraint = params.structured_outputs
        with self._lock:
            if self.max_num_waiting is not None and self._num_compiling >= self.max_num_waiting:
                raise QueueFull(f"too many constraints waiting to compile "
                                f"({self._num_compiling}); retry later")
            self._num_compiling += 1
        job = self._grammar_pool.submit(self.engine.structured.prepare, constraint,
                                        max(params.n, params.best_of or 1))
        job.add_done_callback(self._compiled)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.grammar_timeout)
        except TimeoutError:
            job.cancel()
            raise RequestRejected(
                f"structured_outputs.{constraint.kind} took longer than "
                f"{self.grammar_timeout:g} s to compile (the server's grammar budget); "
                "simplify the constraint") from None
        except ValueError as e:
            raise RequestRejected(str(e)) from None

    async def _read_adapter(self, lora_request: Any) -> None:
        """An adapter dropped from memory (past `max_cpu_loras`) is read again on the
        adapter pool, within ADAPTER_READ_TIMEOUT_S, and offered to the engine: the engine
        thread never reads one from disk (a slow or hung filesystem would stall every
        request). An adapter that cannot be read is left for the engine to refuse."""
        lora = self.engine.lora
        if lora is None or lora.holds(lora_request):
            return
        job = self._adapter_pool.submit(lora.read, lora_request)
        if job is None:
            raise QueueFull("too many LoRA adapters being read; retry later")
        try:
            adapter = await asyncio.wait_for(asyncio.wrap_future(job),
                                             ADAPTER_READ_TIMEOUT_S)
        except TimeoutError:
            raise RequestRejected(f"LoRA adapter {lora_request.lora_name!r} could not be read "
                                  f"within {ADAPTER_READ_TIMEOUT_S:g} s") from None
        except Exception:  # noqa: BLE001 - the engine names the problem as it refuses it
            return
        lora.offer(adapter)

    def _compiled(self, _job: Any) -> None:
        with self._lock:
            self._num_compiling -= 1

    async def generate(self, prompt: Any, params: SamplingParams,
                       **options: Any) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing or cancelling the iterator aborts the request."""
        stream = await self.add_request(prompt, params, **options)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def encode(self, prompt: Any, params: PoolingParams,
                     **options: Any) -> PoolingRequestOutput:
        """A pooling request's output (the pooling runner); cancelling aborts it."""
        async for output in self.generate(prompt, params, **options):
            if isinstance(output, PoolingRequestOutput):
                return output
            break  # aborted (a request timeout, a shutdown): a generation-shaped output
        raise EngineShutdown("the pooling request ended without its output")

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV blocks are freed at the engine's next turn."""
        with self._lock:
            self._aborts.append(request_id)
            self._idle.clear()
        self._wakeup.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the engine thread holds no request, has applied every add and abort
        sent before, and has published its state after the last one; False on timeout.
        (Tests and drains wait on this rather than sleep.)"""
        return self._idle.wait(timeout)

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
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()  # the other tensor-parallel ranks

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._adds or self._streams)

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever it was, nobody must hang
            self.fatal = e
            logger.critical("the engine thread died; failing every request", exc_info=e)
            with self._lock:
                self._accepting = False
            self._fail_all(EngineUnavailable(f"the engine stopped: {type(e).__name__}: {e}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        self._fail_all(EngineShutdown("the server shut down before the request finished"))

    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._wakeup.clear()
            if self._apply_commands():
                return
            if self.request_timeout is not None:
                self._expire()
            if not engine.has_unfinished_requests():
                self._update_state()
                with self._lock:
                    if not (self._adds or self._aborts):
                        self._idle.set()
                self._wakeup.wait(timeout=LOG_INTERVAL_S)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step must not take the server down
                self._step_failed(e)
                continue
            self._deliver(outputs)
            self._update_state()

    def _step_failed(self, error: Exception) -> None:
        """Fail the requests of the step that raised; the others go on. If the engine can
        step no more (a tensor-parallel rank died) or the step had no request (a fault
        outside any one request), every request in flight fails."""
        engine = self.engine
        if engine.executor is not None:  # a failed collective breaks the group
            engine.executor.step_failed(error)
        if engine.failure is not None:  # nor can it step again: fail fast, 503
            logger.error("engine unavailable (%s); failing the requests in flight",
                         engine.failure)
            self._fail_all(EngineUnavailable(f"the engine is unavailable: {engine.failure}"))
            if engine.executor.exits_on_failure:  # ranks on other hosts: the server exits
                self.fatal = RuntimeError(engine.failure)
                if self.on_fatal is not None:
                    self.on_fatal(self.fatal)
            return
        failed = engine.callers_of(engine.step_request_ids) & self._streams.keys()
        logger.exception("model step failed; failing its %d request(s)", len(failed),
                         exc_info=error)
        message = EngineStepError(f"the model step failed: {type(error).__name__}: {error}")
        if failed:
            self._fail(failed, message)
        else:
            self._fail_all(message)
        self._update_state()

    def _expire(self) -> None:
        """End the requests past their deadline, freeing their blocks."""
        now = time.monotonic()
        expired = {rid for rid, stream in self._streams.items()
                   if stream.deadline is not None and stream.deadline <= now}
        if expired:
            self._fail(expired, RequestTimeout(
                f"the request ran past the server's request timeout "
                f"({self.request_timeout:g} s, --request-timeout) and was stopped"))

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
                                    add.arrival_time, add.cache_salt, add.kv_transfer,
                                    add.lora_request, add.grammars)
        except Exception as e:
            add.stream.loop.call_soon_threadsafe(set_exception, add.stream.admitted, e)
            return
        self._streams[add.request_id] = add.stream
        with self._lock:
            self._num_waiting += 1
        add.stream.loop.call_soon_threadsafe(set_result, add.stream.admitted, None)

    def _deliver(self, outputs: list[Any]) -> None:
        """Hand outputs to their streams: one thread-safe call per event loop per step.

        Metrics are recorded first, so a client that has its answer finds it counted.
        """
        failures = self.engine.output_processor.failures
        if failures:
            outputs = [out for out in outputs if out.request_id not in failures]
            for request_id, message in failures.items():
                if request_id in self._streams:
                    self._fail({request_id}, ConstraintFailed(message))
        self.metrics.observe(outputs)
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop[stream.loop].append((stream, output))
        for loop, items in by_loop.items():
            call_soon(loop, put_all, items)

    def _fail_all(self, error: Exception) -> None:
        self._fail(set(self._streams), error)

    def _fail(self, request_ids: set[str], error: Exception) -> None:
        """Abort these requests (their blocks are freed) and end their streams with `error`."""
        for request_id in request_ids:
            stream = self._streams.pop(request_id)
            try:
                final = self.engine.abort_request(request_id)
                self.metrics.observe([final] if final is not None else [])
            except Exception:
                logger.exception("aborting %s failed", request_id)
            call_soon(stream.loop, put_all, [(stream, error)])

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
        tier = self.engine.kv_tier
        if tier is not None:
            self.metrics.update_tier(tier.name, kv.num_tier_hits,
                                     kv.num_tier_queries - kv.num_tier_hits,
                                     kv.num_tier_hit_tokens, tier.stats)
