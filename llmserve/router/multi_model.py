"""`llmserve serve --models-dir DIR`: many models behind one endpoint, each in an engine
process of its own, loaded on the first request that names it and unloaded when idle or to
make room.

Every model of `model_files.find_models` is listed (/v1/models, /models, Ollama's
/api/tags). A request for one that is not loaded starts its engine (`llmserve serve` on
that model, on 127.0.0.1 and a free port, the user's other flags kept) and waits until it
serves; requests for a model being loaded wait for the same start. Loads run one at a time.
Before one, loaded models are unloaded, least recently used first, while more than
`--max-loaded-models` would be loaded or the loaded models' memory (each process's resident set,
measured; before a first load, an estimate from the files) and the new one's would pass
`--max-loaded-memory`. A pinned model (`--pin`) is never unloaded, and a model with
requests in flight is not stopped under them: where every candidate is busy, the least
recently used one takes no new requests (they wait, and load it again) and is unloaded once
its requests are done (up to `CAPACITY_WAIT_S`, then 503). A model idle for its keep-alive
(`--keep-alive`, or the `keep_alive` of the last Ollama request for it; negative: forever)
is unloaded; `POST /models/unload`, and an Ollama request with `keep_alive: 0`, unload by
hand; `POST /models/load` loads.

Each engine is a process: a crash or an out-of-memory kill takes no other model down (the
health monitor sees it exit; its requests in flight end with a 503, and its next request
starts it again), and an unload returns its memory to the system. Requests pass through
`proxy.forward` unchanged, streams included (event streams and Ollama's NDJSON). The HTTP
app around it is `models_app`.
"""

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmserve.config.engine import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_LOADED_MODELS
from llmserve.entrypoints.openai.protocol import BadRequest
from llmserve.entrypoints.openai.serving_base import unless_client_gone
from llmserve.entrypoints.openai.serving_ollama import (
    LOAD_HEADER,
    created_at,
    keep_alive_seconds,
    model_digest,
    modified_at,
    size_on_disk,
)
from llmserve.router.base import Router, RouterSettings
from llmserve.router.launcher import ReplicaProcess, stop_replicas
from llmserve.router.metrics import ModelMetrics
from llmserve.router.model_files import ModelFile, find_models, lookup
from llmserve.router.proxy import CLIENT_CLOSED_REQUEST, ReplicaFailed, replica_failed_response
from llmserve.router.replicas import Replica

logger = logging.getLogger(__name__)

CAPACITY_WAIT_S = 300.0  # how long a load waits for a busy model to go idle
START_TIMEOUT_S = 900.0  # how long a model's engine may take to start serving
# before a model's first load, its process's memory is guessed as its files' size times
# this, plus what a server process holds without a model (torch, the app)
ESTIMATE_FACTOR = 1.3
ESTIMATE_BASE_BYTES = 700 * 2**20
# POST routes whose body names the model that answers them
MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/embeddings",
                "/classify", "/v1/score", "/score", "/rerank", "/v1/rerank", "/v2/rerank",
                "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show")
# the flags of this mode, which a model's own server does not take
ROUTER_FLAGS = ("--models-dir", "--max-loaded-models", "--max-loaded-memory", "--keep-alive",
                "--pin")
UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"


@dataclass(frozen=True)
class ModelServerSettings:
    """What the many-model server serves and how long it keeps models."""

    models_dir: Path | None
    server_argv: tuple[str, ...]  # `serve` and the user's flags, this mode's taken out
    max_loaded: int = DEFAULT_MAX_LOADED_MODELS
    memory_budget: int | None = None  # bytes
    keep_alive_s: float = field(  # negative: forever
        default_factory=lambda: keep_alive_seconds(DEFAULT_KEEP_ALIVE))
    pinned: tuple[str, ...] = ()
    cache_dir: Path | None = None
    capacity_wait_s: float = CAPACITY_WAIT_S
    reap_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {self.max_loaded}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError("--max-loaded-memory must be positive")
        if self.models_dir is not None and not self.models_dir.is_dir():
            raise ValueError(f"--models-dir: no such folder: {self.models_dir}")
        if len(self.pinned) > self.max_loaded:
            raise ValueError(f"{len(self.pinned)} models pinned (--pin) but at most "
                             f"{self.max_loaded} loaded (--max-loaded-models)")


