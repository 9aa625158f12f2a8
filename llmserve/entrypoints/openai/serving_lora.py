"""LoRA adapters over HTTP (vLLM's interface): `--lora-modules name=path ...` at start,
a request's `model` naming an adapter, `/v1/models` listing them with the base model as
their parent, and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (behind the
API key, as every route but /health and /metrics).

Runtime loading is off unless the server was started with `--allow-runtime-lora --lora-dir
DIR` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): the routes then answer 404 saying so. With
it, a client's `lora_path` is taken relative to DIR (an absolute one must lie in it) and
read only from under DIR, symlinks resolved and none leading out (`lora/adapter.py`); any
path with no adapter to read there (outside DIR, missing, not an adapter folder) gets the
same 400, so the answer never tells whether a path exists.

An adapter is read and checked against the model when it is registered (`lora/adapter.py`:
shapes, modules, rank), on a pool of its own (`LOAD_THREADS` threads, `MAX_PENDING_LOADS`
reads running or queued, 429 beyond) under a timeout (504): a read stuck on a hung
filesystem holds no thread that tokenization or the engine needs. One that does not fit is
a 400 naming why, never a failed step; one that fits is handed to the engine, whose first
request on it then reads nothing. Unloading takes the name away at once (new requests for
it get a 404); requests already running on it finish on it, and the engine lets its weights
go when no request uses them (least recently used, beyond `max_cpu_loras`).
"""

import asyncio
import itertools
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from llmserve.engine.async_engine import QueueFull
from llmserve.entrypoints.openai.protocol import BadRequest
from llmserve.lora.adapter import AdapterNotFound, LoRAAdapter, LoRAError, load_adapter
from llmserve.lora.load_pool import LoadPool
from llmserve.lora_request import LoRARequest

LOAD_TIMEOUT_S = 30.0
LOAD_THREADS = 2
MAX_PENDING_LOADS = 4  # running and queued together
RUNTIME_OFF = ("loading and unloading LoRA adapters at runtime is off: start the server with "
               "--allow-runtime-lora --lora-dir DIR to load adapters from under DIR")

# str_max_length: pydantic checks a string is valid Unicode (no lone surrogate, which
# JSON can spell) only where its length is bounded; the body cap is the real bound
_STRICT = ConfigDict(extra="forbid", str_max_length=2**40)


class LoadLoRARequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_int_id: int | None = None


class LoRARegistry:
    """The adapters a server serves, by name (ids are never reused). `lora_dir`: where
    clients may load adapters from (None: runtime loading is off)."""

    def __init__(self, engine: Any, base_name: str, lora_dir: str | None = None,
                 load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.engine = engine  # the AsyncEngine
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self.lora_dir = None if lora_dir is None else _resolved_folder(lora_dir)
        self.load_timeout_s = load_timeout_s
        self._ids = itertools.count(1)
        self._loading: set[str] = set()
        self._pool = LoadPool(LOAD_THREADS, MAX_PENDING_LOADS)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return list(self.adapters)

    async def add(self, name: str, path: str) -> LoRARequest:
        """The operator's adapter (`--lora-modules`): any path."""
        return await self._add(name, path, None)

    async def load(self, name: str, path: str) -> LoRARequest:
        """A client's adapter (`/v1/load_lora_adapter`): from under `lora_dir` only."""
        if self.lora_dir is None:
            raise BadRequest(RUNTIME_OFF, status=404, code="runtime_lora_disabled")
        return await self._add(name, path, self.lora_dir)

    async def _add(self, name: str, path: str, root: str | None) -> LoRARequest:
        if not name or name == self.base_name:
            raise BadRequest(f"lora_name {name!r} is empty or the base model's name",
                             param="lora_name")
        if name in self.adapters or name in self._loading:
            raise BadRequest(f"the LoRA adapter '{name}' has already been loaded",
                             param="lora_name")
        future = self._pool.submit(self._read, name, next(self._ids), path, root)
        if future is None:
            raise QueueFull(f"{MAX_PENDING_LOADS} LoRA adapter loads are already running or "
                            f"queued; retry later")
        self._loading.add(name)
        try:
            adapter = await asyncio.wait_for(asyncio.wrap_future(future), self.load_timeout_s)
        except TimeoutError:
            raise BadRequest(f"reading the LoRA adapter at {path!r} took longer than "
                             f"{self.load_timeout_s:g} s; it was not loaded",
                             param="lora_path", status=504, code="request_timeout") from None
        except LoRAError as e:
            message = str(e)
            if root is not None and isinstance(e, AdapterNotFound):
                # the same words for any path the client may not read: no existence oracle
                message = f"no LoRA adapter at {path!r} under --lora-dir"
            raise BadRequest(message, param="lora_path") from None
        finally:
            self._loading.discard(name)
        self.engine.engine.lora.offer(adapter, root)
        self.adapters[name] = adapter.request
        return adapter.request

    def _read(self, name: str, lora_id: int, path: str, root: str | None) -> LoRAAdapter:
        """On the load pool: the adapter read and fitted to the model."""
        folder = Path(path).expanduser() if root is None else _under(root, path)
        request = LoRARequest(name, lora_id, str(folder), base_model_name=self.base_name)
        core = self.engine.engine
        return load_adapter(request, core.loaded.model, core.config.max_lora_rank, root)

    def remove(self, name: str) -> None:
        if self.lora_dir is None:
            raise BadRequest(RUNTIME_OFF, status=404, code="runtime_lora_disabled")
        request = self.adapters.pop(name, None)
        if request is None:
            raise BadRequest(f"the LoRA adapter '{name}' cannot be found", param="lora_name",
                             status=404, code="model_not_found")
        self.engine.engine.lora.withdraw(request.lora_int_id)

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "llmserve",
                 "root": request.lora_path, "parent": self.base_name}
                for name, request in self.adapters.items()]


def _resolved_folder(path: str) -> str:
    folder = os.path.realpath(Path(path).expanduser())
    if not os.path.isdir(folder):
        raise ValueError(f"--lora-dir {path}: not a folder")
    return folder


def _under(root: str, path: str) -> Path:
    """`path` (relative to `root`, or absolute) resolved; AdapterNotFound unless it lies
    under root. The reads check again, file by file (a link may change meanwhile)."""
    try:
        real = Path(os.path.realpath(Path(root, path)))  # an absolute path replaces root
    except (OSError, ValueError):  # ValueError: a NUL in the path
        raise AdapterNotFound(path) from None
    if not real.is_relative_to(root):
        raise AdapterNotFound(path)
    return real


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> str:
        await registry.load(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> str:
        registry.remove(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` (or a JSON object with "name" and "path") pairs."""
    import json

    pairs = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                pairs.append((spec["name"], spec["path"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON module needs 'name' "
                                 f"and 'path'") from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path")
        pairs.append((name, path))
    return pairs
