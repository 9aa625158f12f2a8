"""Adapter reads off the engine thread and the tokenizer's pool, on daemon threads of their
own, a bounded number at once."""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class LoadPool:
    """Adapter reads on `threads` threads of their own, `capacity` reads running or queued
    at most. Daemon threads (ThreadPoolExecutor's are joined at exit): a read stuck on a
    hung filesystem must not keep the server from exiting."""

    def __init__(self, threads: int, capacity: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(capacity)
        for i in range(threads):
            threading.Thread(target=self._work, name=f"llmserve-lora-load-{i}",
                             daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """`fn(*args)`'s future; None when `capacity` reads are running or queued. A slot
        is freed when its read ends (or is cancelled while queued), not when its waiter
        gives up: stuck reads keep counting."""
        if not self._slots.acquire(blocking=False):
            return None
        future: Future = Future()
        future.add_done_callback(lambda _: self._slots.release())
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as e:
                    future.set_exception(e)