@dataclass(eq=False)
class Slot:
    """One model on offer and, while loaded, its engine process."""

    model: ModelFile
    state: str = UNLOADED
    pinned: bool = False
    process: ReplicaProcess | None = None
    replica: Replica | None = None
    task: asyncio.Task | None = None  # its load under way
    keep_alive_s: float | None = None  # the last request's; None: the server's default
    last_used: float = 0.0  # monotonic; least recently used is unloaded first
    idle_since: float = 0.0  # monotonic
    resident_bytes: int = 0  # the process's memory, measured once it serves
    draining: bool = False  # chosen to make room: takes no new request, unloads when idle
    waiting: int = 0  # requests waiting for it to load
    loads: int = 0
    started_at: float = 0.0

    @property
    def in_flight(self) -> int:
        return self.replica.in_flight if self.replica is not None else 0

    @property
    def busy(self) -> bool:
        """Requests in flight or waiting for it: not unloaded to make room, nor idle."""
        return self.in_flight > 0 or self.waiting > 0

    @property
    def name(self) -> str:
        return self.model.name


class LoadFailed(BadRequest):
    """A model's engine exited (or never served) while starting: 500 naming why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", status=500)


class ModelRouter(Router):
    """Slots by model name; a request's model is loaded (making room) before it is sent."""

    metrics: ModelMetrics

    def __init__(self, settings: RouterSettings, models: ModelServerSettings) -> None:
        super().__init__([], settings, ModelMetrics())
        self.config = models
        self.slots: dict[str, Slot] = {}
        self._load_lock = asyncio.Lock()
        self._files = ThreadPoolExecutor(1, thread_name_prefix="llmserve-models-files")
        self._digests: dict[str, tuple[tuple, str]] = {}
        self.refresh()
        for name in models.pinned:
            slot = self.find(name)
            slot.pinned = True

    # ---- the models on offer ---------------------------------------------------------

    def refresh(self) -> None:
        """Read the folder and the catalog again: new models get a slot; a model whose
        files are gone keeps its slot while loaded."""
        found = find_models(self.config.models_dir, self.config.cache_dir)
        for name, model in found.items():
            slot = self.slots.get(name)
            if slot is None:
                self.slots[name] = Slot(model)
            elif slot.model != model and slot.state == UNLOADED:
                slot.model = model
        for name in [n for n, s in self.slots.items()
                     if n not in found and s.state == UNLOADED and not s.pinned]:
            del self.slots[name]

    def find(self, name: str) -> Slot:
        """The slot of the model `name` means; the folder is read again for a name not
        known; 404 for none."""
        models = {n: s.model for n, s in self.slots.items()}
        model = lookup(models, name)
        if model is None:
            self.refresh()
            model = lookup({n: s.model for n, s in self.slots.items()}, name)
        if model is None:
            known = ", ".join(sorted(self.slots)) or "none"
            raise BadRequest(f"model '{name}' not found (served: {known})", param="model",
                             status=404, code="model_not_found")
        return self.slots[model.name]

    # ---- loading and unloading -------------------------------------------------------

    async def acquire(self, slot: Slot) -> Replica:
        """The model's server, loading it first if it is not loaded. A request waiting
        here counts as busy for its model, so a model just loaded for it is not unloaded
        for another before it is sent."""
        slot.waiting += 1
        try:
            while True:
                replica = self.ready(slot)
                if replica is not None:
                    return replica
                if slot.state == LOADED and slot.draining:  # being unloaded for another
                    await asyncio.sleep(0.05)  # model: wait, then load it again
                    continue
                if slot.task is None:
                    slot.task = asyncio.create_task(self._load(slot))
                await asyncio.shield(slot.task)
        finally:
            slot.waiting -= 1

    def ready(self, slot: Slot) -> Replica | None:
        """The model's server if it takes requests now (a model whose process exited is
        unloaded here; one alive but failing its health checks is a 503). The caller sends
        with no await in between, so the request counts in flight before anything can
        unload the model."""
        if slot.state != LOADED or slot.draining or slot.replica is None:
            return None
        if not slot.replica.is_up:
            self._reap_exited(slot)
            if slot.state == LOADED:
                raise BadRequest(slot.replica.describe_down(), param="model", status=503)
            return None
        slot.last_used = slot.idle_since = time.monotonic()
        return slot.replica

    async def _load(self, slot: Slot) -> None:
        try:
            async with self._load_lock:
                await self._make_room(slot)
                await self._start(slot)
        finally:
            slot.task = None

    async def _start(self, slot: Slot) -> None:
        slot.state, slot.started_at = LOADING, time.monotonic()
        command = model_command(self.config.server_argv, slot.model)
        logger.info("loading model '%s' (%s)", slot.name, slot.model.path)
        # forked from the event loop's thread: the kernel kills a child whose parent
        # *thread* ends (PR_SET_PDEATHSIG), and this one lasts as long as the server
        process = ReplicaProcess(slot.loads, command, f"model {slot.name}")
        process.start_relay()
        slot.process = process
        try:
            await self._until_serving(process)
        except BaseException:
            slot.state, slot.process = UNLOADED, None
            await asyncio.to_thread(stop_replicas, [process])
            self.metrics.load_failures.labels(slot.name).inc()
            raise
        slot.loads += 1
        slot.replica = Replica(slot.loads, process.url, process=process.process,
                               model=slot.name)
        self.replicas.append(slot.replica)
        slot.state, slot.idle_since = LOADED, time.monotonic()
        slot.resident_bytes = resident_bytes(process.process.pid) or self.estimate(slot)
        seconds = time.monotonic() - slot.started_at
        self.metrics.load_seconds.observe(seconds)
        self.metrics.loads.labels(slot.name).inc()
        logger.info("model '%s' loaded in %.1f s (pid %d, %s resident)", slot.name, seconds,
                    process.process.pid, _gib(slot.resident_bytes))

    async def _until_serving(self, process: ReplicaProcess) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.process.poll() is not None:
                failure = await asyncio.to_thread(process.start_failure)
                raise LoadFailed(f"could not load the model: {failure}")
            if process.url is not None and await self._healthy(process.url):
                return
            if time.monotonic() > deadline:
                raise LoadFailed(f"the model did not start serving within "
                                 f"{START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.1)

    async def _healthy(self, url: str) -> bool:
        try:
            response = await self.client.get(f"{url}/health",
                                              headers=self.settings.auth_headers,
                                              timeout=self.settings.health_timeout_s)
        except Exception:  # noqa: BLE001 - not up yet
            return False
        return response.status_code == 200

    async def _make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until `slot` fits the count and
        the memory budget; wait for a busy one to go idle where none is."""
        deadline = time.monotonic() + self.config.capacity_wait_s
        while True:
            others = [s for s in self.slots.values() if s is not slot and s.state == LOADED]
            if self._fits(slot, others):
                return
            movable = sorted((s for s in others if not s.pinned), key=lambda s: s.last_used)
            idle = [s for s in movable if not s.busy]
            if idle:
                await self._unload(idle[0], "evicted")
                continue
            if not movable:
                if len(others) + 1 > self.config.max_loaded:
                    raise BadRequest(f"cannot load '{slot.name}': the {len(others)} loaded "
                                     "models are pinned (--pin) and --max-loaded-models is "
                                     f"{self.config.max_loaded}", param="model", status=503)
                logger.warning("loading '%s' over --max-loaded-memory: every other loaded "
                               "model is pinned", slot.name)
                return
            # every candidate is busy: the least recently used one takes no new request
            # (those wait to load it again) and is unloaded once its requests are done
            victim = movable[0]
            victim.draining = True
            try:
                while victim.state == LOADED and victim.in_flight > 0:
                    if time.monotonic() > deadline:
                        raise BadRequest(
                            f"cannot load '{slot.name}' now: '{victim.name}' still has "
                            f"{victim.in_flight} requests in flight", param="model",
                            status=503)
                    await asyncio.sleep(0.05)
                await self._unload(victim, "evicted")
            finally:
                victim.draining = False

    def _fits(self, slot: Slot, others: list[Slot]) -> bool:
        if len(others) + 1 > self.config.max_loaded:
            return False
        budget = self.config.memory_budget
        if budget is None or not others:
            return True
        return sum(s.resident_bytes for s in others) + self.estimate(slot) <= budget

    def estimate(self, slot: Slot) -> int:
        """The memory a model's process will hold: as measured at its last load, else a
        guess from its files."""
        if slot.resident_bytes:
            return slot.resident_bytes
        return ESTIMATE_BASE_BYTES + math.ceil(size_on_disk(slot.model.path) * ESTIMATE_FACTOR)

    async def _unload(self, slot: Slot, reason: str) -> None:
        """Stop the model's process (SIGTERM, SIGKILL after a while) and forget it."""
        if slot.state != LOADED:
            return
        slot.state = UNLOADING
        logger.info("unloading model '%s' (%s)", slot.name, reason)
        self._detach(slot)
        process = slot.process
        try:
            if process is not None:
                await asyncio.to_thread(stop_replicas, [process])
        finally:
            slot.state, slot.process = UNLOADED, None
            self.metrics.unloads.labels(slot.name, reason).inc()
            self.metrics.forget(slot.name)

    async def unload(self, slot: Slot, reason: str) -> None:
        """Unload by hand, whatever it has in flight (after a load under way)."""
        async with self._load_lock:
            await self._unload(slot, reason)

    def _detach(self, slot: Slot) -> None:
        if slot.replica is not None:  # down (its requests in flight end), without a warning
            slot.replica.is_up, slot.replica.reason = False, "unloaded"
            slot.replica.down.set()
            with suppress(ValueError):
                self.replicas.remove(slot.replica)
            slot.replica = None

    def _reap_exited(self, slot: Slot) -> None:
        """A loaded model whose process exited (a crash, an out-of-memory kill) is
        unloaded; its next request starts it again."""
        if slot.state != LOADED or slot.process is None:
            return
        code = slot.process.process.poll()
        if code is None:
            return
        logger.warning("model '%s' exited with code %s: it loads again on its next request",
                       slot.name, code)
        self._detach(slot)
        slot.state, slot.process = UNLOADED, None
        self.metrics.unloads.labels(slot.name, "exited").inc()
        self.metrics.forget(slot.name)

    async def _reap(self) -> None:
        """Forever: unload models whose process exited or that were idle for their
        keep-alive; re-measure the loaded ones' memory."""
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            now = time.monotonic()
            for slot in list(self.slots.values()):
                self._reap_exited(slot)
                if slot.state != LOADED or slot.task is not None:
                    continue
                if slot.busy:
                    slot.idle_since = now
                    continue
                if self._expired(slot, now) and not self._load_lock.locked():
                    async with self._load_lock:
                        if self._expired(slot, time.monotonic()):  # still idle
                            await self._unload(slot, "idle")
                elif slot.process is not None:
                    slot.resident_bytes = (resident_bytes(slot.process.process.pid)
                                           or slot.resident_bytes)

    def _expired(self, slot: Slot, now: float) -> bool:
        keep = self.keep_alive(slot)
        return (slot.state == LOADED and not slot.pinned and not slot.busy
                and keep >= 0 and now - slot.idle_since >= keep)

    def keep_alive(self, slot: Slot) -> float:
        return self.config.keep_alive_s if slot.keep_alive_s is None else slot.keep_alive_s

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with super().running():
            reaper = asyncio.create_task(self._reap())
            try:
                for slot in self.slots.values():  # pinned models load before serving
                    if slot.pinned:
                        await self.acquire(slot)
                yield
            finally:
                reaper.cancel()
                with suppress(asyncio.CancelledError):
                    await reaper
                await asyncio.to_thread(stop_replicas, [s.process for s in self.slots.values()
                                                        if s.process is not None])
                self._files.shutdown(wait=False, cancel_futures=True)

    # ---- requests --------------------------------------------------------------------

    async def route(self, request: Request) -> Response:
        """Forward a model request to its model's server, loading the model first."""
        path = request.url.path
        body = await request.body()
        parsed = json_object(body)
        name = parsed.get("model") or (parsed.get("name") if path == "/api/show" else None)
        if not isinstance(name, str) or not name:
            raise BadRequest(f"model is required: one of {', '.join(sorted(self.slots))}",
                             param="model")
        keep = None
        if path.startswith("/api/") and parsed.get("keep_alive") is not None:
            keep = keep_alive_seconds(parsed.pop("keep_alive"))
            body = json.dumps(parsed).encode()
        slot = self.find(name)
        if keep == 0 and _only_loads(path, parsed):
            await self.unload(slot, "request")
            return JSONResponse(_unloaded_answer(path, name))
        replica = self.ready(slot)  # loaded: sent at once
        asked, had_to_wait = time.monotonic(), replica is None
        slot.waiting += 1  # busy until sent, so nothing unloads it in between
        try:
            while replica is None:  # a client that leaves while its model loads stops waiting
                if await unless_client_gone(request, self.acquire(slot)) is None:
                    return Response(status_code=CLIENT_CLOSED_REQUEST)
                replica = self.ready(slot)  # checked again with no await before the send
        finally:
            slot.waiting -= 1
        slot.keep_alive_s = keep
        extra = None  # Ollama's answers say how long their model took to load
        if had_to_wait and path.startswith("/api/"):
            extra = {LOAD_HEADER: f"{time.monotonic() - asked:.6f}"}
        try:
            return await self.send(replica, request, body, extra)
        except ReplicaFailed as failure:
            await self.monitor.check(replica)
            self._reap_exited(slot)
            return replica_failed_response(failure, path)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: every model on offer, and whether it is loaded."""
        self.refresh()
        return JSONResponse({"object": "list", "data": [self.card(s) for s in
                                                        self.slots.values()]})

    def card(self, slot: Slot) -> dict[str, Any]:
        status: dict[str, Any] = {"value": slot.state, "pinned": slot.pinned}
        if slot.process is not None:
            status["pid"] = slot.process.process.pid
        return {"id": slot.name, "object": "model", "created": _mtime(slot.model.path),
                "owned_by": "llmserve", "root": str(slot.model.path), "status": status}

    # ---- Ollama's listing routes -----------------------------------------------------

    async def tags(self) -> dict[str, Any]:
        self.refresh()
        return {"models": [await self._listing(s) for s in self.slots.values()]}

    async def ps(self) -> dict[str, Any]:
        rows = []
        for slot in list(self.slots.values()):
            if slot.state != LOADED:
                continue
            listing = await self._listing(slot)
            expires = self.keep_alive(slot)
            until = ("2318-01-01T00:00:00Z" if expires < 0 or slot.pinned else
                     _iso(datetime.now(UTC) + timedelta(
                         seconds=max(0.0, expires - (time.monotonic() - slot.idle_since)))))
            rows.append({"name": listing["name"], "model": listing["model"],
                         "size": slot.resident_bytes, "digest": listing["digest"],
                         "details": listing["details"], "expires_at": until,
                         "size_vram": 0})
        return {"models": rows}

    async def _listing(self, slot: Slot) -> dict[str, Any]:
        model = slot.model
        return {"name": f"{model.name}:latest", "model": f"{model.name}:latest",
                "modified_at": modified_at(model.path), "size": size_on_disk(model.path),
                "digest": await self._digest(model), "details": file_details(model)}

    async def _digest(self, model: ModelFile) -> str:
        stamp = model.stamp()
        cached = self._digests.get(model.name)
        if cached is None or cached[0] != stamp:
            digest = await asyncio.get_running_loop().run_in_executor(
                self._files, model_digest, model.files())
            self._digests[model.name] = cached = (stamp, digest)
        return cached[1]

    async def on_files_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._files, fn, *args)


def model_command(server_argv: tuple[str, ...], model: ModelFile) -> list[str]:
    """The command line of one model's server: the user's `serve` flags (this mode's taken
    out), the model, its own flags, 127.0.0.1 on a free port."""
    return [sys.executable, "-m", "llmserve.entrypoints.cli", *server_argv,
            "--model", str(model.path), "--served-model-name", model.name, *model.flags,
            "--host", "127.0.0.1", "--port", "0"]


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` without `flags` (each taking one value, as `--flag V` or `--flag=V`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{f}=" for f in flags)):
            kept.append(arg)
    return kept


def resident_bytes(pid: int) -> int:
    """A process's resident memory (Linux: /proc), 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def file_details(model: ModelFile) -> dict[str, Any]:
    """Ollama's `details` of a model from its files alone (GGUF header, config.json)."""
    family, parameters, quantization = "", 0, ""
    if model.format == "gguf":
        from llmserve.gguf_meta import open_gguf
        from llmserve.loader.gguf import gguf_file_type

        gguf = open_gguf(model.path)
        family = str(gguf.metadata.get("general.architecture", ""))
        parameters = sum(math.prod(t.shape) for t in gguf.tensors)
        quantization = gguf_file_type(model.path)
    else:
        with suppress(OSError, ValueError):
            config = json.loads((model.path / "config.json").read_text())
            family = str(config.get("model_type", ""))
            quantization = str((config.get("quantization_config") or {})
                               .get("quant_method", "")).upper()
    size = (f"{parameters / 10**9:.1f}B" if parameters >= 10**9 else
            f"{parameters / 10**6:.0f}M" if parameters else "")
    return {"parent_model": "", "format": model.format, "family": family,
            "families": [family] if family else [], "parameter_size": size,
            "quantization_level": quantization}


def json_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadRequest("the body must be a JSON object naming a model",
                         param="model") from None
    if not isinstance(parsed, dict):
        raise BadRequest("the body must be a JSON object naming a model", param="model")
    return parsed


def _only_loads(path: str, body: dict[str, Any]) -> bool:
    """An Ollama request that asks for nothing but the model (load or unload it)."""
    if path == "/api/chat":
        return not body.get("messages")
    if path == "/api/generate":
        return not body.get("prompt")
    return False


def _unloaded_answer(path: str, name: str) -> dict[str, Any]:
    answer: dict[str, Any] = {"model": name, "created_at": created_at()}
    if path == "/api/chat":
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    return {**answer, "done": True, "done_reason": "unload"}


def _mtime(path: Path) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:  # removed while loaded
        return 0


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
