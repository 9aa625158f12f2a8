"""LoRA adapters over HTTP (vLLM's interface): `--lora-modules name=path ...` at start,
a request's `model` naming an adapter, `/v1/models` listing them with the base model as
their parent, and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (behind the
API key, as every route but /health and /metrics).

An adapter is checked against the model when it is registered (`lora/adapter.py`: shapes,
modules, rank): one that does not fit is a 400 naming why, never a failed step. Unloading
takes the name away at once (new requests for it get a 404); requests already running on
it finish on it, and the engine lets its weights go when no request uses them (least
recently used, beyond `max_cpu_loras`).
"""

import itertools
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from llmserve.entrypoints.openai.protocol import BadRequest
from llmserve.lora.adapter import LoRAError, load_adapter
from llmserve.lora_request import LoRARequest

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
    """The adapters a server serves, by name (ids are never reused)."""

    def __init__(self, engine: Any, base_name: str) -> None:
        self.engine = engine  # the AsyncEngine
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return list(self.adapters)

    async def add(self, name: str, path: str) -> LoRARequest:
        if not name or name == self.base_name:
            raise BadRequest(f"lora_name {name!r} is empty or the base model's name",
                             param="lora_name")
        if name in self.adapters:
            raise BadRequest(f"the LoRA adapter '{name}' has already been loaded",
                             param="lora_name")
        request = LoRARequest(name, next(self._ids), str(Path(path).expanduser()),
                              base_model_name=self.base_name)
        core = self.engine.engine
        try:  # fitted to the model off the event loop (it reads the adapter's weights)
            await self.engine.run_blocking(load_adapter, request, core.loaded.model,
                                           core.config.max_lora_rank)
        except LoRAError as e:
            raise BadRequest(str(e), param="lora_path") from None
        self.adapters[name] = request
        return request

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise BadRequest(f"the LoRA adapter '{name}' cannot be found", param="lora_name",
                             status=404, code="model_not_found")

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "llmserve",
                 "root": request.lora_path, "parent": self.base_name}
                for name, request in self.adapters.items()]


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> str:
        await registry.add(body.lora_name, body.lora_path)
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
